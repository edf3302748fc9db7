// Handlers of kvferry.v1.KvFerry: convert, call the core, map the status once.
#include "service/pool_service.h"

#include <xxhash.h>

#include <algorithm>
#include <chrono>

#include "absl/random/random.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/errors.h"
#include "common/log.h"
#include "core/reader.h"
#include "kvferry/kernels/status_macros.h"
#include "service/convert.h"
#include "service/status.h"
#include "service/streams.h"

namespace kvferry::server {
namespace {

using grpc::ServerContext;
using Tenant = std::shared_ptr<TenantAccount>;

// The loop of the client-streaming writes: the first message names the target and starts
// the staged write (`begin`); a later message may repeat the target but not change it
// (`same_target`); every message is added (`add`); a stream that ends cleanly commits.
// Any error, or the client going away, drops the write.
template <typename Request>
absl::StatusOr<int64_t> StreamWrite(
    ServerContext* context, grpc::ServerReader<Request>* reader, PoolManager* pools,
    const TenantAccount& tenant,
    const std::function<absl::StatusOr<std::unique_ptr<StagedWrite>>(const Request&,
                                                                     std::shared_ptr<Pool>)>& begin,
    const std::function<absl::Status(const Request& first, const Request& msg)>& same_target,
    const std::function<absl::Status(StagedWrite&, const Request&)>& add, uint64_t* received,
    StreamWatchdog::Watch& watch) {
  Request first, msg;
  std::unique_ptr<StagedWrite> write;
  StreamReader<Request> stream(reader);
  WriteEnd end;
  bool undecodable = false;
  while (stream.Read(write ? &msg : &first, &undecodable)) {
    watch.Touch();
    if (context->IsCancelled()) return ClientGone(context);
    const Request& m = write ? msg : first;
    *received += m.ByteSizeLong();
    KVF_RETURN_IF_ERROR(end.Next(m.finish_write()));
    if (!write) {
      KVF_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, pools->Get(tenant, first.pool()));
      KVF_ASSIGN_OR_RETURN(write, begin(first, std::move(pool)));
    } else {
      if (!msg.pool().empty() && msg.pool() != first.pool()) {
        return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kStreamTargetChanged,
                     "one write goes to one pool: a later message names another pool");
      }
      KVF_RETURN_IF_ERROR(same_target(first, msg));
    }
    KVF_RETURN_IF_ERROR(add(*write, m));
  }
  if (context->IsCancelled()) return ClientGone(context);
  if (undecodable) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                 "a message of the write stream could not be decoded (a string field that is "
                 "not UTF-8, or malformed bytes); nothing was written");
  }
  if (!write) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kEmptyWrite,
                 "empty write: no messages");
  }
  KVF_RETURN_IF_ERROR(end.AtEnd());
  return write->Commit();
}

}  // namespace

KvFerryService::KvFerryService(PoolManager* pools, SessionManager* sessions, ServiceOptions options)
    : pools_(pools),
      sessions_(sessions),
      options_(options),
      default_auth_(std::make_unique<OpenAuthenticator>(std::make_shared<TenantAccount>(""))),
      auth_(default_auth_.get()),
      own_watchdog_(OwnWatchdog(options_)),
      watchdog_(options_.watchdog != nullptr ? options_.watchdog : own_watchdog_.get()) {}

KvFerryService::KvFerryService(PoolManager* pools, SessionManager* sessions,
                               ServiceOptions options, const Authenticator* auth)
    : pools_(pools),
      sessions_(sessions),
      options_(options),
      auth_(auth),
      own_watchdog_(OwnWatchdog(options_)),
      watchdog_(options_.watchdog != nullptr ? options_.watchdog : own_watchdog_.get()) {}

template <typename Body>
grpc::Status KvFerryService::Handle(ServerContext* context, Body&& body) const {
  absl::StatusOr<std::shared_ptr<TenantAccount>> tenant = auth_->Authenticate(*context);
  if (!tenant.ok()) return ToGrpcStatus(context, tenant.status());
  return ToGrpcStatus(context, body(*tenant));
}

template <typename Body>
grpc::Status KvFerryService::HandleStream(ServerContext* context, Body&& body) const {
  return Handle(context, [&](const Tenant& tenant) {
    return RunStream(*watchdog_, context, tenant,
                     [&](StreamWatchdog::Watch& watch) { return body(tenant, watch); });
  });
}

