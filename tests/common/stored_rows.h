// Random rows stored at scattered locations by the CPU reference: the starting point of the
// tests that check reads, transcodes or stores against the reference.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/random_rows.h"
#include "kvferry/kernels/ops.h"

namespace kvferry::testing {

struct StoredRows {
  std::vector<uint16_t> rows;   // [n, 512] bf16
  std::vector<int64_t> locs;    // [n], distinct
  std::vector<uint8_t> pool;    // `pool` as given, with the n records stored
};

// RandomRows(n, row_seed) stored by reference::QuantizeStore at
// ScatteredLocations(n, g.num_tokens(), loc_seed) of `pool` (g.pool_bytes() bytes).
inline absl::StatusOr<StoredRows> StoreRandomRows(const PoolGeometry& g, int64_t n,
                                                  uint64_t row_seed, uint64_t loc_seed,
                                                  std::vector<uint8_t> pool) {
  StoredRows out{RandomRows(n, row_seed), ScatteredLocations(n, g.num_tokens(), loc_seed),
                 std::move(pool)};
  const absl::Status status = reference::QuantizeStore(g, out.rows, out.locs, out.pool);
  if (!status.ok()) return status;
  return out;
}

}  // namespace kvferry::testing
