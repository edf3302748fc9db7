// The cpu fast path of the KV ops: the reference's validation (the finite and location
// checks made fast), then the row kernels or page copies split across the worker pool.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "cpu/row_kernels.h"
#include "kvferry/kernels/cpu_ops.h"
#include "kvferry/kernels/status_macros.h"
#include "kvferry/kernels/validate.h"

namespace kvferry::cpu {
namespace {

// Rows per task: a row takes 0.1-0.3 µs here, so 256 rows are tens of µs of work, well
// above the few µs a worker takes to wake up.
constexpr int64_t kRowsPerTask = 256;
// Bytes per task for copies that run at memory speed: about 100 µs each.
constexpr int64_t kBytesPerTask = int64_t{1} << 20;
// Outputs of at least this many bytes are written with non-temporal stores: a quarter of
// the last-level cache of a typical server core complex, past which the written lines
// would be evicted before anyone reads them, so reading them in first (as an ordinary store
// does) only costs DRAM bandwidth. Smaller outputs stay in cache for their reader.
constexpr int64_t kStreamingBytes = int64_t{8} << 20;

void ForEach(ThreadPool* workers, int64_t n, int64_t min_grain,
             absl::FunctionRef<void(int64_t, int64_t)> fn) {
  if (n <= 0) return;
  if (workers == nullptr) {
    fn(0, n);
  } else {
    workers->ParallelFor(n, min_grain, fn);
  }
}

// ValidateLocations with the repeat check in a bitmap where the range is not much larger
// than the list: the shared validator sorts (n log n), which costs more than quantizing
// the rows. Any failure is reported by the shared validator, for the reference's message.
absl::Status CheckLocations(std::span<const int64_t> locs, int64_t limit, bool unique,
                            const char* what = "location") {
  bool in_range = true;
  for (const int64_t loc : locs) {
    in_range &= static_cast<uint64_t>(loc) < static_cast<uint64_t>(limit);
  }
  const int64_t n = static_cast<int64_t>(locs.size());
  if (!in_range || (unique && n >= 2 && limit > 64 * n)) {
    return ValidateLocations(locs, limit, unique, what);
  }
  if (!unique || n < 2) return absl::OkStatus();
  std::vector<uint64_t> seen((limit + 63) / 64, 0);
  for (const int64_t loc : locs) {
    uint64_t& word = seen[loc >> 6];
    const uint64_t bit = uint64_t{1} << (loc & 63);
    if (word & bit) return ValidateLocations(locs, limit, unique, what);
    word |= bit;
  }
  return absl::OkStatus();
}

// Calls fn(pool_offset, item) for every (listed page, layer) pair, item being its index in
// a page buffer ([pages][layers][page_bytes]), split across the pool by bytes.
void ForEachPageLayer(const PageCopyGeometry& g, std::span<const int64_t> pages,
                      ThreadPool* workers, absl::FunctionRef<void(int64_t, int64_t)> fn) {
  const int64_t layer_bytes = g.num_pages * g.page_bytes;
  const int64_t items = static_cast<int64_t>(pages.size()) * g.num_layers;
  ForEach(workers, items, std::max<int64_t>(1, kBytesPerTask / g.page_bytes),
          [&](int64_t begin, int64_t end) {
            for (int64_t item = begin; item < end; ++item) {
              const int64_t page = pages[item / g.num_layers];
              const int64_t layer = item % g.num_layers;
              fn(layer * layer_bytes + page * g.page_bytes, item);
            }
          });
}

// The checks both stores make before reading a row: geometry, pool size, rows per location.
absl::Status ValidateStore(const PoolGeometry& geometry, std::span<const uint16_t> rows,
                           std::span<const int64_t> locs, std::span<uint8_t> pool) {
  KVF_RETURN_IF_ERROR(ValidateGeometry(geometry));
  KVF_RETURN_IF_ERROR(ValidateSpanBytes(pool.size(), geometry.pool_bytes(), "pool"));
  return ValidateRowShape(static_cast<int64_t>(rows.size()), static_cast<int64_t>(locs.size()));
}

}  // namespace

absl::Status QuantizeStore(const PoolGeometry& geometry, std::span<const uint16_t> rows,
                           std::span<const int64_t> locs, std::span<uint8_t> pool,
                           ThreadPool* workers) {
  KVF_RETURN_IF_ERROR(ValidateStore(geometry, rows, locs, pool));
  // Pass 1 reads every row once for both the finite check and the tile scales, so the
  // check costs no pass of its own; pass 2 codes the rows under those scales.
  const int64_t n = static_cast<int64_t>(locs.size());
  const int scale_bytes = GetLayoutInfo(geometry.layout).scale_bytes;
  const std::unique_ptr<uint8_t[]> scales(new uint8_t[n * scale_bytes]);
  const bool stream = n * GetLayoutInfo(geometry.layout).bytes_per_token() >= kStreamingBytes;
  std::atomic<bool> finite{true};
  ForEach(workers, n, kRowsPerTask, [&](int64_t begin, int64_t end) {
    if (!internal::ScaleRows(geometry.layout, rows.data() + begin * kHeadDim, end - begin,
                             scales.get() + begin * scale_bytes)) {
      finite.store(false, std::memory_order_relaxed);
    }
  });
  // The shared validator finds the first non-finite value, for the reference's message.
  if (!finite.load()) return ValidateFinite(rows);
  KVF_RETURN_IF_ERROR(CheckLocations(locs, geometry.num_tokens(), /*unique=*/true));
  ForEach(workers, n, kRowsPerTask, [&](int64_t begin, int64_t end) {
    internal::EncodeRows(geometry, rows.data() + begin * kHeadDim,
                         scales.get() + begin * scale_bytes, locs.data() + begin, end - begin,
                         pool.data(), stream);
  });
  return absl::OkStatus();
}

absl::Status QuantizeStoreCheckedRows(const PoolGeometry& geometry,
                                      std::span<const uint16_t> rows,
                                      std::span<const int64_t> locs, std::span<uint8_t> pool,
                                      ThreadPool* workers) {
  KVF_RETURN_IF_ERROR(ValidateStore(geometry, rows, locs, pool));
  KVF_RETURN_IF_ERROR(CheckLocations(locs, geometry.num_tokens(), /*unique=*/true));
  const int64_t n = static_cast<int64_t>(locs.size());
  const bool stream = n * GetLayoutInfo(geometry.layout).bytes_per_token() >= kStreamingBytes;
  std::atomic<bool> finite{true};
  ForEach(workers, n, kRowsPerTask, [&](int64_t begin, int64_t end) {
    if (!internal::StoreCheckedRows(geometry, rows.data() + begin * kHeadDim, locs.data() + begin,
                                    end - begin, pool.data(), stream)) {
      finite.store(false, std::memory_order_relaxed);
    }
  });
  if (!finite.load()) {
    return absl::InternalError(absl::StrCat("rows promised finite are not: ",
                                            ValidateFinite(rows).message()));
  }
  return absl::OkStatus();
}

bool CopyFiniteBf16(std::span<const uint8_t> src, uint8_t* dst) {
  return internal::CopyFinite(src.data(), dst, src.size());
}

absl::Status DequantizeGather(const PoolGeometry& geometry, std::span<const uint8_t> pool,
                              std::span<const int64_t> locs, std::span<uint16_t> out,
                              int64_t out_row_stride, ThreadPool* workers) {
  KVF_RETURN_IF_ERROR(ValidateGeometry(geometry));
  KVF_RETURN_IF_ERROR(ValidateSpanBytes(pool.size(), geometry.pool_bytes(), "pool"));
  const int64_t n = static_cast<int64_t>(locs.size());
  KVF_RETURN_IF_ERROR(ValidateWorkspace(n, out.size(), out_row_stride));
  KVF_RETURN_IF_ERROR(CheckLocations(locs, geometry.num_tokens(), /*unique=*/false));
  const bool stream = n * kBf16RowBytes >= kStreamingBytes;
  ForEach(workers, n, kRowsPerTask, [&](int64_t begin, int64_t end) {
    internal::DequantizeRows(geometry, pool.data(), locs.data() + begin, end - begin,
                             out.data() + begin * out_row_stride, out_row_stride, stream);
  });
  return absl::OkStatus();
}

absl::Status Transcode(const PoolGeometry& from, std::span<const uint8_t> src,
                       const PoolGeometry& to, std::span<uint8_t> dst,
                       std::span<const int64_t> locs, ThreadPool* workers) {
  KVF_RETURN_IF_ERROR(ValidateGeometry(from));
  KVF_RETURN_IF_ERROR(ValidateGeometry(to));
  KVF_RETURN_IF_ERROR(ValidateSpanBytes(src.size(), from.pool_bytes(), "source pool"));
  KVF_RETURN_IF_ERROR(ValidateSpanBytes(dst.size(), to.pool_bytes(), "destination pool"));
  const int64_t limit = std::min(from.num_tokens(), to.num_tokens());
  KVF_RETURN_IF_ERROR(CheckLocations(locs, limit, /*unique=*/true));
  const int64_t n = static_cast<int64_t>(locs.size());
  const bool stream = n * GetLayoutInfo(to.layout).bytes_per_token() >= kStreamingBytes;
  ForEach(workers, n, kRowsPerTask, [&](int64_t begin, int64_t end) {
    internal::TranscodeRows(from, src.data(), to, dst.data(), locs.data() + begin, end - begin,
                            stream);
  });
  return absl::OkStatus();
}

absl::Status CopyRecords(const PoolGeometry& from, std::span<const uint8_t> src,
                         std::span<const int64_t> src_locs, const PoolGeometry& to,
                         std::span<uint8_t> dst, std::span<const int64_t> dst_locs,
                         ThreadPool* workers) {
  KVF_RETURN_IF_ERROR(ValidateGeometry(from));
  KVF_RETURN_IF_ERROR(ValidateGeometry(to));
  if (from.layout != to.layout) {
    return absl::InvalidArgumentError(
        absl::StrCat("records of layout ", LayoutName(from.layout),
                     " cannot be copied into a pool of layout ", LayoutName(to.layout),
                     " (transcode them)"));
  }
  KVF_RETURN_IF_ERROR(ValidateSpanBytes(src.size(), from.pool_bytes(), "source pool"));
  KVF_RETURN_IF_ERROR(ValidateSpanBytes(dst.size(), to.pool_bytes(), "destination pool"));
  const int64_t n = static_cast<int64_t>(dst_locs.size());
  if (!src_locs.empty() && static_cast<int64_t>(src_locs.size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat(src_locs.size(), " source locations for ", n,
                                                   " destination locations"));
  }
  if (src_locs.empty() && n > from.num_tokens()) {
    return absl::InvalidArgumentError(absl::StrCat(n, " records asked of a source pool of ",
                                                   from.num_tokens(), " tokens"));
  }
  KVF_RETURN_IF_ERROR(CheckLocations(src_locs, from.num_tokens(), /*unique=*/false,
                                     "source location"));
  KVF_RETURN_IF_ERROR(CheckLocations(dst_locs, to.num_tokens(), /*unique=*/true,
                                     "destination location"));
  const LayoutInfo info = GetLayoutInfo(to.layout);
  ForEach(workers, n, kBytesPerTask / info.bytes_per_token(), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const RecordOffsets in = LocateRecord(from, src_locs.empty() ? i : src_locs[i]);
      const RecordOffsets out = LocateRecord(to, dst_locs[i]);
      std::memcpy(dst.data() + out.data, src.data() + in.data, info.data_bytes);
      std::memcpy(dst.data() + out.scale, src.data() + in.scale, info.scale_bytes);
    }
  });
  return absl::OkStatus();
}

