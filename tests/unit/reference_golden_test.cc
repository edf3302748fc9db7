// The CPU reference reproduces every golden vector of testdata/kv-formats byte for byte.
#include <cmath>
#include <string>

#include "common/golden.h"
#include "gtest/gtest.h"
#include "kvferry/kernels/numerics.h"
#include "kvferry/kernels/ops.h"

namespace kvferry {
namespace {

using testing::FirstDifference;
using testing::GoldenCase;
using testing::ReadArray;
using testing::ReadBytes;

class ReferenceGoldenTest : public ::testing::TestWithParam<testing::GoldenParam> {
 protected:
  void SetUp() override { c_ = testing::LoadGoldenCase(GetParam().case_name); }
  std::string Name() const { return LayoutName(GetParam().layout); }
  GoldenCase c_;
};

TEST_P(ReferenceGoldenTest, QuantizeStoreReproducesPool) {
  const auto rows = ReadArray<uint16_t>(c_.file("input.bf16"));
  const auto locs = ReadArray<int64_t>(c_.file("locs.i64"));
  const auto golden = ReadBytes(c_.file("pool." + Name() + ".bin"));
  ASSERT_EQ(static_cast<int64_t>(locs.size()), c_.tokens);
  const PoolGeometry g = c_.geometry(GetParam().layout);
  std::vector<uint8_t> pool(g.pool_bytes(), 0);
  ASSERT_TRUE(reference::QuantizeStore(g, rows, locs, pool).ok());
  ASSERT_EQ(pool.size(), golden.size());
  EXPECT_EQ(FirstDifference(pool, golden), -1);
}

TEST_P(ReferenceGoldenTest, DequantizeGatherReproducesRows) {
  const auto locs = ReadArray<int64_t>(c_.file("locs.i64"));
  const auto pool = ReadBytes(c_.file("pool." + Name() + ".bin"));
  const auto golden = ReadArray<uint16_t>(c_.file("dequant." + Name() + ".bf16"));
  std::vector<uint16_t> rows(locs.size() * kHeadDim, 0xFFFF);
  ASSERT_TRUE(reference::DequantizeGather(c_.geometry(GetParam().layout), pool, locs, rows).ok());
  EXPECT_EQ(FirstDifference(rows, golden), -1);
}

TEST_P(ReferenceGoldenTest, TranscodeToV4ReproducesGolden) {
  const auto locs = ReadArray<int64_t>(c_.file("locs.i64"));
  const auto src = ReadBytes(c_.file("pool." + Name() + ".bin"));
  const auto golden = ReadBytes(c_.file("transcode." + Name() + "_to_v4.bin"));
  const PoolGeometry to = c_.geometry(Layout::kV4);
  std::vector<uint8_t> dst(to.pool_bytes(), 0);
  ASSERT_TRUE(reference::Transcode(c_.geometry(GetParam().layout), src, to, dst, locs).ok());
  EXPECT_EQ(FirstDifference(dst, golden), -1);
}

TEST_P(ReferenceGoldenTest, RoundTripErrorMatchesCaseFile) {
  // relative L2 of dequantize(quantize(x)) against x, as case.json states it (6 digits).
  const auto input = ReadArray<uint16_t>(c_.file("input.bf16"));
  const auto locs = ReadArray<int64_t>(c_.file("locs.i64"));
  const PoolGeometry g = c_.geometry(GetParam().layout);
  std::vector<uint8_t> pool(g.pool_bytes(), 0);
  ASSERT_TRUE(reference::QuantizeStore(g, input, locs, pool).ok());
  std::vector<uint16_t> rows(input.size());
  ASSERT_TRUE(reference::DequantizeGather(g, pool, locs, rows).ok());
  double err = 0, ref = 0;
  for (size_t i = 0; i < input.size(); ++i) {
    const double x = numerics::Bf16ToFloat(input[i]);
    const double y = numerics::Bf16ToFloat(rows[i]);
    err += (x - y) * (x - y);
    ref += x * x;
  }
  EXPECT_NEAR(std::sqrt(err / ref), c_.layout(GetParam().layout).relative_l2_error, 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Golden, ReferenceGoldenTest,
                         ::testing::ValuesIn(testing::AllGoldenParams()),
                         [](const ::testing::TestParamInfo<testing::GoldenParam>& info) {
                           return testing::GoldenParamName(info.param);
                         });

}  // namespace
}  // namespace kvferry
