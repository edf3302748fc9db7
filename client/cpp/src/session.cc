// The worker side of a CUDA IPC session: the session stream, tensors, Save/Load, and the
// completion words read from shared memory.
#include "kvferry/client/session.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "internal.h"
#include "kvferry/v1/kvferry.grpc.pb.h"
#include "kvferry/v1/session.grpc.pb.h"

namespace kvferry::client {
using namespace internal;  // NOLINT: the shared conversions

namespace {

constexpr uint64_t kDone = 2, kFailed = 3;

uint64_t LoadWord(const uint64_t* word) {
  return std::atomic_ref<const uint64_t>(*word).load(std::memory_order_acquire);
}

// The completion area, mapped read-only.
struct Area {
  const uint64_t* words = nullptr;
  size_t bytes = 0;
  ~Area() {
    if (words != nullptr) munmap(const_cast<uint64_t*>(words), bytes);
  }
};

}  // namespace

uint64_t Session::Pending::Word() const {
  if (const uint64_t kept = outcome_->word.load(std::memory_order_acquire); kept != 0) return kept;
  return LoadWord(word_);
}

bool Session::Pending::Done() const {
  if (outcome_->refused.load(std::memory_order_acquire)) return true;
  const uint64_t w = Word();
  return (w >> 8) == sequence_ && ((w & 0xFF) == kDone || (w & 0xFF) == kFailed);
}

absl::Status Session::Pending::Wait(absl::Duration timeout) const {
  const absl::Time deadline = absl::Now() + timeout;
  for (int spins = 0; !Done(); ++spins) {
    if (absl::Now() > deadline) return absl::DeadlineExceededError("the operation did not complete");
    if (spins > 1000) std::this_thread::yield();
  }
  if (outcome_->refused.load(std::memory_order_acquire)) return outcome_->refusal;
  if ((Word() & 0xFF) == kFailed) {
    return absl::InternalError("the daemon reported the operation failed; nothing was stored");
  }
  return absl::OkStatus();
}

struct Session::Impl {
  ClientOptions options;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::KvSession::Stub> sessions;
  // Unary calls, round robin (ClientOptions::session_connections); the first is `sessions`'s.
  std::vector<std::unique_ptr<v1::KvSession::Stub>> callers;
  std::atomic<uint32_t> next_caller{0};
  std::unique_ptr<v1::KvFerry::Stub> pools;
  grpc::ClientContext stream_ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionEvent>> stream;
  std::thread events;
  uint64_t id = 0;
  std::string secret;  // SessionOpened.session_secret
  std::shared_ptr<Area> area;
  uint32_t slots = 0;

  absl::Mutex mu;
  std::vector<uint64_t> revoked ABSL_GUARDED_BY(mu);
  std::vector<bool> busy ABSL_GUARDED_BY(mu);      // slots whose operation may still run
  std::vector<uint64_t> issued ABSL_GUARDED_BY(mu);  // sequence of each slot's operation
  // Each slot's operation's outcome, kept when the slot is reused (its Pending may live on).
  std::vector<std::shared_ptr<Pending::Outcome>> outcomes ABSL_GUARDED_BY(mu);
  uint64_t next_sequence ABSL_GUARDED_BY(mu) = 1;
  uint32_t next_slot ABSL_GUARDED_BY(mu) = 0;
  bool closed = false;

  template <typename Request, typename Response>
  absl::Status Unary(grpc::Status (v1::KvSession::Stub::*method)(grpc::ClientContext*,
                                                                const Request&, Response*),
                     const Request& request, Response* response) {
    grpc::ClientContext ctx;
    Prepare(ctx, options, options.timeout);
    return FromGrpc((NextCaller()->*method)(&ctx, request, response), ctx);
  }

  // Enqueued calls not answered yet (Close waits for them); shared with their callbacks,
  // which may end after the session.
  struct Flight {
    absl::Mutex mu;
    int calls ABSL_GUARDED_BY(mu) = 0;
  };
  std::shared_ptr<Flight> flight = std::make_shared<Flight>();

