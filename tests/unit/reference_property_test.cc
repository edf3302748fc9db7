// Properties of the reference ops on random inputs: error bounds, transcode identity,
// untouched bytes, and the page copy round trip.
#include <cmath>

#include "common/random_rows.h"
#include "common/stored_rows.h"
#include "gtest/gtest.h"
#include "kvferry/kernels/numerics.h"
#include "kvferry/kernels/ops.h"

namespace kvferry {
namespace {

using numerics::Bf16ToFloat;

class ReferencePropertyTest : public ::testing::TestWithParam<Layout> {};

// Per-element bound from the formats alone: e4m3 keeps 3 mantissa bits (half-ulp error
// |x| / 16) down to its subnormal step 2^-9 of the scale; e2m1 codes are at most two
// units of the scale apart (4 → 6), so the error is at most the scale, unless it saturates.
TEST_P(ReferencePropertyTest, RoundTripErrorWithinFormatBound) {
  const Layout layout = GetParam();
  const PoolGeometry g{layout, 64, 40};
  const int64_t n = 2000;
  const auto stored = testing::StoreRandomRows(g, n, 7, 8, std::vector<uint8_t>(g.pool_bytes(), 0));
  ASSERT_TRUE(stored.ok()) << stored.status();
  const auto& [rows, locs, pool] = *stored;
  std::vector<uint16_t> back(rows.size());
  ASSERT_TRUE(reference::DequantizeGather(g, pool, locs, back).ok());
  const int tile = GetLayoutInfo(layout).tile;
  for (int64_t r = 0; r < n; ++r) {
    for (int t = 0; t < kHeadDim / tile; ++t) {
      double amax = 0;
      for (int d = t * tile; d < (t + 1) * tile; ++d) {
        amax = std::max(amax, std::fabs(double{Bf16ToFloat(rows[r * kHeadDim + d])}));
      }
      for (int d = t * tile; d < (t + 1) * tile; ++d) {
        const double x = Bf16ToFloat(rows[r * kHeadDim + d]);
        const double y = Bf16ToFloat(back[r * kHeadDim + d]);
        double bound;
        if (layout == Layout::kV4 && d >= kNopeDim) {
          bound = 0;  // RoPE dims are copied bit for bit
        } else if (layout == Layout::kV41Fp4) {
          // S is e4m3(max(amax/6, 2^-9)): off by 1/16 relative, or 2^-10 where subnormal.
          // Codes are within S of x, except where x/S saturates at 6.
          const double m = std::max(amax / 6.0, std::ldexp(1.0, -9));
          const double s_hi = m * 17.0 / 16.0 + std::ldexp(1.0, -10);
          const double s_lo = std::max(m * 15.0 / 16.0 - std::ldexp(1.0, -10), std::ldexp(1.0, -9));
          bound = std::max(s_hi, amax - 6.0 * s_lo);
        } else {
          // scale 2^e <= 2 * max(amax, floor) / 448; subnormal step 2^-9 of it.
          const double floor = layout == Layout::kV4 ? 1e-4 : 448.0 * std::ldexp(1.0, -13);
          const double s = 2.0 * std::max(amax, floor) / 448.0;
          bound = std::max(std::fabs(x) / 16.0, s * std::ldexp(1.0, -10));
        }
        ASSERT_LE(std::fabs(x - y), bound) << "row " << r << " dim " << d << " x=" << x;
      }
    }
  }
}

TEST_P(ReferencePropertyTest, TranscodeEqualsQuantizeOfDequantize) {
  const Layout from = GetParam();
  const PoolGeometry src_g{from, 16, 50};
  const int64_t n = 500;
  const auto stored =
      testing::StoreRandomRows(src_g, n, 11, 12, std::vector<uint8_t>(src_g.pool_bytes(), 0));
  ASSERT_TRUE(stored.ok()) << stored.status();
  const auto& [rows, locs, src] = *stored;
  for (Layout to : {Layout::kV4, Layout::kV41, Layout::kV41Fp4}) {
    const PoolGeometry dst_g{to, 16, 50};
    std::vector<uint8_t> transcoded(dst_g.pool_bytes(), 0);
    ASSERT_TRUE(reference::Transcode(src_g, src, dst_g, transcoded, locs).ok());
    std::vector<uint16_t> dequantized(rows.size());
    ASSERT_TRUE(reference::DequantizeGather(src_g, src, locs, dequantized).ok());
    std::vector<uint8_t> requantized(dst_g.pool_bytes(), 0);
    ASSERT_TRUE(reference::QuantizeStore(dst_g, dequantized, locs, requantized).ok());
    EXPECT_EQ(transcoded, requantized) << LayoutName(from) << " -> " << LayoutName(to);
  }
}

TEST_P(ReferencePropertyTest, BytesOutsideWrittenRecordsStayZero) {
  const Layout layout = GetParam();
  for (int page_size : {1, 16, 64, 256}) {
    const PoolGeometry g{layout, page_size, 8};
    const int64_t n = std::max<int64_t>(1, g.num_tokens() / 3);
    const auto stored =
        testing::StoreRandomRows(g, n, 21, 22, std::vector<uint8_t>(g.pool_bytes(), 0));
    ASSERT_TRUE(stored.ok()) << stored.status();
    const auto& [rows, locs, pool] = *stored;
    // Mark the written records from the spec's formulas (§3), independently of LocateRecord.
    const LayoutInfo info = GetLayoutInfo(layout);
    const int64_t page_bytes = g.page_bytes();
    std::vector<bool> written(pool.size(), false);
    for (int64_t loc : locs) {
      const int64_t page = loc / page_size, slot = loc % page_size;
      for (int b = 0; b < info.data_bytes; ++b) {
        written[page * page_bytes + slot * info.data_bytes + b] = true;
      }
      // V4's eighth scale byte is padding: it must stay zero too.
      const int live_scales = layout == Layout::kV4 ? 7 : info.scale_bytes;
      for (int b = 0; b < live_scales; ++b) {
        written[page * page_bytes + page_size * info.data_bytes + slot * info.scale_bytes + b] =
            true;
      }
    }
    int64_t nonzero_outside = 0, nonzero_inside = 0;
    for (size_t i = 0; i < pool.size(); ++i) {
      if (pool[i] != 0) ++(written[i] ? nonzero_inside : nonzero_outside);
    }
    EXPECT_EQ(nonzero_outside, 0) << "page size " << page_size;
    EXPECT_GT(nonzero_inside, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, ReferencePropertyTest,
                         ::testing::Values(Layout::kV4, Layout::kV41, Layout::kV41Fp4),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return std::string(LayoutName(info.param));
                         });

TEST(ReferencePageCopyTest, GatherThenScatterRestoresListedPagesOnly) {
  const PageCopyGeometry g{1000, 12, 3};
  std::vector<uint8_t> pool(g.pool_bytes());
  for (size_t i = 0; i < pool.size(); ++i) pool[i] = static_cast<uint8_t>(i * 131 + 7);
  const std::vector<int64_t> pages = {9, 2, 5};
  std::vector<uint8_t> buffer(g.buffer_bytes(pages.size()));
  ASSERT_TRUE(reference::GatherPages(g, pool, pages, buffer).ok());
  // Buffer layout: [listed page][layer][page_bytes].
  for (size_t p = 0; p < pages.size(); ++p) {
    for (int layer = 0; layer < g.num_layers; ++layer) {
      const int64_t src = layer * g.num_pages * g.page_bytes + pages[p] * g.page_bytes;
      const int64_t dst = (p * g.num_layers + layer) * g.page_bytes;
      ASSERT_TRUE(std::equal(buffer.begin() + dst, buffer.begin() + dst + g.page_bytes,
                             pool.begin() + src));
    }
  }
  std::vector<uint8_t> target(pool.size(), 0);
  ASSERT_TRUE(reference::ScatterPages(g, buffer, pages, target).ok());
  for (int layer = 0; layer < g.num_layers; ++layer) {
    for (int64_t page = 0; page < g.num_pages; ++page) {
      const bool listed = page == 9 || page == 2 || page == 5;
      const int64_t at = layer * g.num_pages * g.page_bytes + page * g.page_bytes;
      for (int64_t b = 0; b < g.page_bytes; ++b) {
        ASSERT_EQ(target[at + b], listed ? pool[at + b] : 0) << layer << " " << page;
      }
    }
  }
}

TEST(ReferencePageCopyTest, ZeroPagesClearsEveryLayerOfTheListedPagesOnly) {
  const PageCopyGeometry g{1000, 12, 3};
  std::vector<uint8_t> pool(g.pool_bytes());
  for (size_t i = 0; i < pool.size(); ++i) pool[i] = static_cast<uint8_t>(i * 131 + 7) | 1;
  const std::vector<uint8_t> before = pool;
  ASSERT_TRUE(reference::ZeroPages(g, std::vector<int64_t>{9, 2, 9}, pool).ok());
  for (int layer = 0; layer < g.num_layers; ++layer) {
    for (int64_t page = 0; page < g.num_pages; ++page) {
      const bool listed = page == 9 || page == 2;
      const int64_t at = layer * g.num_pages * g.page_bytes + page * g.page_bytes;
      for (int64_t b = 0; b < g.page_bytes; ++b) {
        ASSERT_EQ(pool[at + b], listed ? 0 : before[at + b]) << layer << " " << page;
      }
    }
  }
}

TEST(ReferencePageCopyTest, ZeroPagesWithAPageOutOfRangeChangesNothing) {
  const PageCopyGeometry g{1000, 12, 3};
  std::vector<uint8_t> pool(g.pool_bytes(), 0xAB);
  const absl::Status s = reference::ZeroPages(g, std::vector<int64_t>{1, 12}, pool);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("page 1 is 12, outside [0, 12)"), std::string::npos) << s;
  EXPECT_TRUE(std::all_of(pool.begin(), pool.end(), [](uint8_t b) { return b == 0xAB; }));
}

}  // namespace
}  // namespace kvferry
