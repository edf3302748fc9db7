// Deterministic random KV rows and scattered token locations for tests and benchmarks.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "kvferry/kernels/format.h"
#include "kvferry/kernels/numerics.h"

namespace kvferry::testing {

// [n, 512] bf16 rows, latent-like: each row has its own magnitude (10^-3 .. 10^1) and a
// few outliers, so tiles see varied scales. Values stay well inside V41_FP4's range.
inline std::vector<uint16_t> RandomRows(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> log_scale(-3.0f, 1.0f);
  std::uniform_int_distribution<int> dim(0, kHeadDim - 1);
  std::vector<uint16_t> rows(n * kHeadDim);
  for (int64_t r = 0; r < n; ++r) {
    const float scale = std::pow(10.0f, log_scale(rng));
    for (int d = 0; d < kHeadDim; ++d) {
      rows[r * kHeadDim + d] = numerics::FloatToBf16(normal(rng) * scale);
    }
    for (int k = 0; k < 3; ++k) {
      rows[r * kHeadDim + dim(rng)] = numerics::FloatToBf16(normal(rng) * scale * 20.0f);
    }
  }
  return rows;
}

// n distinct locations drawn from [0, num_tokens), in random order.
inline std::vector<int64_t> ScatteredLocations(int64_t n, int64_t num_tokens, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> all(num_tokens);
  std::iota(all.begin(), all.end(), 0);
  for (int64_t i = 0; i < n; ++i) {
    std::uniform_int_distribution<int64_t> pick(i, num_tokens - 1);
    std::swap(all[i], all[pick(rng)]);
  }
  all.resize(n);
  return all;
}

}  // namespace kvferry::testing
