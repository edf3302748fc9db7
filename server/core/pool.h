// A KV pool: one device allocation of num_layers x num_pages pages in one layout, its page
// table, and the device work the page table asks for (zeroing freed pages).
//
// Writes (StagedWrite, staged_write.h) and reads (readers, reader.h) are their own types;
// they reach the pool's memory through the accessors below while they hold pins of the
// pages they touch. Thread-safe. No gRPC: errors are absl::Status with a reason
// (common/errors.h) and a message for the user.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "kvferry/mutex.h"
#include "backend/backend.h"
#include "core/page_table.h"
#include "core/tenant.h"
#include "core/types.h"
#include "kvferry/kernels/format.h"

namespace kvferry::server {

class Pool : public std::enable_shared_from_this<Pool> {
 public:
  // The rules every pool obeys (name, geometry, layers); INVALID_ARGUMENT with a reason.
  static absl::Status ValidateConfig(const PoolConfig& config);

  // Allocates the pool, zero-filled. RESOURCE_EXHAUSTED when the device lacks the memory,
  // or (QUOTA_EXCEEDED) when `owner` may not hold one more pool or its bytes; nothing is
  // allocated then. The owner is charged the pool, its bytes and every allocated page
  // until the pool is destroyed (its memory freed); null: charged to nobody.
  static absl::StatusOr<std::shared_ptr<Pool>> Create(const PoolConfig& config,
                                                      std::shared_ptr<Backend> backend,
                                                      uint64_t incarnation, OpObserver* observer,
                                                      std::shared_ptr<TenantAccount> owner = nullptr);
  ~Pool();

  const PoolConfig& config() const { return config_; }
  const std::string& device() const { return backend_->device(); }
  // The tenant the pool belongs to (null: none); its account is charged for the pool.
  const std::shared_ptr<TenantAccount>& owner() const { return owner_; }
  uint64_t id() const { return table_.incarnation(); }
  // The geometry of one layer.
  PoolGeometry geometry() const {
    return PoolGeometry{config_.layout, config_.page_size, config_.num_pages};
  }
  PoolStats Stats() const;

  // All or nothing: POOL_FULL when fewer than `count` pages are free, QUOTA_EXCEEDED when
  // the owner may not hold `count` more pages. `lease` > 0: the pages are leased, freed by
  // ExpireLeases() once nothing renewed them (RenewLeases, Renew) for that long; zero: plain
  // pages, kept until FreePages.
  absl::StatusOr<std::vector<PageHandle>> AllocatePages(int64_t count,
                                                        absl::Duration lease = absl::ZeroDuration());
  // Renews the leases of the pages named (by a read or a write); plain pages and stale
  // handles are passed over (the read or write reports those itself).
  void RenewLeases(std::span<const PageHandle> pages) ABSL_LOCKS_EXCLUDED(lease_mu_);
  // Checks every handle (FAILED_PRECONDITION for a stale one: nothing renewed), then renews
  // the leased ones. OK means every leased page lives a lease length from the call, even
  // against an ExpireLeases running at the same time.
  absl::Status Renew(std::span<const PageHandle> pages) ABSL_LOCKS_EXCLUDED(lease_mu_);
  // Frees the pages whose lease ran out by `now` (as FreePages), each only while nothing
  // renewed it since; returns how many.
  int64_t ExpireLeases(absl::Time now) ABSL_LOCKS_EXCLUDED(lease_mu_);
  // Checks every handle first (any stale or repeated: none is freed). Each page reads as
  // zeros in every layer before it is handed out again: zeroed on the device now, or, if a
  // read or write still uses it, when that one finishes. If the zeroing fails (INTERNAL,
  // DEVICE_ERROR) the pages are freed all the same but kept back until zeroed.
  absl::Status FreePages(std::span<const PageHandle> pages);

  // INVALID_ARGUMENT (LAYER_OUT_OF_RANGE) unless 0 <= layer < num_layers.
  absl::Status CheckLayer(int64_t layer) const;
  // Every later pin fails with ABORTED (POOL_DELETED): called when the pool is deleted.
  void MarkDeleted() { table_.MarkDeleted(); }

  // ---- for staged writes and readers -------------------------------------------------------
  PageTable& table() { return table_; }
  Backend& backend() { return *backend_; }
  // Base of layer 0; layers follow each other, num_pages * page_bytes apart. Pages are
  // addressed as one flat array of num_layers * num_pages pages: layer * num_pages + page.
  uint8_t* base() const { return memory_.get(); }
  // The allocation of every page (from base()).
  MemoryBlock memory() const { return memory_.block(); }
  PageCopyGeometry flat_pages() const {
    return PageCopyGeometry{geometry().page_bytes(), config_.num_pages * config_.num_layers, 1};
  }
  // Submit + Wait, reporting the wall time under `op` to the observer.
  absl::Status RunTimed(const char* op, std::span<const Op> ops);
  // Zeroes the pages `ids` of `geometry` (the pool's pages, every layer of each, or
  // flat_pages()). A host memory backend reads the ids where they are; elsewhere they are
  // first copied into device memory: `scratch` when given (at least the ids' bytes, kept by
  // a caller that must not fail on an allocation), else memory allocated here.
  absl::Status ZeroListedPages(PageCopyGeometry geometry, std::span<const int64_t> ids,
                               const Buffer* scratch = nullptr);
  void ObserveOp(const char* op, double seconds) const;
  // Releases a pin (see PageTable::Unpin) and zeroes pages whose reclaim waited for it.
  void Unpin(const PageTable::Pin& pin, int written_layer = -1,
             std::span<const int64_t> written_tokens = {});
  void UnpinWrittenPages(const PageTable::Pin& pin, std::span<const int> layers,
                         std::span<const int64_t> pages);
  void UnpinLayerPages(const PageTable::Pin& pin, std::span<const int64_t> pages);

 private:
  Pool(const PoolConfig& config, std::shared_ptr<Backend> backend, uint64_t incarnation,
       OpObserver* observer, Buffer memory, std::shared_ptr<TenantAccount> owner);
  // Zeroes the pages on the device and returns them to the free list. On a device error
  // the pages stay out of the free list (never handed out unzeroed) until a later
  // AllocatePages zeroes them.
  absl::Status ZeroAndReclaim(std::vector<int64_t> pages);
  // `count` freed pages back to the owner's quota.
  void RefundPages(int64_t count);
  // Renews the leased pages of `pages` (others passed over) to `now` + their length.
  void RenewLocked(std::span<const PageHandle> pages, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(lease_mu_);

  const PoolConfig config_;
  const std::shared_ptr<Backend> backend_;
  OpObserver* const observer_;
  const std::shared_ptr<TenantAccount> owner_;
  std::atomic<int64_t> charged_pages_{0};  // pages charged to owner_, refunded when freed
  struct Lease {
    uint64_t generation;  // of the handle leased: a later allocation of the page is another
    absl::Duration length;
    absl::Time expiry;
  };
  // Taken before the page table's own lock (Renew and ExpireLeases check or free handles
  // under it), never after it.
  kvferry::Mutex lease_mu_;
  absl::flat_hash_map<uint64_t, Lease> leases_ ABSL_GUARDED_BY(lease_mu_);  // by page id
  Buffer memory_;  // [num_layers][num_pages][page_bytes]
  PageTable table_;
};

}  // namespace kvferry::server