  struct Slot {
    uint32_t index;
    uint64_t sequence;
    std::shared_ptr<Pending::Outcome> outcome;
  };
  // Sends `request` with a completion slot; the Pending polls the slot's word.
  template <typename Request>
  absl::StatusOr<Pending> Async(grpc::Status (v1::KvSession::Stub::*method)(
                                    grpc::ClientContext*, const Request&, v1::TransferResponse*),
                                Request& request) {
    absl::StatusOr<Slot> slot = TakeSlotFor(request);
    if (!slot.ok()) return slot.status();
    v1::TransferResponse resp;
    if (absl::Status s = Unary(method, request, &resp); !s.ok()) {
      Unanswered(slot->index, s);
      return s;
    }
    return Pending(area, area->words + slot->index, slot->sequence, slot->outcome);
  }
  // The same without waiting for the daemon: the request goes out on gRPC's threads; a
  // refusal becomes the Pending's outcome.
  template <typename Request>
  absl::StatusOr<Pending> Enqueue(
      void (v1::KvSession::Stub::async_interface::*method)(grpc::ClientContext*, const Request*,
                                                          v1::TransferResponse*,
                                                          std::function<void(grpc::Status)>),
      Request request) {
    absl::StatusOr<Slot> slot = TakeSlotFor(request);
    if (!slot.ok()) return slot.status();
    struct Call {
      grpc::ClientContext ctx;
      Request request;
      v1::TransferResponse response;
    };
    auto call = std::make_shared<Call>();
    call->request = std::move(request);
    Prepare(call->ctx, options, options.timeout);
    {
      absl::MutexLock lock(&flight->mu);
      ++flight->calls;
    }
    v1::KvSession::Stub* stub = NextCaller();
    (stub->async()->*method)(
        &call->ctx, &call->request, &call->response,
        [this, call, slot = *slot, flight = flight](grpc::Status st) {
          if (!st.ok()) {
            const absl::Status s = FromGrpc(st, call->ctx);
            Unanswered(slot.index, s);
            slot.outcome->refusal = s;
            slot.outcome->refused.store(true, std::memory_order_release);
          }
          // The session (this) may be gone once the count drops.
          absl::MutexLock lock(&flight->mu);
          --flight->calls;
        });
    return Pending(area, area->words + slot->index, slot->sequence, slot->outcome);
  }
  // A request that failed: when it was refused (the daemon's reason says so, or the call
  // never got that far) nothing will write its word and the slot is free again; when the
  // answer was lost (deadline, connection) the daemon may still run it, so the slot stays
  // taken until a word of its sequence shows it done.
  void Unanswered(uint32_t index, const absl::Status& s) {
    const absl::StatusCode c = s.code();
    if (ErrorReason(s).empty() &&
        (c == absl::StatusCode::kDeadlineExceeded || c == absl::StatusCode::kUnavailable ||
         c == absl::StatusCode::kCancelled || c == absl::StatusCode::kUnknown)) {
      return;
    }
    absl::MutexLock lock(&mu);
    busy[index] = false;
  }
  // A slot for `request`, named in it.
  template <typename Request>
  absl::StatusOr<Slot> TakeSlotFor(Request& request) {
    absl::StatusOr<Slot> slot = TakeSlot();
    if (slot.ok()) {
      request.mutable_completion()->set_slot(slot->index);
      request.mutable_completion()->set_sequence(slot->sequence);
    }
    return slot;
  }
  v1::KvSession::Stub* NextCaller() {
    return callers[next_caller.fetch_add(1, std::memory_order_relaxed) % callers.size()].get();
  }
  // A free completion slot (round robin) and its next sequence.
  absl::StatusOr<Slot> TakeSlot() {
    absl::MutexLock lock(&mu);
    for (uint32_t k = 0; k < slots; ++k) {
      const uint32_t i = (next_slot + k) % slots;
      if (busy[i]) {
        const uint64_t w = LoadWord(area->words + i);
        if ((w >> 8) == issued[i] && (w & 0xFF) >= kDone) {
          outcomes[i]->word.store(w, std::memory_order_release);
          busy[i] = false;
        }
      }
      if (!busy[i]) {
        busy[i] = true;
        issued[i] = next_sequence++;
        outcomes[i] = std::make_shared<Pending::Outcome>();
        next_slot = i + 1;
        return Slot{i, issued[i], outcomes[i]};
      }
    }
    return absl::ResourceExhaustedError(
        absl::StrCat("all ", slots, " completion slots hold operations still running"));
  }
};

Session::Session(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Session::~Session() { Close().IgnoreError(); }

uint64_t Session::id() const { return impl_->id; }

absl::StatusOr<std::unique_ptr<Session>> Session::Open(const ClientOptions& options,
                                                       const std::string& worker,
                                                       uint32_t device, uint32_t slots) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->channel = MakeChannel(options);
  impl->sessions = v1::KvSession::NewStub(impl->channel);
  impl->callers.push_back(v1::KvSession::NewStub(impl->channel));
  for (int i = 1; i < options.session_connections; ++i) {
    impl->callers.push_back(v1::KvSession::NewStub(MakeChannel(options, /*own_connection=*/true)));
  }
  impl->pools = v1::KvFerry::NewStub(impl->channel);
  if (!options.bearer_token.empty()) {
    impl->stream_ctx.AddMetadata("authorization", "Bearer " + options.bearer_token);
  }
  impl->stream = impl->sessions->OpenSession(&impl->stream_ctx);
  v1::SessionRequest open;
  open.mutable_open()->set_worker(worker);
  open.mutable_open()->set_device(device);
  open.mutable_open()->set_completion_slots(slots);
  v1::SessionEvent event;
  if (!impl->stream->Write(open) || !impl->stream->Read(&event) || !event.has_opened()) {
    impl->stream->WritesDone();
    const grpc::Status s = impl->stream->Finish();
    absl::Status status = FromGrpc(s, impl->stream_ctx);
    if (status.ok()) status = absl::UnavailableError("the daemon did not open the session");
    return status;
  }
  impl->id = event.opened().session_id();
  impl->slots = event.opened().completion_slots();
  impl->secret = event.opened().session_secret();
  // The completion words, read-only in this process.
  const int fd = shm_open(event.opened().completion_shm().c_str(), O_RDONLY, 0);
  if (fd < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot open the completion area ", event.opened().completion_shm(),
        " (the worker and the daemon need one /dev/shm): ", std::strerror(errno)));
  }
  auto area = std::make_shared<Area>();
  area->bytes = impl->slots * sizeof(uint64_t);
  void* map = mmap(nullptr, area->bytes, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  if (map == MAP_FAILED) return absl::InternalError("cannot map the completion area");
  area->words = static_cast<const uint64_t*>(map);
  impl->area = std::move(area);
  // Mapped: the daemon may remove the area's name (no other process opens it then).
  v1::SessionRequest mapped;
  mapped.mutable_mapped();
  impl->stream->Write(mapped);
  {
    absl::MutexLock lock(&impl->mu);
    impl->busy.assign(impl->slots, false);
    impl->issued.assign(impl->slots, 0);
    impl->outcomes.resize(impl->slots);
  }
  Impl* raw = impl.get();
  impl->events = std::thread([raw] {
    v1::SessionEvent e;
    while (raw->stream->Read(&e)) {
      if (e.has_revoked()) {
        absl::MutexLock lock(&raw->mu);
        raw->revoked.push_back(e.revoked().export_id());
      }
    }
  });
  return std::unique_ptr<Session>(new Session(std::move(impl)));
}

