// The CPU compressor against an fp64 evaluation of spec/compressor.md steps 1-4 written
// here, independently of the code under test; window bookkeeping; invalid input.
#include <cmath>

#include "common/compressor_inputs.h"
#include "gtest/gtest.h"
#include "kvferry/kernels/compressor.h"
#include "kvferry/kernels/numerics.h"
#include "kvferry/kernels/ops.h"

namespace kvferry {
namespace {

using numerics::Bf16ToFloat;

// Steps 1-4 in double precision, no intermediate rounding: the entry ending at `end`.
std::vector<double> Fp64Entry(const testing::CompressorInputs& in, int64_t end, float eps) {
  const int r = in.ratio;
  const int64_t width = (r == 4 ? 2 : 1) * 512;
  const int64_t span = r == 4 ? 8 : r;
  std::vector<double> x(512);
  for (int c = 0; c < 512; ++c) {
    if (r == 1) {
      x[c] = in.kv[(end - in.first_position) * width + c];
      continue;
    }
    double m = -INFINITY, sum = 0, acc = 0;
    auto at = [&](int64_t pos) {
      const int64_t half = (r == 4 && end - pos < 4) ? 512 : 0;
      return (pos - in.first_position) * width + half + c;
    };
    for (int64_t pos = std::max<int64_t>(0, end - span + 1); pos <= end; ++pos) {
      m = std::max(m, double{in.score[at(pos)]});
    }
    for (int64_t pos = std::max<int64_t>(0, end - span + 1); pos <= end; ++pos) {
      const double e = std::exp(in.score[at(pos)] - m);
      sum += e;
      acc += e * in.kv[at(pos)];
    }
    x[c] = acc / sum;
  }
  double ms = 0;
  for (double v : x) ms += v * v;
  const double inv = 1.0 / std::sqrt(ms / 512 + eps);
  for (int c = 0; c < 512; ++c) x[c] *= inv * Bf16ToFloat(in.weight[c]);
  const int64_t q = end + 1 - r;
  for (int i = 0; i < 32; ++i) {
    const double cs = in.cos[q * 32 + i], sn = in.sin[q * 32 + i];
    const double a = x[448 + 2 * i], b = x[449 + 2 * i];
    x[448 + 2 * i] = a * cs - b * sn;
    x[449 + 2 * i] = a * sn + b * cs;
  }
  return x;
}

double RelativeL2(const std::vector<double>& ref, const uint16_t* row) {
  double err = 0, norm = 0;
  for (int c = 0; c < 512; ++c) {
    const double d = Bf16ToFloat(row[c]) - ref[c];
    err += d * d;
    norm += ref[c] * ref[c];
  }
  return std::sqrt(err / norm);
}

TEST(CompressorWindowsTest, CountsClosingWindowsWithTheirRows) {
  auto e = CompressorEntries(4, 0, 8);
  EXPECT_EQ(e.first_end, 3);
  EXPECT_EQ(e.count, 2);
  EXPECT_EQ(CompressorEntries(4, 5, 10).count, 0);  // windows 7 and 11 lack rows 0..4 / 4
  e = CompressorEntries(4, 4, 12);                  // positions 4..15
  EXPECT_EQ(e.first_end, 11);
  EXPECT_EQ(e.count, 2);
  e = CompressorEntries(128, 0, 300);
  EXPECT_EQ(e.first_end, 127);
  EXPECT_EQ(e.count, 2);
  e = CompressorEntries(1, 10, 3);
  EXPECT_EQ(e.first_end, 10);
  EXPECT_EQ(e.count, 3);
  e = CompressorEntries(2, 3, 4);  // positions 3..6: window 3 lacks row 2
  EXPECT_EQ(e.first_end, 5);
  EXPECT_EQ(e.count, 1);
  EXPECT_EQ(CompressorEntries(128, 0, 127).count, 0);
}

struct Case {
  int ratio;
  Layout layout;
  bool fake_quant;
  int64_t first_position, num_rows;
};

class CompressorAccuracyTest : public ::testing::TestWithParam<Case> {};

TEST_P(CompressorAccuracyTest, StoredRowIsWithinSpecBoundOfFp64) {
  const Case c = GetParam();
  const PoolGeometry g{c.layout, 64, 80};
  auto in = testing::MakeCompressorInputs(c.ratio, c.first_position, c.num_rows, g.num_tokens(), 9);
  ASSERT_GT(in.windows.count, 0);
  std::vector<uint8_t> pool(g.pool_bytes(), 0);
  CompressorParams p = in.Params(g, pool.data());
  p.fp4_fake_quant = c.fake_quant;
  std::vector<uint16_t> pre(in.windows.count * 512);
  p.pre_quant_rows = pre.data();
  ASSERT_TRUE(reference::Compress(p).ok());
  std::vector<uint16_t> stored(in.windows.count * 512);
  ASSERT_TRUE(reference::DequantizeGather(g, pool, in.entry_locs, stored).ok());
  uint8_t data[576], scale[32], fp4_data[256], fp4_scale[32];
  for (int64_t j = 0; j < in.windows.count; ++j) {
    const std::vector<double> ref = Fp64Entry(in, in.windows.first_end + j * c.ratio, p.eps);
    // Quantizing the fp64 row directly, through the same steps after step 4.
    uint16_t direct[512];
    for (int d = 0; d < 512; ++d) direct[d] = numerics::FloatToBf16(static_cast<float>(ref[d]));
    if (c.fake_quant) {
      reference::QuantizeRow(Layout::kV41Fp4, direct, fp4_data, fp4_scale);
      reference::DequantizeRow(Layout::kV41Fp4, fp4_data, fp4_scale, direct);
    }
    reference::QuantizeRow(c.layout, direct, data, scale);
    reference::DequantizeRow(c.layout, data, scale, direct);
    const double bound = 1.1 * RelativeL2(ref, direct);
    EXPECT_LE(RelativeL2(ref, &stored[j * 512]), bound) << "entry " << j;
    // The pre-quantization row itself is close to fp64 (bf16 roundings of steps 3-4 only).
    EXPECT_LT(RelativeL2(ref, &pre[j * 512]), 4e-3) << "entry " << j;
  }
}

INSTANTIATE_TEST_SUITE_P(
    RatiosLayoutsSizes, CompressorAccuracyTest,
    ::testing::Values(Case{4, Layout::kV4, false, 0, 4}, Case{4, Layout::kV4, false, 0, 7}, Case{4, Layout::kV41, false, 0, 130},
                      Case{4, Layout::kV41Fp4, false, 1000, 1024},
                      Case{128, Layout::kV4, false, 0, 300},
                      Case{128, Layout::kV41Fp4, false, 128, 256},
                      Case{2, Layout::kV41, true, 0, 65}, Case{2, Layout::kV4, false, 11, 33},
                      Case{1, Layout::kV4, true, 5, 16}, Case{1, Layout::kV41Fp4, false, 0, 9}),
    [](const ::testing::TestParamInfo<Case>& info) {
      const Case& c = info.param;
      return "r" + std::to_string(c.ratio) + "_" + LayoutName(c.layout) +
             (c.fake_quant ? "_fq" : "") + "_from" + std::to_string(c.first_position) + "_n" +
             std::to_string(c.num_rows);
    });

class CompressorInvalidTest : public ::testing::Test {
 protected:
  void ExpectRejected(const CompressorParams& p, const std::string& needle) {
    const std::vector<uint8_t> before = pool_;
    const absl::Status s = reference::Compress(p);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
    EXPECT_TRUE(pool_ == before);
  }
  const PoolGeometry g_{Layout::kV41, 16, 8};
  std::vector<uint8_t> pool_ = std::vector<uint8_t>(g_.pool_bytes(), 0x33);
  testing::CompressorInputs in_ = testing::MakeCompressorInputs(4, 0, 16, 128, 3);
};

TEST_F(CompressorInvalidTest, UnknownRatioIsRejected) {
  CompressorParams p = in_.Params(g_, pool_.data());
  p.ratio = 3;
  ExpectRejected(p, "ratio 3");
}

TEST_F(CompressorInvalidTest, FakeQuantWithRatio4IsRejected) {
  CompressorParams p = in_.Params(g_, pool_.data());
  p.fp4_fake_quant = true;
  ExpectRejected(p, "fake quantization");
}

TEST_F(CompressorInvalidTest, WrongEntryCountIsRejected) {
  CompressorParams p = in_.Params(g_, pool_.data());
  p.num_entries = 3;
  ExpectRejected(p, "close 4 windows");
}

TEST_F(CompressorInvalidTest, ShortRopeTableIsRejected) {
  CompressorParams p = in_.Params(g_, pool_.data());
  p.num_rope_positions = 12;
  ExpectRejected(p, "RoPE table");
}

TEST_F(CompressorInvalidTest, NonFiniteKvIsRejected) {
  in_.kv[700] = NAN;
  ExpectRejected(in_.Params(g_, pool_.data()), "kv value 700");
}

TEST_F(CompressorInvalidTest, RepeatedEntryLocationIsRejected) {
  in_.entry_locs[2] = in_.entry_locs[0];
  ExpectRejected(in_.Params(g_, pool_.data()), "both name");
}

TEST_F(CompressorInvalidTest, NonPositiveEpsIsRejected) {
  CompressorParams p = in_.Params(g_, pool_.data());
  p.eps = 0.0f;
  ExpectRejected(p, "eps");
}

}  // namespace
}  // namespace kvferry