// Page copies and zeroing call libc's memcpy and memset: they are already vectorized per
// CPU (chosen at load time), so the fast path only splits the pages across cores.

absl::Status GatherPages(const PageCopyGeometry& geometry, std::span<const uint8_t> pool,
                         std::span<const int64_t> pages, std::span<uint8_t> buffer,
                         ThreadPool* workers) {
  KVF_RETURN_IF_ERROR(ValidatePageCopy(geometry, pool.size(), pages, buffer.size(), false));
  ForEachPageLayer(geometry, pages, workers, [&](int64_t at, int64_t item) {
    std::memcpy(buffer.data() + item * geometry.page_bytes, pool.data() + at, geometry.page_bytes);
  });
  return absl::OkStatus();
}

absl::Status ScatterPages(const PageCopyGeometry& geometry, std::span<const uint8_t> buffer,
                          std::span<const int64_t> pages, std::span<uint8_t> pool,
                          ThreadPool* workers) {
  KVF_RETURN_IF_ERROR(ValidatePageCopy(geometry, pool.size(), pages, buffer.size(), true));
  ForEachPageLayer(geometry, pages, workers, [&](int64_t at, int64_t item) {
    std::memcpy(pool.data() + at, buffer.data() + item * geometry.page_bytes, geometry.page_bytes);
  });
  return absl::OkStatus();
}

absl::Status ZeroPages(const PageCopyGeometry& geometry, std::span<const int64_t> pages,
                       std::span<uint8_t> pool, ThreadPool* workers) {
  KVF_RETURN_IF_ERROR(ValidatePageCopyGeometry(geometry));
  KVF_RETURN_IF_ERROR(ValidateSpanBytes(pool.size(), geometry.pool_bytes(), "pool"));
  KVF_RETURN_IF_ERROR(ValidateLocations(pages, geometry.num_pages, /*unique=*/false, "page"));
  // A page listed twice would be zeroed by two threads at once (a data race, however
  // benign its bytes): split the work over each page once.
  std::vector<int64_t> distinct;
  if (workers != nullptr && pages.size() > 1) {
    distinct.assign(pages.begin(), pages.end());
    std::sort(distinct.begin(), distinct.end());
    distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
    if (distinct.size() < pages.size()) pages = distinct;
  }
  ForEachPageLayer(geometry, pages, workers, [&](int64_t at, int64_t) {
    std::memset(pool.data() + at, 0, geometry.page_bytes);
  });
  return absl::OkStatus();
}

const char* DispatchedTargetName() { return internal::DispatchedTargetName(); }

}  // namespace kvferry::cpu
