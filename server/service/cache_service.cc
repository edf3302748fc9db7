// Handlers of kvferry.v1.KvCache: convert, call the block index, map the status once.
#include "service/cache_service.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/errors.h"
#include "common/log.h"
#include "core/block_put.h"
#include "core/reader.h"
#include "kvferry/kernels/status_macros.h"
#include "service/convert.h"
#include "service/status.h"
#include "service/streams.h"

namespace kvferry::server {
namespace {

using grpc::ServerContext;
using Tenant = std::shared_ptr<TenantAccount>;
using Watch = StreamWatchdog::Watch;

void NamespaceToProto(const NamespaceInfo& info, v1::Namespace* out) {
  out->set_name(info.name);
  out->set_digest(info.digest);
  out->set_block_tokens(static_cast<uint32_t>(info.block_tokens));
  out->set_max_blocks(static_cast<uint64_t>(info.max_blocks));
  for (const MemberInfo& m : info.members) {
    v1::NamespaceMember* p = out->add_members();
    p->set_pool(m.pool);
    p->set_pool_id(m.pool_id);
    p->set_layout(ToProto(m.layout));
    p->set_page_size(m.page_size);
    p->set_num_layers(m.num_layers);
    p->set_tier(m.tier);
    p->set_blocks(static_cast<uint64_t>(m.blocks));
  }
}

void EventToProto(const BlockEvent& e, v1::BlockEvent* out) {
  out->set_sequence(e.sequence);
  out->set_kind(e.kind == BlockEvent::Kind::kStored ? v1::BlockEvent::BLOCK_STORED
                                                    : v1::BlockEvent::BLOCK_REMOVED);
  switch (e.cause) {
    case BlockEvent::Cause::kEvicted: out->set_cause(v1::BlockEvent::EVICTED); break;
    case BlockEvent::Cause::kNamespaceDeleted: out->set_cause(v1::BlockEvent::NAMESPACE_DELETED); break;
    case BlockEvent::Cause::kPoolDeleted: out->set_cause(v1::BlockEvent::POOL_DELETED); break;
    default: out->set_cause(v1::BlockEvent::CAUSE_UNSPECIFIED); break;
  }
  out->set_namespace_(e.name_space);
  out->set_key(e.key);
  out->set_pool(e.pool);
  out->set_tier(e.tier);
}

absl::Status TargetChanged() {
  return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kStreamTargetChanged,
               "one put goes to one namespace and pool: a later message names another");
}

// The loop of the client-streaming puts: the first message names the target and begins the
// put; every message adds its piece; a stream whose last message sets finish_write commits.
// Any error, a stream ended without that mark, or the client going away drops the put (its
// pages are freed, nothing was visible).
template <typename Request>
absl::StatusOr<BlockPut::Result> StreamPut(
    ServerContext* context, grpc::ServerReader<Request>* reader,
    const std::function<absl::StatusOr<std::unique_ptr<BlockPut>>(const Request&)>& begin,
    const std::function<absl::Status(const Request& first, const Request& msg)>& same_target,
    const std::function<absl::Status(BlockPut&, const Request&)>& add, uint64_t* received,
    Watch& watch) {
  Request first, msg;
  std::unique_ptr<BlockPut> put;
  StreamReader<Request> stream(reader);
  WriteEnd end;
  bool undecodable = false;
  while (stream.Read(put ? &msg : &first, &undecodable)) {
    if (context->IsCancelled()) return ClientGone(context);
    watch.Touch();
    const Request& m = put ? msg : first;
    *received += m.ByteSizeLong();
    KVF_RETURN_IF_ERROR(end.Next(m.finish_write()));
    if (!put) {
      KVF_ASSIGN_OR_RETURN(put, begin(first));
    } else {
      if ((!msg.namespace_().empty() && msg.namespace_() != first.namespace_()) ||
          (!msg.pool().empty() && msg.pool() != first.pool()) ||
          (msg.digest() != 0 && msg.digest() != first.digest())) {
        return TargetChanged();
      }
      KVF_RETURN_IF_ERROR(same_target(first, msg));
    }
    KVF_RETURN_IF_ERROR(add(*put, m));
  }
  if (context->IsCancelled()) return ClientGone(context);
  if (undecodable) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                 "a message of the put stream could not be decoded; nothing was stored");
  }
  if (!put) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kEmptyWrite,
                 "empty put: no messages");
  }
  KVF_RETURN_IF_ERROR(end.AtEnd());
  return put->Commit();
}

}  // namespace

