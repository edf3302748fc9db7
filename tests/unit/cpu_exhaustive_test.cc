// Exhaustive per-value checks of the cpu fast path against the reference, on every target:
// every finite bf16 value under every scale a store can give its tile, and every stored
// code under every scale byte (valid or not).
#include <algorithm>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "common/cpu_targets.h"
#include "cpu/fp4_tables.h"
#include "common/golden.h"
#include "common/random_rows.h"
#include "gtest/gtest.h"
#include "kvferry/kernels/cpu_ops.h"
#include "kvferry/kernels/numerics.h"
#include "kvferry/kernels/ops.h"

namespace kvferry {
namespace {

using testing::ForEachCpuTarget;

constexpr int kMaxFiniteMagnitude = 0x7F7F;
constexpr int kPageSize = 64;

int QuantizedTiles(Layout layout) {
  const LayoutInfo info = GetLayoutInfo(layout);
  return (layout == Layout::kV4 ? kNopeDim : kHeadDim) / info.tile;
}

// The scale (exponent byte or FP4 scale code) the reference gives a tile whose largest
// magnitude has bf16 bits a.
int ScaleOf(Layout layout, int a) {
  const float amax = numerics::Bf16ToFloat(static_cast<uint16_t>(a));
  switch (layout) {
    case Layout::kV4:
      return numerics::V4ScaleExponent(amax);
    case Layout::kV41:
      return numerics::V41ScaleExponent(amax);
    case Layout::kV41Fp4:
      return numerics::Fp4ScaleCode(amax);
  }
  return -1;
}

// For each scale a store can produce, the largest finite magnitude whose tile gets it. A
// code depends only on the value and its tile's scale, and a tile's values are at most its
// amax, so tiles led by these amaxes and filled with every smaller magnitude reach every
// (value, scale) pair a store can meet.
std::vector<int> LargestAmaxPerScale(Layout layout) {
  std::map<int, int> largest;
  for (int a = 0; a <= kMaxFiniteMagnitude; ++a) largest[ScaleOf(layout, a)] = a;
  std::vector<int> amaxes;
  for (const auto& [scale, a] : largest) amaxes.push_back(a);
  return amaxes;
}

// Rows whose quantized tiles hold, for every scale, its largest amax followed by every
// finite bf16 value of at most that magnitude, both signs (-0 included). V4's RoPE dims
// cycle through every finite bf16 value.
std::vector<uint16_t> EveryValueUnderEveryScale(Layout layout, int* num_scales) {
  const int tile = GetLayoutInfo(layout).tile;
  std::vector<uint16_t> tiles;
  const std::vector<int> amaxes = LargestAmaxPerScale(layout);
  *num_scales = static_cast<int>(amaxes.size());
  for (const int amax : amaxes) {
    int64_t in_tile = 0;
    for (int m = 0; m <= amax; ++m) {
      for (const uint16_t sign : {uint16_t{0}, uint16_t{0x8000}}) {
        if (in_tile % tile == 0) {
          // Alternate the sign of the tile's leading amax too.
          tiles.push_back(static_cast<uint16_t>(amax | ((tiles.size() / tile) % 2 ? 0x8000 : 0)));
          ++in_tile;
        }
        tiles.push_back(static_cast<uint16_t>(m | sign));
        ++in_tile;
      }
    }
    while (in_tile % tile != 0) {
      tiles.push_back(0);
      ++in_tile;
    }
  }
  const int per_row = QuantizedTiles(layout) * tile;
  const int64_t num_rows = (static_cast<int64_t>(tiles.size()) + per_row - 1) / per_row;
  tiles.resize(num_rows * per_row, 0);
  std::vector<uint16_t> rows(num_rows * kHeadDim);
  uint16_t rope = 0;
  for (int64_t r = 0; r < num_rows; ++r) {
    std::copy_n(tiles.begin() + r * per_row, per_row, rows.begin() + r * kHeadDim);
    for (int d = per_row; d < kHeadDim; ++d) {
      while ((rope & 0x7F80) == 0x7F80) ++rope;  // skip NaN and Inf
      rows[r * kHeadDim + d] = rope++;
    }
  }
  return rows;
}

std::vector<int64_t> Sequential(int64_t n) {
  std::vector<int64_t> locs(n);
  for (int64_t i = 0; i < n; ++i) locs[i] = i;
  return locs;
}

class CpuExhaustiveTest : public ::testing::TestWithParam<Layout> {};

TEST_P(CpuExhaustiveTest, EveryFiniteBf16UnderEveryScaleQuantizesAsTheReference) {
  const Layout layout = GetParam();
  int num_scales = 0;
  const std::vector<uint16_t> rows = EveryValueUnderEveryScale(layout, &num_scales);
  const int64_t n = static_cast<int64_t>(rows.size()) / kHeadDim;
  const PoolGeometry g{layout, kPageSize, (n + kPageSize - 1) / kPageSize};
  const std::vector<int64_t> locs = Sequential(n);
  std::vector<uint8_t> expected(g.pool_bytes(), 0);
  ASSERT_TRUE(reference::QuantizeStore(g, rows, locs, expected).ok());
  std::vector<uint16_t> expected_rows(rows.size());
  ASSERT_TRUE(reference::DequantizeGather(g, expected, locs, expected_rows).ok());
  RecordProperty("scales", num_scales);
  RecordProperty("rows", static_cast<int>(n));
  ForEachCpuTarget([&] {
    std::vector<uint8_t> pool(g.pool_bytes(), 0);
    ASSERT_TRUE(cpu::QuantizeStore(g, rows, locs, pool).ok());
    const auto diff = std::mismatch(pool.begin(), pool.end(), expected.begin());
    ASSERT_TRUE(diff.first == pool.end()) << "pool byte " << diff.first - pool.begin();
    std::vector<uint16_t> back(rows.size());
    ASSERT_TRUE(cpu::DequantizeGather(g, pool, locs, back).ok());
    const auto row_diff = std::mismatch(back.begin(), back.end(), expected_rows.begin());
    ASSERT_TRUE(row_diff.first == back.end()) << "value " << row_diff.first - back.begin();
  });
}

// Every finite magnitude as a tile's amax, at every tile position of a row and with either
// sign: the fast path computes tile scales without the scalar rules (integer bit tests,
// tile maxima reduced several at a time), so each amax must give the reference's scale byte.
// The rest of each tile is random values of smaller magnitude. Both stores are checked
// (the two-pass one and the one for rows already checked finite).
TEST_P(CpuExhaustiveTest, EveryFiniteAmaxGivesTheReferenceScaleAtEveryTilePosition) {
  const Layout layout = GetParam();
  const int tile = GetLayoutInfo(layout).tile;
  const int tiles_per_row = QuantizedTiles(layout);
  // Shift the amaxes by one tile position per pass so each amax meets every position.
  const int64_t per_pass = (kMaxFiniteMagnitude + 1 + tiles_per_row - 1) / tiles_per_row;
  const int64_t n = per_pass * tiles_per_row;
  std::vector<uint16_t> rows(n * kHeadDim);
  testing::FastRandom rng(static_cast<uint64_t>(layout) + 31);
  for (int64_t r = 0; r < n; ++r) {
    const int64_t pass = r / per_pass;
    for (int t = 0; t < tiles_per_row; ++t) {
      const int amax = static_cast<int>(((r % per_pass) * tiles_per_row + (t + pass) % tiles_per_row) %
                                        (kMaxFiniteMagnitude + 1));
      uint16_t* at = rows.data() + r * kHeadDim + t * tile;
      for (int i = 0; i < tile; ++i) {
        at[i] = static_cast<uint16_t>((rng.Next() % (amax + 1)) | (rng.Next() & 0x8000));
      }
      at[rng.Next() % tile] = static_cast<uint16_t>(amax | (rng.Next() & 0x8000));
    }
    for (int d = tiles_per_row * tile; d < kHeadDim; ++d) {  // V4's RoPE dims
      rows[r * kHeadDim + d] = static_cast<uint16_t>(rng.Next() % (kMaxFiniteMagnitude + 1));
    }
  }
  const PoolGeometry g{layout, kPageSize, (n + kPageSize - 1) / kPageSize};
  const std::vector<int64_t> locs = Sequential(n);
  std::vector<uint8_t> expected(g.pool_bytes(), 0);
  ASSERT_TRUE(reference::QuantizeStore(g, rows, locs, expected).ok());
  ForEachCpuTarget([&] {
    for (const bool checked : {false, true}) {
      std::vector<uint8_t> pool(g.pool_bytes(), 0);
      ASSERT_TRUE((checked ? cpu::QuantizeStoreCheckedRows(g, rows, locs, pool)
                           : cpu::QuantizeStore(g, rows, locs, pool))
                      .ok());
      const auto diff = std::mismatch(pool.begin(), pool.end(), expected.begin());
      ASSERT_TRUE(diff.first == pool.end())
          << (checked ? "rows checked: " : "") << "pool byte " << diff.first - pool.begin();
    }
  });
}

// The 512-bit scale pass codes a V41_FP4 tile by arithmetic and Fp4Tables::scale_by_mantissa
// where the amax is at least scale_fast_min, and by the fp32 rule's subnormal step below it
// (which holds only where the scale is subnormal, amax below 0x3DC0). The
// formula must give the reference's code for every such amax, and must reach down to every
// tile whose scale is a normal e4m3 value (amax / 6 >= 2^-6, amax >= 0.09375: bf16 0x3DC0),
// or tiles of ordinary magnitudes would leave the fast path without any test failing.
TEST(CpuFp4TablesTest, TheScaleFormulaGivesTheReferenceCodeWhereverTheScaleIsNormal) {
  const cpu::internal::Fp4Tables& tables = cpu::internal::Fp4Tables::Get();
  EXPECT_LE(tables.scale_fast_min, 0x3DC0);
  for (int a = tables.scale_fast_min; a <= kMaxFiniteMagnitude; ++a) {
    const int formula = std::min((a >> 4) + tables.scale_by_mantissa[a & 0x7F],
                                 cpu::internal::kFp4ScaleFastLimit) & 0xFF;
    ASSERT_EQ(formula, numerics::Fp4ScaleCode(numerics::Bf16ToFloat(static_cast<uint16_t>(a))))
        << "amax bits " << a;
    ASSERT_EQ(tables.scale_by_mantissa16[a & 0x7F], tables.scale_by_mantissa[a & 0x7F]);
  }
}

// A pool whose records hold every code under every scale byte 0..255, including bytes no
// store writes (V4/V41 exponents 0 and 255, negative or NaN-coded FP4 scales): a reader
// must still give the reference's bytes for them.
//
// With `without_e4m3_subnormals`, V4/V41 codes with magnitude 1..7 are replaced by 0x08, so
// that rows reach the decoder the cpu path keeps for rows without them.
std::vector<uint8_t> EveryCodeUnderEveryScaleByte(const PoolGeometry& g, int64_t* num_rows,
                                                  bool without_e4m3_subnormals = false) {
  const LayoutInfo info = GetLayoutInfo(g.layout);
  const int tiles_per_row = QuantizedTiles(g.layout);
  const int tile_bytes = g.layout == Layout::kV41Fp4 ? info.tile / 2 : info.tile;
  // Per scale byte: V4/V41 tiles with codes 0..255 in order; FP4 two tiles, every nibble
  // once in the low and once in the high position.
  const int tiles_per_scale = g.layout == Layout::kV41Fp4 ? 2 : 256 / info.tile;
  const int64_t total_tiles = 256 * tiles_per_scale;
  *num_rows = (total_tiles + tiles_per_row - 1) / tiles_per_row;
  std::vector<uint8_t> pool(g.pool_bytes(), 0);
  testing::FastRandom rng(77);
  for (int64_t r = 0; r < *num_rows; ++r) {
    const RecordOffsets at = LocateRecord(g, r);
    uint8_t* data = pool.data() + at.data;
    uint8_t* scale = pool.data() + at.scale;
    for (int b = 0; b < info.data_bytes; ++b) data[b] = static_cast<uint8_t>(rng.Next());
    for (int b = 0; b < info.scale_bytes; ++b) scale[b] = static_cast<uint8_t>(rng.Next());
    for (int t = 0; t < tiles_per_row; ++t) {
      const int64_t k = r * tiles_per_row + t;
      if (k >= total_tiles) break;
      scale[t] = static_cast<uint8_t>(k / tiles_per_scale);
      const int part = static_cast<int>(k % tiles_per_scale);
      for (int j = 0; j < tile_bytes; ++j) {
        data[t * tile_bytes + j] =
            g.layout == Layout::kV41Fp4
                ? static_cast<uint8_t>(part == 0 ? (2 * j) | ((2 * j + 1) << 4)
                                                 : (2 * j + 1) | ((2 * j) << 4))
                : static_cast<uint8_t>(part * tile_bytes + j);
      }
    }
    if (without_e4m3_subnormals && g.layout != Layout::kV41Fp4) {
      for (int b = 0; b < tiles_per_row * tile_bytes; ++b) {
        if ((data[b] & 0x7F) != 0 && (data[b] & 0x7F) < 8) data[b] = 0x08;
      }
    }
  }
  return pool;
}

class CpuEveryCodeTest : public ::testing::TestWithParam<std::tuple<Layout, bool>> {};

TEST_P(CpuEveryCodeTest, EveryCodeUnderEveryScaleByteDequantizesAndTranscodesAsTheReference) {
  const PoolGeometry g{std::get<0>(GetParam()), kPageSize, 3};
  int64_t n = 0;
  const std::vector<uint8_t> pool = EveryCodeUnderEveryScaleByte(g, &n, std::get<1>(GetParam()));
  ASSERT_LE(n, g.num_tokens());
  const std::vector<int64_t> locs = Sequential(n);
  std::vector<uint16_t> expected(n * kHeadDim);
  ASSERT_TRUE(reference::DequantizeGather(g, pool, locs, expected).ok());
  // Transcoding these records feeds NaN, Inf and huge values to the quantizers too.
  std::vector<std::vector<uint8_t>> expected_transcodes;
  for (const Layout to : testing::AllLayouts()) {
    expected_transcodes.emplace_back(PoolGeometry{to, kPageSize, 3}.pool_bytes(), 0);
    ASSERT_TRUE(reference::Transcode(g, pool, PoolGeometry{to, kPageSize, 3},
                                     expected_transcodes.back(), locs)
                    .ok());
  }
  ForEachCpuTarget([&] {
    std::vector<uint16_t> out(n * kHeadDim);
    ASSERT_TRUE(cpu::DequantizeGather(g, pool, locs, out).ok());
    for (int64_t i = 0; i < n * kHeadDim; ++i) {
      ASSERT_EQ(out[i], expected[i]) << "row " << i / kHeadDim << " dim " << i % kHeadDim;
    }
    for (const Layout to : testing::AllLayouts()) {
      std::vector<uint8_t> dst(PoolGeometry{to, kPageSize, 3}.pool_bytes(), 0);
      ASSERT_TRUE(cpu::Transcode(g, pool, PoolGeometry{to, kPageSize, 3}, dst, locs).ok());
      EXPECT_TRUE(dst == expected_transcodes[static_cast<int>(to)]) << LayoutName(to);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, CpuEveryCodeTest,
    ::testing::Combine(::testing::Values(Layout::kV4, Layout::kV41, Layout::kV41Fp4),
                       ::testing::Bool()),
    [](const ::testing::TestParamInfo<std::tuple<Layout, bool>>& info) {
      return std::string(LayoutName(std::get<0>(info.param))) +
             (std::get<1>(info.param) ? "_without_subnormal_codes" : "");
    });

TEST_P(CpuExhaustiveTest, RandomPoolBytesDequantizeAndTranscodeAsTheReference) {
  const PoolGeometry g{GetParam(), 16, 40};
  std::vector<uint8_t> pool(g.pool_bytes());
  testing::FastRandom rng(static_cast<uint64_t>(GetParam()) + 100);
  for (uint8_t& b : pool) b = static_cast<uint8_t>(rng.Next());
  const std::vector<int64_t> locs = Sequential(g.num_tokens());
  std::vector<uint16_t> expected(locs.size() * kHeadDim);
  ASSERT_TRUE(reference::DequantizeGather(g, pool, locs, expected).ok());
  ForEachCpuTarget([&] {
    std::vector<uint16_t> out(expected.size());
    ASSERT_TRUE(cpu::DequantizeGather(g, pool, locs, out).ok());
    EXPECT_TRUE(out == expected);
    for (const Layout to : testing::AllLayouts()) {
      const PoolGeometry to_g{to, 16, 40};
      std::vector<uint8_t> want(to_g.pool_bytes(), 0), got(to_g.pool_bytes(), 0);
      ASSERT_TRUE(reference::Transcode(g, pool, to_g, want, locs).ok());
      ASSERT_TRUE(cpu::Transcode(g, pool, to_g, got, locs).ok());
      EXPECT_TRUE(got == want) << LayoutName(to);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Layouts, CpuExhaustiveTest,
                         ::testing::Values(Layout::kV4, Layout::kV41, Layout::kV41Fp4),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return std::string(LayoutName(info.param));
                         });

}  // namespace
}  // namespace kvferry
