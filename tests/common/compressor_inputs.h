// Random compressor inputs (kv, score, weight, RoPE table) for tests and benchmarks.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "common/random_rows.h"
#include "kvferry/kernels/compressor.h"

namespace kvferry::testing {

struct CompressorInputs {
  int ratio;
  int64_t first_position, num_rows;
  std::vector<float> kv, score, cos, sin;
  std::vector<uint16_t> weight;
  CompressorWindows windows;
  std::vector<int64_t> entry_locs;

  // Params pointing at this object's host arrays, storing into `pool`.
  CompressorParams Params(const PoolGeometry& geometry, uint8_t* pool) const {
    CompressorParams p;
    p.ratio = ratio;
    p.kv = kv.data();
    p.score = score.data();
    p.num_rows = num_rows;
    p.first_position = first_position;
    p.norm_weight = weight.data();
    p.rope_cos = cos.data();
    p.rope_sin = sin.data();
    p.num_rope_positions = static_cast<int64_t>(cos.size() / 32);
    p.geometry = geometry;
    p.pool = pool;
    p.entry_locs = entry_locs.data();
    p.num_entries = windows.count;
    return p;
  }
};

// Rows for positions [first_position, first_position + num_rows); entries stored at
// scattered locations of a pool with `pool_tokens` slots.
inline CompressorInputs MakeCompressorInputs(int ratio, int64_t first_position, int64_t num_rows,
                                             int64_t pool_tokens, uint64_t seed) {
  CompressorInputs in{ratio, first_position, num_rows};
  FastRandom rng(seed);
  const int64_t width = int64_t{CompressorCoff(ratio)} * kHeadDim;
  in.kv.resize(num_rows * width);
  in.score.resize(num_rows * width);
  for (auto& v : in.kv) v = rng.Normal() * 0.8f;
  for (auto& v : in.score) v = rng.Normal() * 2.0f;
  in.weight.resize(kHeadDim);
  for (auto& w : in.weight) w = numerics::FloatToBf16(1.0f + 0.2f * rng.Normal());
  const int64_t positions = first_position + num_rows;
  in.cos.resize(positions * 32);
  in.sin.resize(positions * 32);
  for (int64_t q = 0; q < positions; ++q) {
    for (int i = 0; i < 32; ++i) {
      const double angle = q * std::pow(10000.0, -2.0 * i / 64.0);
      in.cos[q * 32 + i] = static_cast<float>(std::cos(angle));
      in.sin[q * 32 + i] = static_cast<float>(std::sin(angle));
    }
  }
  in.windows = CompressorEntries(ratio, first_position, num_rows);
  in.entry_locs = ScatteredLocations(in.windows.count, pool_tokens, seed + 1);
  return in;
}

}  // namespace kvferry::testing
