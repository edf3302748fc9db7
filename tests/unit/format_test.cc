// The layout constants and page addressing against the numbers stated in the spec.
#include "kvferry/kernels/format.h"

#include <cmath>

#include "common/golden.h"
#include "gtest/gtest.h"

namespace kvferry {
namespace {

TEST(FormatTest, BytesPerTokenMatchSpecTable) {
  EXPECT_EQ(GetLayoutInfo(Layout::kV4).bytes_per_token(), 584);
  EXPECT_EQ(GetLayoutInfo(Layout::kV41).bytes_per_token(), 528);
  EXPECT_EQ(GetLayoutInfo(Layout::kV41Fp4).bytes_per_token(), 288);
  EXPECT_EQ(GetLayoutInfo(Layout::kV4).data_bytes, 576);
  EXPECT_EQ(GetLayoutInfo(Layout::kV41).scale_bytes, 16);
  EXPECT_EQ(GetLayoutInfo(Layout::kV41Fp4).scale_bytes, 32);
}

TEST(FormatTest, PageBytesMatchSpecExamples) {
  EXPECT_EQ(PageBytes(Layout::kV4, 64), 37440);
  EXPECT_EQ(PageBytes(Layout::kV4, 256), 149760);
  EXPECT_EQ(PageBytes(Layout::kV41, 64), 33792);
  EXPECT_EQ(PageBytes(Layout::kV41Fp4, 64), 18432);
  EXPECT_EQ(PageBytes(Layout::kV4, 1), 1152);  // one 584-byte record padded to 2 × 576
}

TEST(FormatTest, PageBytesMatchGoldenCaseFiles) {
  for (const testing::GoldenCase& c : testing::GoldenCases()) {
    for (Layout layout : testing::AllLayouts()) {
      SCOPED_TRACE(c.name + " " + LayoutName(layout));
      EXPECT_EQ(PageBytes(layout, c.page_size), c.layout(layout).page_bytes);
      EXPECT_EQ(GetLayoutInfo(layout).bytes_per_token(), c.layout(layout).bytes_per_token);
    }
  }
}

TEST(FormatTest, PaddingVanishesWhereSpecSaysSo) {
  // V4 always pads (585 effective B/token at 64 and 256); V41 not at multiples of 32,
  // V41_FP4 not at multiples of 8.
  EXPECT_DOUBLE_EQ(ComputeSavings(Layout::kV4, 64).effective_bytes_per_token, 585.0);
  EXPECT_DOUBLE_EQ(ComputeSavings(Layout::kV4, 256).effective_bytes_per_token, 585.0);
  for (int p = 32; p <= kMaxPageSize; p *= 2) {
    EXPECT_EQ(PageBytes(Layout::kV41, p), int64_t{p} * 528) << p;
  }
  for (int p = 8; p <= kMaxPageSize; p *= 2) {
    EXPECT_EQ(PageBytes(Layout::kV41Fp4, p), int64_t{p} * 288) << p;
  }
  EXPECT_GT(PageBytes(Layout::kV41, 16), 16 * 528);
}

TEST(FormatTest, NominalSavingsMatchSpecTable) {
  auto pct = [](double f) { return std::round(f * 1000.0) / 10.0; };
  EXPECT_DOUBLE_EQ(pct(ComputeSavings(Layout::kV4, 64).nominal_saved_vs_bf16), 43.0);
  EXPECT_DOUBLE_EQ(pct(ComputeSavings(Layout::kV4, 64).nominal_saved_vs_v4), 0.0);
  EXPECT_DOUBLE_EQ(pct(ComputeSavings(Layout::kV41, 64).nominal_saved_vs_bf16), 48.4);
  EXPECT_DOUBLE_EQ(pct(ComputeSavings(Layout::kV41, 64).nominal_saved_vs_v4), 9.6);
  EXPECT_DOUBLE_EQ(pct(ComputeSavings(Layout::kV41Fp4, 64).nominal_saved_vs_bf16), 71.9);
  EXPECT_DOUBLE_EQ(pct(ComputeSavings(Layout::kV41Fp4, 64).nominal_saved_vs_v4), 50.7);
}

TEST(FormatTest, PageSizeMustBePowerOfTwoUpTo4096) {
  for (int p = 1; p <= 4096; p *= 2) EXPECT_TRUE(IsValidPageSize(p)) << p;
  for (int64_t p : {0, -1, -64, 3, 48, 100, 4095, 8192, 1 << 20}) {
    EXPECT_FALSE(IsValidPageSize(p)) << p;
  }
}

TEST(FormatTest, RecordAddressFollowsSpecFormula) {
  const PoolGeometry g{Layout::kV41, 64, 8};
  // token 3 * 64 + 5: page 3, slot 5.
  const RecordOffsets at = LocateRecord(g, 3 * 64 + 5);
  EXPECT_EQ(at.data, 3 * 33792 + 5 * 512);
  EXPECT_EQ(at.scale, 3 * 33792 + 64 * 512 + 5 * 16);
}

TEST(FormatTest, LayoutNamesRoundTrip) {
  for (Layout layout : testing::AllLayouts()) {
    Layout parsed;
    ASSERT_TRUE(ParseLayoutName(LayoutName(layout), &parsed));
    EXPECT_EQ(parsed, layout);
  }
  Layout unused;
  EXPECT_FALSE(ParseLayoutName("V4", &unused));
  EXPECT_FALSE(ParseLayoutName("fp8", &unused));
}

}  // namespace
}  // namespace kvferry
