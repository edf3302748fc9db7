// Host-side input validation shared by every implementation of the ops.
#include "kvferry/kernels/validate.h"

#include <algorithm>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvferry/kernels/numerics.h"

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

absl::Status ValidateFinite(std::span<const uint16_t> rows, int64_t first_row) {
  for (size_t i = 0; i < rows.size(); ++i) {
    if (numerics::Bf16IsNonFinite(rows[i])) {
      const bool is_nan = (rows[i] & 0x7Fu) != 0;
      return absl::InvalidArgumentError(absl::StrCat(
          "row ", first_row + static_cast<int64_t>(i / kHeadDim), " dim ", i % kHeadDim,
          " is ", is_nan ? "NaN" : ((rows[i] & 0x8000u) ? "-Inf" : "+Inf"),
          ": KV rows must be finite"));
    }
  }
  return absl::OkStatus();
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
