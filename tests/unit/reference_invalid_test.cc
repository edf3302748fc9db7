// One named test per kind of invalid input: the error, and the pool's bytes unchanged.
#include "common/random_rows.h"
#include "gtest/gtest.h"
#include "kvferry/kernels/ops.h"
#include "kvferry/kernels/validate.h"

namespace kvferry {
namespace {

class ReferenceInvalidTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // A pool that already holds data, so "unchanged" is a real check.
    rows_ = testing::RandomRows(8, 3);
    locs_ = {0, 5, 17, 30, 31, 40, 63, 2};
    pool_.assign(g_.pool_bytes(), 0);
    ASSERT_TRUE(reference::QuantizeStore(g_, rows_, locs_, pool_).ok());
    before_ = pool_;
  }

  // Runs a write and checks it was refused with INVALID_ARGUMENT naming `needle`,
  // leaving the pool as it was.
  void ExpectRejected(const PoolGeometry& g, std::span<const uint16_t> rows,
                      std::span<const int64_t> locs, const std::string& needle) {
    const absl::Status s = reference::QuantizeStore(g, rows, locs, pool_);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
    EXPECT_TRUE(pool_ == before_) << "pool changed by a rejected write";
  }

  const PoolGeometry g_{Layout::kV41, 16, 4};
  std::vector<uint16_t> rows_;
  std::vector<int64_t> locs_;
  std::vector<uint8_t> pool_, before_;
};

TEST_F(ReferenceInvalidTest, NanRowIsRejected) {
  auto rows = testing::RandomRows(3, 9);
  rows[2 * 512 + 100] = 0x7FC1;
  ExpectRejected(g_, rows, std::vector<int64_t>{1, 3, 4}, "row 2 dim 100 is NaN");
}

TEST_F(ReferenceInvalidTest, PositiveInfIsRejected) {
  auto rows = testing::RandomRows(2, 9);
  rows[511] = 0x7F80;
  ExpectRejected(g_, rows, std::vector<int64_t>{1, 3}, "+Inf");
}

TEST_F(ReferenceInvalidTest, NegativeInfIsRejected) {
  auto rows = testing::RandomRows(2, 9);
  rows[600] = 0xFF80;
  ExpectRejected(g_, rows, std::vector<int64_t>{1, 3}, "row 1 dim 88 is -Inf");
}

TEST_F(ReferenceInvalidTest, PartialRowIsRejected) {
  auto rows = testing::RandomRows(2, 9);
  rows.pop_back();
  ExpectRejected(g_, rows, std::vector<int64_t>{1, 3}, "not a whole number");
}

TEST_F(ReferenceInvalidTest, RowCountDifferentFromLocationCountIsRejected) {
  auto rows = testing::RandomRows(2, 9);
  ExpectRejected(g_, rows, std::vector<int64_t>{1, 3, 4}, "2 rows but 3 locations");
}

TEST_F(ReferenceInvalidTest, LocationPastEndIsRejected) {
  auto rows = testing::RandomRows(2, 9);
  ExpectRejected(g_, rows, std::vector<int64_t>{1, 64}, "location 1 is 64, outside [0, 64)");
}

TEST_F(ReferenceInvalidTest, NegativeLocationIsRejected) {
  auto rows = testing::RandomRows(2, 9);
  ExpectRejected(g_, rows, std::vector<int64_t>{-1, 3}, "location 0 is -1");
}

TEST_F(ReferenceInvalidTest, RepeatedLocationIsRejected) {
  auto rows = testing::RandomRows(3, 9);
  ExpectRejected(g_, rows, std::vector<int64_t>{7, 3, 7}, "locations 0 and 2 both name 7");
}

TEST_F(ReferenceInvalidTest, PageSizeNotPowerOfTwoIsRejected) {
  auto rows = testing::RandomRows(1, 9);
  for (int page_size : {0, 3, 48, 8192}) {
    ExpectRejected(PoolGeometry{Layout::kV41, page_size, 4}, rows, std::vector<int64_t>{1},
                   "page size");
  }
}

TEST_F(ReferenceInvalidTest, UnknownLayoutIsRejected) {
  auto rows = testing::RandomRows(1, 9);
  ExpectRejected(PoolGeometry{static_cast<Layout>(7), 16, 4}, rows, std::vector<int64_t>{1},
                 "unknown layout 7");
}