template <typename Body>
grpc::Status KvCacheService::Handle(ServerContext* context, Body&& body) const {
  absl::StatusOr<std::shared_ptr<TenantAccount>> tenant = auth_->Authenticate(*context);
  if (!tenant.ok()) return ToGrpcStatus(context, tenant.status());
  return ToGrpcStatus(context, body(*tenant));
}

template <typename Body>
grpc::Status KvCacheService::HandleStream(ServerContext* context, Body&& body) const {
  return Handle(context, [&](const Tenant& tenant) {
    return RunStream(*watchdog_, context, tenant,
                     [&](Watch& watch) { return body(tenant, watch); });
  });
}

int64_t KvCacheService::ChunkBytes(uint32_t requested) const {
  if (requested == 0) return options_.default_chunk_bytes;
  return std::clamp<int64_t>(requested, kBf16RowBytes, options_.max_chunk_bytes);
}

grpc::Status KvCacheService::CreateNamespace(ServerContext* context,
                                             const v1::CreateNamespaceRequest* req,
                                             v1::Namespace* out) {
  return Handle(context, [&](const Tenant& tenant) -> absl::Status {
    NamespaceSpec spec;
    spec.name = req->name();
    spec.model_fingerprint = req->model_fingerprint();
    spec.layer_group = req->layer_group();
    spec.tenant_salt = req->tenant_salt();
    spec.block_tokens = req->block_tokens();
    if (req->max_blocks() > (uint64_t{1} << 40)) {
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                   "max_blocks is above 2^40");
    }
    spec.max_blocks = static_cast<int64_t>(req->max_blocks());
    if (req->pools_size() > 8) {
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                   "a namespace has at most 8 member pools");
    }
    for (const std::string& name : req->pools()) {
      KVF_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, pools_->Get(*tenant, name));
      spec.members.push_back(std::move(pool));
    }
    KVF_ASSIGN_OR_RETURN(const NamespaceInfo info, index_->CreateNamespace(*tenant, std::move(spec)));
    log::Info("namespace created tenant={} name={} members={} block_tokens={}",
              log::Quoted(tenant->name()), log::Quoted(info.name), info.members.size(),
              info.block_tokens);
    NamespaceToProto(info, out);
    return absl::OkStatus();
  });
}

grpc::Status KvCacheService::DescribeNamespace(ServerContext* context,
                                               const v1::DescribeNamespaceRequest* req,
                                               v1::Namespace* out) {
  return Handle(context, [&](const Tenant& tenant) -> absl::Status {
    KVF_ASSIGN_OR_RETURN(const NamespaceInfo info, index_->DescribeNamespace(*tenant, req->name()));
    NamespaceToProto(info, out);
    return absl::OkStatus();
  });
}

grpc::Status KvCacheService::DeleteNamespace(ServerContext* context,
                                             const v1::DeleteNamespaceRequest* req,
                                             v1::DeleteNamespaceResponse*) {
  return Handle(context, [&](const Tenant& tenant) -> absl::Status {
    return index_->DeleteNamespace(*tenant, req->name());
  });
}

