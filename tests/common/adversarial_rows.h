// bf16 rows aimed at the corners of the quantization rules, for tests that hold a fast
// implementation to the reference.
#pragma once

#include <cstdint>
#include <vector>

#include "common/random_rows.h"
#include "kvferry/kernels/format.h"

namespace kvferry::testing {

// A random finite bf16 bit pattern: any sign, exponent and mantissa except NaN/Inf.
inline uint16_t RandomFiniteBf16(FastRandom& rng) {
  uint16_t bits = static_cast<uint16_t>(rng.Next());
  if ((bits & 0x7F80u) == 0x7F80u) bits &= 0xBFFFu;  // clear an exponent bit
  return bits;
}

// [n, 512] finite bf16 rows, cycling through four kinds: random bit patterns over the whole
// finite range (every scale, saturation); tiny values (bf16 subnormals, e4m3 subnormals
// after scaling) under an occasional spike; zeros and -0 with rare other values; values
// next to the bf16 maximum.
inline std::vector<uint16_t> AdversarialRows(int64_t n, uint64_t seed) {
  FastRandom rng(seed);
  std::vector<uint16_t> rows(n * kHeadDim);
  for (int64_t r = 0; r < n; ++r) {
    uint16_t* row = &rows[r * kHeadDim];
    for (int d = 0; d < kHeadDim; ++d) {
      const uint16_t sign = static_cast<uint16_t>(rng.Next() & 0x8000u);
      switch (r % 4) {
        case 0:
          row[d] = RandomFiniteBf16(rng);
          break;
        case 1:
          row[d] = rng.Next() % 23 == 0 ? RandomFiniteBf16(rng)
                                        : static_cast<uint16_t>(sign | (rng.Next() % 0x1400));
          break;
        case 2:
          row[d] = rng.Next() % 5 == 0 ? RandomFiniteBf16(rng) : sign;
          break;
        default:
          row[d] = static_cast<uint16_t>(sign | 0x7F00u | (rng.Next() & 0x7Fu));
          break;
      }
    }
  }
  return rows;
}

}  // namespace kvferry::testing
