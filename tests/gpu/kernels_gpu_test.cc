// CUDA kernels against the CPU reference and the golden vectors: every byte compared,
// outputs poisoned before each run so untouched bytes must keep their value.
#include <algorithm>

#include "common/cuda_testing.h"
#include "common/golden.h"
#include "common/random_rows.h"
#include "common/stored_rows.h"
#include "gtest/gtest.h"
#include "kvferry/kernels/cuda_ops.h"
#include "kvferry/kernels/ops.h"

namespace kvferry {
namespace {

using testing::DeviceBuffer;
using testing::Poison;

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!testing::HaveGpu()) GTEST_SKIP() << "no CUDA device";
  }
};

template <typename T>
int64_t FirstDifference(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return -2;
  const auto mismatch = std::mismatch(a.begin(), a.end(), b.begin());
  return mismatch.first == a.end() ? -1 : mismatch.first - a.begin();
}

// ---- golden vectors -------------------------------------------------------------------

class GpuGoldenTest : public GpuTest {};

TEST_F(GpuGoldenTest, EveryGoldenCaseByteForByte) {
  for (const testing::GoldenCase& c : testing::GoldenCases()) {
    const auto rows = testing::ReadArray<uint16_t>(c.file("input.bf16"));
    const auto locs = testing::ReadArray<int64_t>(c.file("locs.i64"));
    DeviceBuffer d_rows(rows), d_locs(locs);
    for (Layout layout : testing::AllLayouts()) {
      const std::string l = LayoutName(layout);
      SCOPED_TRACE(c.name + " " + l);
      const PoolGeometry g = c.geometry(layout);
      // quantize-store into a zero-filled pool
      DeviceBuffer pool(std::vector<uint8_t>(g.pool_bytes(), 0));
      ASSERT_TRUE(cuda::QuantizeStore({g, d_rows.as<uint16_t>(), d_locs.as<int64_t>(),
                                       c.tokens, pool.as<uint8_t>()}, nullptr).ok());
      EXPECT_EQ(FirstDifference(pool.Download<uint8_t>(), testing::ReadBytes(c.file("pool." + l + ".bin"))), -1);
      // dequantize-gather from the golden pool
      DeviceBuffer golden_pool(testing::ReadBytes(c.file("pool." + l + ".bin")));
      DeviceBuffer out(Poison(rows.size() * 2, 5));
      ASSERT_TRUE(cuda::DequantizeGather({g, golden_pool.as<uint8_t>(), d_locs.as<int64_t>(),
                                          c.tokens, out.as<uint16_t>(), kHeadDim}, nullptr).ok());
      EXPECT_EQ(FirstDifference(out.Download<uint16_t>(),
                                testing::ReadArray<uint16_t>(c.file("dequant." + l + ".bf16"))), -1);
      // transcode to V4 into a zero-filled pool
      const PoolGeometry v4 = c.geometry(Layout::kV4);
      DeviceBuffer dst(std::vector<uint8_t>(v4.pool_bytes(), 0));
      ASSERT_TRUE(cuda::Transcode({g, golden_pool.as<uint8_t>(), v4, dst.as<uint8_t>(),
                                   d_locs.as<int64_t>(), c.tokens}, nullptr).ok());
      EXPECT_EQ(FirstDifference(dst.Download<uint8_t>(),
                                testing::ReadBytes(c.file("transcode." + l + "_to_v4.bin"))), -1);
    }
  }
}

// ---- random inputs against the CPU reference ------------------------------------------

struct RandomParam {
  Layout layout;
  int page_size;
};

class GpuRandomTest : public GpuTest, public ::testing::WithParamInterface<RandomParam> {
 protected:
  static constexpr int64_t kSizes[] = {1, 7, 64, 513, 100000};

  // A pool with room for twice the tokens (at least 4 pages), so locations scatter.
  PoolGeometry GeometryFor(int64_t n) const {
    const int p = GetParam().page_size;
    return PoolGeometry{GetParam().layout, p, std::max<int64_t>(4, (2 * n + p - 1) / p)};
  }
};

// Token counts that reach every launch shape quantize-store picks (one block, four
// blocks, ~128 blocks of one chunk per thread; a warp per token above 1024), including
// blocks that hold part of a token.
constexpr int64_t kShapeSizes[] = {2, 3, 5, 9, 16, 17, 31, 33, 100, 129, 300, 1024, 1025, 2047};

TEST_P(GpuRandomTest, QuantizeStoreMatchesReference) {
  std::vector<int64_t> sizes(std::begin(kSizes), std::end(kSizes));
  sizes.insert(sizes.end(), std::begin(kShapeSizes), std::end(kShapeSizes));
  for (int64_t n : sizes) {
    SCOPED_TRACE("tokens " + std::to_string(n));
    const PoolGeometry g = GeometryFor(n);
    std::vector<uint8_t> poison = Poison(g.pool_bytes(), 1);
    DeviceBuffer pool(poison);
    const auto expected = testing::StoreRandomRows(g, n, 100 + n, 200 + n, std::move(poison));
    ASSERT_TRUE(expected.ok()) << expected.status();
    DeviceBuffer d_rows(expected->rows), d_locs(expected->locs);
    ASSERT_TRUE(cuda::QuantizeStore(
        {g, d_rows.as<uint16_t>(), d_locs.as<int64_t>(), n, pool.as<uint8_t>()}, nullptr).ok());
    EXPECT_EQ(FirstDifference(pool.Download<uint8_t>(), expected->pool), -1);
  }
}

TEST_P(GpuRandomTest, DequantizeGatherMatchesReferenceAtAnyStride) {
  for (int64_t n : kSizes) {
    const PoolGeometry g = GeometryFor(n);
    const auto stored = testing::StoreRandomRows(g, n, 300 + n, 400 + n, Poison(g.pool_bytes(), 2));
    ASSERT_TRUE(stored.ok()) << stored.status();
    const std::vector<uint8_t>& pool = stored->pool;
    const std::vector<int64_t>& locs = stored->locs;
    DeviceBuffer d_pool(pool), d_locs(locs);
    // 512: packed; 520: aligned vector path with gaps; 515: unaligned element path.
    for (int64_t stride : {512, 520, 515}) {
      SCOPED_TRACE("tokens " + std::to_string(n) + " stride " + std::to_string(stride));
      const size_t values = (n - 1) * stride + kHeadDim;
      std::vector<uint16_t> expected(values);
      const auto poison = Poison(values * 2, 3);
      std::memcpy(expected.data(), poison.data(), poison.size());
      DeviceBuffer out(expected);
      ASSERT_TRUE(reference::DequantizeGather(g, pool, locs, expected, stride).ok());
      ASSERT_TRUE(cuda::DequantizeGather({g, d_pool.as<uint8_t>(), d_locs.as<int64_t>(), n,
                                          out.as<uint16_t>(), stride}, nullptr).ok());
      EXPECT_EQ(FirstDifference(out.Download<uint16_t>(), expected), -1);
    }
  }
}

TEST_P(GpuRandomTest, TranscodeToEveryLayoutMatchesReference) {
  for (int64_t n : kSizes) {
    const PoolGeometry from = GeometryFor(n);
    const auto stored =
        testing::StoreRandomRows(from, n, 500 + n, 600 + n, Poison(from.pool_bytes(), 4));
    ASSERT_TRUE(stored.ok()) << stored.status();
    const std::vector<uint8_t>& src = stored->pool;
    const std::vector<int64_t>& locs = stored->locs;
    DeviceBuffer d_src(src), d_locs(locs);
    for (Layout to_layout : testing::AllLayouts()) {
      SCOPED_TRACE("tokens " + std::to_string(n) + " to " + LayoutName(to_layout));
      const PoolGeometry to{to_layout, from.page_size, from.num_pages};
      std::vector<uint8_t> expected = Poison(to.pool_bytes(), 5);
      DeviceBuffer dst(expected);
      ASSERT_TRUE(reference::Transcode(from, src, to, expected, locs).ok());
      ASSERT_TRUE(cuda::Transcode({from, d_src.as<uint8_t>(), to, dst.as<uint8_t>(),
                                   d_locs.as<int64_t>(), n}, nullptr).ok());
      EXPECT_EQ(FirstDifference(dst.Download<uint8_t>(), expected), -1);
    }
  }
}

std::vector<RandomParam> RandomParams() {
  std::vector<RandomParam> params;
  for (Layout layout : testing::AllLayouts()) {
    for (int page_size : {16, 64, 256}) params.push_back({layout, page_size});
  }
  return params;
}

