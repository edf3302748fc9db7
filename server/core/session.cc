// SessionManager: tensors of other processes, Save/Load in place, completion words.
#include "core/session.h"

#include <sys/random.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <tuple>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/errors.h"
#include "common/log.h"
#include "common/worker_process.h"
#include "kvferry/kernels/status_macros.h"
#include "kvferry/thread_name.h"

namespace kvferry::server {

namespace {

int64_t AlignUp(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// VMM allocations one tensor may name (PyTorch's expandable segments map 20 MiB apiece).
constexpr size_t kMaxVmmAllocations = 4096;

absl::Status Invalid(ErrorReason reason, std::string message) {
  return Error(absl::StatusCode::kInvalidArgument, reason, message);
}

absl::Status ClosedError(uint64_t id) {
  return Error(absl::StatusCode::kNotFound, ErrorReason::kSessionNotFound,
               absl::StrCat("session ", id, " has ended"));
}

// Whole blocks and whole pages, pairwise (a block is a page's worth of tokens): checked
// (counts, bounds, handles; pages unique for a save, blocks unique for a load) and returned
// as block ids and page ids.
absl::Status PagePairs(const TransferRequest& r, const KvTensorSpec& spec, Pool& pool,
                       bool save, std::vector<int64_t>* blocks, std::vector<int64_t>* page_ids) {
  if (r.tensor_blocks.size() != r.pages.size() || r.pages.empty()) {
    return Invalid(ErrorReason::kInvalidRequest,
                   absl::StrCat(r.tensor_blocks.size(), " blocks and ", r.pages.size(),
                                " pages: give one of each per page, at least one"));
  }
  const int page_size = pool.config().page_size;
  if (static_cast<int>(spec.block_tokens) != page_size) {
    return Error(absl::StatusCode::kFailedPrecondition, ErrorReason::kLayoutMismatch,
                 absl::StrCat("tensor blocks of ", spec.block_tokens, " tokens, pool pages of ",
                              page_size));
  }
  const size_t n = r.pages.size();
  for (size_t i = 0; i < n; ++i) {
    if (r.tensor_blocks[i] >= spec.num_blocks) {
      return Invalid(ErrorReason::kBlockOutOfRange,
                     absl::StrCat("block ", r.tensor_blocks[i], " is outside ", spec.num_blocks,
                                  " blocks"));
    }
  }
  // The handles themselves are checked when their pages are pinned (under the table's lock,
  // once); here only that each names a page of the pool, for the bitmap below.
  const uint64_t num_pages = static_cast<uint64_t>(pool.config().num_pages);
  for (const PageHandle& h : r.pages) {
    if (h.page_id >= num_pages) return pool.table().CheckHandle(h);
  }
  // A save writes each page once; a load writes each block once. Both are in range now: a
  // bitmap finds repeats (a page-form transfer names thousands).
  const uint64_t range = save ? num_pages : spec.num_blocks;
  std::vector<uint64_t> seen((range + 63) / 64, 0);
  blocks->resize(n);
  page_ids->resize(n);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t block = r.tensor_blocks[i];
    const uint64_t written = save ? r.pages[i].page_id : block;
    uint64_t& word = seen[written / 64];
    const uint64_t bit = uint64_t{1} << (written % 64);
    if ((word & bit) != 0) {
      return Invalid(ErrorReason::kDuplicatePage,
                     absl::StrCat(save ? "page " : "block ", written, " is listed twice"));
    }
    word |= bit;
    (*blocks)[i] = static_cast<int64_t>(block);
    (*page_ids)[i] = static_cast<int64_t>(r.pages[i].page_id);
  }
  return absl::OkStatus();
}

}  // namespace

struct SessionManager::Tensor {
  KvTensorSpec spec;
  std::shared_ptr<Backend> backend;
  std::shared_ptr<ImportedMemory> memory;
  uint8_t* data() const { return memory->base() + spec.offset; }
  uint64_t bytes() const {
    return spec.kind == RowKind::kRecords
               ? spec.num_blocks * spec.block_stride
               : (spec.num_blocks - 1) * spec.block_stride +
                     (spec.block_tokens - 1) * spec.token_stride + kBf16RowBytes;
  }
};

struct SessionManager::Session {
  uint64_t id = 0;
  std::shared_ptr<TenantAccount> owner;
  std::string worker;
  std::string device;  // "cuda:N"
  std::string secret;
  uint64_t* words = nullptr;
  uint32_t slots = 0;

  kvferry::Mutex mu;
  bool closed ABSL_GUARDED_BY(mu) = false;
  std::string shm_name ABSL_GUARDED_BY(mu);  // until the worker mapped the area
  absl::flat_hash_map<uint64_t, std::shared_ptr<Tensor>> tensors ABSL_GUARDED_BY(mu);
  struct Export {
    std::shared_ptr<Pool> pool;
  };
  absl::flat_hash_map<uint64_t, Export> exports ABSL_GUARDED_BY(mu);
  std::vector<std::pair<std::weak_ptr<Pool>, std::vector<PageHandle>>> pages ABSL_GUARDED_BY(mu);
  std::deque<Revocation> revocations ABSL_GUARDED_BY(mu);

