// Scalar number formats of the KV records (bf16, e4m3, e2m1, ue8m0) and the per-tile scale
// rules of spec/kv-formats.md §4; host and device, integer bit arithmetic only.
//
// Every conversion here is written on the bits so that the CPU reference and the CUDA
// kernels produce identical bytes regardless of compiler flags or rounding-mode state.
// Inputs are finite (the callers reject NaN/Inf before quantizing).
#pragma once

#include <cstdint>
#include <cstring>

#include "kvferry/kernels/format.h"

namespace kvferry::numerics {

KVF_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

KVF_HD float BitsToFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

KVF_HD float Bf16ToFloat(uint16_t h) { return BitsToFloat(uint32_t{h} << 16); }

// True when a bf16 value is NaN or ±Inf (exponent field all ones).
KVF_HD bool Bf16IsNonFinite(uint16_t h) { return (h & 0x7F80u) == 0x7F80u; }

// fp32 → bf16, round to nearest even (NaN stays NaN, overflow becomes Inf as in IEEE).
KVF_HD uint16_t FloatToBf16(float f) {
  const uint32_t u = FloatBits(f);
  if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu) != 0) {
    return static_cast<uint16_t>((u >> 16) | 0x40u);
  }
  const uint32_t rounding_bias = 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

// Rounds `significand >> shift` to nearest, ties to even (1 <= shift <= 31).
KVF_HD uint32_t ShiftRightRne(uint32_t significand, int shift) {
  const uint32_t kept = significand >> shift;
  const uint32_t rest = significand & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  return kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
}

// OCP E4M3 ("fn"): bias 7, 3 mantissa bits, max finite 448 (code 0x7E), subnormal step 2^-9.
inline constexpr uint8_t kE4m3MaxCode = 0x7E;

// fp32 → e4m3, round to nearest even, saturating to ±448. The sign of a value that rounds
// to zero is kept (−tiny → 0x80), as IEEE conversions do.
KVF_HD uint8_t FloatToE4m3(float f) {
  const uint32_t u = FloatBits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t abs_bits = u & 0x7FFFFFFFu;
  if (abs_bits > 0x43E00000u) return sign | kE4m3MaxCode;  // |f| > 448
  const int biased = static_cast<int>(abs_bits >> 23);
  const uint32_t mantissa = abs_bits & 0x7FFFFFu;
  const int unbiased = biased == 0 ? -126 : biased - 127;
  if (unbiased >= -6) {
    // Normal e4m3: keep 3 of 23 mantissa bits; a carry rolls into the exponent.
    const uint32_t code = (static_cast<uint32_t>(unbiased + 7) << 3) | (mantissa >> 20);
    const uint32_t rest = mantissa & 0xFFFFFu;
    const uint32_t rounded = code + ((rest > 0x80000u || (rest == 0x80000u && (code & 1u))) ? 1u : 0u);
    return sign | static_cast<uint8_t>(rounded > kE4m3MaxCode ? kE4m3MaxCode : rounded);
  }
  // Subnormal e4m3: the value in units of 2^-9 is significand * 2^(unbiased - 23 + 9).
  const uint32_t significand = biased == 0 ? mantissa : (mantissa | 0x800000u);
  const int shift = 14 - unbiased;  // > 20 here
  if (shift > 24) return sign;      // below a quarter of the smallest step: rounds to zero
  return sign | static_cast<uint8_t>(ShiftRightRne(significand, shift));
}

KVF_HD float E4m3ToFloat(uint8_t code) {
  const uint32_t exponent = (code >> 3) & 0xFu;
  const uint32_t mantissa = code & 0x7u;
  float magnitude;
  if (exponent == 0) {
    magnitude = static_cast<float>(mantissa) * 0.001953125f;  // m * 2^-9, exact
  } else {
    magnitude = BitsToFloat(((exponent + 120u) << 23) | (mantissa << 20));
  }
  return (code & 0x80u) ? -magnitude : magnitude;
}

