// The scalar conversions checked exhaustively against NVIDIA's host implementations in
// cuda_fp8.h / cuda_fp4.h / cuda_bf16.h (compiled as plain host code: an independent oracle).
#include "kvferry/kernels/numerics.h"

#include <cuda_bf16.h>
#include <cuda_fp4.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstring>

#include "gtest/gtest.h"

namespace kvferry::numerics {
namespace {

uint8_t NvE4m3(float v) { return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3); }
uint8_t NvE2m1(float v) { return __nv_cvt_float_to_fp4(v, __NV_E2M1, cudaRoundNearest); }

float HalfRawToFloat(__half_raw raw) {
  __half h;
  std::memcpy(&h, &raw, sizeof(h));
  return __half2float(h);
}

// Every finite bf16 value times 2^k for k in [-30, 30]: the conversions see exact
// normals, subnormals, ties and saturating values on both signs.
template <typename F>
void ForEveryScaledBf16(F&& check) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if (Bf16IsNonFinite(static_cast<uint16_t>(h))) continue;
    const float base = Bf16ToFloat(static_cast<uint16_t>(h));
    for (int k = -30; k <= 30; ++k) {
      const float v = std::ldexp(base, k);
      if (!std::isfinite(v)) continue;
      check(v);
    }
  }
}

TEST(NumericsTest, FloatToE4m3MatchesNvidiaSatfiniteOnEveryScaledBf16) {
  int64_t checked = 0, mismatches = 0;
  ForEveryScaledBf16([&](float v) {
    ++checked;
    if (FloatToE4m3(v) != NvE4m3(v) && ++mismatches <= 5) {
      ADD_FAILURE() << "v=" << v << " ours=0x" << std::hex << int{FloatToE4m3(v)} << " nvidia=0x"
                    << int{NvE4m3(v)};
    }
  });
  EXPECT_EQ(mismatches, 0);
  EXPECT_GT(checked, 3'000'000);
}

TEST(NumericsTest, FloatToE2m1MatchesNvidiaOnEveryScaledBf16) {
  int64_t mismatches = 0;
  ForEveryScaledBf16([&](float v) {
    if (FloatToE2m1(v) != NvE2m1(v) && ++mismatches <= 5) {
      ADD_FAILURE() << "v=" << v << " ours=0x" << std::hex << int{FloatToE2m1(v)}
                    << " nvidia=0x" << int{NvE2m1(v)};
    }
  });
  EXPECT_EQ(mismatches, 0);
}

TEST(NumericsTest, E4m3DecodeMatchesNvidiaForEveryFiniteCode) {
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7F) == 0x7F) continue;  // NaN codes
    const float nv = HalfRawToFloat(__nv_cvt_fp8_to_halfraw(static_cast<uint8_t>(code), __NV_E4M3));
    EXPECT_EQ(FloatBits(E4m3ToFloat(static_cast<uint8_t>(code))), FloatBits(nv)) << code;
  }
  EXPECT_EQ(E4m3ToFloat(kE4m3MaxCode), 448.0f);
}

TEST(NumericsTest, E2m1DecodeMatchesNvidiaForEveryCode) {
  for (int code = 0; code < 16; ++code) {
    const float nv = HalfRawToFloat(__nv_cvt_fp4_to_halfraw(static_cast<uint8_t>(code), __NV_E2M1));
    EXPECT_EQ(FloatBits(E2m1ToFloat(static_cast<uint8_t>(code))), FloatBits(nv)) << code;
  }
}