  ~Session() {
    if (words != nullptr) munmap(words, slots * sizeof(uint64_t));
    kvferry::MutexLock lock(&mu);
    Unlink();
  }
  void Unlink() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (!shm_name.empty()) shm_unlink(shm_name.c_str());
    shm_name.clear();
  }
  // Readers poll with acquire loads: everything the operation did is visible once they
  // see the word.
  void SetWord(const AsyncSlot& s, uint64_t state) {
    std::atomic_ref<uint64_t>(words[s.slot]).store((s.sequence << 8) | state,
                                                   std::memory_order_release);
  }
};

SessionManager::SessionManager(PoolManager* pools, TransferObserver* observer)
    : pools_(pools), observer_(observer) {
  for (int i = 0; i < kCompletionThreads; ++i) {
    completers_.emplace_back([this] {
      NameThisThread("kvf-completions");
      CompletionLoop();
    });
  }
}

SessionManager::~SessionManager() {
  {
    kvferry::MutexLock lock(&jobs_mu_);
    stopping_ = true;
  }
  for (std::thread& t : completers_) t.join();
}

void SessionManager::CompletionLoop() {
  while (true) {
    std::function<void()> job;
    {
      kvferry::MutexLock lock(&jobs_mu_);
      jobs_mu_.Await(kvferry::Condition(
          +[](SessionManager* m) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return !m->jobs_.empty() || m->stopping_;
          },
          this));
      if (jobs_.empty()) return;  // stopping, and nothing left
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();
  }
}

void SessionManager::Complete(std::shared_ptr<Session> session, AsyncSlot slot,
                              std::function<absl::Status()> finish) {
  kvferry::MutexLock lock(&jobs_mu_);
  jobs_.push_back([session = std::move(session), slot, finish = std::move(finish)] {
    session->SetWord(slot, finish().ok() ? kWordDone : kWordFailed);
  });
}

absl::StatusOr<SessionManager::Opened> SessionManager::Open(std::shared_ptr<TenantAccount> owner,
                                                            const std::string& worker,
                                                            uint32_t device, uint32_t slots) {
  if (slots == 0) slots = 1024;
  if (slots > 65536) {
    return Invalid(ErrorReason::kInvalidRequest,
                   absl::StrCat("completion_slots ", slots, " is above 65536"));
  }
  auto session = std::make_shared<Session>();
  session->owner = std::move(owner);
  session->worker = worker.substr(0, 64);
  session->device = absl::StrCat("cuda:", device);
  {
    kvferry::MutexLock lock(&mu_);
    session->id = next_session_++;
  }
  session->slots = slots;
  // 32 bytes of secret, 16 for the completion area's name.
  std::string random(48, '\0');
  if (getrandom(random.data(), random.size(), 0) != static_cast<ssize_t>(random.size())) {
    return Error(absl::StatusCode::kInternal, ErrorReason::kInternalError,
                 absl::StrCat("getrandom for the session's secret: ", std::strerror(errno)));
  }
  session->secret = random.substr(0, 32);
  // Readable by the worker (possibly another user in another container), written only here.
  // The random part keeps anyone from creating the name first (the create is exclusive and
  // the name cannot be guessed); a local user who lists /dev/shm can still open it
  // read-only until the worker's `mapped` removes it.
  const std::string name = absl::StrCat("/kvferry-", getpid(), "-", session->id, "-",
                                        absl::BytesToHexString(random.substr(32)));
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0644);
  if (fd < 0) {
    return Error(absl::StatusCode::kInternal, ErrorReason::kInternalError,
                 absl::StrCat("shm_open for the completion area: ", std::strerror(errno)));
  }
  {
    kvferry::MutexLock lock(&session->mu);
    session->shm_name = name;
  }
  const size_t bytes = slots * sizeof(uint64_t);
  void* map = MAP_FAILED;
  if (ftruncate(fd, static_cast<off_t>(bytes)) == 0) {
    map = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  close(fd);
  if (map == MAP_FAILED) {
    return Error(absl::StatusCode::kInternal, ErrorReason::kInternalError,
                 absl::StrCat("mapping the completion area: ", std::strerror(errno)));
  }
  session->words = static_cast<uint64_t*>(map);
  kvferry::MutexLock lock(&mu_);
  sessions_[session->id] = session;
  return Opened{session->id, name, slots, session->secret};
}

void SessionManager::CompletionMapped(uint64_t session_id) {
  std::shared_ptr<Session> session;
  {
    kvferry::MutexLock lock(&mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) return;
    session = it->second;
  }
  kvferry::MutexLock lock(&session->mu);
  session->Unlink();
}

void SessionManager::Close(uint64_t session_id) {
  std::shared_ptr<Session> session;
  {
    kvferry::MutexLock lock(&mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) return;
    session = std::move(it->second);
    sessions_.erase(it);
  }
  std::vector<std::pair<std::weak_ptr<Pool>, std::vector<PageHandle>>> pages;
  {
    kvferry::MutexLock lock(&session->mu);
    session->closed = true;
    session->Unlink();  // work still in flight keeps the mapping, not the name
    session->tensors.clear();   // mappings close once running work lets go of them
    session->exports.clear();   // a deleted pool's memory goes with its last export
    pages.swap(session->pages);
  }
  for (auto& [weak, handles] : pages) {
    std::shared_ptr<Pool> pool = weak.lock();
    if (pool == nullptr) continue;
    // One at a time: a page the worker freed itself (now or earlier) is stale and skipped
    // without keeping the others.
    for (const PageHandle& h : handles) pool->FreePages({&h, 1}).IgnoreError();
  }
}

std::optional<Revocation> SessionManager::NextRevocation(uint64_t session_id) {
  absl::StatusOr<std::shared_ptr<Session>> found = Find(session_id, nullptr);
  if (!found.ok()) return std::nullopt;
  Session& s = **found;
  kvferry::MutexLock lock(&s.mu);
  s.mu.Await(kvferry::Condition(
      +[](Session* x) ABSL_NO_THREAD_SAFETY_ANALYSIS { return x->closed || !x->revocations.empty(); },
      &s));
  if (s.revocations.empty()) return std::nullopt;
  Revocation r = std::move(s.revocations.front());
  s.revocations.pop_front();
  return r;
}

absl::StatusOr<std::shared_ptr<SessionManager::Session>> SessionManager::Find(
    uint64_t id, const TenantAccount* caller) const {
  kvferry::ReaderMutexLock lock(&mu_);
  auto it = sessions_.find(id);
  // Another tenant's session is as absent as one nobody opened.
  if (it == sessions_.end() || (caller != nullptr && it->second->owner.get() != caller)) {
    return Error(absl::StatusCode::kNotFound, ErrorReason::kSessionNotFound,
                 absl::StrCat("no open session ", id));
  }
  return it->second;
}

absl::StatusOr<std::vector<uint64_t>> SessionManager::Register(
    uint64_t session_id, const TenantAccount& caller, std::span<const KvTensorSpec> specs) {
  KVF_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, Find(session_id, &caller));
  // A process named for VMM memory proves first that it is the session's: only the
  // session's owner knows its secret, so a descriptor of that process reading it shows the
  // owner controls the process, and no caller can map another worker's memory by naming
  // its process.
  std::vector<std::unique_ptr<WorkerProcess>> workers(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    const KvTensorSpec& spec = specs[i];
    if (spec.vmm.empty()) continue;
    if (!spec.ipc_handle.empty() || spec.vmm.size() > kMaxVmmAllocations) {
      return Invalid(ErrorReason::kInvalidRequest,
                     absl::StrCat("tensor '", spec.name.substr(0, 64),
                                  "': name its memory by an IPC handle or by at most ",
                                  kMaxVmmAllocations, " VMM allocations, not both"));
    }
    KVF_ASSIGN_OR_RETURN(workers[i], WorkerProcess::Open(spec.vmm_pid));
    KVF_RETURN_IF_ERROR(workers[i]->Proves(spec.vmm_proof_fd, session->secret));
  }
  // The device's backend, made on the first registration (a session without tensors works
  // on any daemon: its completion words and pages need no GPU).
  KVF_ASSIGN_OR_RETURN(std::shared_ptr<Backend> backend, pools_->BackendFor(session->device));
  std::vector<std::shared_ptr<Tensor>> made;
  for (size_t i = 0; i < specs.size(); ++i) {
    const KvTensorSpec& spec = specs[i];
    const std::string name = spec.name.substr(0, 64);
    if (spec.num_blocks == 0 || spec.block_tokens == 0 || spec.block_tokens > kMaxPageSize) {
      return Invalid(ErrorReason::kInvalidGeometry,
                     absl::StrCat("tensor '", name, "': num_blocks and block_tokens (<= 4096) must be positive"));
    }
    if (spec.offset % 16 != 0 || spec.block_stride % 16 != 0) {
      return Invalid(ErrorReason::kInvalidGeometry,
                     absl::StrCat("tensor '", name, "': offset and block_stride must be multiples of 16 bytes"));
    }
    if (spec.kind == RowKind::kBf16) {
      if (spec.token_stride < kBf16RowBytes || spec.token_stride % 16 != 0) {
        return Invalid(ErrorReason::kInvalidGeometry,
                       absl::StrCat("tensor '", name, "': token_stride ", spec.token_stride,
                                    " must be >= 1024 and a multiple of 16"));
      }
    } else {
      if (!IsValidPageSize(spec.block_tokens) ||
          spec.block_stride != static_cast<uint64_t>(PageBytes(spec.layout, spec.block_tokens))) {
        return Invalid(ErrorReason::kInvalidGeometry,
                       absl::StrCat("tensor '", name, "': records blocks are pages: block_tokens a power of two, block_stride ",
                                    IsValidPageSize(spec.block_tokens) ? PageBytes(spec.layout, spec.block_tokens) : 0,
                                    " bytes"));
      }
    }
    if (spec.num_blocks > (uint64_t{1} << 40) || spec.block_stride > (uint64_t{1} << 40) ||
        spec.token_stride > (uint64_t{1} << 30)) {
      return Invalid(ErrorReason::kTensorOutOfBounds, absl::StrCat("tensor '", name, "' is too large"));
    }
    auto tensor = std::make_shared<Tensor>();
    tensor->spec = spec;
    tensor->backend = backend;
    if (spec.vmm.empty()) {
      KVF_ASSIGN_OR_RETURN(tensor->memory, backend->ImportIpc(spec.ipc_handle));
    } else {
      KVF_ASSIGN_OR_RETURN(tensor->memory, backend->ImportVmm(*workers[i], spec.vmm));
    }
    // A geometry past the allocation would let a kernel read or write other memory of the
    // device (another tenant's pools) or fault and take the device down for every client:
    // refused here, computed without wrapping.
    unsigned __int128 extent = spec.kind == RowKind::kRecords
                                   ? static_cast<unsigned __int128>(spec.num_blocks) * spec.block_stride
                                   : static_cast<unsigned __int128>(spec.num_blocks - 1) * spec.block_stride +
                                         static_cast<unsigned __int128>(spec.block_tokens - 1) * spec.token_stride +
                                         kBf16RowBytes;
    extent += spec.offset;
    if (extent > tensor->memory->bytes()) {
      return Invalid(ErrorReason::kTensorOutOfBounds,
                     absl::StrCat("tensor '", name, "' ends past its allocation of ",
                                  tensor->memory->bytes(), " bytes"));
    }
    made.push_back(std::move(tensor));
  }
  std::vector<uint64_t> ids;
  kvferry::MutexLock lock(&session->mu);
  if (session->closed) return ClosedError(session_id);
  for (auto& t : made) {
    uint64_t id;
    {
      kvferry::MutexLock l(&mu_);
      id = next_tensor_++;
    }
    session->tensors[id] = std::move(t);
    ids.push_back(id);
  }
  return ids;
}

