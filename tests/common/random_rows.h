// Deterministic random KV rows and scattered token locations for tests and benchmarks.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "kvferry/kernels/format.h"
#include "kvferry/kernels/numerics.h"

namespace kvferry::testing {

// A small fast generator (xorshift64*) so large test inputs cost little to make.
class FastRandom {
 public:
  explicit FastRandom(uint64_t seed) : state_(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t Next() {
    state_ ^= state_ >> 12;
    state_ ^= state_ << 25;
    state_ ^= state_ >> 27;
    return state_ * 0x2545F4914F6CDD1Dull;
  }
  // Uniform in [0, 1).
  float Uniform() { return static_cast<float>(Next() >> 40) * (1.0f / 16777216.0f); }
  // Approximately standard normal (Irwin-Hall sum of four uniforms, rescaled).
  float Normal() {
    const uint64_t r = Next();
    float sum = 0;
    for (int i = 0; i < 4; ++i) sum += static_cast<float>((r >> (16 * i)) & 0xFFFF);
    return (sum * (1.0f / 65536.0f) - 2.0f) * 1.7320508f;
  }

 private:
  uint64_t state_;
};

// [n, 512] bf16 rows, latent-like: each row has its own magnitude (10^-3 .. 10^1) and a
// few outliers, so tiles see varied scales. Values stay well inside V41_FP4's range.
inline std::vector<uint16_t> RandomRows(int64_t n, uint64_t seed) {
  FastRandom rng(seed);
  std::vector<uint16_t> rows(n * kHeadDim);
  for (int64_t r = 0; r < n; ++r) {
    const float scale = std::pow(10.0f, -3.0f + 4.0f * rng.Uniform());
    for (int d = 0; d < kHeadDim; ++d) {
      rows[r * kHeadDim + d] = numerics::FloatToBf16(rng.Normal() * scale);
    }
    for (int k = 0; k < 3; ++k) {
      rows[r * kHeadDim + (rng.Next() % kHeadDim)] =
          numerics::FloatToBf16(rng.Normal() * scale * 20.0f);
    }
  }
  return rows;
}

// n distinct locations drawn from [0, num_tokens), in random order.
inline std::vector<int64_t> ScatteredLocations(int64_t n, int64_t num_tokens, uint64_t seed) {
  FastRandom rng(seed);
  std::vector<int64_t> all(num_tokens);
  std::iota(all.begin(), all.end(), 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pick = i + static_cast<int64_t>(rng.Next() % static_cast<uint64_t>(num_tokens - i));
    std::swap(all[i], all[pick]);
  }
  all.resize(n);
  return all;
}

}  // namespace kvferry::testing