absl::Status Session::Close() {
  if (impl_ == nullptr || impl_->closed) return absl::OkStatus();
  impl_->closed = true;
  {
    // Enqueued calls end first (each within its deadline): their callbacks use the session.
    Impl::Flight& f = *impl_->flight;
    absl::MutexLock lock(&f.mu);
    f.mu.Await(absl::Condition(+[](int* calls) { return *calls == 0; }, &f.calls));
  }
  v1::SessionRequest close;
  close.mutable_close();
  impl_->stream->Write(close);
  impl_->stream->WritesDone();
  impl_->events.join();  // the daemon ends the stream after closing the session
  return FromGrpc(impl_->stream->Finish(), impl_->stream_ctx);
}

absl::StatusOr<uint64_t> Session::RegisterKv(const KvTensor& t) {
  v1::RegisterKvRequest req;
  req.set_session_id(impl_->id);
  v1::KvTensor* p = req.add_tensors();
  p->set_ipc_handle(t.ipc_handle);
  p->set_offset(t.offset);
  p->set_num_blocks(t.num_blocks);
  p->set_block_tokens(t.block_tokens);
  p->set_block_stride(t.block_stride);
  p->set_token_stride(t.token_stride);
  p->set_kind(t.kind == KvTensor::Kind::kBf16 ? v1::ROW_KIND_BF16 : v1::ROW_KIND_RECORDS);
  p->set_layout(ToProto(t.layout));
  p->set_name(t.name);
  p->set_vmm_pid(t.vmm_pid);
  for (const KvTensor::VmmAllocation& a : t.vmm_allocations) {
    v1::VmmAllocation* v = p->add_vmm_allocations();
    v->set_fd(a.fd);
    v->set_size(a.size);
  }
  // VMM memory: the daemon takes the descriptors from this process, which proves it is the
  // session's by a descriptor that reads the session's secret (open for this call only).
  int proof = -1;
  if (!t.vmm_allocations.empty()) {
    proof = memfd_create("kvferry-session-proof", MFD_CLOEXEC);
    if (proof < 0 || write(proof, impl_->secret.data(), impl_->secret.size()) !=
                         static_cast<ssize_t>(impl_->secret.size())) {
      if (proof >= 0) close(proof);
      return absl::InternalError(absl::StrCat("memfd for the session's proof: ", std::strerror(errno)));
    }
    p->set_vmm_proof_fd(proof);
  }
  v1::RegisterKvResponse resp;
  const absl::Status registered = impl_->Unary(&v1::KvSession::Stub::RegisterKv, req, &resp);
  if (proof >= 0) close(proof);
  KVF_CLIENT_RETURN(registered);
  if (resp.tensor_ids_size() != 1) return absl::InternalError("RegisterKv answered no tensor id");
  return resp.tensor_ids(0);
}