absl::StatusOr<int64_t> SessionManager::Save(const TransferRequest& request) {
  return Transfer(request, /*save=*/true);
}
absl::StatusOr<int64_t> SessionManager::Load(const TransferRequest& request) {
  return Transfer(request, /*save=*/false);
}

absl::StatusOr<int64_t> SessionManager::Transfer(const TransferRequest& r, bool save) {
  const auto start = std::chrono::steady_clock::now();
  KVF_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, Find(r.session_id, r.caller));
  std::shared_ptr<Tensor> tensor;
  {
    kvferry::MutexLock lock(&session->mu);
    auto it = session->tensors.find(r.tensor_id);
    if (it == session->tensors.end()) {
      return Error(absl::StatusCode::kNotFound, ErrorReason::kTensorNotFound,
                   absl::StrCat("session ", r.session_id, " has no tensor ", r.tensor_id));
    }
    tensor = it->second;
  }
  if (r.async.has_value() &&
      (r.async->slot >= session->slots || r.async->sequence >= (uint64_t{1} << 56))) {
    return Invalid(ErrorReason::kInvalidRequest,
                   absl::StrCat("completion slot ", r.async->slot, " is outside [0, ",
                                session->slots, ") or its sequence above 2^56"));
  }
  KVF_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, pools_->Get(*session->owner, r.pool));
  if (r.pool_id != 0 && pool->id() != r.pool_id) {
    return Error(absl::StatusCode::kAborted, ErrorReason::kPoolNotFound,
                 absl::StrCat("pool '", r.pool, "' was deleted and made again meanwhile"));
  }
  if (pool->device() != session->device) {
    return Error(absl::StatusCode::kFailedPrecondition, ErrorReason::kDeviceMismatch,
                 absl::StrCat("pool '", r.pool, "' lives on ", pool->device(), ", the session's tensors on ",
                              session->device));
  }
  KVF_RETURN_IF_ERROR(pool->CheckLayer(r.layer));
  const KvTensorSpec& spec = tensor->spec;
  const bool records = spec.kind == RowKind::kRecords;
  const bool page_form = r.blocks.empty() && r.locations.empty();
  if (records && !page_form) {
    return Error(absl::StatusCode::kFailedPrecondition, ErrorReason::kKindMismatch,
                 "a records tensor moves whole blocks: use the page form");
  }
  const PoolGeometry g = pool->geometry();
  const int page_size = g.page_size;
  Backend& backend = *tensor->backend;
  uint8_t* layer_base = pool->base() + r.layer * g.pool_bytes();

  // Where the host time of one call goes (logged at debug level): checks, pinning, staging
  // and launching before the device work, releasing after it.
  // `scratch_at`: the scratch taken (from the backend's block cache), within staging.
  std::chrono::steady_clock::time_point checked_at, pinned_at, scratch_at;
  // Host staging for the index arrays and the flag, pinned; device scratch beside it.
  struct Scratch {
    Buffer host, device;
  };
  auto scratch = std::make_shared<Scratch>();
  // `host` bytes of staging (the index arrays the host fills), `device` >= host of scratch.
  auto make_scratch = [&](int64_t host, int64_t device) -> absl::Status {
    KVF_ASSIGN_OR_RETURN(scratch->host, backend.Allocate(host, MemoryKind::kHostStaging, false));
    KVF_ASSIGN_OR_RETURN(scratch->device, backend.Allocate(std::max(host, device), MemoryKind::kDevice, false));
    scratch_at = std::chrono::steady_clock::now();
    return absl::OkStatus();
  };
  std::vector<Op> ops;
  // Copies a host array into the scratch at `at`, returning its device pointer.
  auto stage = [&](int64_t at, const void* data, size_t bytes) {
    std::memcpy(scratch->host.get() + at, data, bytes);
    ops.push_back(CopyOp{scratch->device.get() + at, scratch->host.get() + at, bytes});
    return reinterpret_cast<const int64_t*>(scratch->device.get() + at);
  };

  int64_t tokens = 0;
  uint64_t bytes_moved = 0;
  PageTable::Pin pin;
  std::function<absl::Status(const absl::Status&)> finish;  // after the device work

  if (!records) {
    // Per token: the row's element offset in the tensor's allocation, and the pool location;
    // and the pages touched, once each.
    std::vector<int64_t> offsets, locs;
    std::vector<PageHandle> handles;
    // Page form: per-page lists only; the device expands them to per-token indices.
    std::vector<int64_t> page_blocks, page_ids;
    if (page_form) {
      // Whole blocks to whole pages: block i's tokens are page i's slots.
      KVF_RETURN_IF_ERROR(PagePairs(r, spec, *pool, save, &page_blocks, &page_ids));
    } else {
    if (r.blocks.size() != r.locations.size() || r.blocks.empty()) {
      return Invalid(ErrorReason::kInvalidRequest,
                     absl::StrCat(r.blocks.size(), " tensor tokens and ", r.locations.size(),
                                  " pool locations: give one of each per token, at least one"));
    }
    const int64_t n = static_cast<int64_t>(r.blocks.size());
    offsets.resize(n);
    absl::flat_hash_set<int64_t> seen_blocks;
    for (int64_t i = 0; i < n; ++i) {
      const BlockSlot& b = r.blocks[i];
      if (b.block >= spec.num_blocks || b.slot >= spec.block_tokens) {
        return Invalid(ErrorReason::kBlockOutOfRange,
                       absl::StrCat("token ", i, ": block ", b.block, " slot ", b.slot, " is outside ",
                                    spec.num_blocks, " blocks of ", spec.block_tokens));
      }
      offsets[i] = static_cast<int64_t>((spec.offset + b.block * spec.block_stride + b.slot * spec.token_stride) / 2);
      if (!save && !seen_blocks.insert(offsets[i]).second) {
        return Invalid(ErrorReason::kDuplicateLocation,
                       absl::StrCat("token ", i, ": block ", b.block, " slot ", b.slot, " is loaded twice"));
      }
    }
    KVF_ASSIGN_OR_RETURN(locs, pool->table().Resolve(r.locations));
    absl::flat_hash_map<uint64_t, uint64_t> generation;
    absl::flat_hash_set<int64_t> seen;
    for (int64_t i = 0; i < n; ++i) {
      const PageHandle& h = r.locations[i].page;
      auto [it, inserted] = generation.try_emplace(h.page_id, h.generation);
      if (inserted) handles.push_back(h);
      if (save && !seen.insert(locs[i]).second) {
        return Invalid(ErrorReason::kDuplicateLocation,
                       absl::StrCat("location ", i, " is written twice in one save"));
      }
    }
    }
    const int64_t n = page_form ? static_cast<int64_t>(page_ids.size()) * page_size
                                : static_cast<int64_t>(locs.size());
    // Device addresses of the per-token indices: staged from the host (token form) or
    // expanded on the device from the page lists staged at `at_lists` (page form).
    auto indices = [&](int64_t at_offsets, int64_t at_locs, int64_t at_lists, uint8_t* dev)
        -> std::pair<const int64_t*, const int64_t*> {
      if (!page_form) {
        return {stage(at_offsets, offsets.data(), n * 8), stage(at_locs, locs.data(), n * 8)};
      }
      const int64_t listed = static_cast<int64_t>(page_ids.size());
      ExpandBlockIndicesParams e;
      e.blocks = stage(at_lists, page_blocks.data(), listed * 8);
      e.pages = stage(at_lists + AlignUp(listed * 8, 256), page_ids.data(), listed * 8);
      e.num_listed = listed;
      e.page_size = page_size;
      e.row0 = static_cast<int64_t>(spec.offset / 2);
      e.block_stride = static_cast<int64_t>(spec.block_stride / 2);
      e.token_stride = static_cast<int64_t>(spec.token_stride / 2);
      e.row_offsets = reinterpret_cast<int64_t*>(dev + at_offsets);
      e.locs = reinterpret_cast<int64_t*>(dev + at_locs);
      ops.push_back(e);
      return {e.row_offsets, e.locs};
    };
    const int64_t lists_bytes = 2 * AlignUp(static_cast<int64_t>(page_ids.size()) * 8 + 8, 256);
    checked_at = std::chrono::steady_clock::now();
    // A save holds its pages for its layer only: saves of other layers into them go on.
    const std::span<const PageHandle> pinned = page_form ? std::span<const PageHandle>(r.pages) : handles;
    KVF_ASSIGN_OR_RETURN(pin, save ? pool->table().PinLayer(pinned, static_cast<int>(r.layer))
                                   : pool->table().PinPages(pinned, /*exclusive=*/false));
    pinned_at = std::chrono::steady_clock::now();
    tokens = n;
    bytes_moved = n * (kBf16RowBytes + GetLayoutInfo(g.layout).bytes_per_token());
    if (save) {
      // Pages that already hold records of this layer are backed up, so that a row found
      // NaN or Inf by the kernel can be undone; fresh pages are zeroed back instead.
      // The fresh pages' list is made only if the save is undone (from the pin).
      std::vector<int64_t> backup;
      const int64_t fresh_count = std::count(pin.held.begin(), pin.held.end(), 0);
      if (fresh_count < static_cast<int64_t>(pin.pages.size())) {
        for (size_t i = 0; i < pin.pages.size(); ++i) {
          if (pin.held[i]) backup.push_back(r.layer * g.num_pages + pin.pages[i]);
        }
      }
      // Scratch: [flag | backup ids | fresh ids | page lists] staged from the host, then the
      // per-token indices (from the host in the token form, expanded on the device in the
      // page form: 16 MB for 1M tokens that need no host copy), then the backed-up pages.
      const int64_t at_flag = 0, at_backup_ids = 256;
      const int64_t at_fresh_ids = at_backup_ids + AlignUp(backup.size() * 8 + 8, 256);
      const int64_t at_lists = at_fresh_ids + AlignUp(fresh_count * 8 + 8, 256);
      const int64_t at_offsets = at_lists + lists_bytes, at_locs = at_offsets + AlignUp(n * 8, 256);
      const int64_t at_backup = at_locs + AlignUp(n * 8, 256);
      if (absl::Status s = make_scratch(page_form ? at_offsets : at_backup,
                                        at_backup + backup.size() * g.page_bytes());
          !s.ok()) {
        pool->Unpin(pin);
        return s;
      }
      uint8_t* dev = scratch->device.get();
      QuantizeStoreParams q;
      q.geometry = g;
      q.rows = reinterpret_cast<const uint16_t*>(tensor->memory->base());
      std::tie(q.row_offsets, q.locs) = indices(at_offsets, at_locs, at_lists, dev);
      q.num_tokens = n;
      q.pool = layer_base;
      q.nonfinite = reinterpret_cast<uint32_t*>(dev + at_flag);
      ops.push_back(FillZeroOp{dev + at_flag, 4});
      PageCopyParams keep;
      keep.geometry = pool->flat_pages();
      keep.pool = pool->base();
      keep.num_listed = static_cast<int64_t>(backup.size());
      keep.buffer = dev + at_backup;
      if (!backup.empty()) {
        keep.pages = stage(at_backup_ids, backup.data(), backup.size() * 8);
        ops.push_back(GatherPagesOp{keep});
      }
      // The fresh pages' ids go to the device only if the store is undone.
      PageCopyParams zero = keep;
      zero.num_listed = fresh_count;
      zero.pages = reinterpret_cast<const int64_t*>(dev + at_fresh_ids);
      ops.push_back(q);
      ops.push_back(CopyOp{scratch->host.get() + at_flag, dev + at_flag, 4});
      finish = [pool, pin = std::move(pin), scratch, keep, zero, at_flag, at_fresh_ids,
                layer = r.layer, num_pages = g.num_pages, page_form, locs = std::move(locs),
                page_ids = std::move(page_ids), &backend](const absl::Status& ran) -> absl::Status {
        uint32_t flag = 0;
        std::memcpy(&flag, scratch->host.get() + at_flag, 4);
        absl::Status result = ran;
        if (ran.ok() && flag != 0) {
          std::vector<Op> undo;
          if (keep.num_listed > 0) undo.push_back(ScatterPagesOp{keep});
          if (zero.num_listed > 0) {
            std::vector<int64_t> fresh;
            for (size_t i = 0; i < pin.pages.size(); ++i) {
              if (!pin.held[i]) fresh.push_back(static_cast<int64_t>(layer) * num_pages + pin.pages[i]);
            }
            std::memcpy(scratch->host.get() + at_fresh_ids, fresh.data(), fresh.size() * 8);
            undo.push_back(CopyOp{scratch->device.get() + at_fresh_ids,
                                  scratch->host.get() + at_fresh_ids, fresh.size() * 8});
            undo.push_back(ZeroPagesOp{zero});
          }
          result = backend.Run(undo);
          if (result.ok()) {
            result = Error(absl::StatusCode::kInvalidArgument, ErrorReason::kNonFiniteValue,
                           "a source row holds NaN or Inf; nothing was stored");
          }
        }
        if (result.ok() && page_form) {
          pool->UnpinLayerPages(pin, page_ids);  // every slot of each page
        } else {
          pool->Unpin(pin, result.ok() ? static_cast<int>(layer) : -1,
                      result.ok() ? std::span<const int64_t>(locs) : std::span<const int64_t>());
        }
        return result;
      };
    } else {
      // Scratch: [page lists | per-token indices], as for a save.
      const int64_t at_lists = 0, at_offsets = lists_bytes, at_locs = at_offsets + AlignUp(n * 8, 256);
      const int64_t end = at_locs + AlignUp(n * 8, 256);
      if (absl::Status s = make_scratch(page_form ? at_offsets : end, end); !s.ok()) {
        pool->Unpin(pin);
        return s;
      }
      DequantizeGatherParams d;
      d.geometry = g;
      d.pool = layer_base;
      std::tie(d.out_offsets, d.locs) = indices(at_offsets, at_locs, at_lists, scratch->device.get());
      d.num_tokens = n;
      d.out = reinterpret_cast<uint16_t*>(tensor->memory->base());
      d.out_offset_align = 8;  // offsets and strides are multiples of 16 bytes
      ops.push_back(d);
      finish = [pool, pin = std::move(pin), scratch](const absl::Status& ran) {
        pool->Unpin(pin);
        return ran;
      };
    }
  } else {
    const bool transcode = spec.layout != g.layout;
    if (save && transcode) {
      return Error(absl::StatusCode::kFailedPrecondition, ErrorReason::kLayoutMismatch,
                   absl::StrCat("records in ", LayoutName(spec.layout), " cannot be saved into a ",
                                LayoutName(g.layout), " pool"));
    }
    std::vector<int64_t> blocks, page_ids;
    KVF_RETURN_IF_ERROR(PagePairs(r, spec, *pool, save, &blocks, &page_ids));
    const int64_t n = static_cast<int64_t>(page_ids.size());
    std::vector<int64_t> flat(n);
    for (int64_t i = 0; i < n; ++i) flat[i] = r.layer * g.num_pages + page_ids[i];
    checked_at = std::chrono::steady_clock::now();
    KVF_ASSIGN_OR_RETURN(pin, save ? pool->table().PinLayer(r.pages, static_cast<int>(r.layer))
                                   : pool->table().PinPages(r.pages, /*exclusive=*/false));
    pinned_at = std::chrono::steady_clock::now();
    tokens = n * page_size;
    bytes_moved = 2 * n * g.page_bytes();
    std::vector<int64_t> src_locs, dst_locs;
    if (transcode) {
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t s : pool->table().WrittenSlots(static_cast<int>(r.layer), {&page_ids[i], 1})) {
          src_locs.push_back(page_ids[i] * page_size + s);
          dst_locs.push_back(blocks[i] * page_size + s);
        }
      }
    }
    const int64_t w = static_cast<int64_t>(src_locs.size());
    const int64_t at_flat = AlignUp(n * 8, 256), at_src = 2 * at_flat, at_dst = at_src + AlignUp(w * 8 + 8, 256);
    if (absl::Status s = make_scratch(at_dst + AlignUp(w * 8 + 8, 256), at_dst + AlignUp(w * 8 + 8, 256)); !s.ok()) {
      pool->Unpin(pin);
      return s;
    }
    PageCopyParams copy;
    copy.geometry = pool->flat_pages();
    copy.pool = pool->base();
    copy.buffer_pages = stage(0, blocks.data(), n * 8);
    copy.pages = stage(at_flat, flat.data(), n * 8);
    copy.num_listed = n;
    copy.buffer = tensor->data();
    if (save) {
      ops.push_back(ScatterPagesOp{copy});
    } else if (!transcode) {
      ops.push_back(GatherPagesOp{copy});
    } else {
      PageCopyParams clear;
      clear.geometry = PageCopyGeometry{static_cast<int64_t>(spec.block_stride),
                                        static_cast<int64_t>(spec.num_blocks), 1};
      clear.pool = tensor->data();
      clear.pages = copy.buffer_pages;
      clear.num_listed = n;
      ops.push_back(ZeroPagesOp{clear});
      if (w > 0) {
        TranscodeParams t;
        t.from = g;
        t.src = layer_base;
        t.to = PoolGeometry{spec.layout, page_size, static_cast<int64_t>(spec.num_blocks)};
        t.dst = tensor->data();
        t.locs = stage(at_src, src_locs.data(), w * 8);
        t.dst_locs = stage(at_dst, dst_locs.data(), w * 8);
        t.num_tokens = w;
        ops.push_back(t);
      }
    }
    finish = [pool, pin = std::move(pin), scratch, save,
              page_ids = std::move(page_ids)](const absl::Status& ran) {
      if (save && ran.ok()) {
        pool->UnpinLayerPages(pin, page_ids);
      } else {
        pool->Unpin(pin);
      }
      return ran;
    };
  }

  const char* op = save ? "save" : "load";
  const auto staged_at = std::chrono::steady_clock::now();
  absl::StatusOr<Completion> submitted = backend.Submit(ops);
  if (!submitted.ok()) {
    // Nothing ran past the failed launch; the finishing step releases the pins.
    const absl::Status s = finish(submitted.status());
    if (observer_ != nullptr) observer_->RecordTransfer(op, false, 0, 0);
    return s;
  }
  auto done = std::make_shared<Completion>(std::move(*submitted));
  const auto submitted_at = std::chrono::steady_clock::now();
  auto complete = [done, finish = std::move(finish), tensor, pool, observer = observer_, op, bytes_moved, start,
                   checked_at, pinned_at, scratch_at, staged_at, submitted_at, tokens, hold = r.hold]() {
    absl::Status ran = WithReason(done->Wait(), ErrorReason::kDeviceError);
    const auto waited_at = std::chrono::steady_clock::now();
    // The device part alone (kvferry_kernel_seconds{op="save"|"load"}).
    pool->ObserveOp(op, std::chrono::duration<double>(waited_at - submitted_at).count());
    const absl::Status s = finish(ran);
    if (spdlog::should_log(spdlog::level::debug)) {
      log::Debug("session {} of {} tokens: checks {:.3f} ms, pinning {:.3f}, staging {:.3f} "
                 "(scratch {:.3f}), launch {:.3f}, device {:.3f}, release {:.3f}",
                 op, tokens, log::Millis(start, checked_at), log::Millis(checked_at, pinned_at),
                 log::Millis(pinned_at, staged_at), log::Millis(pinned_at, scratch_at),
                 log::Millis(staged_at, submitted_at),
                 log::Millis(submitted_at, waited_at),
                 log::Millis(waited_at, std::chrono::steady_clock::now()));
    }
    if (observer != nullptr) {
      observer->RecordTransfer(
          op, s.ok(), s.ok() ? bytes_moved : 0,
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    return s;
  };
  if (r.async.has_value()) {
    session->SetWord(*r.async, kWordPending);
    Complete(session, *r.async, std::move(complete));
    return 0;
  }
  KVF_RETURN_IF_ERROR(complete());
  return tokens;
}

absl::StatusOr<PoolExport> SessionManager::MapPool(uint64_t session_id, const TenantAccount& caller,
                                                   const std::string& name) {
  KVF_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, Find(session_id, &caller));
  KVF_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool, pools_->Get(*session->owner, name));
  if (pool->device() != session->device) {
    return Error(absl::StatusCode::kFailedPrecondition, ErrorReason::kDeviceMismatch,
                 absl::StrCat("pool '", name, "' lives on ", pool->device(), ", the session on ",
                              session->device));
  }
  PoolExport out;
  KVF_ASSIGN_OR_RETURN(out.memory, pool->backend().ExportIpc(pool->base()));
  out.page_bytes = pool->geometry().page_bytes();
  out.layer_bytes = pool->geometry().pool_bytes();
  out.pool = pool->Stats();
  {
    kvferry::MutexLock lock(&mu_);
    out.export_id = next_export_++;
  }
  kvferry::MutexLock lock(&session->mu);
  if (session->closed) return ClosedError(session_id);
  session->exports[out.export_id] = Session::Export{std::move(pool)};
  return out;
}

