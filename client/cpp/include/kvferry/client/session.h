// A worker's CUDA IPC session with the kvferryd on its GPU (proto: kvferry/v1/session.proto).
//
// The session lives while this object does (or until Close): the daemon keeps the worker's
// registered tensors mapped and its session-owned pages allocated for that long, and
// releases everything when the session ends — also when the worker process dies. Save and
// Load run the daemon's kernels directly on the worker's GPU memory. A synchronous call
// returns once every byte is in place; an asynchronous one returns a Pending whose Done()
// polls a word in shared memory (no rpc). Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvferry/client/client.h"

namespace kvferry::client {

// A tensor of the worker's, in blocks of `block_tokens` tokens.
struct KvTensor {
  enum class Kind { kBf16, kRecords };
  std::string ipc_handle;  // cudaIpcMemHandle_t bytes of the allocation (see cuda_ipc.h)
  uint64_t offset = 0;     // bytes from the allocation's base
  uint64_t num_blocks = 0;
  uint32_t block_tokens = 0;
  uint64_t block_stride = 0;  // bytes between blocks (records: the page bytes)
  uint64_t token_stride = 0;  // bf16: bytes between a block's tokens (>= 1024)
  Kind kind = Kind::kBf16;
  Layout layout = Layout::kV4;  // records
  std::string name;
  // Instead of ipc_handle, memory of CUDA's virtual memory API: this process's id and, in
  // address order, a descriptor and the bytes mapped of each allocation backing the range
  // (see DescribeVmmTensor in cuda_ipc.h); `offset` then counts from the first's start.
  struct VmmAllocation {
    int fd = -1;
    uint64_t size = 0;
  };
  uint32_t vmm_pid = 0;
  std::vector<VmmAllocation> vmm_allocations;
};

struct BlockSlot {
  uint64_t block = 0;
  uint32_t slot = 0;
};

// A pool exported to this session.
struct PoolMapping {
  uint64_t export_id = 0;
  std::string ipc_handle;
  uint64_t offset = 0;       // layer l, page p: offset + l * layer_bytes + p * page_bytes
  uint64_t page_bytes = 0;
  uint64_t layer_bytes = 0;
  PoolInfo pool;
};

class Session {
 public:
  // An asynchronous Save or Load.
  class Pending {
   public:
    // True once the operation finished (successfully or not); reads shared memory only.
    bool Done() const;
    // Waits (polling) until done or `timeout`; OK when it succeeded. An enqueued request
    // the daemon refused returns the daemon's status (with its reason).
    absl::Status Wait(absl::Duration timeout = absl::Seconds(60)) const;

    // The outcome of one operation once its slot was taken for another (0: not yet), or
    // the daemon's refusal of an enqueued one.
    struct Outcome {
      std::atomic<uint64_t> word{0};
      std::atomic<bool> refused{false};
      absl::Status refusal;  // written before `refused` is set
    };

   private:
    friend class Session;
    Pending(std::shared_ptr<const void> area, const uint64_t* word, uint64_t sequence,
            std::shared_ptr<const Outcome> outcome)
        : area_(std::move(area)), word_(word), sequence_(sequence), outcome_(std::move(outcome)) {}
    // The word of this operation: the slot's, or what the slot held when it was reused.
    uint64_t Word() const;
    std::shared_ptr<const void> area_;  // keeps the mapping alive
    const uint64_t* word_;
    uint64_t sequence_;
    std::shared_ptr<const Outcome> outcome_;
  };

  // Opens a session for tensors on CUDA device `device` (as the daemon numbers it).
  static absl::StatusOr<std::unique_ptr<Session>> Open(const ClientOptions& options,
                                                       const std::string& worker,
                                                       uint32_t device, uint32_t slots = 0);
  ~Session();

  uint64_t id() const;
  absl::StatusOr<uint64_t> RegisterKv(const KvTensor& tensor);
  // Pages that belong to the session: freed by the daemon when the session ends.
  absl::StatusOr<std::vector<PageHandle>> AllocatePages(const std::string& pool, uint32_t count);

