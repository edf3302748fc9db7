// gRPC handlers of kvferryd.
#include "service/kvferry_service.h"

#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>

#include "absl/strings/str_cat.h"
#include "kvferry/kernels/status_macros.h"
#include "log.h"

namespace kvferry::server {
namespace {

using grpc::ServerContext;

// Proto enum ↔ kernels enum (the numbering differs by the UNSPECIFIED value).
absl::StatusOr<Layout> FromProto(v1::Layout layout) {
  switch (layout) {
    case v1::LAYOUT_V4:
      return Layout::kV4;
    case v1::LAYOUT_V41:
      return Layout::kV41;
    case v1::LAYOUT_V41_FP4:
      return Layout::kV41Fp4;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown layout ", static_cast<int>(layout),
                       ": expected LAYOUT_V4, LAYOUT_V41 or LAYOUT_V41_FP4"));
  }
}

v1::Layout ToProto(Layout layout) {
  switch (layout) {
    case Layout::kV4:
      return v1::LAYOUT_V4;
    case Layout::kV41:
      return v1::LAYOUT_V41;
    case Layout::kV41Fp4:
      return v1::LAYOUT_V41_FP4;
  }
  return v1::LAYOUT_UNSPECIFIED;
}

PageHandle FromProto(const v1::PageHandle& h) { return PageHandle{h.page_id(), h.generation()}; }

std::vector<TokenLocation> FromProto(
    const google::protobuf::RepeatedPtrField<v1::TokenLocation>& locations) {
  std::vector<TokenLocation> out(locations.size());
  for (int i = 0; i < locations.size(); ++i) {
    out[i] = TokenLocation{FromProto(locations[i].page()), locations[i].slot()};
  }
  return out;
}

void FillPool(const PoolStats& s, v1::Pool* out) {
  out->set_name(s.name);
  out->set_layout(ToProto(s.layout));
  out->set_page_size(s.page_size);
  out->set_num_pages(s.num_pages);
  out->set_num_layers(s.num_layers);
  out->set_device(s.device);
  out->set_page_bytes(s.page_bytes);
  out->set_pool_bytes(s.pool_bytes);
  out->set_pages_used(s.pages_used);
  out->set_pages_free(s.num_pages - s.pages_used);
  out->set_tokens_held(s.tokens_held);
}

// The client went away (cancelled or past its deadline): its staged work is dropped.
absl::Status ClientGone(ServerContext* context) {
  if (context->deadline() < std::chrono::system_clock::now()) {
    return absl::DeadlineExceededError("deadline exceeded; the write was dropped");
  }
  return absl::CancelledError("client cancelled; the work was dropped");
}

// Layer and count fields are uint32 on the wire; larger than any pool, clamped before the
// core sees them as int (which then reports them out of range).
int ClampLayer(uint32_t layer) { return static_cast<int>(std::min<uint32_t>(layer, 1u << 20)); }

std::span<const uint8_t> Bytes(const std::string& s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  grpc::StatusCode code;
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return grpc::Status::OK;
    case absl::StatusCode::kCancelled:
      code = grpc::StatusCode::CANCELLED;
      break;
    case absl::StatusCode::kInvalidArgument:
      code = grpc::StatusCode::INVALID_ARGUMENT;
      break;
    case absl::StatusCode::kDeadlineExceeded:
      code = grpc::StatusCode::DEADLINE_EXCEEDED;
      break;
    case absl::StatusCode::kNotFound:
      code = grpc::StatusCode::NOT_FOUND;
      break;
    case absl::StatusCode::kAlreadyExists:
      code = grpc::StatusCode::ALREADY_EXISTS;
      break;
    case absl::StatusCode::kPermissionDenied:
      code = grpc::StatusCode::PERMISSION_DENIED;
      break;
    case absl::StatusCode::kResourceExhausted:
      code = grpc::StatusCode::RESOURCE_EXHAUSTED;
      break;
    case absl::StatusCode::kFailedPrecondition:
      code = grpc::StatusCode::FAILED_PRECONDITION;
      break;
    case absl::StatusCode::kAborted:
      code = grpc::StatusCode::ABORTED;
      break;
    case absl::StatusCode::kOutOfRange:
      code = grpc::StatusCode::OUT_OF_RANGE;
      break;
    case absl::StatusCode::kUnimplemented:
      code = grpc::StatusCode::UNIMPLEMENTED;
      break;
    case absl::StatusCode::kUnavailable:
      code = grpc::StatusCode::UNAVAILABLE;
      break;
    case absl::StatusCode::kDataLoss:
      code = grpc::StatusCode::DATA_LOSS;
      break;
    case absl::StatusCode::kUnauthenticated:
      code = grpc::StatusCode::UNAUTHENTICATED;
      break;
    default:
      code = grpc::StatusCode::INTERNAL;
      break;
  }
  return grpc::Status(code, std::string(status.message()));
}

