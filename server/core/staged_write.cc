// StagedWrite: validation as pieces arrive, one arena, one device op at commit.
#include "core/staged_write.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/errors.h"
#include "common/log.h"
#include "kvferry/kernels/cpu_ops.h"
#include "kvferry/kernels/status_macros.h"
#include "kvferry/kernels/validate.h"

namespace kvferry::server {
namespace {

int64_t AlignUp(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

}  // namespace

// ---- arena ---------------------------------------------------------------------------------

StagingArena::~StagingArena() {
  if (owner_ != nullptr) owner_->Refund(Resource::kStagedWriteBytes, size_);
}

absl::StatusOr<int64_t> StagingArena::Reserve(int64_t bytes) {
  const int64_t offset = size_;
  if (owner_ != nullptr) KVF_RETURN_IF_ERROR(owner_->Charge(Resource::kStagedWriteBytes, bytes));
  while (static_cast<int64_t>(chunks_.size()) * chunk_bytes_ < size_ + bytes) {
    absl::StatusOr<Buffer> chunk = backend_->Allocate(chunk_bytes_, kind_, false);
    if (!chunk.ok()) {
      if (owner_ != nullptr) owner_->Refund(Resource::kStagedWriteBytes, bytes);
      return chunk.status();
    }
    chunks_.push_back(std::move(*chunk));
  }
  size_ += bytes;
  return offset;
}

bool StagingArena::Write(int64_t offset, std::span<const uint8_t> data, bool check_finite) {
  bool finite = true;
  size_t done = 0;
  while (done < data.size()) {
    const int64_t at = offset + static_cast<int64_t>(done);
    const int64_t in_chunk = std::min<int64_t>(chunk_bytes_ - at % chunk_bytes_,
                                               static_cast<int64_t>(data.size() - done));
    if (check_finite) {
      // Chunks and offsets are even: every piece holds whole bf16 values.
      finite &= cpu::CopyFiniteBf16(data.subspan(done, in_chunk), At(at));
    } else {
      std::memcpy(At(at), data.data() + done, in_chunk);
    }
    done += in_chunk;
  }
  return finite;
}

void StagingArena::Truncate(int64_t size) {
  if (size >= size_) return;
  if (owner_ != nullptr) owner_->Refund(Resource::kStagedWriteBytes, size_ - size);
  size_ = size;
}

uint8_t* StagingArena::At(int64_t offset) const {
  return chunks_[offset / chunk_bytes_].get() + offset % chunk_bytes_;
}

std::vector<std::span<uint8_t>> StagingArena::Pieces(int64_t offset, int64_t bytes) const {
  std::vector<std::span<uint8_t>> pieces;
  for (int64_t at = offset; at < offset + bytes;) {
    const int64_t n = std::min(chunk_bytes_ - at % chunk_bytes_, offset + bytes - at);
    pieces.emplace_back(At(at), static_cast<size_t>(n));
    at += n;
  }
  return pieces;
}

void StagingArena::CopyOps(uint8_t* device, std::vector<Op>& ops) const {
  for (int64_t at = 0; at < size_; at += chunk_bytes_) {
    ops.push_back(CopyOp{device + at, At(at), static_cast<size_t>(std::min(chunk_bytes_, size_ - at))});
  }
}

// ---- write ---------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<StagedWrite>> StagedWrite::ForRows(std::shared_ptr<Pool> pool,
                                                                  int64_t layer,
                                                                  WriteLimits limits) {
  KVF_RETURN_IF_ERROR(pool->CheckLayer(layer));
  // On a host memory pool the arena holds records, in chunks of whole pages (RecordChunk).
  const int64_t page_bytes = RecordGeometry(pool->geometry(), 0).page_bytes();
  const int64_t chunk = pool->backend().host_memory()
                            ? std::max<int64_t>(1, StagingArena::kChunkBytes / page_bytes) * page_bytes
                            : StagingArena::kChunkBytes;
  return std::unique_ptr<StagedWrite>(
      new StagedWrite(std::move(pool), /*rows=*/true, static_cast<int>(layer), limits, chunk));
}

absl::StatusOr<std::unique_ptr<StagedWrite>> StagedWrite::ForPages(std::shared_ptr<Pool> pool,
                                                                   Layout layout,
                                                                   WriteLimits limits,
                                                                   int64_t staging_chunk_bytes,
                                                                   bool device_staging) {
  if (layout != pool->config().layout) {
    return Error(absl::StatusCode::kFailedPrecondition, ErrorReason::kLayoutMismatch,
                 absl::StrCat("layout mismatch: pages are ", LayoutName(layout), ", pool '",
                              pool->config().name, "' holds ", LayoutName(pool->config().layout)));
  }
  const MemoryKind kind = device_staging && !pool->backend().host_memory()
                             ? MemoryKind::kDevice
                             : MemoryKind::kHostStaging;
  // Chunks of whole pages, so that no staged page crosses two chunks: the commit then
  // scatters from the staging where it lies (DirectPieces) instead of copying all of it into
  // one more buffer first.
  const int64_t page_bytes = pool->geometry().page_bytes();
  const int64_t chunk = std::max<int64_t>(1, staging_chunk_bytes / page_bytes) * page_bytes;
  return std::unique_ptr<StagedWrite>(
      new StagedWrite(std::move(pool), /*rows=*/false, -1, limits, chunk, kind));
}

absl::Status StagedWrite::CheckGeneration(const PageHandle& page) {
  auto [it, inserted] = generations_.try_emplace(page.page_id, page.generation);
  if (!inserted && it->second != page.generation) {
    return Error(absl::StatusCode::kFailedPrecondition, ErrorReason::kHandleGenerationChanged,
                 absl::StrCat("page ", page.page_id, " is named at generations ", it->second,
                              " and ", page.generation,
                              " in one write: it was freed in between, so the write is refused"));
  }
  return absl::OkStatus();
}

absl::Status StagedWrite::CountMessage(bool empty) {
  // A first message may only name the target; every later one must carry bytes, so a
  // stream of empty messages cannot hold the write open for free.
  if (empty && messages_ > 0) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                 absl::StrCat("write message ", messages_, " carries no data"));
  }
  ++messages_;
  return absl::OkStatus();
}