absl::StatusOr<std::vector<PoolStats>> KvFerryService::Page(std::vector<PoolStats> pools,
                                                            uint32_t page_size,
                                                            const std::string& page_token,
                                                            std::string* next_token) const {
  const size_t size = page_size == 0 || static_cast<int64_t>(page_size) > options_.max_page_size
                          ? static_cast<size_t>(options_.max_page_size)
                          : static_cast<size_t>(page_size);
  // The token is the last name of the previous page (opaque to clients): the next page
  // starts after it, so pools created or deleted in between cannot shift it.
  std::string after;
  if (!page_token.empty() &&
      (!absl::WebSafeBase64Unescape(page_token, &after) || after.empty())) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                 "page_token is not one kvferryd returned; start again with an empty token");
  }
  auto first = page_token.empty()
                   ? pools.begin()
                   : std::upper_bound(pools.begin(), pools.end(), after,
                                      [](const std::string& name, const PoolStats& p) {
                                        return name < p.name;
                                      });
  const size_t from = static_cast<size_t>(first - pools.begin());
  const size_t to = std::min(pools.size(), from + size);
  next_token->clear();
  if (to < pools.size()) *next_token = absl::WebSafeBase64Escape(pools[to - 1].name);
  std::vector<PoolStats> page(std::make_move_iterator(pools.begin() + from),
                              std::make_move_iterator(pools.begin() + to));
  return page;
}

int64_t KvFerryService::ChunkBytes(uint32_t requested) const {
  if (requested == 0) return options_.default_chunk_bytes;
  // At least one bf16 row per piece, at most the daemon's limit.
  return std::clamp<int64_t>(requested, kBf16RowBytes, options_.max_chunk_bytes);
}

grpc::Status KvFerryService::CreatePool(ServerContext* context, const v1::CreatePoolRequest* req,
                                        v1::Pool* out) {
  return Handle(context, [&](const Tenant& tenant) -> absl::Status {
    KVF_ASSIGN_OR_RETURN(const PoolConfig config, FromProto(*req));
    KVF_ASSIGN_OR_RETURN(const std::shared_ptr<Pool> pool,
                         pools_->Create(tenant, config, req->device()));
    const PoolStats stats = pool->Stats();
    log::Info("pool created tenant={} name={} id={} layout={} page_size={} pages={} layers={} "
              "device={} bytes={}",
              log::Quoted(stats.tenant), log::Quoted(stats.name), stats.pool_id,
              LayoutName(stats.layout), stats.page_size, stats.num_pages, stats.num_layers,
              stats.device, stats.pool_bytes);
    ToProto(stats, out);
    return absl::OkStatus();
  });
}

grpc::Status KvFerryService::DescribePool(ServerContext* context,
                                          const v1::DescribePoolRequest* req, v1::Pool* out) {
  return Handle(context, [&](const Tenant& tenant) -> absl::Status {
    KVF_ASSIGN_OR_RETURN(const std::shared_ptr<Pool> pool, pools_->Get(*tenant, req->name()));
    ToProto(pool->Stats(), out);
    return absl::OkStatus();
  });
}

grpc::Status KvFerryService::ListPools(ServerContext* context, const v1::ListPoolsRequest* req,
                                       v1::ListPoolsResponse* out) {
  return Handle(context, [&](const Tenant& tenant) -> absl::Status {
    KVF_ASSIGN_OR_RETURN(const std::vector<PoolStats> page,
                         Page(pools_->Stats(*tenant).pools, req->page_size(), req->page_token(),
                              out->mutable_next_page_token()));
    for (const PoolStats& s : page) ToProto(s, out->add_pools());
    return absl::OkStatus();
  });
}

grpc::Status KvFerryService::DeletePool(ServerContext* context, const v1::DeletePoolRequest* req,
                                        v1::DeletePoolResponse*) {
  return Handle(context, [&](const Tenant& tenant) -> absl::Status {
    KVF_RETURN_IF_ERROR(pools_->Delete(*tenant, req->name()));
    log::Info("pool deleted tenant={} name={}", log::Quoted(tenant->name()),
              log::Quoted(req->name()));
    return absl::OkStatus();
  });
}

