// The kernels' hardware conversion paths (record.cuh) against the portable bit-exact
// conversions of numerics.h, exhaustively over every bf16 input and every scale.
#include <cuda_runtime.h>

#include <vector>

#include "common/cuda_testing.h"
#include "gtest/gtest.h"
#include "kvferry/kernels/numerics.h"
#include "record.cuh"

namespace kvferry {
namespace {

using cuda::detail::kChunk;
using namespace numerics;

constexpr int kMinShift = -30, kMaxShift = 30, kShifts = kMaxShift - kMinShift + 1;

// out[(shift * 65536 + h)] = e4m3 of bf16(h) * 2^shift, 8 values per thread.
__global__ void PackE4m3Kernel(uint8_t* out) {
  const int64_t base = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) * kChunk;
  if (base >= int64_t{kShifts} * 65536) return;
  const int shift = static_cast<int>(base >> 16) + kMinShift;
  float v[kChunk];
  for (int j = 0; j < kChunk; ++j) {
    v[j] = Bf16ToFloat(static_cast<uint16_t>((base + j) & 0xFFFF));
  }
  const uint2 packed = cuda::detail::PackE4m3(v, ldexpf(1.0f, shift));
  for (int j = 0; j < kChunk; ++j) {
    out[base + j] = static_cast<uint8_t>((j < 4 ? packed.x : packed.y) >> (8 * (j & 3)));
  }
}

// How PackE2m1Kernel encodes: the threshold form, or the half2 form the kernels use on
// eight values (quantize-store) or on four (the compressors' FP4 tiles).
enum class E2m1Form { kThresholds, kHalf2Eight, kHalf2Four };

// out[(scale_code * 65536 + h)] = e2m1 of bf16(h) under e4m3 scale scale_code.
__global__ void PackE2m1Kernel(uint8_t* out, E2m1Form form) {
  const int64_t base = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) * kChunk;
  if (base >= int64_t{128} * 65536) return;
  const float s = E4m3ToFloat(static_cast<uint8_t>(base >> 16));
  float v[kChunk];
  for (int j = 0; j < kChunk; ++j) v[j] = Bf16ToFloat(static_cast<uint16_t>((base + j) & 0xFFFF));
  uint32_t packed;
  if (form == E2m1Form::kThresholds) {
    packed = cuda::detail::PackE2m1(v, s);
  } else if (form == E2m1Form::kHalf2Eight) {
    packed = cuda::detail::EncodeE2m1(v, cuda::detail::E2m1Multiplier(s));
  } else {
    const float lo[4] = {v[0], v[1], v[2], v[3]};
    const float hi[4] = {v[4], v[5], v[6], v[7]};
    const float inv = cuda::detail::E2m1Multiplier(s);
    packed = cuda::detail::EncodeE2m1(lo, inv) | (cuda::detail::EncodeE2m1(hi, inv) << 16);
  }
  for (int j = 0; j < kChunk; ++j) out[base + j] = (packed >> (4 * j)) & 0xF;
}

// Per bf16 amax h: the device's V4 scale byte, FP4 scale code, and e4m3 decode of h & 0xFF.
__global__ void ScaleKernel(uint8_t* v4, uint8_t* fp4, float* decoded) {
  const int h = blockIdx.x * blockDim.x + threadIdx.x;
  if (h >= 0x7F80) return;
  const float amax = Bf16ToFloat(static_cast<uint16_t>(h));
  v4[h] = cuda::detail::V4ScaleExponentBf16(amax);
  fp4[h] = cuda::detail::Fp4ScaleCodeFast(amax);
  decoded[h] = cuda::detail::E4m3ToFloatFast(static_cast<uint8_t>(h & 0xFF));
}

// out[e * 256 + code] = bf16 of e4m3(code) * 2^(e-127); and e2m1 nibbles × e4m3 scales.
__global__ void UnpackKernel(uint16_t* e4m3_out, uint16_t* e2m1_out) {
  const int e = blockIdx.x;  // 0..255
  const int group = threadIdx.x;  // 0..31: codes 8 * group .. +7
  uint2 codes;
  uint32_t words[2] = {0, 0};
  for (int j = 0; j < kChunk; ++j) words[j / 4] |= uint32_t(8 * group + j) << (8 * (j & 3));
  codes = make_uint2(words[0], words[1]);
  uint16_t bits[kChunk];
  if (e >= 1 && e <= 254) {
    cuda::detail::UnpackE4m3(codes, Ue8m0ToFloat(static_cast<uint8_t>(e)), bits);
    for (int j = 0; j < kChunk; ++j) e4m3_out[e * 256 + 8 * group + j] = bits[j];
  }
  if (e < 128 && group < 2) {
    const float s = E4m3ToFloat(static_cast<uint8_t>(e));
    uint32_t nibbles = 0;
    for (int j = 0; j < kChunk; ++j) nibbles |= uint32_t(8 * group + j) << (4 * j);
    cuda::detail::UnpackE2m1(nibbles, s, bits);
    for (int j = 0; j < kChunk; ++j) e2m1_out[e * 16 + 8 * group + j] = bits[j];
  }
}

class NumericsGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!testing::HaveGpu()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(NumericsGpuTest, HardwareE4m3EqualsReferenceForEveryScaledBf16) {
  const int64_t n = int64_t{kShifts} * 65536;
  testing::DeviceBuffer out(n);
  PackE4m3Kernel<<<(n / kChunk + 255) / 256, 256>>>(out.as<uint8_t>());
  const auto got = out.Download<uint8_t>();
  int64_t mismatches = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t h = i & 0xFFFF;
    if (Bf16IsNonFinite(h)) continue;
    const float v = Bf16ToFloat(h) * std::ldexp(1.0f, static_cast<int>(i >> 16) + kMinShift);
    if (got[i] != FloatToE4m3(v) && ++mismatches < 5) {
      ADD_FAILURE() << "bf16 0x" << std::hex << h << " shift " << std::dec
                    << (i >> 16) + kMinShift << " gpu " << int{got[i]} << " ref "
                    << int{FloatToE4m3(v)};
    }
  }
  EXPECT_EQ(mismatches, 0);
}

class E2m1GpuTest : public NumericsGpuTest, public ::testing::WithParamInterface<E2m1Form> {};

TEST_P(E2m1GpuTest, DivisionFreeE2m1EqualsReferenceForEveryBf16AndScale) {
  const int64_t n = int64_t{128} * 65536;
  testing::DeviceBuffer out(n);
  PackE2m1Kernel<<<(n / kChunk + 255) / 256, 256>>>(out.as<uint8_t>(), GetParam());
  const auto got = out.Download<uint8_t>();
  int64_t mismatches = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t h = i & 0xFFFF;
    const uint8_t scale_code = static_cast<uint8_t>(i >> 16);
    if (Bf16IsNonFinite(h) || scale_code == 0 || scale_code == 0x7F) continue;  // S >= 2^-9
    const uint8_t want = QuantizeFp4(Bf16ToFloat(h), E4m3ToFloat(scale_code));
    if (got[i] != want && ++mismatches < 5) {
      ADD_FAILURE() << "bf16 0x" << std::hex << h << " scale 0x" << int{scale_code} << " gpu "
                    << int{got[i]} << " ref " << int{want};
    }
  }
  EXPECT_EQ(mismatches, 0);
}

INSTANTIATE_TEST_SUITE_P(ThresholdsAndHalf2, E2m1GpuTest,
                         ::testing::Values(E2m1Form::kThresholds, E2m1Form::kHalf2Eight,
                                           E2m1Form::kHalf2Four));

TEST_F(NumericsGpuTest, DeviceScaleRulesEqualReferenceForEveryBf16Amax) {
  testing::DeviceBuffer v4(0x7F80), fp4(0x7F80), decoded(0x7F80 * sizeof(float));
  ScaleKernel<<<(0x7F80 + 255) / 256, 256>>>(v4.as<uint8_t>(), fp4.as<uint8_t>(),
                                             decoded.as<float>());
  const auto got_v4 = v4.Download<uint8_t>();
  const auto got_fp4 = fp4.Download<uint8_t>();
  const auto got_decoded = decoded.Download<float>();
  for (int h = 0; h < 0x7F80; ++h) {
    const float amax = Bf16ToFloat(static_cast<uint16_t>(h));
    ASSERT_EQ(got_v4[h], V4ScaleExponent(amax)) << "amax " << amax;
    ASSERT_EQ(got_fp4[h], Fp4ScaleCode(amax)) << "amax " << amax;
    if ((h & 0x7F) != 0x7F) {
      ASSERT_EQ(FloatBits(got_decoded[h]), FloatBits(E4m3ToFloat(static_cast<uint8_t>(h & 0xFF))));
    }
  }
}

TEST_F(NumericsGpuTest, HardwareDecodeEqualsReferenceForEveryCodeAndScale) {
  testing::DeviceBuffer e4m3(256 * 256 * 2), e2m1(128 * 16 * 2);
  UnpackKernel<<<256, 32>>>(e4m3.as<uint16_t>(), e2m1.as<uint16_t>());
  const auto got8 = e4m3.Download<uint16_t>();
  const auto got4 = e2m1.Download<uint16_t>();
  for (int e = 1; e <= 254; ++e) {
    for (int code = 0; code < 256; ++code) {
      if ((code & 0x7F) == 0x7F) continue;  // NaN codes are never written
      const uint16_t want =
          FloatToBf16(E4m3ToFloat(static_cast<uint8_t>(code)) * Ue8m0ToFloat(static_cast<uint8_t>(e)));
      ASSERT_EQ(got8[e * 256 + code], want) << "e " << e << " code " << code;
    }
  }
  for (int s = 1; s < 127; ++s) {
    for (int nibble = 0; nibble < 16; ++nibble) {
      const uint16_t want = FloatToBf16(E2m1ToFloat(static_cast<uint8_t>(nibble)) *
                                        E4m3ToFloat(static_cast<uint8_t>(s)));
      ASSERT_EQ(got4[s * 16 + nibble], want) << "scale " << s << " nibble " << nibble;
    }
  }
}

}  // namespace
}  // namespace kvferry