absl::Status StagedWrite::AddRows(std::span<const TokenLocation> locations,
                                  std::span<const uint8_t> rows) {
  const int64_t n = static_cast<int64_t>(locations.size());
  const int64_t staged = static_cast<int64_t>(tokens_.size());
  KVF_RETURN_IF_ERROR(CountMessage(n == 0 && rows.empty()));
  if (static_cast<int64_t>(rows.size()) != n * kBf16RowBytes) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kBadRowLength,
                 absl::StrCat(n, " locations with ", rows.size(), " bytes of rows, expected ",
                              n * kBf16RowBytes, " (", kBf16RowBytes,
                              " bytes = 512 bf16 per row)"));
  }
  if (staged + n > limits_.max_tokens || (staged + n) * kBf16RowBytes > limits_.max_bytes) {
    return Error(absl::StatusCode::kResourceExhausted, ErrorReason::kWriteTooLarge,
                 absl::StrCat("write of more than ", std::min(limits_.max_tokens,
                                                              limits_.max_bytes / kBf16RowBytes),
                              " tokens; split it into several writes"));
  }
  KVF_ASSIGN_OR_RETURN(std::vector<int64_t> tokens, pool_->table().Resolve(locations));
  for (int64_t i = 0; i < n; ++i) {
    KVF_RETURN_IF_ERROR(CheckGeneration(locations[i].page));
    if (!seen_tokens_.insert(tokens[i]).second) {
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kDuplicateLocation,
                   absl::StrCat("location ", staged + i, " (page ", locations[i].page.page_id,
                                " slot ", locations[i].slot, ") is written twice in one write"));
    }
  }
  if (n == 0) return absl::OkStatus();
  if (records_) {
    KVF_RETURN_IF_ERROR(StageRecords(staged, rows));
    tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
    return absl::OkStatus();
  }
  // The rows are checked finite as they are copied into the staging, in one pass; a NaN or
  // Inf gives the message's staging back, and a message that also finds no staging gets the
  // NaN's error (as when the check came first).
  auto not_finite = [&] {
    return WithReason(ValidateFiniteBytes(rows, staged), ErrorReason::kNonFiniteValue);
  };
  absl::StatusOr<int64_t> offset = arena_.Reserve(static_cast<int64_t>(rows.size()));
  if (!offset.ok()) {
    KVF_RETURN_IF_ERROR(not_finite());
    return offset.status();
  }
  if (!arena_.Write(*offset, rows, /*check_finite=*/true)) {
    arena_.Truncate(*offset);
    KVF_RETURN_IF_ERROR(not_finite());
    return Error(absl::StatusCode::kInternal, ErrorReason::kInternalError,
                 "the staging copy found a value that is not finite where the check finds none");
  }
  tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
  return absl::OkStatus();
}

