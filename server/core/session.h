// Sessions of co-located workers: registered tensors of another process (CUDA IPC), Save
// and Load between them and the pools with the daemon's kernels in place, completion words
// in shared memory, pool exports, and pages owned by a session.
//
// A session lives from Open to Close (the service closes it when the worker's stream ends,
// however it ends). Close drops the session's tensors, exports and pages; work already
// submitted finishes first (it holds what it uses). Thread-safe.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kvferry/mutex.h"
#include "core/pool_manager.h"
#include "core/tenant.h"

namespace kvferry::server {

enum class RowKind { kBf16, kRecords };

// A worker tensor as registered: blocks of `block_tokens` tokens.
struct KvTensorSpec {
  std::string ipc_handle;  // of the allocation holding the tensor
  // Or the worker's VMM allocations (Backend::ImportVmm), when `vmm` is not empty.
  uint32_t vmm_pid = 0;
  std::vector<VmmAllocation> vmm;
  int vmm_proof_fd = -1;  // the worker's descriptor holding the session's secret
  uint64_t offset = 0;     // bytes from the allocation's base
  uint64_t num_blocks = 0;
  uint32_t block_tokens = 0;
  uint64_t block_stride = 0;  // bytes
  uint64_t token_stride = 0;  // bytes (bf16 rows)
  RowKind kind = RowKind::kBf16;
  Layout layout = Layout::kV4;  // records
  std::string name;
};

// A token of a registered tensor.
struct BlockSlot {
  uint64_t block = 0;
  uint32_t slot = 0;
};

// Where an asynchronous operation reports completion.
struct AsyncSlot {
  uint32_t slot = 0;
  uint64_t sequence = 0;
};

// Completion word states (proto/kvferry/v1/session.proto).
inline constexpr uint64_t kWordPending = 1, kWordDone = 2, kWordFailed = 3;

struct TransferRequest {
  const TenantAccount* caller = nullptr;  // must be the session's owner
  uint64_t session_id = 0;
  uint64_t tensor_id = 0;
  std::string pool;
  int64_t layer = 0;
  // Token form (bf16 tensors): pairwise.
  std::vector<BlockSlot> blocks;          // tensor side
  std::vector<TokenLocation> locations;   // pool side
  // Page form (records tensors): pairwise.
  std::vector<uint64_t> tensor_blocks;
  std::vector<PageHandle> pages;
  std::optional<AsyncSlot> async;
  // Nonzero: the pool must be this incarnation (Pool::id()), else ABORTED (POOL_NOT_FOUND):
  // pages taken from the cache are not those of a pool of the same name made since.
  uint64_t pool_id = 0;
  // Kept until the transfer's device work has finished, also when asynchronous (a cache
  // load's pin of its blocks).
  std::shared_ptr<const void> hold;
};

struct PoolExport {
  uint64_t export_id = 0;
  ExportedMemory memory;
  int64_t page_bytes = 0, layer_bytes = 0;
  PoolStats pool;
};

// An export the daemon took back (its pool was deleted), for the session's event stream.
struct Revocation {
  uint64_t export_id = 0;
  std::string reason;
};

struct SessionCounts {
  int64_t sessions = 0;
  int64_t tensors = 0;
  int64_t registered_bytes = 0;
  int64_t exports = 0;
};

// Receives Save/Load outcomes (metrics); may be null.
class TransferObserver {
 public:
  virtual ~TransferObserver() = default;
  virtual void RecordTransfer(const char* op, bool ok, uint64_t bytes, double seconds) = 0;
};

class SessionManager {
 public:
  SessionManager(PoolManager* pools, TransferObserver* observer);
  ~SessionManager();

  struct Opened {
    uint64_t session_id;
    std::string completion_shm;
    uint32_t completion_slots;
    std::string secret;  // random; a worker proves with it that a process is the session's
  };
  // `device`: the CUDA index of the worker's tensors ("cuda:<device>" pools only). The
  // session belongs to `owner`: it reaches only that tenant's pools, and any other caller
  // naming it gets SESSION_NOT_FOUND.
  absl::StatusOr<Opened> Open(std::shared_ptr<TenantAccount> owner, const std::string& worker,
                              uint32_t device, uint32_t slots);
  // Ends the session; unknown ids are ignored.
  void Close(uint64_t session_id);
  // The worker mapped the session's completion area: its name is removed.
  void CompletionMapped(uint64_t session_id);
  // Events for the session's stream (export revocations): blocks until one is there or the
  // session is closed (then nullopt).
  std::optional<Revocation> NextRevocation(uint64_t session_id);

  absl::StatusOr<std::vector<uint64_t>> Register(uint64_t session_id, const TenantAccount& caller,
                                                 std::span<const KvTensorSpec> tensors);
  // Token counts moved (0 for an asynchronous request, whose outcome goes to its word).
  absl::StatusOr<int64_t> Save(const TransferRequest& request);
  absl::StatusOr<int64_t> Load(const TransferRequest& request);

  absl::StatusOr<PoolExport> MapPool(uint64_t session_id, const TenantAccount& caller,
                                     const std::string& pool);
  absl::Status UnmapPool(uint64_t session_id, const TenantAccount& caller, uint64_t export_id);
  // Pages allocated on behalf of a session are freed when it ends.
  absl::Status AdoptPages(uint64_t session_id, const TenantAccount& caller,
                          const std::shared_ptr<Pool>& pool, std::span<const PageHandle> pages);

  // A pool was deleted: revoke its exports (their sessions are told; the memory stays until
  // each export is released or its session ends).
  void PoolDeleted(const Pool& pool);

  SessionCounts Counts() const;

 private:
  struct Session;
  struct Tensor;
  // The session `id` of `caller` (null: any caller, for the daemon's own use).
  absl::StatusOr<std::shared_ptr<Session>> Find(uint64_t id, const TenantAccount* caller) const;
  absl::StatusOr<int64_t> Transfer(const TransferRequest& request, bool save);
  // Runs `finish` (which waits for the device) on a completion thread, then writes the
  // word.
  void Complete(std::shared_ptr<Session> session, AsyncSlot slot, std::function<absl::Status()> finish);
  void CompletionLoop();

  PoolManager* const pools_;
  TransferObserver* const observer_;
  mutable kvferry::Mutex mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
  uint64_t next_session_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_tensor_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_export_ ABSL_GUARDED_BY(mu_) = 1;

  // Asynchronous completions, taken in submission order by a few threads: each waits for
  // its operation's device work, releases its pages and writes its word, so that one
  // operation's release overlaps the next one's wait.
  static constexpr int kCompletionThreads = 4;
  kvferry::Mutex jobs_mu_;
  std::deque<std::function<void()>> jobs_ ABSL_GUARDED_BY(jobs_mu_);
  bool stopping_ ABSL_GUARDED_BY(jobs_mu_) = false;
  std::vector<std::thread> completers_;
};

}  // namespace kvferry::server