absl::StatusOr<std::vector<PageHandle>> Session::AllocatePages(const std::string& pool,
                                                               uint32_t count) {
  v1::AllocatePagesRequest req;
  req.set_pool(pool);
  req.set_count(count);
  req.set_session_id(impl_->id);
  v1::AllocatePagesResponse resp;
  grpc::ClientContext ctx;
  Prepare(ctx, impl_->options, impl_->options.timeout);
  KVF_CLIENT_RETURN(FromGrpc(impl_->pools->AllocatePages(&ctx, req, &resp), ctx));
  std::vector<PageHandle> pages;
  for (const auto& h : resp.pages()) pages.push_back({h.page_id(), h.generation()});
  return pages;
}

namespace {

template <typename Request>
void Target(Request& req, uint64_t session, uint64_t tensor, const std::string& pool,
            uint32_t layer) {
  req.set_session_id(session);
  req.set_tensor_id(tensor);
  req.set_pool(pool);
  req.set_layer(layer);
}

void AddSlots(std::span<const BlockSlot> slots, google::protobuf::RepeatedPtrField<v1::BlockSlot>* out) {
  for (const BlockSlot& b : slots) {
    v1::BlockSlot* p = out->Add();
    p->set_block(b.block);
    p->set_slot(b.slot);
  }
}

void AddLocations(std::span<const TokenLocation> locations,
                  google::protobuf::RepeatedPtrField<v1::TokenLocation>* out) {
  for (const TokenLocation& l : locations) {
    v1::TokenLocation* p = out->Add();
    ToProto(l.page, p->mutable_page());
    p->set_slot(l.slot);
  }
}

}  // namespace

absl::StatusOr<uint64_t> Session::Save(uint64_t tensor, const std::string& pool, uint32_t layer,
                                       std::span<const BlockSlot> from,
                                       std::span<const TokenLocation> to) {
  v1::SaveRequest req;
  Target(req, impl_->id, tensor, pool, layer);
  AddSlots(from, req.mutable_sources());
  AddLocations(to, req.mutable_destinations());
  v1::TransferResponse resp;
  KVF_CLIENT_RETURN(impl_->Unary(&v1::KvSession::Stub::Save, req, &resp));
  return resp.tokens();
}

absl::StatusOr<uint64_t> Session::Load(uint64_t tensor, const std::string& pool, uint32_t layer,
                                       std::span<const TokenLocation> from,
                                       std::span<const BlockSlot> to) {
  v1::LoadRequest req;
  Target(req, impl_->id, tensor, pool, layer);
  AddLocations(from, req.mutable_sources());
  AddSlots(to, req.mutable_destinations());
  v1::TransferResponse resp;
  KVF_CLIENT_RETURN(impl_->Unary(&v1::KvSession::Stub::Load, req, &resp));
  return resp.tokens();
}