TEST_F(ReferenceInvalidTest, PoolSpanOfWrongSizeIsRejected) {
  auto rows = testing::RandomRows(1, 9);
  // Same bytes, but the geometry claims more pages than the span holds.
  ExpectRejected(PoolGeometry{Layout::kV41, 16, 5}, rows, std::vector<int64_t>{1},
                 "the geometry needs");
}

TEST_F(ReferenceInvalidTest, TranscodeWithRepeatedLocationLeavesDestinationUnchanged) {
  std::vector<uint8_t> dst(PoolGeometry{Layout::kV4, 16, 4}.pool_bytes(), 0x5A);
  const std::vector<uint8_t> dst_before = dst;
  const absl::Status s = reference::Transcode(g_, pool_, PoolGeometry{Layout::kV4, 16, 4}, dst,
                                              std::vector<int64_t>{5, 5});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(dst == dst_before);
}

TEST_F(ReferenceInvalidTest, DequantizeOutOfRangeLocationWritesNothing) {
  std::vector<uint16_t> out(2 * 512, 0x1234);
  const absl::Status s = reference::DequantizeGather(g_, pool_, std::vector<int64_t>{0, 99}, out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](uint16_t v) { return v == 0x1234; }));
}

TEST_F(ReferenceInvalidTest, DequantizeRowStrideBelow512IsRejected) {
  std::vector<uint16_t> out(2 * 512);
  EXPECT_EQ(reference::DequantizeGather(g_, pool_, std::vector<int64_t>{0, 1}, out, 256).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ReferenceInvalidTest, ScatterWithRepeatedPageLeavesPoolUnchanged) {
  const PageCopyGeometry pg{g_.page_bytes(), g_.num_pages, 1};
  std::vector<uint8_t> buffer(pg.buffer_bytes(2), 0xEE);
  const absl::Status s = reference::ScatterPages(pg, buffer, std::vector<int64_t>{1, 1}, pool_);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("pages 0 and 1 both name 1"), std::string::npos) << s;
  EXPECT_TRUE(pool_ == before_);
}

TEST_F(ReferenceInvalidTest, ScatterWithShortBufferLeavesPoolUnchanged) {
  const PageCopyGeometry pg{g_.page_bytes(), g_.num_pages, 1};
  std::vector<uint8_t> buffer(pg.buffer_bytes(2) - 1, 0xEE);
  EXPECT_EQ(reference::ScatterPages(pg, buffer, std::vector<int64_t>{0, 1}, pool_).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(pool_ == before_);
}

}  // namespace
}  // namespace kvferry

namespace kvferry {
namespace {

TEST(ValidateFiniteTest, FindsEveryNonFiniteValueAtAnyPositionAndAlignment) {
  for (size_t offset : {0, 1, 3}) {  // the bytes as they sit in a message, any alignment
    for (int position = 0; position < 2 * 512; position += 37) {
      for (uint16_t bad : {uint16_t{0x7FC0}, uint16_t{0xFF80}, uint16_t{0x7F81}}) {
        std::vector<uint8_t> bytes(offset + 2 * 2 * 512, 0x3C);  // finite values
        bytes[offset + 2 * position] = static_cast<uint8_t>(bad & 0xFF);
        bytes[offset + 2 * position + 1] = static_cast<uint8_t>(bad >> 8);
        const absl::Status s =
            ValidateFiniteBytes(std::span(bytes).subspan(offset), /*first_row=*/10);
        ASSERT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << position;
        const std::string where = "row " + std::to_string(10 + position / 512) + " dim " +
                                  std::to_string(position % 512) + " is ";
        EXPECT_NE(s.message().find(where), std::string::npos) << s.message();
      }
    }
    // Values next to the non-finite ones (largest finite, -0, subnormal) pass.
    std::vector<uint8_t> bytes(offset, 0);
    for (uint16_t ok : {uint16_t{0x7F7F}, uint16_t{0xFF7F}, uint16_t{0x8000}, uint16_t{0x0001}}) {
      bytes.push_back(static_cast<uint8_t>(ok & 0xFF));
      bytes.push_back(static_cast<uint8_t>(ok >> 8));
    }
    EXPECT_TRUE(ValidateFiniteBytes(std::span(bytes).subspan(offset)).ok());
  }
}

}  // namespace
}  // namespace kvferry