int64_t KvFerryService::ChunkBytes(uint32_t requested) const {
  if (requested == 0) return options_.default_chunk_bytes;
  // At least one bf16 row per piece, at most the daemon's limit.
  return std::clamp<int64_t>(requested, kBf16RowBytes, options_.max_chunk_bytes);
}

grpc::Status KvFerryService::CreatePool(ServerContext*, const v1::CreatePoolRequest* req,
                                        v1::Pool* out) {
  absl::StatusOr<Layout> layout = FromProto(req->layout());
  if (!layout.ok()) return ToGrpcStatus(layout.status());
  if (req->num_pages() == 0 || req->num_pages() > (uint64_t{1} << 40)) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("num_pages ", req->num_pages(), " is not in [1, 2^40]")));
  }
  if (!IsValidPageSize(req->page_size())) {
    return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
        "page size ", req->page_size(), " is not a power of two in [1, ", kMaxPageSize, "]")));
  }
  PoolConfig config{req->name(), *layout, static_cast<int>(req->page_size()),
                    static_cast<int64_t>(req->num_pages()),
                    ClampLayer(req->num_layers())};
  absl::StatusOr<std::shared_ptr<Pool>> pool = pools_->Create(config, req->device());
  if (!pool.ok()) return ToGrpcStatus(pool.status());
  const PoolStats stats = (*pool)->Stats();
  log::Info("pool created name={} layout={} page_size={} pages={} layers={} device={} bytes={}",
            stats.name, LayoutName(stats.layout), stats.page_size, stats.num_pages,
            stats.num_layers, stats.device, stats.pool_bytes);
  FillPool(stats, out);
  return grpc::Status::OK;
}

grpc::Status KvFerryService::DescribePool(ServerContext*, const v1::DescribePoolRequest* req,
                                          v1::Pool* out) {
  absl::StatusOr<std::shared_ptr<Pool>> pool = pools_->Get(req->name());
  if (!pool.ok()) return ToGrpcStatus(pool.status());
  FillPool((*pool)->Stats(), out);
  return grpc::Status::OK;
}

grpc::Status KvFerryService::ListPools(ServerContext*, const v1::ListPoolsRequest*,
                                       v1::ListPoolsResponse* out) {
  for (const auto& pool : pools_->List()) FillPool(pool->Stats(), out->add_pools());
  return grpc::Status::OK;
}

grpc::Status KvFerryService::DeletePool(ServerContext*, const v1::DeletePoolRequest* req,
                                        v1::DeletePoolResponse*) {
  const absl::Status s = pools_->Delete(req->name());
  if (s.ok()) log::Info("pool deleted name={}", req->name());
  return ToGrpcStatus(s);
}

grpc::Status KvFerryService::AllocatePages(ServerContext*, const v1::AllocatePagesRequest* req,
                                           v1::AllocatePagesResponse* out) {
  absl::StatusOr<std::shared_ptr<Pool>> pool = pools_->Get(req->pool());
  if (!pool.ok()) return ToGrpcStatus(pool.status());
  absl::StatusOr<std::vector<PageHandle>> pages = (*pool)->AllocatePages(req->count());
  if (!pages.ok()) return ToGrpcStatus(pages.status());
  for (const PageHandle& h : *pages) {
    v1::PageHandle* p = out->add_pages();
    p->set_page_id(h.page_id);
    p->set_generation(h.generation);
  }
  return grpc::Status::OK;
}

grpc::Status KvFerryService::FreePages(ServerContext*, const v1::FreePagesRequest* req,
                                       v1::FreePagesResponse*) {
  absl::StatusOr<std::shared_ptr<Pool>> pool = pools_->Get(req->pool());
  if (!pool.ok()) return ToGrpcStatus(pool.status());
  std::vector<PageHandle> pages;
  for (const auto& h : req->pages()) pages.push_back(FromProto(h));
  return ToGrpcStatus((*pool)->FreePages(pages));
}