grpc::Status KvFerryService::AllocatePages(ServerContext* context,
                                           const v1::AllocatePagesRequest* req,
                                           v1::AllocatePagesResponse* out) {
  return Handle(context, [&](const Tenant& tenant) -> absl::Status {
    if (req->count() > static_cast<uint64_t>(options_.max_pages_per_call)) {
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kTooManyPages,
                   absl::StrCat("count ", req->count(), " is above ", options_.max_pages_per_call,
                                ", the most pages one reply carries; allocate in several calls"));
    }
    KVF_ASSIGN_OR_RETURN(const std::shared_ptr<Pool> pool, pools_->Get(*tenant, req->pool()));
    if (req->session_id() != 0 && sessions_ == nullptr) {
      return Error(absl::StatusCode::kNotFound, ErrorReason::kSessionNotFound, "no sessions here");
    }
    if (req->session_id() != 0 && req->lease_seconds() != 0) {
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                   "pages belong to a session or are leased, not both");
    }
    KVF_ASSIGN_OR_RETURN(const std::vector<PageHandle> pages,
                         pool->AllocatePages(req->count(), absl::Seconds(req->lease_seconds())));
    if (req->session_id() != 0) {
      if (absl::Status s = sessions_->AdoptPages(req->session_id(), *tenant, pool, pages); !s.ok()) {
        pool->FreePages(pages).IgnoreError();
        return s;
      }
    }
    if (context->IsCancelled()) {
      // Nobody will receive these handles: give the pages back.
      pool->FreePages(pages).IgnoreError();
      return ClientGone(context);
    }
    for (const PageHandle& h : pages) ToProto(h, out->add_pages());
    return absl::OkStatus();
  });
}

grpc::Status KvFerryService::FreePages(ServerContext* context, const v1::FreePagesRequest* req,
                                       v1::FreePagesResponse*) {
  return Handle(context, [&](const Tenant& tenant) -> absl::Status {
    KVF_ASSIGN_OR_RETURN(const std::shared_ptr<Pool> pool, pools_->Get(*tenant, req->pool()));
    return pool->FreePages(FromProto(req->pages()));
  });
}

grpc::Status KvFerryService::RenewPages(ServerContext* context, const v1::RenewPagesRequest* req,
                                        v1::RenewPagesResponse*) {
  return Handle(context, [&](const Tenant& tenant) -> absl::Status {
    KVF_ASSIGN_OR_RETURN(const std::shared_ptr<Pool> pool, pools_->Get(*tenant, req->pool()));
    return pool->Renew(FromProto(req->pages()));
  });
}

grpc::Status KvFerryService::WriteTokens(ServerContext* context,
                                         grpc::ServerReader<v1::WriteTokensRequest>* reader,
                                         v1::WriteResponse* out) {
  return HandleStream(context, [&](const Tenant& tenant,
                                   StreamWatchdog::Watch& watch) -> absl::Status {
    uint64_t received = 0;
    KVF_ASSIGN_OR_RETURN(
        const int64_t written,
        StreamWrite<v1::WriteTokensRequest>(
            context, reader, pools_, *tenant,
            [&](const v1::WriteTokensRequest& first, std::shared_ptr<Pool> pool) {
              return StagedWrite::ForRows(std::move(pool), first.layer(), options_.write_limits);
            },
            [](const v1::WriteTokensRequest& first, const v1::WriteTokensRequest& msg) {
              if (msg.has_layer() && msg.layer() != first.layer()) {
                return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kStreamTargetChanged,
                             absl::StrCat("one write goes to one layer: a later message names layer ",
                                          msg.layer(), " after layer ", first.layer()));
              }
              return absl::OkStatus();
            },
            [](StagedWrite& write, const v1::WriteTokensRequest& msg) {
              if (msg.finish_write() && msg.locations_size() == 0 && msg.rows().empty()) {
                return absl::OkStatus();  // the mark alone
              }
              return write.AddRows(FromProto(msg.locations()), Bytes(msg.rows()));
            },
            &received, watch));
    out->set_tokens_written(written);
    out->set_bytes_received(received);
    return absl::OkStatus();
  });
}

