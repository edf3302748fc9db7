// A write staged whole before it touches the pool: bf16 rows or raw page bytes, in one
// staging arena per write. Rows for a pool in device memory are staged as they are and
// quantized on the device at commit; rows for a pool in host memory (cpu) are quantized
// into staged records as each message arrives (split across the backend's workers), and
// the commit only moves those records to their locations. Page bytes are copied on commit.
//
// Add() validates each piece as it arrives (shapes, handles, slots, repeats, NaN/Inf,
// limits) and appends it to the arena. Commit() checks the handles again, copies the arena
// to the device and stores everything with one device op: a failure at any step before
// that op leaves the pool as it was, and the op itself either runs or not. Dropping an
// uncommitted write releases its staging and changes nothing. Not thread-safe (one stream
// feeds one write); any number of writes may be in flight on a pool.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "backend/backend.h"
#include "core/pool.h"

namespace kvferry::server {

// The one set of limits of every staged write.
struct WriteLimits {
  int64_t max_tokens = int64_t{1} << 20;  // rows one write may stage
  int64_t max_bytes = int64_t{1} << 30;   // bytes (rows, or page bytes) one write may stage
};

// Host staging that grows in fixed chunks of the backend's staging memory; one logical
// byte stream. Its bytes are charged to `owner` (may be null) while the arena lives.
class StagingArena {
 public:
  static constexpr int64_t kChunkBytes = int64_t{4} << 20;  // a multiple of a bf16 row
  // `kind`: kHostStaging, or kDevice for bytes that arrive by a transport that writes device
  // memory (then only Reserve, At, Pieces and CopyOps apply).
  explicit StagingArena(Backend* backend, TenantAccount* owner = nullptr,
                        int64_t chunk_bytes = kChunkBytes,
                        MemoryKind kind = MemoryKind::kHostStaging)
      : backend_(backend), owner_(owner), chunk_bytes_(chunk_bytes), kind_(kind) {}
  StagingArena(const StagingArena&) = delete;
  StagingArena& operator=(const StagingArena&) = delete;
  ~StagingArena();
  // Reserves `bytes` at the end of the stream; returns their offset. QUOTA_EXCEEDED when
  // the owner may not stage that many more bytes.
  absl::StatusOr<int64_t> Reserve(int64_t bytes);
  // Copies data into reserved bytes at `offset`. With `check_finite` (data being bf16
  // values), says in the same pass over the bytes whether every value is finite; else true.
  bool Write(int64_t offset, std::span<const uint8_t> data, bool check_finite = false);
  // Gives back the reserved bytes from `size` on (their charge too); the chunks stay.
  void Truncate(int64_t size);
  // Host pointer of a reserved offset, valid for the bytes up to the end of its chunk.
  uint8_t* At(int64_t offset) const;
  int64_t size() const { return size_; }
  // The pieces (each within one chunk) of bytes [offset, offset + bytes).
  std::vector<std::span<uint8_t>> Pieces(int64_t offset, int64_t bytes) const;
  // The chunk a reserved offset lies in.
  MemoryBlock Block(int64_t offset) const { return chunks_[offset / chunk_bytes_].block(); }
  // Copy ops that move the whole stream to `device` (size() bytes).
  void CopyOps(uint8_t* device, std::vector<Op>& ops) const;
  MemoryKind kind() const { return kind_; }
  int64_t chunk_bytes() const { return chunk_bytes_; }

 private:
  Backend* const backend_;
  TenantAccount* const owner_;
  const int64_t chunk_bytes_;
  const MemoryKind kind_;
  std::vector<Buffer> chunks_;
  int64_t size_ = 0;
};

class StagedWrite {
 public:
  // A write of bf16 rows into `layer` (checked here).
  static absl::StatusOr<std::unique_ptr<StagedWrite>> ForRows(std::shared_ptr<Pool> pool,
                                                              int64_t layer, WriteLimits limits);
  // A write of page bytes, which the caller says are in `layout` (must be the pool's).
  // Staging grows in pieces of `staging_chunk_bytes` (a receiver of messages of that size,
  // a multiple of the page bytes, gets each message in one contiguous piece).
  // `device_staging`: on a pool in device memory (not cpu), the staging is device memory of
  // the pool's device, for bytes that arrive by a transport that writes device memory
  // (ReservePages only; AddPageBytes is refused); the commit scatters from it in place.
  static absl::StatusOr<std::unique_ptr<StagedWrite>> ForPages(
      std::shared_ptr<Pool> pool, Layout layout, WriteLimits limits,
      int64_t staging_chunk_bytes = StagingArena::kChunkBytes, bool device_staging = false);

