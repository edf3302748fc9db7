// A KV pool: one device allocation of num_layers x num_pages pages in one layout, its page
// allocator with generation-checked handles, staged writes, chunked reads and accounting.
//
// Thread-safe. Writers (allocate, free, commit) take the pool's lock exclusively; reads
// hold it shared only while their current batch is on the device, never while a caller's
// sink sends it on. No gRPC in here: errors are absl::Status with messages for the user.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "backend/backend.h"
#include "kvferry/kernels/format.h"

namespace kvferry::server {

struct PageHandle {
  uint64_t page_id = 0;
  uint64_t generation = 0;
};

struct TokenLocation {
  PageHandle page;
  uint32_t slot = 0;
};

struct PoolConfig {
  std::string name;
  Layout layout = Layout::kV4;
  int page_size = 64;      // tokens per page
  int64_t num_pages = 0;
  int num_layers = 1;
};

struct PoolStats {
  std::string name;
  std::string device;
  Layout layout = Layout::kV4;
  int page_size = 0;
  int64_t num_pages = 0;
  int num_layers = 0;
  int64_t page_bytes = 0;     // one page of one layer
  int64_t pool_bytes = 0;
  int64_t pages_used = 0;
  int64_t tokens_held = 0;    // slots of allocated pages written in at least one layer
  int64_t records_held = 0;   // (slot, layer) records written
  Savings savings;            // bytes/token and the fractions saved (format.h)
  double bytes_saved_vs_bf16 = 0;  // records_held * (1024 - effective bytes/token)
  double bytes_saved_vs_v4 = 0;    // records_held * (V4 effective - effective bytes/token)
};

// Receives the wall time of each device op (metrics); may be null.
class OpObserver {
 public:
  virtual ~OpObserver() = default;
  virtual void RecordOp(const char* op, Layout layout, double seconds) = 0;
};

class Pool {
 public:
  // Allocates the pool, zero-filled. RESOURCE_EXHAUSTED when the device lacks the memory.
  static absl::StatusOr<std::shared_ptr<Pool>> Create(const PoolConfig& config,
                                                      std::shared_ptr<Backend> backend,
                                                      OpObserver* observer);

  const PoolConfig& config() const { return config_; }
  const std::string& device() const { return backend_->device(); }
  // The geometry of one layer.
  PoolGeometry geometry() const {
    return PoolGeometry{config_.layout, config_.page_size, config_.num_pages};
  }
  PoolStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);

  // All or nothing: RESOURCE_EXHAUSTED when fewer than `count` pages are free.
  absl::StatusOr<std::vector<PageHandle>> AllocatePages(int64_t count) ABSL_LOCKS_EXCLUDED(mu_);
  // Checks every handle first; on any stale or repeated handle frees none.
  absl::Status FreePages(std::span<const PageHandle> pages) ABSL_LOCKS_EXCLUDED(mu_);

  // A write of bf16 rows into one layer, staged on the device message by message and
  // stored by Commit(). Dropping it uncommitted releases the staging and changes nothing.
  class TokenWrite {
   public:
    // Validates one message (lengths, handles, slots, repeats across the whole write,
    // NaN/Inf) and stages it. After an error the write must be dropped.
    absl::Status Add(std::span<const TokenLocation> locations, std::span<const uint8_t> rows);
    // Re-checks the handles under the pool's lock and quantizes every staged row.
    absl::StatusOr<int64_t> Commit();
    int64_t tokens() const { return tokens_; }

   private:
    friend class Pool;
    TokenWrite(std::shared_ptr<Pool> pool, int layer, int64_t max_tokens)
        : pool_(std::move(pool)), layer_(layer), max_tokens_(max_tokens) {}
    struct Chunk {
      DeviceMemory rows;  // [n, 512] bf16
      DeviceMemory locs;  // [n] int64 token indices of the layer
      std::vector<int64_t> host_locs;
      int64_t n = 0;
    };
    std::shared_ptr<Pool> pool_;
    int layer_;
    int64_t max_tokens_;
    absl::flat_hash_map<uint64_t, uint64_t> generations_;  // page id → generation used
    absl::flat_hash_set<int64_t> seen_;
    std::vector<Chunk> chunks_;
    int64_t tokens_ = 0;
  };
  absl::StatusOr<std::unique_ptr<TokenWrite>> BeginTokenWrite(int layer, int64_t max_tokens);

  // A write of raw page bytes (already in the pool's layout), staged the same way. Each
  // (page, layer) arrives in order, possibly over several messages, and must be complete.
  class PageWrite {
   public:
    absl::Status Add(const PageHandle& page, int layer, uint64_t offset,
                     std::span<const uint8_t> data);
    absl::StatusOr<int64_t> Commit();

   private:
    friend class Pool;
    PageWrite(std::shared_ptr<Pool> pool, int64_t max_bytes)
        : pool_(std::move(pool)), max_bytes_(max_bytes) {}
    struct Staged {
      PageHandle handle;
      int layer;
      DeviceMemory bytes;
      uint64_t received = 0;
    };
    std::shared_ptr<Pool> pool_;
    int64_t max_bytes_;
    std::vector<Staged> pages_;
    absl::flat_hash_map<std::pair<uint64_t, int>, size_t> index_;
    int64_t staged_bytes_ = 0;
  };
  absl::StatusOr<std::unique_ptr<PageWrite>> BeginPageWrite(int64_t max_bytes);

  // Streams the pages (for each page, each listed layer; all layers when `layers` is
  // empty) to `sink` in pieces of at most chunk_bytes: the stored bytes, or with
  // `transcode_to`, every written slot transcoded to that layout (others zero).
  using Sink = std::function<absl::Status(std::string& bytes)>;
  absl::Status ReadPages(std::span<const PageHandle> pages, std::span<const int> layers,
                         std::optional<Layout> transcode_to, int64_t chunk_bytes,
                         const Sink& sink);

  // Streams dequantized rows of one layer for the locations, chunk_rows rows per piece.
  absl::Status ReadWorkspace(int layer, std::span<const TokenLocation> locations,
                             int64_t chunk_rows, const Sink& sink);

 private:
  Pool(const PoolConfig& config, std::shared_ptr<Backend> backend, OpObserver* observer,
       DeviceMemory memory);

  int64_t layer_bytes() const { return config_.num_pages * geometry().page_bytes(); }
  uint8_t* layer_base(int layer) const { return memory_.get() + layer * layer_bytes(); }
  // FAILED_PRECONDITION unless the handle names an allocated page of its generation.
  absl::Status CheckHandle(const PageHandle& handle) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::Status CheckLayer(int layer) const;
  // Token indices of the locations (handles and slots checked).
  absl::StatusOr<std::vector<int64_t>> Resolve(std::span<const TokenLocation> locations) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Index of (layer, token) in written_.
  int64_t WrittenBit(int layer, int64_t token) const {
    return layer * geometry().num_tokens() + token;
  }
  void MarkWritten(int layer, int64_t token) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool IsWritten(int layer, int64_t token) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Runs a backend op, reporting its duration.
  absl::Status Timed(const char* op, Layout layout, const std::function<absl::Status()>& run) const;

  const PoolConfig config_;
  const std::shared_ptr<Backend> backend_;
  OpObserver* const observer_;
  DeviceMemory memory_;  // [num_layers][num_pages][page_bytes]

  mutable absl::Mutex mu_;
  std::vector<uint64_t> generation_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> allocated_ ABSL_GUARDED_BY(mu_);
  std::vector<int64_t> free_list_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> written_ ABSL_GUARDED_BY(mu_);       // bits [layer][token]
  std::vector<uint16_t> slot_layers_ ABSL_GUARDED_BY(mu_);   // layers written per token
  int64_t tokens_held_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t records_held_ ABSL_GUARDED_BY(mu_) = 0;

  std::weak_ptr<Pool> self_;
};

}  // namespace kvferry::server