// Quantizes one message's rows, staged rows [first, first + n), into the records of the
// arena in one pass over the rows (each block checked finite, scaled and coded while in
// cache), split across the backend's workers. A NaN or Inf fails the op with records of
// earlier blocks written: staging, given back here.
absl::Status StagedWrite::StageRecords(int64_t first, std::span<const uint8_t> rows) {
  const int64_t n = static_cast<int64_t>(rows.size()) / kBf16RowBytes;
  const PoolGeometry chunk = RecordChunk();
  const int64_t page_size = chunk.page_size;
  // The arena holds whole pages of records: those of the rows staged so far.
  const int64_t pages_before = (first + page_size - 1) / page_size;
  const int64_t pages_after = (first + n + page_size - 1) / page_size;
  auto not_finite = [&] {
    return WithReason(ValidateFiniteBytes(rows, first), ErrorReason::kNonFiniteValue);
  };
  // The charge is the records' bytes, whatever the staging pages round up to.
  TenantAccount* const owner = pool_->owner().get();
  const int64_t charge = n * GetLayoutInfo(chunk.layout).bytes_per_token();
  absl::Status charged = owner != nullptr ? owner->Charge(Resource::kStagedWriteBytes, charge)
                                          : absl::OkStatus();
  const int64_t size_before = arena_.size();
  if (charged.ok() && pages_after > pages_before) {
    charged = arena_.Reserve((pages_after - pages_before) * chunk.page_bytes()).status();
    if (!charged.ok() && owner != nullptr) owner->Refund(Resource::kStagedWriteBytes, charge);
  }
  if (!charged.ok()) {
    KVF_RETURN_IF_ERROR(not_finite());  // a NaN's error first, as when rows are staged
    return charged;
  }
  // Row bytes of a message at an odd address (protobuf keeps them at the start of a heap
  // block, so never in practice) are copied to an aligned buffer first.
  std::vector<uint16_t> aligned;
  const uint16_t* from = reinterpret_cast<const uint16_t*>(rows.data());
  if (reinterpret_cast<uintptr_t>(rows.data()) % alignof(uint16_t) != 0) {
    aligned.resize(rows.size() / sizeof(uint16_t));
    std::memcpy(aligned.data(), rows.data(), rows.size());
    from = aligned.data();
  }
  const int64_t per_chunk = chunk.num_tokens();
  std::vector<int64_t> locs(static_cast<size_t>(n));
  std::vector<Op> ops;
  for (int64_t i = 0; i < n;) {
    const int64_t token = first + i;
    const int64_t in_chunk = token % per_chunk;
    const int64_t count = std::min(n - i, per_chunk - in_chunk);
    for (int64_t k = 0; k < count; ++k) locs[static_cast<size_t>(i + k)] = in_chunk + k;
    QuantizeStoreParams store;
    store.geometry = chunk;
    store.rows = from + i * kHeadDim;
    store.locs = locs.data() + i;
    store.num_tokens = count;
    store.pool = arena_.At(token / per_chunk * arena_.chunk_bytes());
    store.single_pass = true;
    ops.push_back(store);
    i += count;
  }
  if (const absl::Status stored = pool_->RunTimed("quantize_store", ops); !stored.ok()) {
    arena_.Truncate(size_before);
    if (owner != nullptr) owner->Refund(Resource::kStagedWriteBytes, charge);
    KVF_RETURN_IF_ERROR(not_finite());
    return stored;
  }
  records_charged_ += charge;
  return absl::OkStatus();
}