absl::Status SessionManager::UnmapPool(uint64_t session_id, const TenantAccount& caller,
                                       uint64_t export_id) {
  KVF_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, Find(session_id, &caller));
  kvferry::MutexLock lock(&session->mu);
  if (session->exports.erase(export_id) == 0) {
    return Error(absl::StatusCode::kNotFound, ErrorReason::kExportNotFound,
                 absl::StrCat("session ", session_id, " has no export ", export_id));
  }
  return absl::OkStatus();
}

absl::Status SessionManager::AdoptPages(uint64_t session_id, const TenantAccount& caller,
                                        const std::shared_ptr<Pool>& pool,
                                        std::span<const PageHandle> pages) {
  KVF_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, Find(session_id, &caller));
  kvferry::MutexLock lock(&session->mu);
  // Closing already took the session's pages: the caller frees these.
  if (session->closed) return ClosedError(session_id);
  session->pages.emplace_back(pool, std::vector<PageHandle>(pages.begin(), pages.end()));
  return absl::OkStatus();
}

void SessionManager::PoolDeleted(const Pool& pool) {
  std::vector<std::shared_ptr<Session>> all;
  {
    kvferry::ReaderMutexLock lock(&mu_);
    for (auto& [id, s] : sessions_) all.push_back(s);
  }
  for (auto& s : all) {
    kvferry::MutexLock lock(&s->mu);
    for (auto& [id, e] : s->exports) {
      if (e.pool.get() == &pool) {
        s->revocations.push_back(
            Revocation{id, absl::StrCat("pool '", pool.config().name, "' was deleted")});
      }
    }
  }
}

SessionCounts SessionManager::Counts() const {
  std::vector<std::shared_ptr<Session>> all;
  {
    kvferry::ReaderMutexLock lock(&mu_);
    for (auto& [id, s] : sessions_) all.push_back(s);
  }
  SessionCounts c;
  c.sessions = static_cast<int64_t>(all.size());
  for (auto& s : all) {
    kvferry::MutexLock lock(&s->mu);
    c.tensors += static_cast<int64_t>(s->tensors.size());
    c.exports += static_cast<int64_t>(s->exports.size());
    for (auto& [id, t] : s->tensors) c.registered_bytes += static_cast<int64_t>(t->bytes());
  }
  return c;
}

}  // namespace kvferry::server