namespace {

// The loop shared by the client-streaming writes: the first message names the pool and
// starts the staged write (`begin`), every message is added to it (`add`), and a stream
// that ends cleanly commits it. Any error, or the client going away, drops the write.
template <typename Request, typename Write>
absl::StatusOr<int64_t> StagedWrite(
    ServerContext* context, grpc::ServerReader<Request>* reader, PoolManager* pools,
    const std::function<absl::StatusOr<std::unique_ptr<Write>>(const Request&, Pool&)>& begin,
    const std::function<absl::Status(Write&, const Request&)>& add, uint64_t* received) {
  Request msg;
  std::shared_ptr<Pool> pool;
  std::unique_ptr<Write> write;
  while (reader->Read(&msg)) {
    if (context->IsCancelled()) return ClientGone(context);
    *received += msg.ByteSizeLong();
    if (!write) {
      KVF_ASSIGN_OR_RETURN(pool, pools->Get(msg.pool()));
      KVF_ASSIGN_OR_RETURN(write, begin(msg, *pool));
    } else if (!msg.pool().empty() && msg.pool() != pool->config().name) {
      return absl::InvalidArgumentError(absl::StrCat("one write goes to one pool: '", msg.pool(),
                                                     "' after '", pool->config().name, "'"));
    }
    KVF_RETURN_IF_ERROR(add(*write, msg));
  }
  if (context->IsCancelled()) return ClientGone(context);
  if (!write) return absl::InvalidArgumentError("empty write: no messages");
  return write->Commit();
}

}  // namespace

grpc::Status KvFerryService::WriteTokens(ServerContext* context,
                                         grpc::ServerReader<v1::WriteTokensRequest>* reader,
                                         v1::WriteResponse* out) {
  uint64_t received = 0;
  const absl::StatusOr<int64_t> written = StagedWrite<v1::WriteTokensRequest, Pool::TokenWrite>(
      context, reader, pools_,
      [&](const v1::WriteTokensRequest& first, Pool& pool) {
        return pool.BeginTokenWrite(ClampLayer(first.layer()), options_.max_write_tokens);
      },
      [](Pool::TokenWrite& write, const v1::WriteTokensRequest& msg) {
        return write.Add(FromProto(msg.locations()), Bytes(msg.rows()));
      },
      &received);
  if (!written.ok()) return ToGrpcStatus(written.status());
  out->set_tokens_written(*written);
  out->set_bytes_received(received);
  return grpc::Status::OK;
}

grpc::Status KvFerryService::WritePages(ServerContext* context,
                                        grpc::ServerReader<v1::WritePagesRequest>* reader,
                                        v1::WriteResponse* out) {
  uint64_t received = 0;
  const absl::StatusOr<int64_t> written = StagedWrite<v1::WritePagesRequest, Pool::PageWrite>(
      context, reader, pools_,
      [&](const v1::WritePagesRequest& first,
          Pool& pool) -> absl::StatusOr<std::unique_ptr<Pool::PageWrite>> {
        KVF_ASSIGN_OR_RETURN(const Layout layout, FromProto(first.layout()));
        if (layout != pool.config().layout) {
          return absl::FailedPreconditionError(absl::StrCat(
              "layout mismatch: pages are ", LayoutName(layout), ", pool '", pool.config().name,
              "' holds ", LayoutName(pool.config().layout)));
        }
        return pool.BeginPageWrite(options_.max_write_bytes);
      },
      [](Pool::PageWrite& write, const v1::WritePagesRequest& msg) {
        return write.Add(FromProto(msg.page()), ClampLayer(msg.layer()), msg.offset(),
                         Bytes(msg.data()));
      },
      &received);
  if (!written.ok()) return ToGrpcStatus(written.status());
  out->set_pages_written(*written);
  out->set_bytes_received(received);
  return grpc::Status::OK;
}

grpc::Status KvFerryService::ReadPages(ServerContext* context, const v1::ReadPagesRequest* req,
                                       grpc::ServerWriter<v1::PageChunk>* writer) {
  absl::StatusOr<std::shared_ptr<Pool>> pool = pools_->Get(req->pool());
  if (!pool.ok()) return ToGrpcStatus(pool.status());
  Layout out_layout = (*pool)->config().layout;
  std::optional<Layout> transcode_to;
  if (req->transcode_to() != v1::LAYOUT_UNSPECIFIED) {
    absl::StatusOr<Layout> l = FromProto(req->transcode_to());
    if (!l.ok()) return ToGrpcStatus(l.status());
    out_layout = *l;
    transcode_to = *l;
  }
  std::vector<PageHandle> pages;
  for (const auto& h : req->pages()) pages.push_back(FromProto(h));
  std::vector<int> layers;
  for (uint32_t l : req->layers()) layers.push_back(ClampLayer(l));
  const uint64_t page_bytes = PageBytes(out_layout, (*pool)->config().page_size);
  uint64_t offset = 0;
  v1::PageChunk chunk;
  const absl::Status s = (*pool)->ReadPages(
      pages, layers, transcode_to, ChunkBytes(req->chunk_bytes()), [&](std::string& bytes) {
        if (context->IsCancelled()) return ClientGone(context);
        chunk.set_offset(offset);
        chunk.set_xxh64(XXH64(bytes.data(), bytes.size(), 0));
        chunk.set_page_bytes(page_bytes);
        offset += bytes.size();
        chunk.set_data(std::move(bytes));
        if (!writer->Write(chunk)) return ClientGone(context);
        return absl::OkStatus();
      });
  return ToGrpcStatus(s);
}