  // Rows write: one message's locations and rows ([n, 512] bf16 as little-endian bytes).
  absl::Status AddRows(std::span<const TokenLocation> locations, std::span<const uint8_t> rows);
  // Pages write: bytes of one (page, layer) at `offset`; each (page, layer) arrives in
  // order, possibly over several messages, and must be complete at commit.
  absl::Status AddPageBytes(const PageHandle& page, int64_t layer, uint64_t offset,
                            std::span<const uint8_t> data);

  // Pages write whose bytes arrive by other means (another daemon, over UCX): reserves,
  // for each page in order, for each layer in order, one page of staging, with the checks of
  // AddPageBytes (handles, layers, limits) and no (page, layer) twice (DUPLICATE_PAGE).
  // StagingPieces() then says where a range of that byte stream lies, and MarkReceived()
  // that every byte is there.
  //
  // With `in_place`, on a host memory pool (cpu) whose listed (page, layer) pairs hold no
  // record yet, there is no staging: the bytes land in the pool itself. So too on a pool in
  // device memory staged on the device (ForPages with `device_staging`: UCX moves its
  // memory) where each message of `in_place_message_bytes` (a whole number of pages) lands
  // in one run of the pool — consecutive pages of one layer, as a fresh pool's allocations
  // of one layer are — since UCX takes device memory into one contiguous buffer per
  // message. The pages are then
  // pinned for writing from here until the write ends (another write of them waits), a
  // commit only checks the handles again and marks the pages written, and a write dropped
  // uncommitted zeroes those pairs again before it unpins them, so the pool ends as it
  // was. A reader of those pages meanwhile (reads never wait for writes) may see part of
  // the bytes. Otherwise, or when any pair holds a record, the bytes are staged as above.
  absl::Status ReservePages(std::span<const PageHandle> pages, std::span<const int64_t> layers,
                            bool in_place = false, int64_t in_place_message_bytes = 0);
  // Whether ReservePages chose to receive in place (false again once committed).
  bool in_place() const { return in_place_pin_.has_value(); }
  // Pages write staged in host memory for a pool in device memory (after ReservePages): the
  // staged bytes are to go to the device as they arrive (MirrorToDevice), into device memory
  // reserved here, and the commit scatters from there, so that the copy to the device
  // overlaps the rest of the transfer instead of following it. False (nothing reserved) for
  // any other write.
  absl::StatusOr<bool> PrepareDeviceMirror();
  // Starts copying stream bytes [offset, offset + bytes), which have all arrived, to the
  // device (PrepareDeviceMirror said true). Each range once; the commit waits for the copies
  // and refuses a stream not wholly copied.
  absl::Status MirrorToDevice(int64_t offset, int64_t bytes);
  bool mirrored() const { return mirror_.get() != nullptr; }
  // The pieces of staging (or, in place, of the pool) in order that hold stream bytes
  // [offset, offset + bytes); adjacent pieces are merged.
  std::vector<std::span<uint8_t>> StagingPieces(int64_t offset, int64_t bytes) const;
  // The allocation the byte at `offset` of that stream lies in: its staging chunk, or the
  // pool's memory when receiving in place.
  MemoryBlock StagingBlock(int64_t offset) const;
  void MarkReceived();

  // Stores everything: the number of rows (rows write) or (page, layer) pairs stored.
  absl::StatusOr<int64_t> Commit();

  Pool& pool() { return *pool_; }
  // The bytes staged, as charged to the pool's owner: rows or page bytes as they arrived,
  // or, on a host memory pool, the records the rows were quantized to (bytes_per_token
  // each).
  int64_t staged_bytes() const { return records_ ? records_charged_ : arena_.size(); }
  // Rows write: the rows staged so far.
  int64_t staged_rows() const { return static_cast<int64_t>(tokens_.size()); }
  // Whether the staging is device memory (ForPages with `device_staging` on a GPU pool).
  bool device_staging() const { return arena_.kind() == MemoryKind::kDevice; }

  // An uncommitted write in place zeroes what it may have written, then unpins.
  ~StagedWrite();
  StagedWrite(const StagedWrite&) = delete;
  StagedWrite& operator=(const StagedWrite&) = delete;

