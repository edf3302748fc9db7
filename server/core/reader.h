// Readers of a pool: raw (or transcoded) pages, and dequantized workspaces, produced as a
// sequence of batches of at most about `batch_bytes` each.
//
// A reader validates its whole request when it is made (handles, slots, layers), so a bad
// request fails before any byte is produced. It then keeps one batch in flight on the
// device while the caller consumes the previous one (two host staging slots), so device
// work overlaps whatever the caller does with the bytes. Its memory is bounded by the batch
// size (plus one page), never by the request. Each batch pins its pages while the device
// reads them and checks their handles again: a page freed meanwhile fails the read
// (FAILED_PRECONDITION) rather than returning another owner's bytes. Not thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "backend/backend.h"
#include "core/pool.h"

namespace kvferry::server {

class Reader {
 public:
  virtual ~Reader();
  // The next batch, or an empty span once every byte was produced. A batch stays valid until
  // depth() - 1 more calls (the next call, at the default depth of 2) or the reader's end.
  // After an error the reader is done.
  absl::StatusOr<std::span<const uint8_t>> Next();
  // Launches the first batch now, so that it is under way while the caller waits for
  // something else (the first Next() then only waits for it). A later set_depth or
  // set_device_output that changes them drops that batch (the first Next() launches it
  // again). After an error the reader is done.
  absl::Status Prefetch();
  // Batches in memory at once (each call to Next launches the batch after the one it
  // returns): a caller that keeps sending earlier batches while later ones are gathered
  // asks for more. At least 2; only before the first Next().
  void set_depth(int depth);
  int depth() const { return static_cast<int>(slots_.size()); }
  // Finishes the batch in flight and releases its pages; Next() fails from then on. The
  // batches' memory lives until the reader is destroyed.
  void Stop();
  // Stops the reader and hands over the batches' memory, for what may still read the batches
  // after the reader is gone (a transport's messages in flight): it lives as long as the
  // returned owner.
  std::shared_ptr<void> TakeMemory();
  // Bytes of the whole output.
  int64_t total_bytes() const { return total_bytes_; }
  // Whether the batches are left in the device memory of the pool's backend rather than
  // copied to host memory: a page reader of a pool in device memory (not cpu) may, for a
  // transport that reads device memory. Only before the first Next().
  void set_device_output(bool on);
  bool device_output() const { return device_output_; }
  // The allocation the batch Next() returned last lies in (a slot, reused by later batches).
  MemoryBlock last_block() const;

 protected:
  struct Slot {
    Buffer host;     // output bytes of one batch, then (page reads) ids and slots
    Buffer device;   // scratch of one batch
    const uint8_t* out = nullptr;  // where the batch's output is (null: host)
    std::optional<PageTable::Pin> pin;
    Completion done;
    int64_t bytes = 0;
    bool busy = false;
    double started = 0;  // seconds, steady clock, for the op timing
    // op_name() of the batch, taken at launch: ~Reader finishes busy slots after the
    // derived reader is gone, when op_name() can no longer be called.
    const char* op = "";
  };
  Reader(std::shared_ptr<Pool> pool, int64_t num_batches, int64_t total_bytes)
      : pool_(std::move(pool)), num_batches_(num_batches), total_bytes_(total_bytes) {}
  // Pins batch `index`'s pages and submits its device work into `slot` (through Submit).
  virtual absl::Status Launch(int64_t index, Slot& slot) = 0;
  // Submits a batch's `ops` under `pin`: on success the slot owns the pin and the
  // completion of `bytes` of output; on failure the pin is released.
  absl::Status Submit(Slot& slot, std::span<const Op> ops, PageTable::Pin pin, int64_t bytes);
  virtual const char* op_name() const = 0;

  const std::shared_ptr<Pool> pool_;
  bool can_output_on_device_ = false;  // set by a reader that can
  bool device_output_ = false;

 private:
  absl::Status Start(int64_t index);
  absl::Status Finish(Slot& slot);
  // Ends a first batch launched before any Next() (Prefetch), so that it launches again.
  void DropPrefetched();

  const int64_t num_batches_;
  const int64_t total_bytes_;
  std::vector<Slot> slots_ = std::vector<Slot>(2);
  int64_t next_ = 0;  // batches returned so far
  bool failed_ = false;
};

// Pages in request order, for each page each listed layer in order (all layers when
// `layers` is empty), as stored or, with `transcode_to`, every written slot transcoded to
// that layout and every other byte zero. Repeated layers are INVALID_ARGUMENT
// (DUPLICATE_LAYER); repeated pages are allowed. A pool in device memory (not cpu) may
// leave its batches there (set_device_output).
absl::StatusOr<std::unique_ptr<Reader>> ReadPages(std::shared_ptr<Pool> pool,
                                                  std::span<const PageHandle> pages,
                                                  std::span<const int64_t> layers,
                                                  std::optional<Layout> transcode_to,
                                                  int64_t batch_bytes);

// Dequantized bf16 rows [n, 512] of one layer for the locations, in order (repeats allowed).
absl::StatusOr<std::unique_ptr<Reader>> ReadWorkspace(std::shared_ptr<Pool> pool, int64_t layer,
                                                      std::span<const TokenLocation> locations,
                                                      int64_t batch_bytes);

// Output bytes of one page of `pool` read as `layout`.
int64_t OutputPageBytes(const Pool& pool, std::optional<Layout> layout);

}  // namespace kvferry::server
