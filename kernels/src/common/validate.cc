// Host-side input validation shared by every implementation of the ops.
#include "kvferry/kernels/validate.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvferry/kernels/numerics.h"
#include "kvferry/kernels/ops.h"
#include "kvferry/kernels/status_macros.h"

namespace kvferry {

absl::Status ValidateGeometry(const PoolGeometry& geometry) {
  if (!IsValidLayout(static_cast<int>(geometry.layout))) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown layout ", static_cast<int>(geometry.layout)));
  }
  if (!IsValidPageSize(geometry.page_size)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "page size ", geometry.page_size, " is not a power of two in [1, ", kMaxPageSize, "]"));
  }
  if (geometry.num_pages <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("a pool needs at least one page, got ", geometry.num_pages));
  }
  return absl::OkStatus();
}

absl::Status ValidatePageCopyGeometry(const PageCopyGeometry& geometry) {
  if (geometry.page_bytes <= 0 || geometry.num_pages <= 0 || geometry.num_layers <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "page copy geometry needs positive sizes, got page_bytes ", geometry.page_bytes,
        ", num_pages ", geometry.num_pages, ", num_layers ", geometry.num_layers));
  }
  return absl::OkStatus();
}

absl::Status ValidateSpanBytes(size_t have, int64_t want, const char* what) {
  if (static_cast<int64_t>(have) != want) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " holds ", have, " bytes, the geometry needs ", want));
  }
  return absl::OkStatus();
}

absl::Status ValidatePageCopy(const PageCopyGeometry& geometry, size_t pool_size,
                              std::span<const int64_t> pages, size_t buffer_size, bool unique) {
  KVF_RETURN_IF_ERROR(ValidatePageCopyGeometry(geometry));
  KVF_RETURN_IF_ERROR(ValidateSpanBytes(pool_size, geometry.pool_bytes(), "pool"));
  KVF_RETURN_IF_ERROR(
      ValidateSpanBytes(buffer_size, geometry.buffer_bytes(pages.size()), "page buffer"));
  return ValidateLocations(pages, geometry.num_pages, unique, "page");
}

absl::Status ValidateWorkspace(int64_t num_rows, size_t out_size, int64_t out_row_stride) {
  if (out_row_stride < kHeadDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("workspace row stride ", out_row_stride, " is below ", kHeadDim));
  }
  const int64_t needed = num_rows == 0 ? 0 : (num_rows - 1) * out_row_stride + kHeadDim;
  if (static_cast<int64_t>(out_size) < needed) {
    return absl::InvalidArgumentError(absl::StrCat("workspace holds ", out_size, " values, ",
                                                   num_rows, " rows need ", needed));
  }
  return absl::OkStatus();
}

absl::Status ValidateRowShape(int64_t num_values, int64_t num_rows) {
  if (num_values % kHeadDim != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rows hold ", num_values, " bf16 values (", num_values * 2,
        " bytes), not a whole number of ", kHeadDim, "-value (1024-byte) rows"));
  }
  if (num_values / kHeadDim != num_rows) {
    return absl::InvalidArgumentError(absl::StrCat("got ", num_values / kHeadDim,
                                                   " rows but ", num_rows, " locations"));
  }
  return absl::OkStatus();
}

namespace {

// The error for the first non-finite value at or after value index `from`.
absl::Status NonFiniteError(std::span<const uint8_t> rows, size_t from, int64_t first_row) {
  for (size_t i = from; 2 * i + 1 < rows.size(); ++i) {
    const uint16_t v = static_cast<uint16_t>(rows[2 * i] | (rows[2 * i + 1] << 8));
    if (numerics::Bf16IsNonFinite(v)) {
      const bool is_nan = (v & 0x7Fu) != 0;
      return absl::InvalidArgumentError(absl::StrCat(
          "row ", first_row + static_cast<int64_t>(i / kHeadDim), " dim ", i % kHeadDim, " is ",
          is_nan ? "NaN" : ((v & 0x8000u) ? "-Inf" : "+Inf"), ": KV rows must be finite"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateFiniteBytes(std::span<const uint8_t> rows, int64_t first_row) {
  // Four bf16 values per 64-bit word: a value is NaN or Inf when its exponent bits are all
  // set, i.e. when (v & 0x7F80) ^ 0x7F80 is zero; the classic has-zero-lane test finds one.
  constexpr uint64_t kExponent = 0x7F807F807F807F80ull;
  constexpr uint64_t kOnes = 0x0001000100010001ull;
  constexpr uint64_t kHigh = 0x8000800080008000ull;
  size_t at = 0;
  for (; at + 8 <= rows.size(); at += 8) {
    uint64_t w;
    std::memcpy(&w, rows.data() + at, 8);
    const uint64_t lanes = (w & kExponent) ^ kExponent;
    if (((lanes - kOnes) & ~lanes & kHigh) != 0) return NonFiniteError(rows, at / 2, first_row);
  }
  return NonFiniteError(rows, at / 2, first_row);
}

absl::Status ValidateFinite(std::span<const uint16_t> rows, int64_t first_row) {
  return ValidateFiniteBytes({reinterpret_cast<const uint8_t*>(rows.data()), rows.size() * 2},
                             first_row);
}

absl::Status ValidateLocations(std::span<const int64_t> locs, int64_t limit, bool unique,
                               const char* what) {
  for (size_t i = 0; i < locs.size(); ++i) {
    if (locs[i] < 0 || locs[i] >= limit) {
      return absl::InvalidArgumentError(absl::StrCat(what, " ", i, " is ", locs[i],
                                                     ", outside [0, ", limit, ")"));
    }
  }
  if (!unique || locs.size() < 2) return absl::OkStatus();
  // Sort indices by value so the message can name both positions of a repeat.
  std::vector<uint32_t> order(locs.size());
  std::iota(order.begin(), order.end(), 0u);
  std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    return locs[a] != locs[b] ? locs[a] < locs[b] : a < b;
  });
  for (size_t k = 1; k < order.size(); ++k) {
    if (locs[order[k]] == locs[order[k - 1]]) {
      return absl::InvalidArgumentError(absl::StrCat(what, "s ", order[k - 1], " and ",
                                                     order[k], " both name ",
                                                     locs[order[k]]));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvferry
