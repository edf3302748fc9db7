// The kvferry C++ client over the generated gRPC stubs.
#include "kvferry/client/client.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <thread>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "kvferry/v1/kvferry.grpc.pb.h"

#include "client_impl.h"
#include "internal.h"

namespace kvferry::client {
using namespace internal;  // NOLINT: the shared conversions

const char* LayoutName(Layout layout) {
  switch (layout) {
    case Layout::kV4: return "v4";
    case Layout::kV41: return "v41";
    case Layout::kV41Fp4: return "v41_fp4";
  }
  return "unknown";
}

bool ParseLayout(const std::string& name, Layout* layout) {
  for (Layout l : {Layout::kV4, Layout::kV41, Layout::kV41Fp4}) {
    if (name == LayoutName(l)) {
      *layout = l;
      return true;
    }
  }
  return false;
}

std::string ErrorReason(const absl::Status& status) {
  absl::optional<absl::Cord> reason = status.GetPayload(kReasonPayload);
  return reason.has_value() ? std::string(*reason) : std::string();
}

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(ClientOptions options) {
  if (options.message_bytes < kRowBytes) {
    return absl::InvalidArgumentError(absl::StrCat("message_bytes must be at least ", kRowBytes));
  }
  auto impl = std::make_unique<Impl>();
  impl->channel = MakeChannel(options);
  impl->stub = v1::KvFerry::NewStub(impl->channel);
  impl->cache = v1::KvCache::NewStub(impl->channel);
  impl->transfer = v1::Transfer::NewStub(impl->channel);
  impl->options = std::move(options);
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

absl::StatusOr<PoolInfo> Client::CreatePool(const PoolSpec& spec, CallOptions call) {
  v1::CreatePoolRequest req;
  req.set_name(spec.name);
  req.set_layout(ToProto(spec.layout));
  req.set_page_size(spec.page_size);
  req.set_num_pages(spec.num_pages);
  req.set_num_layers(spec.num_layers);
  req.set_device(spec.device);
  v1::Pool pool;
  KVF_CLIENT_RETURN(impl_->Unary(&v1::KvFerry::Stub::CreatePool, req, &pool, call));
  return FromProto(pool);
}

absl::StatusOr<PoolInfo> Client::DescribePool(const std::string& name, CallOptions call) {
  v1::DescribePoolRequest req;
  req.set_name(name);
  v1::Pool pool;
  KVF_CLIENT_RETURN(impl_->Unary(&v1::KvFerry::Stub::DescribePool, req, &pool, call));
  return FromProto(pool);
}

absl::StatusOr<std::vector<PoolInfo>> Client::ListPools(CallOptions call) {
  // Page after page (the daemon answers at most 1000 pools per call).
  std::vector<PoolInfo> pools;
  v1::ListPoolsRequest req;
  do {
    v1::ListPoolsResponse resp;
    KVF_CLIENT_RETURN(impl_->Unary(&v1::KvFerry::Stub::ListPools, req, &resp, call));
    for (const v1::Pool& p : resp.pools()) pools.push_back(FromProto(p));
    req.set_page_token(resp.next_page_token());
  } while (!req.page_token().empty());
  return pools;
}

absl::Status Client::DeletePool(const std::string& name, CallOptions call) {
  v1::DeletePoolRequest req;
  req.set_name(name);
  v1::DeletePoolResponse resp;
  return impl_->Unary(&v1::KvFerry::Stub::DeletePool, req, &resp, call);
}

absl::StatusOr<std::vector<PageHandle>> Client::AllocatePages(const std::string& pool,
                                                              uint32_t count, CallOptions call) {
  return AllocatePages(pool, count, absl::ZeroDuration(), call);
}

absl::StatusOr<std::vector<PageHandle>> Client::AllocatePages(const std::string& pool,
                                                              uint32_t count, absl::Duration lease,
                                                              CallOptions call) {
  v1::AllocatePagesRequest req;
  req.set_pool(pool);
  req.set_count(count);
  if (lease != absl::ZeroDuration()) {
    const int64_t seconds = absl::ToInt64Seconds(absl::Ceil(lease, absl::Seconds(1)));
    if (seconds < 1 || seconds > int64_t{UINT32_MAX}) {
      return absl::InvalidArgumentError("a page lease is between 1 second and 2^32-1 seconds");
    }
    req.set_lease_seconds(static_cast<uint32_t>(seconds));
  }
  v1::AllocatePagesResponse resp;
  KVF_CLIENT_RETURN(impl_->Unary(&v1::KvFerry::Stub::AllocatePages, req, &resp, call));
  std::vector<PageHandle> pages;
  for (const v1::PageHandle& h : resp.pages()) pages.push_back({h.page_id(), h.generation()});
  return pages;
}

// A call that names a pool and a list of its pages (FreePages, RenewPages).
// (`Impl` is deduced: Client::Impl is private.)
template <typename Impl, typename Request, typename Response>
absl::Status PagesCall(Impl& impl,
                       grpc::Status (v1::KvFerry::Stub::*method)(grpc::ClientContext*,
                                                                const Request&, Response*),
                       const std::string& pool, std::span<const PageHandle> pages,
                       CallOptions call) {
  Request req;
  req.set_pool(pool);
  for (const PageHandle& h : pages) ToProto(h, req.add_pages());
  Response resp;
  return impl.Unary(method, req, &resp, call);
}

absl::Status Client::RenewPages(const std::string& pool, std::span<const PageHandle> pages,
                                CallOptions call) {
  return PagesCall(*impl_, &v1::KvFerry::Stub::RenewPages, pool, pages, call);
}

absl::Status Client::FreePages(const std::string& pool, std::span<const PageHandle> pages,
                               CallOptions call) {
  return PagesCall(*impl_, &v1::KvFerry::Stub::FreePages, pool, pages, call);
}

absl::StatusOr<WriteResult> Client::WriteTokens(const std::string& pool, uint32_t layer,
                                                std::span<const TokenLocation> locations,
                                                std::span<const uint16_t> rows, CallOptions call) {
  if (rows.size() != locations.size() * kRowValues) {
    return absl::InvalidArgumentError(absl::StrCat(locations.size(), " locations need ",
                                                   locations.size() * kRowValues,
                                                   " bf16 values, got ", rows.size()));
  }
  const size_t per_message = static_cast<size_t>(impl_->options.message_bytes / kRowBytes);
  WriteResult result;
  KVF_CLIENT_RETURN(impl_->Retry([&]() -> absl::Status {
    grpc::ClientContext ctx;
    impl_->Prepare(ctx, call);
    v1::WriteResponse resp;
    auto writer = impl_->stub->WriteTokens(&ctx, &resp);
    size_t first = 0;
    do {
      const size_t n = std::min(per_message, locations.size() - first);
      v1::WriteTokensRequest msg;
      if (first == 0) {
        msg.set_pool(pool);
        msg.set_layer(layer);
      }
      for (size_t i = first; i < first + n; ++i) {
        v1::TokenLocation* l = msg.add_locations();
        ToProto(locations[i].page, l->mutable_page());
        l->set_slot(locations[i].slot);
      }
      msg.set_rows(reinterpret_cast<const char*>(rows.data() + first * kRowValues), n * kRowBytes);
      first += n;
      // The last message says so: the daemon stores only a write whose end it saw.
      msg.set_finish_write(first == locations.size());
      if (!writer->Write(msg)) break;  // the server ended the call: Finish says why
    } while (first < locations.size());
    writer->WritesDone();
    KVF_CLIENT_RETURN(FromGrpc(writer->Finish(), ctx));
    result.tokens_written = resp.tokens_written();
    result.bytes_sent = resp.bytes_received();
    return absl::OkStatus();
  }));
  return result;
}

absl::StatusOr<WriteResult> Client::WritePages(const std::string& pool, Layout layout,
                                               std::span<const PageBytes> pages, CallOptions call) {
  const size_t per_message = static_cast<size_t>(impl_->options.message_bytes);
  WriteResult result;
  KVF_CLIENT_RETURN(impl_->Retry([&]() -> absl::Status {
    grpc::ClientContext ctx;
    impl_->Prepare(ctx, call);
    v1::WriteResponse resp;
    auto writer = impl_->stub->WritePages(&ctx, &resp);
    bool first = true, open = true;
    for (const PageBytes& page : pages) {
      for (size_t at = 0; open && (at < page.data.size() || (at == 0 && page.data.empty()));) {
        const size_t n = std::min(per_message, page.data.size() - at);
        v1::WritePagesRequest msg;
        if (first) {
          msg.set_pool(pool);
          msg.set_layout(ToProto(layout));
          first = false;
        }
        ToProto(page.page, msg.mutable_page());
        msg.set_layer(page.layer);
        msg.set_offset(at);
        msg.set_data(reinterpret_cast<const char*>(page.data.data() + at), n);
        open = writer->Write(msg);
        at += n;
        if (n == 0) break;
      }
    }
    if (open) {  // the end of the write: a message that only sets finish_write
      v1::WritePagesRequest msg;
      if (first) {  // no pages: the message also names the pool
        msg.set_pool(pool);
        msg.set_layout(ToProto(layout));
      }
      msg.set_finish_write(true);
      writer->Write(msg);
    }
    writer->WritesDone();
    KVF_CLIENT_RETURN(FromGrpc(writer->Finish(), ctx));
    result.pages_written = resp.pages_written();
    result.bytes_sent = resp.bytes_received();
    return absl::OkStatus();
  }));
  return result;
}

namespace {

v1::ReadPagesRequest PagesRequest(const std::string& pool, std::span<const PageHandle> pages,
                                  std::span<const uint32_t> layers,
                                  std::optional<Layout> transcode_to, int64_t chunk_bytes) {
  v1::ReadPagesRequest req;
  req.set_pool(pool);
  for (const PageHandle& h : pages) ToProto(h, req.add_pages());
  for (uint32_t l : layers) req.add_layers(l);
  if (transcode_to.has_value()) req.set_transcode_to(ToProto(*transcode_to));
  req.set_chunk_bytes(static_cast<uint32_t>(chunk_bytes));
  return req;
}

}  // namespace

absl::StatusOr<uint64_t> Client::ReadPagesInto(const std::string& pool,
                                               std::span<const PageHandle> pages,
                                               std::span<const uint32_t> layers,
                                               std::optional<Layout> transcode_to,
                                               std::span<uint8_t> out, CallOptions call) {
  uint64_t page_bytes = 0;
  KVF_CLIENT_RETURN(impl_->ReadPages(
      PagesRequest(pool, pages, layers, transcode_to, impl_->options.message_bytes),
      [&](uint64_t) -> absl::StatusOr<std::span<uint8_t>> { return out; }, &page_bytes, call));
  return page_bytes;
}

absl::StatusOr<std::vector<uint8_t>> Client::ReadPages(const std::string& pool,
                                                       std::span<const PageHandle> pages,
                                                       std::span<const uint32_t> layers,
                                                       std::optional<Layout> transcode_to,
                                                       CallOptions call) {
  uint64_t units = pages.size() * layers.size();
  if (layers.empty()) {
    absl::StatusOr<PoolInfo> info = DescribePool(pool, call);
    if (!info.ok()) return info.status();
    units = pages.size() * info->spec.num_layers;
  }
  std::vector<uint8_t> out;
  uint64_t page_bytes = 0;
  KVF_CLIENT_RETURN(impl_->ReadPages(
      PagesRequest(pool, pages, layers, transcode_to, impl_->options.message_bytes),
      [&](uint64_t bytes) -> absl::StatusOr<std::span<uint8_t>> {
        out.assign(units * bytes, 0);
        return std::span<uint8_t>(out);
      },
      &page_bytes, call));
  return out;
}

absl::Status Client::ReadWorkspaceInto(const std::string& pool, uint32_t layer,
                                       std::span<const TokenLocation> locations,
                                       std::span<uint16_t> out, CallOptions call) {
  if (out.size() != locations.size() * kRowValues) {
    return absl::InvalidArgumentError(absl::StrCat(locations.size(), " locations need ",
                                                   locations.size() * kRowValues,
                                                   " bf16 values of output, got ", out.size()));
  }
  v1::ReadWorkspaceRequest req;
  req.set_pool(pool);
  req.set_layer(layer);
  for (const TokenLocation& l : locations) {
    v1::TokenLocation* p = req.add_locations();
    ToProto(l.page, p->mutable_page());
    p->set_slot(l.slot);
  }
  req.set_chunk_bytes(static_cast<uint32_t>(impl_->options.message_bytes));
  const std::span<uint8_t> bytes(reinterpret_cast<uint8_t*>(out.data()), out.size() * 2);
  return impl_->Retry([&]() -> absl::Status {
    grpc::ClientContext ctx;
    impl_->Prepare(ctx, call);
    auto reader = impl_->stub->ReadWorkspace(&ctx, req);
    auto whole = [&]() -> absl::StatusOr<std::span<uint8_t>> { return bytes; };
    return Impl::Drain<v1::WorkspaceChunk>(
        ctx, *reader, [&](const v1::WorkspaceChunk&) { return whole(); }, whole,
        [](const v1::WorkspaceChunk& c) { return c.first_row() * kRowBytes; },
        [](const v1::WorkspaceChunk& c) -> const std::string& { return c.rows(); });
  });
}

absl::StatusOr<std::vector<uint16_t>> Client::ReadWorkspace(const std::string& pool, uint32_t layer,
                                                            std::span<const TokenLocation> locations,
                                                            CallOptions call) {
  std::vector<uint16_t> out(locations.size() * kRowValues);
  KVF_CLIENT_RETURN(ReadWorkspaceInto(pool, layer, locations, out, call));
  return out;
}

absl::StatusOr<Stats> Client::GetStats(CallOptions call) {
  // Page after page of pools; every page carries the same totals.
  v1::Stats resp;
  v1::GetStatsRequest req;
  std::vector<v1::PoolStats> all;
  do {
    resp.Clear();
    KVF_CLIENT_RETURN(impl_->Unary(&v1::KvFerry::Stub::GetStats, req, &resp, call));
    all.insert(all.end(), resp.pools().begin(), resp.pools().end());
    req.set_page_token(resp.next_page_token());
  } while (!req.page_token().empty());
  Stats stats;
  for (const v1::PoolStats& p : all) {
    PoolStats s;
    s.name = p.name();
    s.layout = FromProto(p.layout());
    s.page_size = p.page_size();
    s.pages_used = p.pages_used();
    s.pages_free = p.pages_free();
    s.tokens_held = p.tokens_held();
    s.records_held = p.records_held();
    s.pool_bytes = p.pool_bytes();
    s.nominal_bytes_per_token = p.nominal_bytes_per_token();
    s.effective_bytes_per_token = p.effective_bytes_per_token();
    s.bytes_saved_vs_bf16 = p.bytes_saved_vs_bf16();
    s.bytes_saved_vs_v4 = p.bytes_saved_vs_v4();
    stats.pools.push_back(std::move(s));
  }
  stats.tokens_held = resp.tokens_held();
  stats.records_held = resp.records_held();
  stats.pool_bytes = resp.pool_bytes();
  stats.bytes_saved_vs_bf16 = resp.bytes_saved_vs_bf16();
  stats.bytes_saved_vs_v4 = resp.bytes_saved_vs_v4();
  return stats;
}

absl::Status Client::Health(CallOptions call) {
  return impl_->Retry([&]() -> absl::Status {
    grpc::GenericStub stub(impl_->channel);
    grpc::CompletionQueue cq;
    grpc::ClientContext ctx;
    impl_->Prepare(ctx, call);
    grpc::Slice empty("");  // HealthCheckRequest{service: ""}: the whole server
    grpc::ByteBuffer req(&empty, 1), resp;
    auto rpc = stub.PrepareUnaryCall(&ctx, "/grpc.health.v1.Health/Check", req, &cq);
    rpc->StartCall();
    grpc::Status status;
    rpc->Finish(&resp, &status, reinterpret_cast<void*>(1));
    void* tag;
    bool ok;
    cq.Next(&tag, &ok);
    cq.Shutdown();
    while (cq.Next(&tag, &ok)) {
    }
    KVF_CLIENT_RETURN(FromGrpc(status, ctx));
    std::vector<grpc::Slice> slices;
    resp.Dump(&slices);
    std::string bytes;
    for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
    // HealthCheckResponse: field 1 (status), varint; 1 is SERVING.
    if (bytes != std::string("\x08\x01", 2)) {
      return absl::UnavailableError("kvferryd is not serving");
    }
    return absl::OkStatus();
  });
}

}  // namespace kvferry::client