absl::Status StagedWrite::AddPageBytes(const PageHandle& page, int64_t layer, uint64_t offset,
                                       std::span<const uint8_t> data) {
  if (device_staging()) {
    return Error(absl::StatusCode::kInternal, ErrorReason::kInternalError,
                 "page bytes from the host cannot go into device staging");
  }
  KVF_RETURN_IF_ERROR(CountMessage(data.empty()));
  if (data.empty()) return absl::OkStatus();  // a first message that only names the pool
  KVF_RETURN_IF_ERROR(pool_->CheckLayer(layer));
  KVF_RETURN_IF_ERROR(pool_->table().CheckHandle(page));
  KVF_RETURN_IF_ERROR(CheckGeneration(page));
  const uint64_t page_bytes = static_cast<uint64_t>(pool_->geometry().page_bytes());
  auto [it, inserted] =
      page_index_.try_emplace(std::make_pair(page.page_id, static_cast<int>(layer)), pages_.size());
  if (inserted) {
    if (arena_.size() + static_cast<int64_t>(page_bytes) > limits_.max_bytes) {
      page_index_.erase(it);
      return Error(absl::StatusCode::kResourceExhausted, ErrorReason::kWriteTooLarge,
                   absl::StrCat("write of more than ", limits_.max_bytes,
                                " bytes; split it into several writes"));
    }
    absl::StatusOr<int64_t> at = arena_.Reserve(static_cast<int64_t>(page_bytes));
    if (!at.ok()) {
      page_index_.erase(it);
      return at.status();
    }
    pages_.push_back(StagedPage{page, static_cast<int>(layer), *at, 0});
  }
  StagedPage& staged = pages_[it->second];
  if (offset != staged.received) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kPageBytesOutOfOrder,
                 absl::StrCat("page ", page.page_id, " layer ", layer, ": data at offset ", offset,
                              ", expected ", staged.received,
                              staged.received == page_bytes ? " (the page is already complete)" : ""));
  }
  if (data.size() > page_bytes - staged.received) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kPageBytesOutOfOrder,
                 absl::StrCat("page ", page.page_id, " layer ", layer, ": ",
                              staged.received + data.size(), " bytes exceed the page size of ",
                              page_bytes));
  }
  arena_.Write(staged.offset + static_cast<int64_t>(staged.received), data);
  staged.received += data.size();
  return absl::OkStatus();
}

absl::Status StagedWrite::ReservePages(std::span<const PageHandle> pages,
                                       std::span<const int64_t> layers, bool in_place,
                                       int64_t in_place_message_bytes) {
  const int64_t page_bytes = pool_->geometry().page_bytes();
  const int64_t units = static_cast<int64_t>(pages.size() * layers.size());
  if (units == 0) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kEmptyWrite,
                 "no page or no layer to write");
  }
  if (units > limits_.max_bytes / page_bytes) {
    return Error(absl::StatusCode::kResourceExhausted, ErrorReason::kWriteTooLarge,
                 absl::StrCat(units, " pages of ", page_bytes, " bytes exceed the limit of ",
                              limits_.max_bytes, " bytes per write; split it"));
  }
  // Checked as a whole: the handles under one lock of the page table, repeats through
  // bitmaps. (A transfer names tens of thousands of pages: per-page locks and hash maps cost
  // more than its bytes take to move.) Each page is then named once with a valid handle, so
  // no page can be named at two generations.
  std::vector<char> layer_seen(static_cast<size_t>(pool_->config().num_layers), 0);
  for (int64_t layer : layers) {
    KVF_RETURN_IF_ERROR(pool_->CheckLayer(layer));
    if (layer_seen[static_cast<size_t>(layer)]++ != 0) {
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kDuplicatePage,
                   absl::StrCat("layer ", layer, " is named twice: every listed page would be ",
                                "named twice as a destination"));
    }
  }
  KVF_RETURN_IF_ERROR(pool_->table().CheckHandles(pages));
  SeenPages seen(pages.size(), pool_->config().num_pages);
  for (const PageHandle& page : pages) {
    if (!seen.Insert(page.page_id)) {
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kDuplicatePage,
                   absl::StrCat("page ", page.page_id, " is named twice as a destination"));
    }
  }
  // The byte stream: for each page in order, each layer in order, one page of bytes.
  pages_.reserve(static_cast<size_t>(units));
  for (const PageHandle& page : pages) {
    for (int64_t layer : layers) {
      const int64_t at = static_cast<int64_t>(pages_.size()) * page_bytes;
      pages_.push_back(StagedPage{page, static_cast<int>(layer), at, 0});
    }
  }
  if (in_place && (pool_->backend().host_memory() ||
                   (device_staging() && MessagesLandInOneRun(in_place_message_bytes)))) {
    // Pages another write holds now are not waited for: they are staged, and the commit
    // waits for that write instead (the transfer's bytes move meanwhile).
    absl::StatusOr<PageTable::Pin> pin = pool_->table().PinPages(pages, true, absl::ZeroDuration());
    if (!pin.ok() && ReasonOf(pin.status()) != ErrorReason::kPagesBusy) return pin.status();
    bool fresh = pin.ok();
    for (size_t l = 0; fresh && l < layers.size(); ++l) {
      const std::vector<uint8_t> held =
          pool_->table().PagesWithRecords(static_cast<int>(layers[l]), pin->pages);
      fresh = std::none_of(held.begin(), held.end(), [](uint8_t h) { return h != 0; });
    }
    if (fresh && !pool_->backend().host_memory()) {
      // Where the rollback's zeroing reads the page ids on the device, taken now: undoing a
      // write in place must not depend on an allocation succeeding later.
      absl::StatusOr<Buffer> ids =
          pool_->backend().Allocate(static_cast<size_t>(units) * sizeof(int64_t),
                                    MemoryKind::kDevice, false);
      if (!ids.ok()) {
        pool_->Unpin(*pin);
        return ids.status();
      }
      rollback_ids_ = *std::move(ids);
    }
    if (fresh) {
      in_place_pin_ = *std::move(pin);
      return absl::OkStatus();
    }
    if (pin.ok()) pool_->Unpin(*pin);
  }
  // One reservation for the whole stream: page i at i * page_bytes, as listed above.
  KVF_ASSIGN_OR_RETURN(const int64_t start, arena_.Reserve(units * page_bytes));
  if (start != 0) {
    return Error(absl::StatusCode::kInternal, ErrorReason::kInternalError,
                 "pages reserved into a write that staged bytes already");
  }
  return absl::OkStatus();
}

