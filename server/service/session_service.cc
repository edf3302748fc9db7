// Handlers of kvferry.v1.KvSession.
#include "service/session_service.h"

#include <chrono>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/errors.h"
#include "common/log.h"
#include "core/cache_session.h"
#include "kvferry/kernels/status_macros.h"
#include "kvferry/thread_name.h"
#include "service/convert.h"
#include "service/status.h"
#include "service/streams.h"

namespace kvferry::server {
namespace {

absl::StatusOr<KvTensorSpec> FromProto(const v1::KvTensor& t) {
  KvTensorSpec spec;
  spec.ipc_handle = t.ipc_handle();
  spec.vmm_pid = t.vmm_pid();
  for (const v1::VmmAllocation& a : t.vmm_allocations()) spec.vmm.push_back({a.fd(), a.size()});
  spec.vmm_proof_fd = t.vmm_proof_fd();
  spec.offset = t.offset();
  spec.num_blocks = t.num_blocks();
  spec.block_tokens = t.block_tokens();
  spec.block_stride = t.block_stride();
  spec.token_stride = t.token_stride();
  spec.name = t.name();
  switch (t.kind()) {
    case v1::ROW_KIND_BF16:
      spec.kind = RowKind::kBf16;
      break;
    case v1::ROW_KIND_RECORDS: {
      spec.kind = RowKind::kRecords;
      absl::StatusOr<Layout> layout = server::FromProto(t.layout());
      if (!layout.ok()) return layout.status();
      spec.layout = *layout;
      break;
    }
    default:
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                   "tensor kind must be ROW_KIND_BF16 or ROW_KIND_RECORDS");
  }
  return spec;
}

std::vector<BlockSlot> FromProto(const google::protobuf::RepeatedPtrField<v1::BlockSlot>& slots) {
  std::vector<BlockSlot> out;
  out.reserve(slots.size());
  for (const v1::BlockSlot& b : slots) out.push_back({b.block(), b.slot()});
  return out;
}

template <typename Request>
TransferRequest Common(const Request& req, const TenantAccount& caller) {
  TransferRequest t;
  t.caller = &caller;
  t.session_id = req.session_id();
  t.tensor_id = req.tensor_id();
  t.pool = req.pool();
  t.layer = req.layer();
  if (req.has_completion()) t.async = AsyncSlot{req.completion().slot(), req.completion().sequence()};
  return t;
}

}  // namespace

template <typename Body>
grpc::Status SessionService::Handle(grpc::ServerContext* context, Body&& body) const {
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::shared_ptr<TenantAccount>> tenant = auth_->Authenticate(*context);
  if (!tenant.ok()) return ToGrpcStatus(context, tenant.status());
  const auto authenticated = std::chrono::steady_clock::now();
  grpc::Status status = ToGrpcStatus(context, body(**tenant));
  if (spdlog::should_log(spdlog::level::debug)) {
    // With the client's own timing, what the rpc itself costs (transport, parsing).
    log::Debug("session rpc handled in {:.3f} ms (authentication {:.3f} ms)",
               log::Millis(start, std::chrono::steady_clock::now()), log::Millis(start, authenticated));
  }
  return status;
}

grpc::Status SessionService::OpenSession(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<v1::SessionEvent, v1::SessionRequest>* stream) {
  absl::StatusOr<std::shared_ptr<TenantAccount>> owner = auth_->Authenticate(*context);
  if (!owner.ok()) return ToGrpcStatus(context, owner.status());
  const absl::Status status =
      RunStream(*watchdog_, context, *owner, [&](StreamWatchdog::Watch& watch) -> absl::Status {
        v1::SessionRequest first;
        if (!stream->Read(&first)) return ClientGone(context);
        if (!first.has_open()) {
          return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                       "the first message of a session must be `open`");
        }
        KVF_ASSIGN_OR_RETURN(const SessionManager::Opened opened,
                             sessions_->Open(*owner, first.open().worker(), first.open().device(),
                                             first.open().completion_slots()));
        // Open: the session lives as long as its worker, however quiet.
        watch.LongLived(/*idle_checked=*/false);
        Serve(opened, first.open(), context, stream);
        return absl::OkStatus();
      });
  return ToGrpcStatus(context, status);
}

void SessionService::Serve(const SessionManager::Opened& opened, const v1::SessionOpen& open,
                           grpc::ServerContext* context,
                           grpc::ServerReaderWriter<v1::SessionEvent, v1::SessionRequest>* stream) {
  const uint64_t id = opened.session_id;
  log::Info("session opened id={} worker={} device=cuda:{}", id, log::Quoted(open.worker()),
            open.device());
  v1::SessionEvent event;
  event.mutable_opened()->set_session_id(id);
  event.mutable_opened()->set_completion_shm(opened.completion_shm);
  event.mutable_opened()->set_session_secret(opened.secret);
  event.mutable_opened()->set_completion_slots(opened.completion_slots);
  stream->Write(event);
  // Revocations go out on a writer thread; this thread reads until the worker goes away.
  std::thread writer([&] {
    NameThisThread("kvf-revocations");
    while (std::optional<Revocation> revoked = sessions_->NextRevocation(id)) {
      v1::SessionEvent e;
      e.mutable_revoked()->set_export_id(revoked->export_id);
      e.mutable_revoked()->set_reason(revoked->reason);
      stream->Write(e);
    }
  });
  v1::SessionRequest request;
  while (stream->Read(&request)) {
    if (request.has_close()) break;
    if (request.has_mapped()) sessions_->CompletionMapped(id);
  }
  sessions_->Close(id);
  writer.join();
  log::Info("session closed id={}{}", id, context->IsCancelled() ? " (worker gone)" : "");
}