namespace {

v1::SaveRequest BlocksSave(uint64_t session, uint64_t tensor, const std::string& pool,
                           uint32_t layer, std::span<const uint64_t> from,
                           std::span<const PageHandle> to) {
  v1::SaveRequest req;
  Target(req, session, tensor, pool, layer);
  req.mutable_source_blocks()->Add(from.begin(), from.end());
  Pack(to, req.mutable_destination_page_list());
  return req;
}

v1::LoadRequest BlocksLoad(uint64_t session, uint64_t tensor, const std::string& pool,
                           uint32_t layer, std::span<const PageHandle> from,
                           std::span<const uint64_t> to) {
  v1::LoadRequest req;
  Target(req, session, tensor, pool, layer);
  Pack(from, req.mutable_source_page_list());
  req.mutable_destination_blocks()->Add(to.begin(), to.end());
  return req;
}

}  // namespace

absl::StatusOr<uint64_t> Session::SaveBlocks(uint64_t tensor, const std::string& pool,
                                             uint32_t layer, std::span<const uint64_t> from,
                                             std::span<const PageHandle> to) {
  v1::TransferResponse resp;
  KVF_CLIENT_RETURN(impl_->Unary(&v1::KvSession::Stub::Save,
                                 BlocksSave(impl_->id, tensor, pool, layer, from, to), &resp));
  return resp.tokens();
}

absl::StatusOr<uint64_t> Session::LoadBlocks(uint64_t tensor, const std::string& pool,
                                             uint32_t layer, std::span<const PageHandle> from,
                                             std::span<const uint64_t> to) {
  v1::TransferResponse resp;
  KVF_CLIENT_RETURN(impl_->Unary(&v1::KvSession::Stub::Load,
                                 BlocksLoad(impl_->id, tensor, pool, layer, from, to), &resp));
  return resp.tokens();
}

absl::StatusOr<Session::Pending> Session::SaveBlocksAsync(uint64_t tensor, const std::string& pool,
                                                          uint32_t layer,
                                                          std::span<const uint64_t> from,
                                                          std::span<const PageHandle> to) {
  v1::SaveRequest req = BlocksSave(impl_->id, tensor, pool, layer, from, to);
  return impl_->Async(&v1::KvSession::Stub::Save, req);
}

absl::StatusOr<Session::Pending> Session::LoadBlocksAsync(uint64_t tensor, const std::string& pool,
                                                          uint32_t layer,
                                                          std::span<const PageHandle> from,
                                                          std::span<const uint64_t> to) {
  v1::LoadRequest req = BlocksLoad(impl_->id, tensor, pool, layer, from, to);
  return impl_->Async(&v1::KvSession::Stub::Load, req);
}

absl::StatusOr<Session::Pending> Session::EnqueueSaveBlocks(uint64_t tensor,
                                                            const std::string& pool,
                                                            uint32_t layer,
                                                            std::span<const uint64_t> from,
                                                            std::span<const PageHandle> to) {
  return impl_->Enqueue(&v1::KvSession::Stub::async_interface::Save,
                        BlocksSave(impl_->id, tensor, pool, layer, from, to));
}

absl::StatusOr<Session::Pending> Session::EnqueueLoadBlocks(uint64_t tensor,
                                                            const std::string& pool,
                                                            uint32_t layer,
                                                            std::span<const PageHandle> from,
                                                            std::span<const uint64_t> to) {
  return impl_->Enqueue(&v1::KvSession::Stub::async_interface::Load,
                        BlocksLoad(impl_->id, tensor, pool, layer, from, to));
}

absl::StatusOr<Session::Pending> Session::SaveAsync(uint64_t tensor, const std::string& pool,
                                                    uint32_t layer, std::span<const BlockSlot> from,
                                                    std::span<const TokenLocation> to) {
  v1::SaveRequest req;
  Target(req, impl_->id, tensor, pool, layer);
  AddSlots(from, req.mutable_sources());
  AddLocations(to, req.mutable_destinations());
  return impl_->Async(&v1::KvSession::Stub::Save, req);
}