bool StagedWrite::MessagesLandInOneRun(int64_t message_bytes) const {
  const int64_t page_bytes = pool_->geometry().page_bytes();
  if (message_bytes < page_bytes || message_bytes % page_bytes != 0) return false;
  const size_t per_message = static_cast<size_t>(message_bytes / page_bytes);
  for (size_t i = 1; i < pages_.size(); ++i) {
    if (i % per_message != 0 &&
        FlatId(pages_[i].layer, pages_[i].handle.page_id) !=
            FlatId(pages_[i - 1].layer, pages_[i - 1].handle.page_id) + 1) {
      return false;
    }
  }
  return true;
}

MemoryBlock StagedWrite::StagingBlock(int64_t offset) const {
  return in_place() ? pool_->memory() : arena_.Block(offset);
}

std::vector<std::span<uint8_t>> StagedWrite::StagingPieces(int64_t offset, int64_t bytes) const {
  if (!in_place()) return arena_.Pieces(offset, bytes);
  const int64_t page_bytes = pool_->geometry().page_bytes();
  std::vector<std::span<uint8_t>> pieces;
  for (int64_t at = offset; at < offset + bytes;) {
    const StagedPage& p = pages_[static_cast<size_t>(at / page_bytes)];
    const int64_t within = at % page_bytes;
    const int64_t take = std::min(page_bytes - within, offset + bytes - at);
    uint8_t* where = pool_->base() + FlatId(p.layer, p.handle.page_id) * page_bytes + within;
    if (!pieces.empty() && pieces.back().data() + pieces.back().size() == where) {
      pieces.back() = std::span<uint8_t>(pieces.back().data(), pieces.back().size() + take);
    } else {
      pieces.emplace_back(where, static_cast<size_t>(take));
    }
    at += take;
  }
  return pieces;
}

StagedWrite::PageColumns StagedWrite::Columns() const {
  PageColumns c;
  for (const StagedPage& p : pages_) {
    c.handles.push_back(p.handle);
    c.page_ids.push_back(static_cast<int64_t>(p.handle.page_id));
    c.layers.push_back(p.layer);
    c.flat_ids.push_back(FlatId(p.layer, p.handle.page_id));
  }
  return c;
}