INSTANTIATE_TEST_SUITE_P(LayoutsAndPageSizes, GpuRandomTest, ::testing::ValuesIn(RandomParams()),
                         [](const ::testing::TestParamInfo<RandomParam>& info) {
                           return std::string(LayoutName(info.param.layout)) + "_p" +
                                  std::to_string(info.param.page_size);
                         });

// ---- page gather/scatter ----------------------------------------------------------------

class GpuPageCopyTest : public GpuTest {};

TEST_F(GpuPageCopyTest, GatherAndScatterMatchReferenceWithDeviceAndPinnedBuffers) {
  const PageCopyGeometry g{PageBytes(Layout::kV4, 64), 40, 3};
  const std::vector<int64_t> pages = {39, 0, 17, 5, 22};
  const auto pool = Poison(g.pool_bytes(), 6);
  std::vector<uint8_t> expected_buffer(g.buffer_bytes(pages.size()));
  ASSERT_TRUE(reference::GatherPages(g, pool, pages, expected_buffer).ok());
  DeviceBuffer d_pool(pool), d_pages(pages);

  DeviceBuffer d_buffer(Poison(expected_buffer.size(), 7));
  ASSERT_TRUE(cuda::GatherPages({g, d_pool.as<uint8_t>(), d_pages.as<int64_t>(),
                                 static_cast<int64_t>(pages.size()), d_buffer.as<uint8_t>()},
                                nullptr).ok());
  EXPECT_EQ(FirstDifference(d_buffer.Download<uint8_t>(), expected_buffer), -1);

  testing::PinnedBuffer pinned(expected_buffer.size());
  ASSERT_TRUE(cuda::GatherPages({g, d_pool.as<uint8_t>(), d_pages.as<int64_t>(),
                                 static_cast<int64_t>(pages.size()), pinned.data()}, nullptr).ok());
  testing::CudaCheck(cudaDeviceSynchronize(), "gather to pinned");
  EXPECT_TRUE(std::equal(expected_buffer.begin(), expected_buffer.end(), pinned.data()));

  // Scatter a fresh buffer from pinned memory into a poisoned pool.
  const auto incoming = Poison(expected_buffer.size(), 8);
  std::memcpy(pinned.data(), incoming.data(), incoming.size());
  std::vector<uint8_t> expected_pool = Poison(g.pool_bytes(), 9);
  DeviceBuffer target(expected_pool);
  ASSERT_TRUE(reference::ScatterPages(g, incoming, pages, expected_pool).ok());
  ASSERT_TRUE(cuda::ScatterPages({g, target.as<uint8_t>(), d_pages.as<int64_t>(),
                                  static_cast<int64_t>(pages.size()), pinned.data()}, nullptr).ok());
  EXPECT_EQ(FirstDifference(target.Download<uint8_t>(), expected_pool), -1);
}

TEST_F(GpuPageCopyTest, UnalignedPageBytesUseTheBytePath) {
  const PageCopyGeometry g{1001, 7, 2};
  const std::vector<int64_t> pages = {6, 1};
  const auto pool = Poison(g.pool_bytes(), 10);
  std::vector<uint8_t> expected(g.buffer_bytes(pages.size()));
  ASSERT_TRUE(reference::GatherPages(g, pool, pages, expected).ok());
  DeviceBuffer d_pool(pool), d_pages(pages), d_buffer(expected.size());
  ASSERT_TRUE(cuda::GatherPages({g, d_pool.as<uint8_t>(), d_pages.as<int64_t>(), 2,
                                 d_buffer.as<uint8_t>()}, nullptr).ok());
  EXPECT_EQ(FirstDifference(d_buffer.Download<uint8_t>(), expected), -1);
}

TEST_F(GpuPageCopyTest, ZeroPagesZeroesExactlyTheListedPagesInEveryLayer) {
  for (const PageCopyGeometry g : {PageCopyGeometry{PageBytes(Layout::kV41Fp4, 16), 12, 3},
                                   PageCopyGeometry{1001, 5, 2}}) {
    const std::vector<int64_t> pages = {11 % g.num_pages, 2, 4};
    std::vector<uint8_t> expected = Poison(g.pool_bytes(), 11);
    DeviceBuffer d_pool(expected), d_pages(pages);
    for (int64_t p : pages) {
      for (int layer = 0; layer < g.num_layers; ++layer) {
        std::fill_n(expected.begin() + (layer * g.num_pages + p) * g.page_bytes, g.page_bytes, 0);
      }
    }
    ASSERT_TRUE(cuda::ZeroPages({g, d_pool.as<uint8_t>(), d_pages.as<int64_t>(),
                                 static_cast<int64_t>(pages.size()), nullptr},
                                nullptr).ok());
    EXPECT_EQ(FirstDifference(d_pool.Download<uint8_t>(), expected), -1) << g.page_bytes;
  }
}