grpc::Status KvCacheService::PutRows(ServerContext* context,
                                     grpc::ServerReader<v1::PutRowsRequest>* reader,
                                     v1::PutResponse* out) {
  return HandleStream(context, [&](const Tenant& tenant, Watch& watch) -> absl::Status {
    uint64_t received = 0;
    KVF_ASSIGN_OR_RETURN(
        const BlockPut::Result result,
        StreamPut<v1::PutRowsRequest>(
            context, reader,
            [&](const v1::PutRowsRequest& first) {
              return BlockPut::Begin(index_, *tenant, first.namespace_(), first.digest(),
                                     first.pool(), /*records=*/false, Layout::kV4,
                                     options_.write_limits);
            },
            [](const v1::PutRowsRequest&, const v1::PutRowsRequest&) { return absl::OkStatus(); },
            [](BlockPut& put, const v1::PutRowsRequest& m) {
              if (m.finish_write() && m.key().empty() && m.rows().empty()) {
                return absl::OkStatus();  // the mark alone
              }
              return put.AddRows(m.key(), m.layer(), m.first_slot(), Bytes(m.rows()));
            },
            &received, watch));
    out->set_blocks_stored(result.stored);
    out->set_blocks_already_held(result.already_held);
    out->set_bytes_received(received);
    return absl::OkStatus();
  });
}

grpc::Status KvCacheService::PutPages(ServerContext* context,
                                      grpc::ServerReader<v1::PutPagesRequest>* reader,
                                      v1::PutResponse* out) {
  return HandleStream(context, [&](const Tenant& tenant, Watch& watch) -> absl::Status {
    uint64_t received = 0;
    KVF_ASSIGN_OR_RETURN(
        const BlockPut::Result result,
        StreamPut<v1::PutPagesRequest>(
            context, reader,
            [&](const v1::PutPagesRequest& first) -> absl::StatusOr<std::unique_ptr<BlockPut>> {
              KVF_ASSIGN_OR_RETURN(const Layout layout, FromProto(first.layout()));
              return BlockPut::Begin(index_, *tenant, first.namespace_(), first.digest(),
                                     first.pool(), /*records=*/true, layout,
                                     options_.write_limits);
            },
            [](const v1::PutPagesRequest& first, const v1::PutPagesRequest& msg) {
              if (msg.layout() != v1::LAYOUT_UNSPECIFIED && msg.layout() != first.layout()) {
                return TargetChanged();
              }
              return absl::OkStatus();
            },
            [](BlockPut& put, const v1::PutPagesRequest& m) {
              if (m.finish_write() && m.key().empty() && m.data().empty()) {
                return absl::OkStatus();  // the mark alone
              }
              return put.AddPageBytes(m.key(), m.layer(), m.offset(), Bytes(m.data()));
            },
            &received, watch));
    out->set_blocks_stored(result.stored);
    out->set_blocks_already_held(result.already_held);
    out->set_bytes_received(received);
    return absl::OkStatus();
  });
}

grpc::Status KvCacheService::Lookup(ServerContext* context, const v1::LookupRequest* req,
                                    v1::LookupResponse* out) {
  return Handle(context, [&](const Tenant& tenant) -> absl::Status {
    LookupRequest lookup;
    lookup.name_space = req->namespace_();
    lookup.digest = req->digest();
    lookup.keys.reserve(req->keys_size());
    for (const std::string& key : req->keys()) lookup.keys.push_back(key);
    lookup.pools.assign(req->pools().begin(), req->pools().end());
    lookup.lease_ttl = absl::Milliseconds(req->lease_ttl_ms());
    KVF_ASSIGN_OR_RETURN(const LookupResult result, index_->Lookup(*tenant, lookup));
    out->set_hit_blocks(result.hit_blocks);
    out->set_pending_blocks(result.pending_blocks);
    out->set_hit_tokens(result.hit_blocks * result.block_tokens);
    out->set_lease_id(result.lease_id);
    if (result.lease_id != 0) out->set_lease_expires_unix_ms(absl::ToUnixMillis(result.lease_expiry));
    return absl::OkStatus();
  });
}

grpc::Status KvCacheService::ReleaseLease(ServerContext* context,
                                          const v1::ReleaseLeaseRequest* req,
                                          v1::ReleaseLeaseResponse*) {
  return Handle(context, [&](const Tenant& tenant) -> absl::Status {
    return index_->ReleaseLease(*tenant, req->namespace_(), req->lease_id());
  });
}

grpc::Status KvCacheService::LoadRows(ServerContext* context, const v1::LoadRowsRequest* req,
                                      grpc::ServerWriter<v1::WorkspaceChunk>* writer) {
  return HandleStream(context, [&](const Tenant& tenant, Watch& watch) -> absl::Status {
    if (req->first_block() > (uint64_t{1} << 40) || req->num_blocks() > (uint64_t{1} << 40)) {
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kBlockOutOfRange,
                   "first_block or num_blocks is beyond any lease");
    }
    KVF_ASSIGN_OR_RETURN(const std::unique_ptr<LoadPin> pin,
                         index_->PinForLoad(*tenant, req->namespace_(), req->digest(),
                                            req->lease_id(), req->pool(),
                                            static_cast<int64_t>(req->first_block()),
                                            static_cast<int64_t>(req->num_blocks())));
    const int page_size = pin->pool()->config().page_size;
    std::vector<TokenLocation> where;
    where.reserve(pin->pages().size() * page_size);
    for (const PageHandle& page : pin->pages()) {
      for (int s = 0; s < page_size; ++s) where.push_back({page, static_cast<uint32_t>(s)});
    }
    const int64_t chunk_bytes = ChunkBytes(req->chunk_bytes()) / kBf16RowBytes * kBf16RowBytes;
    KVF_ASSIGN_OR_RETURN(std::unique_ptr<Reader> reader,
                         server::ReadWorkspace(pin->pool(), req->layer(), where, chunk_bytes));
    return StreamRead<v1::WorkspaceChunk>(
        context, *reader, chunk_bytes, writer,
        [](uint64_t offset, v1::WorkspaceChunk& chunk) {
          chunk.set_first_row(offset / kBf16RowBytes);
        },
        [](v1::WorkspaceChunk& chunk) { return chunk.mutable_rows(); },
        [&] { watch.Touch(); });
  });
}

grpc::Status KvCacheService::LoadPages(ServerContext* context, const v1::LoadPagesRequest* req,
                                       grpc::ServerWriter<v1::PageChunk>* writer) {
  return HandleStream(context, [&](const Tenant& tenant, Watch& watch) -> absl::Status {
    if (req->first_block() > (uint64_t{1} << 40) || req->num_blocks() > (uint64_t{1} << 40)) {
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kBlockOutOfRange,
                   "first_block or num_blocks is beyond any lease");
    }
    KVF_ASSIGN_OR_RETURN(const std::optional<Layout> transcode_to,
                         TranscodeFromProto(req->transcode_to()));
    KVF_ASSIGN_OR_RETURN(const std::unique_ptr<LoadPin> pin,
                         index_->PinForLoad(*tenant, req->namespace_(), req->digest(),
                                            req->lease_id(), req->pool(),
                                            static_cast<int64_t>(req->first_block()),
                                            static_cast<int64_t>(req->num_blocks())));
    const std::vector<int64_t> layers(req->layers().begin(), req->layers().end());
    const int64_t chunk_bytes = ChunkBytes(req->chunk_bytes());
    KVF_ASSIGN_OR_RETURN(std::unique_ptr<Reader> reader,
                         server::ReadPages(pin->pool(), pin->pages(), layers, transcode_to,
                                           chunk_bytes));
    const uint64_t page_bytes = OutputPageBytes(*pin->pool(), transcode_to);
    return StreamRead<v1::PageChunk>(
        context, *reader, chunk_bytes, writer,
        [&](uint64_t offset, v1::PageChunk& chunk) {
          chunk.set_offset(offset);
          chunk.set_page_bytes(page_bytes);
        },
        [](v1::PageChunk& chunk) { return chunk.mutable_data(); },
        [&] { watch.Touch(); });
  });
}

grpc::Status KvCacheService::SubscribeEvents(ServerContext* context,
                                             const v1::SubscribeEventsRequest* req,
                                             grpc::ServerWriter<v1::EventBatch>* writer) {
  return HandleStream(context, [&](const Tenant& tenant, Watch& watch) -> absl::Status {
    EventLog& log = index_->events();
    if (req->publisher_id() != 0 && req->publisher_id() != log.publisher_id()) {
      return Error(absl::StatusCode::kFailedPrecondition, ErrorReason::kPublisherChanged,
                   absl::StrCat("publisher ", req->publisher_id(), " is gone (the daemon "
                                "restarted, now publisher ", log.publisher_id(),
                                "): take a Snapshot"));
    }
    // Open as long as the subscriber reads: its heartbeats keep the idle timeout away, a
    // subscriber that stops reading is cancelled by it.
    watch.LongLived(/*idle_checked=*/true);
    uint64_t after = req->after_sequence();
    // A heartbeat first: the subscriber learns the publisher and where the sequence is.
    bool heartbeat = true;
    while (true) {
      if (context->IsCancelled()) return ClientGone(context);
      std::vector<BlockEvent> events;
      uint64_t latest = 0;
      const EventLog::ReadResult r =
          log.Read(tenant->name(), after, 4096, heartbeat ? absl::ZeroDuration() : absl::Milliseconds(500),
                   &events, &latest);
      heartbeat = false;
      if (r == EventLog::ReadResult::kClosed) {
        return Error(absl::StatusCode::kUnavailable, ErrorReason::kShuttingDown,
                     "the daemon is stopping");
      }
      if (r == EventLog::ReadResult::kLost) {
        return Error(absl::StatusCode::kAborted, ErrorReason::kEventsLost,
                     absl::StrCat("events after ", after, " are no longer kept (latest ", latest,
                                  "): take a Snapshot and subscribe after its sequence"));
      }
      v1::EventBatch batch;
      batch.set_publisher_id(log.publisher_id());
      batch.set_sequence(latest);
      for (const BlockEvent& e : events) EventToProto(e, batch.add_events());
      if (!events.empty()) after = events.back().sequence;
      // Read waited at most half a second: an idle stream gets a heartbeat at least every
      // second.
      if (!writer->Write(batch)) return ClientGone(context);
      watch.Touch();
    }
  });
}

grpc::Status KvCacheService::Snapshot(ServerContext* context, const v1::SnapshotRequest*,
                                      grpc::ServerWriter<v1::SnapshotChunk>* writer) {
  return HandleStream(context, [&](const Tenant& tenant, Watch& watch) -> absl::Status {
    const BlockIndex::Snapshot snapshot = index_->TakeSnapshot(*tenant);
    v1::SnapshotChunk chunk;
    size_t bytes = 0;
    auto send = [&]() -> absl::Status {
      chunk.set_publisher_id(snapshot.publisher_id);
      chunk.set_sequence(snapshot.sequence);
      if (!writer->Write(chunk)) return ClientGone(context);
      watch.Touch();
      chunk.Clear();
      bytes = 0;
      return absl::OkStatus();
    };
    for (const BlockEvent& e : snapshot.blocks) {
      EventToProto(e, chunk.add_blocks());
      bytes += e.key.size() + e.name_space.size() + e.pool.size() + e.tier.size() + 16;
      if (bytes >= static_cast<size_t>(options_.max_chunk_bytes)) KVF_RETURN_IF_ERROR(send());
    }
    if (chunk.blocks_size() > 0 || snapshot.blocks.empty()) KVF_RETURN_IF_ERROR(send());
    return absl::OkStatus();
  });
}

}  // namespace kvferry::server