absl::StatusOr<Session::Pending> Session::LoadAsync(uint64_t tensor, const std::string& pool,
                                                    uint32_t layer,
                                                    std::span<const TokenLocation> from,
                                                    std::span<const BlockSlot> to) {
  v1::LoadRequest req;
  Target(req, impl_->id, tensor, pool, layer);
  AddLocations(from, req.mutable_sources());
  AddSlots(to, req.mutable_destinations());
  return impl_->Async(&v1::KvSession::Stub::Load, req);
}

absl::StatusOr<Session::CacheSaveResult> Session::SaveToCache(
    const NamespaceRef& ns, const std::string& pool, std::span<const uint64_t> layer_tensors,
    std::span<const std::string> keys, std::span<const uint64_t> from) {
  v1::SaveRequest req;
  req.set_session_id(impl_->id);
  req.set_pool(pool);
  for (uint64_t t : layer_tensors) req.add_layer_tensor_ids(t);
  for (uint64_t b : from) req.add_source_blocks(b);
  v1::CacheBlocks* cache = req.mutable_cache();
  cache->set_namespace_(ns.name);
  cache->set_digest(ns.digest);
  for (const std::string& key : keys) cache->add_keys(key);
  v1::TransferResponse resp;
  KVF_CLIENT_RETURN(impl_->Unary(&v1::KvSession::Stub::Save, req, &resp));
  return CacheSaveResult{resp.tokens(), resp.blocks_stored(), resp.blocks_already_held()};
}

namespace {

v1::LoadRequest CacheLoad(uint64_t session, uint64_t tensor, const NamespaceRef& ns,
                          uint64_t lease_id, const std::string& pool, uint32_t layer,
                          uint64_t first_block, std::span<const uint64_t> to) {
  v1::LoadRequest req;
  Target(req, session, tensor, pool, layer);
  for (uint64_t b : to) req.add_destination_blocks(b);
  v1::CacheBlocks* cache = req.mutable_cache();
  cache->set_namespace_(ns.name);
  cache->set_digest(ns.digest);
  cache->set_lease_id(lease_id);
  cache->set_first_block(first_block);
  return req;
}

}  // namespace

absl::StatusOr<uint64_t> Session::LoadFromCache(uint64_t tensor, const NamespaceRef& ns,
                                                uint64_t lease_id, const std::string& pool,
                                                uint32_t layer, uint64_t first_block,
                                                std::span<const uint64_t> to) {
  const v1::LoadRequest req = CacheLoad(impl_->id, tensor, ns, lease_id, pool, layer, first_block, to);
  v1::TransferResponse resp;
  KVF_CLIENT_RETURN(impl_->Unary(&v1::KvSession::Stub::Load, req, &resp));
  return resp.tokens();
}

absl::StatusOr<Session::Pending> Session::LoadFromCacheAsync(
    uint64_t tensor, const NamespaceRef& ns, uint64_t lease_id, const std::string& pool,
    uint32_t layer, uint64_t first_block, std::span<const uint64_t> to) {
  v1::LoadRequest req = CacheLoad(impl_->id, tensor, ns, lease_id, pool, layer, first_block, to);
  return impl_->Async(&v1::KvSession::Stub::Load, req);
}

absl::StatusOr<PoolMapping> Session::MapPool(const std::string& pool) {
  v1::MapPoolRequest req;
  req.set_session_id(impl_->id);
  req.set_pool(pool);
  v1::MapPoolResponse resp;
  KVF_CLIENT_RETURN(impl_->Unary(&v1::KvSession::Stub::MapPool, req, &resp));
  PoolMapping m;
  m.export_id = resp.export_id();
  m.ipc_handle = resp.ipc_handle();
  m.offset = resp.offset();
  m.page_bytes = resp.page_bytes();
  m.layer_bytes = resp.layer_bytes();
  m.pool = FromProto(resp.pool());
  return m;
}

absl::Status Session::UnmapPool(uint64_t export_id) {
  v1::UnmapPoolRequest req;
  req.set_session_id(impl_->id);
  req.set_export_id(export_id);
  v1::UnmapPoolResponse resp;
  return impl_->Unary(&v1::KvSession::Stub::UnmapPool, req, &resp);
}

std::vector<uint64_t> Session::Revoked() const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->revoked;
}

}  // namespace kvferry::client
