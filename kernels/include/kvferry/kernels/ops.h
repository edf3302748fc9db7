// The KV ops on host memory: the CPU reference, bit-exact definition of every op.
//
// All functions are thread-compatible (no shared state) and validate their whole input
// before touching the output: on any error nothing has been written. Spans are borrowed
// for the duration of the call.
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "kvferry/kernels/format.h"

namespace kvferry {

// A set of pools of identical geometry stacked by layer, as the daemon holds them:
// pool bytes = [num_layers][num_pages][page_bytes]. The transfer unit of a page is all of
// its layers: a page buffer is [pages.size()][num_layers][page_bytes].
struct PageCopyGeometry {
  int64_t page_bytes = 0;
  int64_t num_pages = 0;
  int num_layers = 1;

  int64_t pool_bytes() const { return page_bytes * num_pages * num_layers; }
  int64_t buffer_bytes(int64_t num_listed_pages) const {
    return num_listed_pages * num_layers * page_bytes;
  }
};

namespace reference {

// Writes rows[i] ([n, 512] bf16, row-major) into token location locs[i] of `pool`
// (geometry.pool_bytes() bytes). Errors (INVALID_ARGUMENT): bad geometry, rows not n×512,
// a NaN/Inf value, a location out of range or repeated, a pool span of the wrong size.
absl::Status QuantizeStore(const PoolGeometry& geometry, std::span<const uint16_t> rows,
                           std::span<const int64_t> locs, std::span<uint8_t> pool);

// Dequantizes the records at locs (repeats allowed) into out: row i at
// out[i * out_row_stride .. +512) as bf16. out_row_stride (in elements) is >= 512; the
// elements between rows are not touched.
absl::Status DequantizeGather(const PoolGeometry& geometry, std::span<const uint8_t> pool,
                              std::span<const int64_t> locs, std::span<uint16_t> out,
                              int64_t out_row_stride = kHeadDim);

// For each location, quantize_to(dequantize_from(row)) into the same location of dst.
// Locations must be in range for both geometries and unique.
absl::Status Transcode(const PoolGeometry& from, std::span<const uint8_t> src,
                       const PoolGeometry& to, std::span<uint8_t> dst,
                       std::span<const int64_t> locs);

// Copies the listed pages (all layers) of pool into buffer, back to back. Repeats allowed.
absl::Status GatherPages(const PageCopyGeometry& geometry, std::span<const uint8_t> pool,
                         std::span<const int64_t> pages, std::span<uint8_t> buffer);

// The inverse of GatherPages: buffer's pages into the listed pages of pool. Pages must be
// unique (a repeated page would make the result depend on order).
absl::Status ScatterPages(const PageCopyGeometry& geometry, std::span<const uint8_t> buffer,
                          std::span<const int64_t> pages, std::span<uint8_t> pool);

// Zeroes every layer of the listed pages of pool (repeats allowed), as a freed page must
// read: a new pool is zero-filled (spec §3).
absl::Status ZeroPages(const PageCopyGeometry& geometry, std::span<const int64_t> pages,
                       std::span<uint8_t> pool);

// Row-level primitives, shared with callers that already validated their input.
// QuantizeRow: one finite bf16 row → its data and scale records.
void QuantizeRow(Layout layout, const uint16_t* row, uint8_t* data, uint8_t* scale);
// DequantizeRow: one record → a bf16 row.
void DequantizeRow(Layout layout, const uint8_t* data, const uint8_t* scale, uint16_t* row);

}  // namespace reference
}  // namespace kvferry