StagedWrite::~StagedWrite() {
  if (records_charged_ > 0 && pool_->owner() != nullptr) {
    pool_->owner()->Refund(Resource::kStagedWriteBytes, records_charged_);
  }
  if (!in_place_pin_) return;
  // The pairs held no record when the write began: zero is what they held. On a device, the
  // copies this process's transport queued into them (UCX's, on its own streams) have ended
  // first. (A copy a peer process still runs into them after its transfer failed is beyond
  // this process's reach.)
  const std::vector<int64_t> ids = Columns().flat_ids;
  if (const absl::Status synced = pool_->backend().SynchronizeDevice(); !synced.ok()) {
    log::Error("pool '{}': waiting for the device before zeroing the pages of a write in place "
               "that did not commit: {}", pool_->config().name, synced.ToString());
  }
  if (const absl::Status zeroed = pool_->ZeroListedPages(pool_->flat_pages(), ids, &rollback_ids_);
      !zeroed.ok()) {
    log::Error("pool '{}': {} pages written in place by a write that did not commit could not "
               "be zeroed again: {}", pool_->config().name, ids.size(), zeroed.ToString());
  }
  pool_->Unpin(*in_place_pin_);
}

void StagedWrite::MarkReceived() {
  const uint64_t page_bytes = static_cast<uint64_t>(pool_->geometry().page_bytes());
  for (StagedPage& p : pages_) p.received = page_bytes;
}

absl::StatusOr<int64_t> StagedWrite::Commit() {
  return rows_ ? CommitRows() : CommitPages();
}

absl::StatusOr<Buffer> StagedWrite::StageOnDevice(std::span<const int64_t> indices,
                                                  int64_t* indices_at) {
  Backend& backend = pool_->backend();
  *indices_at = AlignUp(arena_.size(), 256);
  const size_t index_bytes = indices.size() * sizeof(int64_t);
  KVF_ASSIGN_OR_RETURN(Buffer staging,
                       backend.Allocate(*indices_at + index_bytes, MemoryKind::kDevice, false));
  std::vector<Op> copies;
  arena_.CopyOps(staging.get(), copies);
  copies.push_back(CopyOp{staging.get() + *indices_at, indices.data(), index_bytes});
  KVF_RETURN_IF_ERROR(backend.Run(copies));
  return staging;
}

absl::StatusOr<int64_t> StagedWrite::CommitRows() {
  const int64_t n = static_cast<int64_t>(tokens_.size());
  if (n == 0) return 0;
  const PoolGeometry g = pool_->geometry();
  uint8_t* const layer_base = pool_->base() + static_cast<int64_t>(layer_) * g.pool_bytes();
  std::vector<Op> ops;
  Buffer staging;
  if (records_) {
    // Host memory pool: the records staged as the rows arrived move to their locations,
    // one op per chunk of the arena.
    const PoolGeometry chunk = RecordChunk();
    for (int64_t first = 0; first < n; first += chunk.num_tokens()) {
      CopyRecordsParams move;
      move.from = chunk;
      move.src = arena_.At(first / chunk.num_tokens() * arena_.chunk_bytes());
      move.to = g;
      move.dst = layer_base;
      move.dst_locs = tokens_.data() + first;
      move.num_tokens = std::min(chunk.num_tokens(), n - first);
      ops.push_back(move);
    }
  } else {
    // Device staging: [rows | token indices], stored with one op.
    QuantizeStoreParams store;
    store.geometry = g;
    store.pool = layer_base;
    int64_t locs_at = 0;
    KVF_ASSIGN_OR_RETURN(staging, StageOnDevice(tokens_, &locs_at));
    store.rows = staging.get<uint16_t>();
    store.locs = reinterpret_cast<const int64_t*>(staging.get() + locs_at);
    store.num_tokens = n;
    ops.push_back(store);
  }

  std::vector<PageHandle> handles;
  for (const auto& [page, generation] : generations_) handles.push_back({page, generation});
  KVF_ASSIGN_OR_RETURN(const PageTable::Pin pin, pool_->table().PinLayer(handles, layer_));
  const absl::Status stored = pool_->RunTimed(records_ ? "copy_records" : "quantize_store", ops);
  pool_->Unpin(pin, stored.ok() ? layer_ : -1, stored.ok() ? std::span<const int64_t>(tokens_)
                                                           : std::span<const int64_t>());
  KVF_RETURN_IF_ERROR(stored);
  pool_->RenewLeases(handles);
  return n;
}