  // bf16 tensors, token by token (pairwise). Returns the tokens moved.
  absl::StatusOr<uint64_t> Save(uint64_t tensor, const std::string& pool, uint32_t layer,
                                std::span<const BlockSlot> from, std::span<const TokenLocation> to);
  absl::StatusOr<uint64_t> Load(uint64_t tensor, const std::string& pool, uint32_t layer,
                                std::span<const TokenLocation> from, std::span<const BlockSlot> to);
  // Whole blocks and pages (pairwise; block_tokens == page size), for either kind of tensor:
  // bf16 rows are quantized / dequantized slot for slot; records are copied, or on Load
  // transcoded to the tensor's layout. The compact form for large transfers.
  absl::StatusOr<uint64_t> SaveBlocks(uint64_t tensor, const std::string& pool, uint32_t layer,
                                      std::span<const uint64_t> from, std::span<const PageHandle> to);
  absl::StatusOr<uint64_t> LoadBlocks(uint64_t tensor, const std::string& pool, uint32_t layer,
                                      std::span<const PageHandle> from, std::span<const uint64_t> to);
  // The same, returning once the work is validated and enqueued. Saves of different layers
  // into the same pages do not wait for each other (a worker may save layer after layer
  // while the earlier ones still run); two saves of one layer of a page take turns.
  absl::StatusOr<Pending> SaveBlocksAsync(uint64_t tensor, const std::string& pool, uint32_t layer,
                                          std::span<const uint64_t> from,
                                          std::span<const PageHandle> to);
  absl::StatusOr<Pending> LoadBlocksAsync(uint64_t tensor, const std::string& pool, uint32_t layer,
                                          std::span<const PageHandle> from,
                                          std::span<const uint64_t> to);
  // The same without waiting for the daemon to take the request: it goes out on the client
  // library's threads, so the calling thread (an engine's forward pass) never waits on gRPC.
  // A refusal (a stale page, a block out of range, ...) becomes the Pending's outcome:
  // Wait returns the daemon's status and reason. Requests enqueued one after another may
  // reach the daemon in any order: wait for a Save's Pending before a Load of its pages.
  absl::StatusOr<Pending> EnqueueSaveBlocks(uint64_t tensor, const std::string& pool,
                                            uint32_t layer, std::span<const uint64_t> from,
                                            std::span<const PageHandle> to);
  absl::StatusOr<Pending> EnqueueLoadBlocks(uint64_t tensor, const std::string& pool,
                                            uint32_t layer, std::span<const PageHandle> from,
                                            std::span<const uint64_t> to);
  absl::StatusOr<Pending> SaveAsync(uint64_t tensor, const std::string& pool, uint32_t layer,
                                    std::span<const BlockSlot> from, std::span<const TokenLocation> to);
  absl::StatusOr<Pending> LoadAsync(uint64_t tensor, const std::string& pool, uint32_t layer,
                                    std::span<const TokenLocation> from, std::span<const BlockSlot> to);

  // The KV cache's blocks by key (Client::Lookup and friends), moved in place like
  // SaveBlocks / LoadBlocks. SaveToCache: source blocks `from` — the same block ids in each
  // layer's tensor, `layer_tensors[l]` for layer l of member `pool`, every layer of it —
  // become the blocks of `keys` (pairwise); keys already held are skipped; the new blocks
  // are visible to lookups all at once when it returns, or not at all on an error.
  struct CacheSaveResult {
    uint64_t tokens = 0;               // tokens moved over all layers
    uint64_t blocks_stored = 0;
    uint64_t blocks_already_held = 0;
  };
  absl::StatusOr<CacheSaveResult> SaveToCache(const NamespaceRef& ns, const std::string& pool,
                                              std::span<const uint64_t> layer_tensors,
                                              std::span<const std::string> keys,
                                              std::span<const uint64_t> from);
  // Blocks [first_block, first_block + to.size()) of lease `lease_id`'s hits in member
  // `pool`, layer `layer`, into blocks `to` of `tensor` (dequantized, copied or transcoded
  // as LoadBlocks). FAILED_PRECONDITION (LEASE_EXPIRED) when the lease is not held.
  absl::StatusOr<uint64_t> LoadFromCache(uint64_t tensor, const NamespaceRef& ns,
                                         uint64_t lease_id, const std::string& pool,
                                         uint32_t layer, uint64_t first_block,
                                         std::span<const uint64_t> to);
  absl::StatusOr<Pending> LoadFromCacheAsync(uint64_t tensor, const NamespaceRef& ns,
                                             uint64_t lease_id, const std::string& pool,
                                             uint32_t layer, uint64_t first_block,
                                             std::span<const uint64_t> to);

  absl::StatusOr<PoolMapping> MapPool(const std::string& pool);
  absl::Status UnmapPool(uint64_t export_id);
  // Export ids the daemon revoked so far (their pool was deleted).
  std::vector<uint64_t> Revoked() const;

  // Ends the session (also done by the destructor).
  absl::Status Close();

 private:
  struct Impl;
  explicit Session(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvferry::client