grpc::Status SessionService::RegisterKv(grpc::ServerContext* context,
                                        const v1::RegisterKvRequest* req,
                                        v1::RegisterKvResponse* out) {
  return Handle(context, [&](const TenantAccount& caller) -> absl::Status {
    std::vector<KvTensorSpec> specs;
    for (const v1::KvTensor& t : req->tensors()) {
      KVF_ASSIGN_OR_RETURN(KvTensorSpec spec, FromProto(t));
      specs.push_back(std::move(spec));
    }
    KVF_ASSIGN_OR_RETURN(const std::vector<uint64_t> ids, sessions_->Register(req->session_id(), caller, specs));
    for (uint64_t id : ids) out->add_tensor_ids(id);
    return absl::OkStatus();
  });
}

grpc::Status SessionService::Save(grpc::ServerContext* context, const v1::SaveRequest* req,
                                  v1::TransferResponse* out) {
  return Handle(context, [&](const TenantAccount& caller) -> absl::Status {
    if (req->has_cache()) {
      if (req->has_completion() || !req->sources().empty() || !req->destinations().empty() ||
          !req->destination_pages().empty() || req->has_destination_page_list()) {
        return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                     "a save by key names source_blocks and cache keys only, and is "
                     "synchronous (no completion, sources, destinations or pages)");
      }
      CacheSaveRequest s;
      s.caller = &caller;
      s.session_id = req->session_id();
      s.name_space = req->cache().namespace_();
      s.digest = req->cache().digest();
      s.pool = req->pool();
      s.keys.assign(req->cache().keys().begin(), req->cache().keys().end());
      s.blocks.assign(req->source_blocks().begin(), req->source_blocks().end());
      s.layer_tensors.assign(req->layer_tensor_ids().begin(), req->layer_tensor_ids().end());
      if (s.layer_tensors.empty() && req->layer() == 0) s.layer_tensors.push_back(req->tensor_id());
      KVF_ASSIGN_OR_RETURN(const CacheSaveResult result, SaveToCache(*sessions_, *cache_, s));
      out->set_tokens(result.tokens);
      out->set_blocks_stored(result.stored);
      out->set_blocks_already_held(result.already_held);
      return absl::OkStatus();
    }
    if (!req->layer_tensor_ids().empty()) {
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                   "layer_tensor_ids belong to a save by key (cache)");
    }
    TransferRequest t = Common(*req, caller);
    t.blocks = FromProto(req->sources());
    t.locations = server::FromProto(req->destinations());
    t.tensor_blocks.assign(req->source_blocks().begin(), req->source_blocks().end());
    KVF_ASSIGN_OR_RETURN(t.pages, server::PagesFromProto(req->destination_pages(), req->has_destination_page_list(),
                                        req->destination_page_list(), "destination"));
    KVF_ASSIGN_OR_RETURN(const int64_t tokens, sessions_->Save(t));
    out->set_tokens(tokens);
    return absl::OkStatus();
  });
}

grpc::Status SessionService::Load(grpc::ServerContext* context, const v1::LoadRequest* req,
                                  v1::TransferResponse* out) {
  return Handle(context, [&](const TenantAccount& caller) -> absl::Status {
    TransferRequest t = Common(*req, caller);
    t.tensor_blocks.assign(req->destination_blocks().begin(), req->destination_blocks().end());
    if (req->has_cache()) {
      if (!req->sources().empty() || !req->destinations().empty() ||
          !req->source_pages().empty() || req->has_source_page_list()) {
        return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                     "a load by key names its lease and destination_blocks only (no sources, "
                     "destinations or pages)");
      }
      CacheLoadRequest l;
      l.transfer = std::move(t);
      l.name_space = req->cache().namespace_();
      l.digest = req->cache().digest();
      l.lease_id = req->cache().lease_id();
      l.first_block = req->cache().first_block();
      KVF_ASSIGN_OR_RETURN(const int64_t tokens, LoadFromCache(*sessions_, *cache_, std::move(l)));
      out->set_tokens(tokens);
      return absl::OkStatus();
    }
    t.locations = server::FromProto(req->sources());
    t.blocks = FromProto(req->destinations());
    KVF_ASSIGN_OR_RETURN(t.pages, server::PagesFromProto(req->source_pages(), req->has_source_page_list(),
                                        req->source_page_list(), "source"));
    KVF_ASSIGN_OR_RETURN(const int64_t tokens, sessions_->Load(t));
    out->set_tokens(tokens);
    return absl::OkStatus();
  });
}

grpc::Status SessionService::MapPool(grpc::ServerContext* context, const v1::MapPoolRequest* req,
                                     v1::MapPoolResponse* out) {
  return Handle(context, [&](const TenantAccount& caller) -> absl::Status {
    KVF_ASSIGN_OR_RETURN(const PoolExport e,
                         sessions_->MapPool(req->session_id(), caller, req->pool()));
    out->set_export_id(e.export_id);
    out->set_ipc_handle(e.memory.ipc_handle);
    out->set_offset(e.memory.offset);
    out->set_page_bytes(e.page_bytes);
    out->set_layer_bytes(e.layer_bytes);
    ToProto(e.pool, out->mutable_pool());
    return absl::OkStatus();
  });
}

grpc::Status SessionService::UnmapPool(grpc::ServerContext* context,
                                       const v1::UnmapPoolRequest* req, v1::UnmapPoolResponse*) {
  return Handle(context, [&](const TenantAccount& caller) {
    return sessions_->UnmapPool(req->session_id(), caller, req->export_id());
  });
}

}  // namespace kvferry::server