// OCP E2M1: bit 3 sign, bits 0..2 index {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
// fp32 → e2m1 nibble, round to nearest even, saturating to ±6; the sign of the input is
// kept (so -0 → 0x8: callers add +0.0f first where the spec wants -0 → +0).
KVF_HD uint8_t FloatToE2m1(float f) {
  const uint32_t u = FloatBits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 28) & 0x8u);
  const float a = BitsToFloat(u & 0x7FFFFFFFu);
  uint8_t code;
  if (a <= 0.25f) {
    code = 0;
  } else if (a < 0.75f) {
    code = 1;
  } else if (a <= 1.25f) {
    code = 2;
  } else if (a < 1.75f) {
    code = 3;
  } else if (a <= 2.5f) {
    code = 4;
  } else if (a < 3.5f) {
    code = 5;
  } else if (a <= 5.0f) {
    code = 6;
  } else {
    code = 7;
  }
  return sign | code;
}

KVF_HD float E2m1ToFloat(uint8_t nibble) {
  // Magnitudes times 2, so the table is small integers: 0 1 2 3 4 6 8 12.
  const uint32_t m = nibble & 0x7u;
  const uint32_t twice = m < 4 ? m : (m < 6 ? (m - 2) * 2 : (m - 4) * 4);
  const float magnitude = static_cast<float>(twice) * 0.5f;
  return (nibble & 0x8u) ? -magnitude : magnitude;
}

// 2^(e-127) for a ue8m0 byte e in [1, 254].
KVF_HD float Ue8m0ToFloat(uint8_t e) { return BitsToFloat(uint32_t{e} << 23); }

// 2^(127-e): the exact multiplier that brings a tile into e4m3 range, e in [1, 253].
KVF_HD float Ue8m0Reciprocal(uint8_t e) { return BitsToFloat(static_cast<uint32_t>(254 - e) << 23); }

// V4 NoPE tile scale (§4): the smallest power of two >= max(amax, 1e-4) / 448.
KVF_HD uint8_t V4ScaleExponent(float amax) {
  const float floor_amax = amax > 1e-4f ? amax : 1e-4f;
#if defined(__CUDA_ARCH__)
  const float q = __fdiv_rn(floor_amax, 448.0f);
#else
  const float q = floor_amax / 448.0f;
#endif
  const uint32_t bits = FloatBits(q);
  return static_cast<uint8_t>((bits >> 23) + ((bits & 0x7FFFFFu) != 0 ? 1u : 0u));
}

// V41 tile scale (§4): max(2^ceil(log2(amax/448)), 2^-13), exactly, without a division.
KVF_HD uint8_t V41ScaleExponent(float amax) {
  const uint32_t bits = FloatBits(amax);
  const int exponent = static_cast<int>(bits >> 23);
  const int e = exponent - 8 + ((bits & 0x7FFFFFu) > 0x600000u ? 1 : 0);
  return static_cast<uint8_t>(e > 114 ? e : 114);
}

// V41_FP4 tile scale (§4): e4m3 RNE-sat(min(max(amax * R, 2^-9), 448)), R = fp32(1/6).
KVF_HD uint8_t Fp4ScaleCode(float amax) {
  const float kOneSixth = BitsToFloat(0x3E2AAAABu);
#if defined(__CUDA_ARCH__)
  float s = __fmul_rn(amax, kOneSixth);
#else
  float s = amax * kOneSixth;
#endif
  s = s > 0.001953125f ? s : 0.001953125f;
  s = s < 448.0f ? s : 448.0f;
  return FloatToE4m3(s);
}

// One FP4 code for value x under scale S (§4 step 2): e2m1 RNE-sat((x / S) + 0.0f).
KVF_HD uint8_t QuantizeFp4(float x, float scale) {
#if defined(__CUDA_ARCH__)
  const float r = __fadd_rn(__fdiv_rn(x, scale), 0.0f);
#else
  const float r = x / scale + 0.0f;
#endif
  return FloatToE2m1(r);
}

}  // namespace kvferry::numerics