// ---- named failure tests ------------------------------------------------------------------

class GpuInvalidTest : public GpuTest {};

TEST_F(GpuInvalidTest, BadPageSizeIsRejectedBeforeLaunch) {
  DeviceBuffer rows(1024), locs(8), pool(4096);
  const absl::Status s = cuda::QuantizeStore(
      {{Layout::kV41, 48, 2}, rows.as<uint16_t>(), locs.as<int64_t>(), 1, pool.as<uint8_t>()},
      nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("page size 48"), std::string::npos) << s;
}

TEST_F(GpuInvalidTest, UnknownLayoutIsRejected) {
  DeviceBuffer rows(1024), locs(8), pool(1 << 16);
  EXPECT_EQ(cuda::QuantizeStore({{static_cast<Layout>(9), 16, 2}, rows.as<uint16_t>(),
                                 locs.as<int64_t>(), 1, pool.as<uint8_t>()}, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(GpuInvalidTest, NullAndMisalignedPointersAreRejected) {
  DeviceBuffer rows(4096), locs(8), pool(1 << 16);
  const PoolGeometry g{Layout::kV4, 16, 2};
  EXPECT_EQ(cuda::QuantizeStore({g, nullptr, locs.as<int64_t>(), 1, pool.as<uint8_t>()}, nullptr)
                .code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::QuantizeStore({g, rows.as<uint16_t>() + 1, locs.as<int64_t>(), 1,
                                 pool.as<uint8_t>()}, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(GpuInvalidTest, NegativeTokenCountIsRejected) {
  DeviceBuffer rows(1024), locs(8), pool(1 << 16);
  EXPECT_EQ(cuda::QuantizeStore({{Layout::kV4, 16, 2}, rows.as<uint16_t>(), locs.as<int64_t>(),
                                 -1, pool.as<uint8_t>()}, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(GpuInvalidTest, EmptyInputIsANoOp) {
  const PoolGeometry g{Layout::kV41, 16, 2};
  std::vector<uint8_t> before = Poison(g.pool_bytes(), 11);
  DeviceBuffer pool(before);
  EXPECT_TRUE(cuda::QuantizeStore({g, nullptr, nullptr, 0, pool.as<uint8_t>()}, nullptr).ok());
  EXPECT_EQ(pool.Download<uint8_t>(), before);
}

TEST_F(GpuInvalidTest, OutOfRangeLocationOnDeviceWritesNothing) {
  // Locations on the device are the caller's to validate; the kernel must still never
  // write outside the pool, and must leave it unchanged for the bad token.
  const PoolGeometry g{Layout::kV41, 16, 2};
  const auto rows = testing::RandomRows(2, 12);
  std::vector<uint8_t> before = Poison(g.pool_bytes(), 13);
  DeviceBuffer pool(before), d_rows(rows), d_locs(std::vector<int64_t>{32, -5});
  ASSERT_TRUE(cuda::QuantizeStore({g, d_rows.as<uint16_t>(), d_locs.as<int64_t>(), 2,
                                   pool.as<uint8_t>()}, nullptr).ok());
  EXPECT_EQ(pool.Download<uint8_t>(), before);
}

TEST_F(GpuInvalidTest, TranscodeWithDifferentPageSizesIsRejected) {
  DeviceBuffer a(1 << 20), b(1 << 20), locs(8);
  EXPECT_EQ(cuda::Transcode({{Layout::kV41, 16, 2}, a.as<uint8_t>(), {Layout::kV4, 64, 2},
                             b.as<uint8_t>(), locs.as<int64_t>(), 1}, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(GpuInvalidTest, OverlappingTranscodePoolsAreRejected) {
  DeviceBuffer a(1 << 20), locs(8);
  EXPECT_EQ(cuda::Transcode({{Layout::kV41, 16, 2}, a.as<uint8_t>(), {Layout::kV4, 16, 2},
                             a.as<uint8_t>() + 256, locs.as<int64_t>(), 1}, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvferry
