// The KV ops on host memory, fast: vectorized (Highway, runtime dispatch to the best
// instruction set of the CPU) and split across a worker pool for large requests.
//
// Each op has the reference's signature (kvferry/kernels/ops.h), validates exactly as the
// reference does (same checks in the same order, same status codes and messages), writes
// nothing on error, and produces the reference's bytes for every input. `workers` is
// borrowed for the call; nullptr, or a request too small to split, runs on the calling
// thread. Thread-compatible: concurrent calls may share one pool but must not write the
// same memory.
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "kvferry/kernels/cpu_thread_pool.h"
#include "kvferry/kernels/format.h"
#include "kvferry/kernels/ops.h"

namespace kvferry::cpu {

// reference::QuantizeStore.
absl::Status QuantizeStore(const PoolGeometry& geometry, std::span<const uint16_t> rows,
                           std::span<const int64_t> locs, std::span<uint8_t> pool,
                           ThreadPool* workers = nullptr);

// The same bytes, for rows the caller has already found finite (ValidateFinite), or into a
// pool the caller discards on failure: each block of rows is scaled and coded while it is
// still in cache, so the rows are read from memory once, where QuantizeStore reads them
// twice (it must check them all before writing any). A NaN or Inf found: INTERNAL, and
// records of the blocks before it may be written already.
absl::Status QuantizeStoreCheckedRows(const PoolGeometry& geometry,
                                      std::span<const uint16_t> rows,
                                      std::span<const int64_t> locs, std::span<uint8_t> pool,
                                      ThreadPool* workers = nullptr);

// reference::DequantizeGather.
absl::Status DequantizeGather(const PoolGeometry& geometry, std::span<const uint8_t> pool,
                              std::span<const int64_t> locs, std::span<uint16_t> out,
                              int64_t out_row_stride = kHeadDim, ThreadPool* workers = nullptr);

// reference::Transcode.
absl::Status Transcode(const PoolGeometry& from, std::span<const uint8_t> src,
                       const PoolGeometry& to, std::span<uint8_t> dst,
                       std::span<const int64_t> locs, ThreadPool* workers = nullptr);

// Moves stored records between pools of one layout (CopyRecordsParams, op_params.h):
// record i of `src` (at src_locs[i], or at i when src_locs is empty) is copied, data and
// scale rows byte for byte, to dst_locs[i] of `dst`. INVALID_ARGUMENT, with nothing
// written, for pools of two layouts, lists of two lengths, a location out of range or a
// destination listed twice. The pools must not overlap.
absl::Status CopyRecords(const PoolGeometry& from, std::span<const uint8_t> src,
                         std::span<const int64_t> src_locs, const PoolGeometry& to,
                         std::span<uint8_t> dst, std::span<const int64_t> dst_locs,
                         ThreadPool* workers = nullptr);

// reference::GatherPages.
absl::Status GatherPages(const PageCopyGeometry& geometry, std::span<const uint8_t> pool,
                         std::span<const int64_t> pages, std::span<uint8_t> buffer,
                         ThreadPool* workers = nullptr);

// reference::ScatterPages.
absl::Status ScatterPages(const PageCopyGeometry& geometry, std::span<const uint8_t> buffer,
                          std::span<const int64_t> pages, std::span<uint8_t> pool,
                          ThreadPool* workers = nullptr);

// reference::ZeroPages.
absl::Status ZeroPages(const PageCopyGeometry& geometry, std::span<const int64_t> pages,
                       std::span<uint8_t> pool, ThreadPool* workers = nullptr);

// Copies bf16 rows held as little-endian bytes (either pointer at any alignment) to dst and
// says whether every value is finite: one pass over the bytes where ValidateFiniteBytes
// and a copy take two. dst holds the copy either way; ValidateFiniteBytes names the first
// value that is not finite.
bool CopyFiniteBf16(std::span<const uint8_t> src, uint8_t* dst);

// The name of the instruction set the ops dispatch to on this CPU (e.g. "AVX2"), for logs
// and benchmark tables.
const char* DispatchedTargetName();

}  // namespace kvferry::cpu