grpc::Status KvFerryService::ReadWorkspace(ServerContext* context,
                                           const v1::ReadWorkspaceRequest* req,
                                           grpc::ServerWriter<v1::WorkspaceChunk>* writer) {
  absl::StatusOr<std::shared_ptr<Pool>> pool = pools_->Get(req->pool());
  if (!pool.ok()) return ToGrpcStatus(pool.status());
  const std::vector<TokenLocation> locations = FromProto(req->locations());
  uint64_t first_row = 0;
  v1::WorkspaceChunk chunk;
  const absl::Status s = (*pool)->ReadWorkspace(
      ClampLayer(req->layer()), locations,
      std::max<int64_t>(1, ChunkBytes(req->chunk_bytes()) / kBf16RowBytes),
      [&](std::string& rows) {
        if (context->IsCancelled()) return ClientGone(context);
        chunk.set_first_row(first_row);
        chunk.set_xxh64(XXH64(rows.data(), rows.size(), 0));
        first_row += rows.size() / kBf16RowBytes;
        chunk.set_rows(std::move(rows));
        if (!writer->Write(chunk)) return ClientGone(context);
        return absl::OkStatus();
      });
  return ToGrpcStatus(s);
}

grpc::Status KvFerryService::GetStats(ServerContext*, const v1::GetStatsRequest*, v1::Stats* out) {
  for (const auto& pool : pools_->List()) {
    const PoolStats s = pool->Stats();
    v1::PoolStats* p = out->add_pools();
    p->set_name(s.name);
    p->set_layout(ToProto(s.layout));
    p->set_page_size(s.page_size);
    p->set_pages_used(s.pages_used);
    p->set_pages_free(s.num_pages - s.pages_used);
    p->set_tokens_held(s.tokens_held);
    p->set_records_held(s.records_held);
    p->set_nominal_bytes_per_token(s.savings.nominal_bytes_per_token);
    p->set_effective_bytes_per_token(s.savings.effective_bytes_per_token);
    p->set_bytes_saved_vs_bf16(s.bytes_saved_vs_bf16);
    p->set_bytes_saved_vs_v4(s.bytes_saved_vs_v4);
    p->set_pool_bytes(s.pool_bytes);
    out->set_tokens_held(out->tokens_held() + s.tokens_held);
    out->set_records_held(out->records_held() + s.records_held);
    out->set_bytes_saved_vs_bf16(out->bytes_saved_vs_bf16() + s.bytes_saved_vs_bf16);
    out->set_bytes_saved_vs_v4(out->bytes_saved_vs_v4() + s.bytes_saved_vs_v4);
    out->set_pool_bytes(out->pool_bytes() + s.pool_bytes);
  }
  return grpc::Status::OK;
}

// ---- metrics interceptor -----------------------------------------------------------------

namespace {

const char* CodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK: return "OK";
    case grpc::StatusCode::CANCELLED: return "CANCELLED";
    case grpc::StatusCode::UNKNOWN: return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS: return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED: return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE: return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED: return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL: return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS: return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
    default: return "UNKNOWN";
  }
}

class MetricsInterceptor final : public grpc::experimental::Interceptor {
 public:
  MetricsInterceptor(const char* method, DaemonMetrics* metrics)
      : metrics_(metrics), start_(std::chrono::steady_clock::now()) {
    const std::string full = method == nullptr ? "" : method;
    method_ = full.substr(full.rfind('/') + 1);
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE)) {
      if (const void* m = methods->GetRecvMessage(); m != nullptr) {
        received_ += static_cast<const google::protobuf::Message*>(m)->ByteSizeLong();
      }
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_MESSAGE)) {
      if (const void* m = methods->GetSendMessage(); m != nullptr) {
        sent_ += static_cast<const google::protobuf::Message*>(m)->ByteSizeLong();
      } else if (grpc::ByteBuffer* b = methods->GetSerializedSendMessage(); b != nullptr) {
        sent_ += b->Length();
      }
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status status = methods->GetSendStatus();
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
      metrics_->RecordRpc(method_, CodeName(status.error_code()), seconds);
      metrics_->RecordBytes(method_, received_, sent_);
      if (!status.ok()) {
        log::Debug("rpc failed method={} code={} message=\"{}\"", method_,
                   CodeName(status.error_code()), status.error_message());
      }
    }
    methods->Proceed();
  }

 private:
  DaemonMetrics* const metrics_;
  std::string method_;
  const std::chrono::steady_clock::time_point start_;
  uint64_t received_ = 0, sent_ = 0;
};

}  // namespace

grpc::experimental::Interceptor* MetricsInterceptorFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  return new MetricsInterceptor(info->method(), metrics_);
}

}  // namespace kvferry::server
