// The page table of one pool: allocation, generations, pins, occupancy and reclaim.
//
// Bookkeeping only (no device memory): the Pool does the device work the table asks for.
// A page is free (zeroed, ready), allocated, or reclaiming (freed: its handle is already
// refused, and it returns to the free list only after the Pool zeroed it on the device,
// which waits until no read or write still uses it). Requests pin the pages they touch
// while their device work runs: readers shared, writers exclusive among writers (two
// writes of one page never interleave; reads never wait for writes). A writer of one layer
// excludes only writers of that layer and writers of every layer, so a worker's saves of
// layer after layer into the same pages run one behind the other without waiting for each
// other's device work. Thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvferry/mutex.h"
#include "core/types.h"

namespace kvferry::server {

// The pages of a list seen so far (ids below the pool's page count: their handles were
// checked): a bitmap over the pool's pages for long lists (a page-form transfer names
// thousands), a hash set for short ones.
class SeenPages {
 public:
  SeenPages(size_t listed, int64_t num_pages)
      : bits_(listed >= 256 ? static_cast<size_t>((num_pages + 63) / 64) : 0, 0) {}
  // True the first time `page` is offered.
  bool Insert(uint64_t page) {
    if (bits_.empty()) return set_.insert(page).second;
    uint64_t& word = bits_[page / 64];
    const uint64_t bit = uint64_t{1} << (page % 64);
    const bool fresh = (word & bit) == 0;
    word |= bit;
    return fresh;
  }

 private:
  std::vector<uint64_t> bits_;
  absl::flat_hash_set<uint64_t> set_;
};

class PageTable {
 public:
  // `incarnation` (1 .. 2^24-1) is unique among the daemon's pools; it becomes the high
  // bits of every generation.
  PageTable(std::string pool_name, int64_t num_pages, int page_size, int num_layers,
            uint64_t incarnation);

  // All or nothing: POOL_FULL when fewer than `count` pages are free.
  absl::StatusOr<std::vector<PageHandle>> Allocate(int64_t count) ABSL_LOCKS_EXCLUDED(mu_);
  // Checks every handle first (stale or repeated: none is freed). Bumps each generation
  // and forgets the page's records. Returns the pages to zero now; pages still pinned are
  // returned by the Unpin that releases them.
  absl::StatusOr<std::vector<int64_t>> Free(std::span<const PageHandle> pages)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Pages the caller zeroed (from Free or Unpin) go back to the free list; the next
  // allocation takes them in the order listed.
  void Reclaimed(std::span<const int64_t> pages) ABSL_LOCKS_EXCLUDED(mu_);
  // Pages whose zeroing failed: kept out of the free list until TakeUnzeroed hands them to
  // a caller that tries again.
  void ZeroingFailed(std::span<const int64_t> pages) ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<int64_t> TakeUnzeroed() ABSL_LOCKS_EXCLUDED(mu_);

  // A set of pinned pages; `pages` unique, `generations` as checked.
  struct Pin {
    std::vector<int64_t> pages;
    std::vector<uint64_t> generations;
    bool exclusive = false;
    int layer = -1;  // exclusive: the one layer written, or -1 for every layer
    // PinLayer: per pinned page, whether the layer held a record in any of its slots when
    // pinned (1) or none (0), as PagesWithRecords says.
    std::vector<uint8_t> held;
    uint64_t frees = 0;  // the table's count of frees when pinned
  };
  // Checks the handles (and that the pool is not deleted) and pins their pages. Repeats
  // are allowed and pinned once. Exclusive pins wait for other writers of the same pages,
  // for at most `max_wait` (then ABORTED, PAGES_BUSY): a writer holds its pages for a commit
  // (milliseconds), a transfer received in place for as long as UCX may still write them.
  static constexpr absl::Duration kWriterWait = absl::Seconds(30);
  absl::StatusOr<Pin> PinPages(std::span<const PageHandle> pages, bool exclusive,
                               absl::Duration max_wait = kWriterWait) ABSL_LOCKS_EXCLUDED(mu_);
  // An exclusive pin of one layer of the pages (`layer` in [0, layers)): it waits only for
  // writers of that layer and writers of every layer. Fills the pin's `held`.
  absl::StatusOr<Pin> PinLayer(std::span<const PageHandle> pages, int layer,
                               absl::Duration max_wait = kWriterWait) ABSL_LOCKS_EXCLUDED(mu_);
  // Releases a pin. With `written_layer` >= 0, first records `written_tokens` of that layer
  // as written — only for pages whose generation is still the pinned one. Returns pages
  // whose reclaim waited for this pin: the caller zeroes them and calls Reclaimed.
  std::vector<int64_t> Unpin(const Pin& pin, int written_layer = -1,
                             std::span<const int64_t> written_tokens = {})
      ABSL_LOCKS_EXCLUDED(mu_);
  // Same, marking every slot of the listed (layer, page) pairs written.
  std::vector<int64_t> UnpinWrittenPages(const Pin& pin, std::span<const int> layers,
                                         std::span<const int64_t> pages)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Same for a layer's pin (PinLayer): every slot of the listed pages in the pin's layer.
  std::vector<int64_t> UnpinLayerPages(const Pin& pin, std::span<const int64_t> pages)
      ABSL_LOCKS_EXCLUDED(mu_);

  // FAILED_PRECONDITION / INVALID_ARGUMENT unless the handle names an allocated page of its
  // generation in this incarnation.
  absl::Status CheckHandle(const PageHandle& handle) const ABSL_LOCKS_EXCLUDED(mu_);
  // The same for every handle, under one lock: the first failure, in list order.
  absl::Status CheckHandles(std::span<const PageHandle> handles) const ABSL_LOCKS_EXCLUDED(mu_);
  // Token indices (page * page_size + slot) of the locations, every handle and slot checked.
  absl::StatusOr<std::vector<int64_t>> Resolve(std::span<const TokenLocation> locations) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // For each token of the listed pages (in order, page_size each), whether `layer` holds a
  // record there: the indices i * page_size + slot that do.
  std::vector<int64_t> WrittenSlots(int layer, std::span<const int64_t> pages) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // For each listed page, whether `layer` holds a record in any of its slots (1) or none (0).
  std::vector<uint8_t> PagesWithRecords(int layer, std::span<const int64_t> pages) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // After this, every PinPages fails with ABORTED (POOL_DELETED).
  void MarkDeleted() ABSL_LOCKS_EXCLUDED(mu_);

  struct Counts {
    int64_t pages_used = 0, pages_free = 0, tokens_held = 0, records_held = 0;
  };
  Counts counts() const ABSL_LOCKS_EXCLUDED(mu_);

  uint64_t incarnation() const { return incarnation_; }

 private:
  enum class State : uint8_t { kFree, kAllocated, kReclaiming };
  struct Page {
    uint64_t generation = 0;
    State state = State::kFree;
    bool writer = false;  // a writer of every layer holds the page
  };

  absl::Status CheckHandleLocked(const PageHandle& handle) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void MarkWritten(int layer, int64_t token) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every slot of `page` in `layer`, a 64-bit word of occupancy bits at a time.
  void MarkPageWritten(int layer, int64_t page) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ForgetRecords(int64_t page) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sets the held bits of tokens [begin, end), counting the newly held.
  void MarkHeld(int64_t begin, int64_t end) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Pin> PinList(std::span<const PageHandle> pages, bool exclusive, int layer,
                              absl::Duration max_wait) ABSL_LOCKS_EXCLUDED(mu_);
  bool HoldsRecords(int layer, int64_t page) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Whether a writer of `layer` (-1: every layer) would meet another writer on page `p`.
  bool WriterHolds(int64_t p, int layer) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Drops the pin of one page; true when the page now waits only for zeroing.
  bool Release(int64_t page, const Pin& pin) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether a writer of some one layer holds page `p`.
  bool AnyLayerWriter(int64_t p) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // No reader or writer of any kind holds page `p`.
  bool Unused(int64_t p) const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return readers_[p] == 0 && !pages_[p].writer && !AnyLayerWriter(p);
  }
  int64_t Bit(int layer, int64_t token) const { return layer * num_tokens_ + token; }
  // Page `p` is allocated at `generation` (a handle of it is current).
  bool Current(int64_t p, uint64_t generation) const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return pages_[p].state == State::kAllocated && pages_[p].generation == generation;
  }
  // Whether a writer of `layer` holds page `p`, and taking or letting go of that hold (the
  // caller keeps layer_writer_bits_).
  bool LayerWriter(int layer, int64_t p) const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    const int64_t bit = layer * num_pages_ + p;
    return (layer_writer_[bit / 64] >> (bit % 64)) & 1;
  }
  void SetLayerWriter(int layer, int64_t p, bool held) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int64_t bit = layer * num_pages_ + p;
    const uint64_t mask = uint64_t{1} << (bit % 64);
    layer_writer_[bit / 64] = held ? layer_writer_[bit / 64] | mask : layer_writer_[bit / 64] & ~mask;
  }

  const std::string pool_name_;
  const int64_t num_pages_;
  const int page_size_;
  const int num_layers_;
  const int64_t num_tokens_;
  const uint64_t incarnation_;

  mutable kvferry::Mutex mu_;
  // Kept apart from the pins, so that pins and their releases (thousands of pages a call,
  // from several threads) touch as few cache lines as they can.
  std::vector<Page> pages_ ABSL_GUARDED_BY(mu_);
  std::vector<int32_t> readers_ ABSL_GUARDED_BY(mu_);  // per page
  // Counts the frees: a pin taken when it read the same saw none of its pages freed since.
  uint64_t frees_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<int64_t> free_list_ ABSL_GUARDED_BY(mu_);
  int64_t reclaiming_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<int64_t> unzeroed_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> written_ ABSL_GUARDED_BY(mu_);      // bits [layer][token]
  std::vector<uint64_t> layer_writer_ ABSL_GUARDED_BY(mu_);  // bits [layer][page]: pinned by a writer of that layer
  int64_t layer_writer_bits_ ABSL_GUARDED_BY(mu_) = 0;       // set in layer_writer_
  // bits [token]: some layer holds a record there (the OR of the token's bits in written_)
  std::vector<uint64_t> held_ ABSL_GUARDED_BY(mu_);
  int64_t tokens_held_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t records_held_ ABSL_GUARDED_BY(mu_) = 0;
  bool deleted_ ABSL_GUARDED_BY(mu_) = false;
};

// The generation a page starts at in a pool incarnation, and the number of bits the
// per-page count takes below the incarnation.
inline constexpr int kGenerationCountBits = 40;
inline constexpr uint64_t kMaxIncarnation = (uint64_t{1} << 24) - 1;

}  // namespace kvferry::server