std::vector<std::span<uint8_t>> StagedWrite::DirectPieces() const {
  if (!pool_->backend().host_memory() && !device_staging()) return {};
  const int64_t page_bytes = pool_->geometry().page_bytes();
  // Pages staged back to back from offset 0 in chunks of whole pages (every pages write
  // stages that way): the arena's own pieces.
  bool in_order = arena_.chunk_bytes() % page_bytes == 0;
  for (size_t i = 0; i < pages_.size() && in_order; ++i) {
    in_order = pages_[i].offset == static_cast<int64_t>(i) * page_bytes;
  }
  if (in_order) return arena_.Pieces(0, arena_.size());
  std::vector<std::span<uint8_t>> pieces;
  for (const StagedPage& p : pages_) {
    std::vector<std::span<uint8_t>> at = arena_.Pieces(p.offset, page_bytes);
    if (at.size() != 1) return {};  // a page across two chunks: stage on the device
    if (!pieces.empty() && pieces.back().data() + pieces.back().size() == at[0].data()) {
      pieces.back() = std::span<uint8_t>(pieces.back().data(), pieces.back().size() + at[0].size());
    } else {
      pieces.push_back(at[0]);
    }
  }
  return pieces;
}

absl::StatusOr<int64_t> StagedWrite::CommitPages() {
  const uint64_t page_bytes = static_cast<uint64_t>(pool_->geometry().page_bytes());
  for (const StagedPage& s : pages_) {
    if (s.received != page_bytes) {
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kPageIncomplete,
                   absl::StrCat("page ", s.handle.page_id, " layer ", s.layer, " is incomplete: ",
                                s.received, " of ", page_bytes, " bytes"));
    }
  }
  if (in_place()) return CommitInPlace();
  const int64_t n = static_cast<int64_t>(pages_.size());
  if (n == 0) return 0;
  const auto [handles, page_ids, layers, flat_ids] = Columns();
  PageCopyParams scatter;
  scatter.geometry = pool_->flat_pages();
  scatter.pool = pool_->base();
  std::vector<Op> ops;
  Buffer staging;
  const std::vector<std::span<uint8_t>> pieces = DirectPieces();
  if (!pieces.empty()) {
    // Host memory pool, or staging in device memory, every page within one piece of the
    // arena: each piece's pages are scattered from where they were staged (on a device,
    // with the page ids copied there by the first op of the same list).
    const int64_t* ids = flat_ids.data();
    if (!pool_->backend().host_memory()) {
      const size_t id_bytes = flat_ids.size() * sizeof(int64_t);
      KVF_ASSIGN_OR_RETURN(staging, pool_->backend().Allocate(id_bytes, MemoryKind::kDevice, false));
      ops.push_back(CopyOp{staging.get(), flat_ids.data(), id_bytes});
      ids = staging.get<int64_t>();
    }
    int64_t first = 0;
    for (std::span<uint8_t> piece : pieces) {
      const int64_t count = static_cast<int64_t>(piece.size() / page_bytes);
      scatter.pages = ids + first;
      scatter.num_listed = count;
      scatter.buffer = piece.data();
      ops.push_back(ScatterPagesOp{scatter});
      first += count;
    }
  } else if (mirrored()) {
    // Copied to the device as it arrived: the last copies, then the ids behind the bytes.
    KVF_RETURN_IF_ERROR(WaitMirrorCopies(/*all=*/true));
    if (mirrored_bytes_ != arena_.size()) {
      return Error(absl::StatusCode::kInternal, ErrorReason::kInternalError,
                   absl::StrCat("only ", mirrored_bytes_, " of ", arena_.size(),
                                " staged bytes were copied to the device"));
    }
    ops.push_back(CopyOp{mirror_.get() + mirror_ids_at_, flat_ids.data(),
                         flat_ids.size() * sizeof(int64_t)});
    scatter.pages = reinterpret_cast<const int64_t*>(mirror_.get() + mirror_ids_at_);
    scatter.num_listed = n;
    scatter.buffer = mirror_.get();
    ops.push_back(ScatterPagesOp{scatter});
  } else {
    // Device staging: [page bytes | flat page ids].
    int64_t ids_at = 0;
    KVF_ASSIGN_OR_RETURN(staging, StageOnDevice(flat_ids, &ids_at));
    scatter.pages = reinterpret_cast<const int64_t*>(staging.get() + ids_at);
    scatter.num_listed = n;
    scatter.buffer = staging.get();
    ops.push_back(ScatterPagesOp{scatter});
  }
  KVF_ASSIGN_OR_RETURN(const PageTable::Pin pin, pool_->table().PinPages(handles, true));
  const absl::Status stored = pool_->RunTimed("scatter_pages", ops);
  if (stored.ok()) {
    pool_->UnpinWrittenPages(pin, layers, page_ids);
  } else {
    pool_->Unpin(pin);
  }
  KVF_RETURN_IF_ERROR(stored);
  pool_->RenewLeases(handles);
  return n;
}

