// Host-side validation of op inputs, shared by the CPU reference, the CUDA launchers and
// the daemon. Each check returns INVALID_ARGUMENT with a message naming the offending
// index and value, or OK.
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "kvferry/kernels/format.h"

namespace kvferry {

// Layout in range, page size a power of two in [1, 4096], num_pages > 0.
absl::Status ValidateGeometry(const PoolGeometry& geometry);

// Page copies: page_bytes, num_pages and num_layers all positive.
struct PageCopyGeometry;  // kvferry/kernels/ops.h
absl::Status ValidatePageCopyGeometry(const PageCopyGeometry& geometry);

// A caller's span holds exactly the bytes the geometry needs; `what` names it in the message.
absl::Status ValidateSpanBytes(size_t have, int64_t want, const char* what);

// A page copy: the geometry, the pool and page-buffer spans, every page in range and, when
// `unique`, no page listed twice.
absl::Status ValidatePageCopy(const PageCopyGeometry& geometry, size_t pool_size,
                              std::span<const int64_t> pages, size_t buffer_size, bool unique);

// A dequantize-gather workspace: the row stride is at least 512 and `out_size` values hold
// `num_rows` rows at that stride.
absl::Status ValidateWorkspace(int64_t num_rows, size_t out_size, int64_t out_row_stride);

// `num_values` bf16 values form whole 512-value rows.
absl::Status ValidateRowShape(int64_t num_values, int64_t num_rows);

// No NaN or ±Inf among the rows. `first_row` offsets the row index in the message (for
// callers that validate a stream chunk by chunk).
absl::Status ValidateFinite(std::span<const uint16_t> rows, int64_t first_row = 0);
// The same for rows still held as little-endian bytes (any alignment), as they arrive off
// the wire.
absl::Status ValidateFiniteBytes(std::span<const uint8_t> rows, int64_t first_row = 0);

// Every location in [0, limit); when `unique`, no location appears twice.
absl::Status ValidateLocations(std::span<const int64_t> locs, int64_t limit, bool unique,
                               const char* what = "location");

}  // namespace kvferry