grpc::Status KvFerryService::WritePages(ServerContext* context,
                                        grpc::ServerReader<v1::WritePagesRequest>* reader,
                                        v1::WriteResponse* out) {
  return HandleStream(context, [&](const Tenant& tenant,
                                   StreamWatchdog::Watch& watch) -> absl::Status {
    uint64_t received = 0;
    KVF_ASSIGN_OR_RETURN(
        const int64_t written,
        StreamWrite<v1::WritePagesRequest>(
            context, reader, pools_, *tenant,
            [&](const v1::WritePagesRequest& first,
                std::shared_ptr<Pool> pool) -> absl::StatusOr<std::unique_ptr<StagedWrite>> {
              KVF_ASSIGN_OR_RETURN(const Layout layout, FromProto(first.layout()));
              return StagedWrite::ForPages(std::move(pool), layout, options_.write_limits);
            },
            [](const v1::WritePagesRequest& first, const v1::WritePagesRequest& msg) {
              if (msg.layout() != v1::LAYOUT_UNSPECIFIED && msg.layout() != first.layout()) {
                return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kStreamTargetChanged,
                             "one write has one layout: a later message names another");
              }
              return absl::OkStatus();
            },
            [](StagedWrite& write, const v1::WritePagesRequest& msg) {
              if (msg.finish_write() && !msg.has_page() && msg.data().empty()) {
                return absl::OkStatus();  // the mark alone
              }
              return write.AddPageBytes(FromProto(msg.page()), msg.layer(), msg.offset(),
                                        Bytes(msg.data()));
            },
            &received, watch));
    out->set_pages_written(written);
    out->set_bytes_received(received);
    return absl::OkStatus();
  });
}

grpc::Status KvFerryService::ReadPages(ServerContext* context, const v1::ReadPagesRequest* req,
                                       grpc::ServerWriter<v1::PageChunk>* writer) {
  return HandleStream(context, [&](const Tenant& tenant,
                                   StreamWatchdog::Watch& watch) -> absl::Status {
    KVF_ASSIGN_OR_RETURN(const std::shared_ptr<Pool> pool, pools_->Get(*tenant, req->pool()));
    KVF_ASSIGN_OR_RETURN(const std::optional<Layout> transcode_to,
                         TranscodeFromProto(req->transcode_to()));
    const std::vector<int64_t> layers(req->layers().begin(), req->layers().end());
    const int64_t chunk_bytes = ChunkBytes(req->chunk_bytes());
    KVF_ASSIGN_OR_RETURN(std::unique_ptr<Reader> reader,
                         server::ReadPages(pool, FromProto(req->pages()), layers, transcode_to,
                                           chunk_bytes));
    const uint64_t page_bytes = OutputPageBytes(*pool, transcode_to);
    return StreamRead<v1::PageChunk>(
        context, *reader, chunk_bytes, writer,
        [&](uint64_t offset, v1::PageChunk& chunk) {
          chunk.set_offset(offset);
          chunk.set_page_bytes(page_bytes);
        },
        [](v1::PageChunk& chunk) { return chunk.mutable_data(); }, [&] { watch.Touch(); });
  });
}

grpc::Status KvFerryService::ReadWorkspace(ServerContext* context,
                                           const v1::ReadWorkspaceRequest* req,
                                           grpc::ServerWriter<v1::WorkspaceChunk>* writer) {
  return HandleStream(context, [&](const Tenant& tenant,
                                   StreamWatchdog::Watch& watch) -> absl::Status {
    KVF_ASSIGN_OR_RETURN(const std::shared_ptr<Pool> pool, pools_->Get(*tenant, req->pool()));
    // Pieces of whole rows.
    const int64_t chunk_bytes = ChunkBytes(req->chunk_bytes()) / kBf16RowBytes * kBf16RowBytes;
    KVF_ASSIGN_OR_RETURN(std::unique_ptr<Reader> reader,
                         server::ReadWorkspace(pool, req->layer(), FromProto(req->locations()),
                                               chunk_bytes));
    return StreamRead<v1::WorkspaceChunk>(
        context, *reader, chunk_bytes, writer,
        [](uint64_t offset, v1::WorkspaceChunk& chunk) {
          chunk.set_first_row(offset / kBf16RowBytes);
        },
        [](v1::WorkspaceChunk& chunk) { return chunk.mutable_rows(); }, [&] { watch.Touch(); });
  });
}

grpc::Status KvFerryService::GetStats(ServerContext* context, const v1::GetStatsRequest* req,
                                      v1::Stats* out) {
  return Handle(context, [&](const Tenant& tenant) -> absl::Status {
    DaemonStats stats = pools_->Stats(*tenant);
    std::string next;
    KVF_ASSIGN_OR_RETURN(stats.pools, Page(std::move(stats.pools), req->page_size(),
                                           req->page_token(), &next));
    ToProto(stats, out);
    out->set_next_page_token(next);
    return absl::OkStatus();
  });
}

}  // namespace kvferry::server