TEST(NumericsTest, FloatToBf16MatchesNvidiaRoundNearest) {
  // Every 2^32 / 4099-th float pattern, plus the neighbours of each bf16 tie.
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 4099) {
    const float f = BitsToFloat(static_cast<uint32_t>(u));
    if (std::isnan(f)) continue;
    const __nv_bfloat16 nv = __float2bfloat16_rn(f);
    uint16_t nv_bits;
    std::memcpy(&nv_bits, &nv, sizeof(nv_bits));
    ASSERT_EQ(FloatToBf16(f), nv_bits) << std::hex << u;
  }
  for (uint32_t h = 0; h < 0x7F80; h += 7) {
    for (uint32_t low : {0x7FFFu, 0x8000u, 0x8001u}) {
      const float f = BitsToFloat((h << 16) | low);
      const __nv_bfloat16 nv = __float2bfloat16_rn(f);
      uint16_t nv_bits;
      std::memcpy(&nv_bits, &nv, sizeof(nv_bits));
      ASSERT_EQ(FloatToBf16(f), nv_bits) << std::hex << h << " " << low;
    }
  }
}

TEST(NumericsTest, Fp4QuantizeFollowsSpecSignAndTieRules) {
  // Spec §4: ties to the even code, saturation at 6, -0 → +0, negative-to-zero keeps sign.
  const struct {
    float r;
    uint8_t code;
  } cases[] = {{0.25f, 0x0}, {0.75f, 0x2}, {1.25f, 0x2}, {1.75f, 0x4}, {2.5f, 0x4},
               {3.5f, 0x6},  {5.0f, 0x6},  {6.5f, 0x7},  {1e9f, 0x7},  {-0.1f, 0x8},
               {-0.0f, 0x0}, {-5.5f, 0xF}};
  for (const auto& c : cases) {
    EXPECT_EQ(QuantizeFp4(c.r, 1.0f), c.code) << c.r;
    EXPECT_EQ(QuantizeFp4(c.r, 1.0f), NvE2m1(c.r + 0.0f)) << c.r;
  }
}

// Independent statements of the scale rules, in double precision.
int V41ScaleByDouble(double amax) {
  int e = amax > 0 ? static_cast<int>(std::ceil(std::log2(amax / 448.0))) : -13;
  // log2 can land a hair off an exact power of two: settle it exactly.
  while (std::ldexp(448.0, e - 1) >= amax && e - 1 >= -13) --e;
  while (std::ldexp(448.0, e) < amax) ++e;
  return std::max(e, -13) + 127;
}

TEST(NumericsTest, V41ScaleIsCeilPowerOfTwoOfAmaxOver448ForEveryBf16) {
  for (uint32_t h = 0; h < 0x7F80; ++h) {
    const float amax = Bf16ToFloat(static_cast<uint16_t>(h));
    ASSERT_EQ(V41ScaleExponent(amax), V41ScaleByDouble(amax)) << amax;
  }
}

TEST(NumericsTest, V4ScaleIsSmallestPowerOfTwoAtLeastQForEveryBf16) {
  for (uint32_t h = 0; h < 0x7F80; ++h) {
    const float amax = Bf16ToFloat(static_cast<uint16_t>(h));
    const float q = std::max(amax, 1e-4f) / 448.0f;
    int exp2;
    const double mant = std::frexp(static_cast<double>(q), &exp2);  // q = mant * 2^exp2
    const int want = (mant == 0.5 ? exp2 - 1 : exp2) + 127;
    ASSERT_EQ(V4ScaleExponent(amax), want) << amax;
    ASSERT_GE(std::ldexp(1.0, V4ScaleExponent(amax) - 127), q);
  }
}

TEST(NumericsTest, Fp4ScaleIsSaturatedE4m3OfAmaxTimesOneSixth) {
  const float r = BitsToFloat(0x3E2AAAABu);
  EXPECT_FLOAT_EQ(r, 1.0f / 6.0f);
  for (uint32_t h = 0; h < 0x7F80; ++h) {
    const float amax = Bf16ToFloat(static_cast<uint16_t>(h));
    const float s = std::min(std::max(amax * r, 0.001953125f), 448.0f);
    ASSERT_EQ(Fp4ScaleCode(amax), NvE4m3(s)) << amax;
  }
}

}  // namespace
}  // namespace kvferry::numerics