 private:
  StagedWrite(std::shared_ptr<Pool> pool, bool rows, int layer, WriteLimits limits,
              int64_t staging_chunk_bytes = StagingArena::kChunkBytes,
              MemoryKind staging_kind = MemoryKind::kHostStaging)
      : pool_(std::move(pool)), rows_(rows), layer_(layer), limits_(limits),
        records_(rows && pool_->backend().host_memory()),
        // Staged records are charged per record (records_charged_), not per staging page.
        arena_(&pool_->backend(), records_ ? nullptr : pool_->owner().get(), staging_chunk_bytes,
               staging_kind) {}
  absl::Status CheckGeneration(const PageHandle& page);
  absl::Status CountMessage(bool empty);
  // Device staging holding the arena, then `indices` at *indices_at; copied before any
  // page is pinned.
  absl::StatusOr<Buffer> StageOnDevice(std::span<const int64_t> indices, int64_t* indices_at);
  absl::StatusOr<int64_t> CommitRows();
  // Rows write on a host memory pool: each chunk of the arena is a small pool of the
  // target's layout (pages of kRecordPageSize tokens, or fewer when the pool's pages are
  // smaller), staged token i at token i % tokens of chunk i / tokens.
  static constexpr int kRecordPageSize = 16;  // little padding, little waste for one token
  static PoolGeometry RecordGeometry(const PoolGeometry& pool, int64_t chunk_bytes) {
    const int page_size = std::min(pool.page_size, kRecordPageSize);
    return PoolGeometry{pool.layout, page_size, chunk_bytes / PageBytes(pool.layout, page_size)};
  }
  PoolGeometry RecordChunk() const {
    return RecordGeometry(pool_->geometry(), arena_.chunk_bytes());
  }
  absl::Status StageRecords(int64_t first, std::span<const uint8_t> rows);
  absl::StatusOr<int64_t> CommitPages();
  absl::StatusOr<int64_t> CommitInPlace();
  // Whether every run of `message_bytes` of the reserved stream is one run of the pool.
  bool MessagesLandInOneRun(int64_t message_bytes) const;
  // The staged (page, layer) pairs in order, as the page table and the page ops take them.
  struct PageColumns {
    std::vector<PageHandle> handles;
    std::vector<int64_t> page_ids;
    std::vector<int> layers;
    std::vector<int64_t> flat_ids;  // layer * num_pages + page: the pool as flat pages
  };
  PageColumns Columns() const;
  int64_t FlatId(int layer, uint64_t page_id) const {
    return layer * pool_->config().num_pages + static_cast<int64_t>(page_id);
  }
  // The runs of staged page bytes, in page order, when the pool's backend scatters from the
  // arena where it is (a host memory pool, or staging in device memory) and every page lies
  // within one chunk of the arena; else none.
  std::vector<std::span<uint8_t>> DirectPieces() const;

  const std::shared_ptr<Pool> pool_;
  const bool rows_;
  const int layer_;
  const WriteLimits limits_;
  const bool records_;  // rows staged as records (see RecordChunk)
  StagingArena arena_;
  int64_t records_charged_ = 0;  // records_: bytes charged to the pool's owner
  int64_t messages_ = 0;
  // Every page named, at the generation named: a page named at two generations (freed and
  // allocated again in between) fails the whole write.
  absl::flat_hash_map<uint64_t, uint64_t> generations_;

  // Rows write.
  absl::flat_hash_set<int64_t> seen_tokens_;
  std::vector<int64_t> tokens_;  // per staged row, in arena order

  // Pages write.
  struct StagedPage {
    PageHandle handle;
    int layer;
    int64_t offset;  // in the arena
    uint64_t received = 0;
  };
  std::vector<StagedPage> pages_;
  absl::flat_hash_map<std::pair<uint64_t, int>, size_t> page_index_;
  // In place: the pages' pin, held until the commit or the end of the write.
  std::optional<PageTable::Pin> in_place_pin_;
  // In place on a device: room for the page ids the rollback zeroes (see ReservePages).
  Buffer rollback_ids_;

  // Device mirror (PrepareDeviceMirror): [page bytes | flat page ids at mirror_ids_at_], the
  // bytes copied so far, and the copies not yet waited for. Declared after the arena and the
  // mirror: the copies are waited for (their destructors) before either is freed.
  Buffer mirror_;
  int64_t mirror_ids_at_ = 0;
  int64_t mirrored_bytes_ = 0;
  std::vector<Completion> mirror_copies_;
  absl::Status WaitMirrorCopies(bool all);
};

}  // namespace kvferry::server