absl::StatusOr<bool> StagedWrite::PrepareDeviceMirror() {
  if (rows_ || pool_->backend().host_memory() || device_staging() || in_place() ||
      pages_.empty() || mirrored()) {
    return false;
  }
  // Pages staged back to back from offset 0 (as ReservePages stages them), as the commit's
  // scatter from the mirror reads them.
  const int64_t page_bytes = pool_->geometry().page_bytes();
  for (size_t i = 0; i < pages_.size(); ++i) {
    if (pages_[i].offset != static_cast<int64_t>(i) * page_bytes) return false;
  }
  mirror_ids_at_ = AlignUp(arena_.size(), 256);
  const size_t bytes = static_cast<size_t>(mirror_ids_at_) + pages_.size() * sizeof(int64_t);
  KVF_ASSIGN_OR_RETURN(mirror_, pool_->backend().Allocate(bytes, MemoryKind::kDevice, false));
  return true;
}

absl::Status StagedWrite::MirrorToDevice(int64_t offset, int64_t bytes) {
  if (!mirrored() || offset < 0 || bytes <= 0 || offset + bytes > arena_.size()) {
    return Error(absl::StatusCode::kInternal, ErrorReason::kInternalError,
                 absl::StrCat("no mirror for staged bytes [", offset, ", ", offset + bytes,
                              ") of ", arena_.size()));
  }
  // Copies already done give their streams back before more are taken.
  KVF_RETURN_IF_ERROR(WaitMirrorCopies(/*all=*/false));
  std::vector<Op> copies;
  int64_t at = offset;
  for (std::span<uint8_t> piece : arena_.Pieces(offset, bytes)) {
    copies.push_back(CopyOp{mirror_.get() + at, piece.data(), piece.size()});
    at += static_cast<int64_t>(piece.size());
  }
  KVF_ASSIGN_OR_RETURN(Completion copied, pool_->backend().Submit(copies));
  mirror_copies_.push_back(std::move(copied));
  mirrored_bytes_ += bytes;
  return absl::OkStatus();
}

absl::Status StagedWrite::WaitMirrorCopies(bool all) {
  absl::Status first;
  std::vector<Completion> pending;
  for (Completion& c : mirror_copies_) {
    if (all || c.Ready()) {
      first.Update(c.Wait());
    } else {
      pending.push_back(std::move(c));
    }
  }
  mirror_copies_ = std::move(pending);
  return first;
}

// The bytes are in the pool already: the handles are checked again (a page freed or the pool
// deleted meanwhile fails the write, and the destructor zeroes what landed) and the pairs
// marked written.
absl::StatusOr<int64_t> StagedWrite::CommitInPlace() {
  const PageColumns c = Columns();
  const std::vector<PageHandle>& handles = c.handles;
  // The checks of a pin (handles, and the pool not deleted), as the staged commit's.
  KVF_ASSIGN_OR_RETURN(const PageTable::Pin check, pool_->table().PinPages(handles, false));
  pool_->Unpin(check);
  pool_->UnpinWrittenPages(*in_place_pin_, c.layers, c.page_ids);
  in_place_pin_.reset();
  pool_->RenewLeases(handles);
  return static_cast<int64_t>(pages_.size());
}

}  // namespace kvferry::server
