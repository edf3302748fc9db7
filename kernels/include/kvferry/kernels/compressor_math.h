// The compressor's arithmetic, written once for host and device so that the CPU reference
// and the CUDA kernels compute the same fp32 operations in the same order: their
// pre-quantization rows are then identical, not merely within the spec's 2-ulp tolerance.
//
// Every operation is an explicit IEEE fp32 multiply, add, divide or square root (no fused
// multiply-add on either side: the host builds with -ffp-contract=off, the device uses the
// _rn intrinsics), the exponential is a fixed polynomial instead of a library call, and
// the reductions follow the kernels' thread layout (see SumOfSquares).
#pragma once

#include <cmath>
#include <cstdint>

#include "kvferry/kernels/format.h"
#include "kvferry/kernels/numerics.h"

namespace kvferry::compressor_math {

KVF_HD float Mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
KVF_HD float Add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
KVF_HD float Sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
KVF_HD float Div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
KVF_HD float Sqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// e^x for x <= 0 (softmax arguments), within 2 fp32 ulp: x = k ln2 + r with |r| <= ln2/2
// (Cody-Waite split of ln2), e^r by its degree-7 Taylor polynomial, times 2^k. Below -87
// (e^x < 2^-125) the result is 0, as is e^-inf.
KVF_HD float Exp(float x) {
  if (!(x >= -87.0f)) return 0.0f;
  const float k = std::floor(Add(Mul(x, 1.44269504088896341f), 0.5f));
  const float r = Sub(Sub(x, Mul(k, 0.693145751953125f)), Mul(k, 1.42860682030941723212e-6f));
  float p = 1.0f / 5040.0f;
  p = Add(Mul(p, r), 1.0f / 720.0f);
  p = Add(Mul(p, r), 1.0f / 120.0f);
  p = Add(Mul(p, r), 1.0f / 24.0f);
  p = Add(Mul(p, r), 1.0f / 6.0f);
  p = Add(Mul(p, r), 0.5f);
  p = Add(Mul(p, r), 1.0f);
  p = Add(Mul(p, r), 1.0f);
  // k in [-126, 0] here, so 2^k is a normal float.
  return Mul(p, numerics::BitsToFloat(static_cast<uint32_t>(static_cast<int>(k) + 127) << 23));
}

// Online softmax-weighted sum over rows for one channel: after Add() of every row,
// Result() = sum_i e^(s_i - max) v_i / sum_i e^(s_i - max). One exponential per row: when
// a row raises the maximum, the old terms are rescaled by e^(old - new) and the new term
// weighs 1; otherwise the new term weighs e^(s - max).
struct OnlineSoftmax {
  float m = -INFINITY;
  float sum = 0.0f;
  float acc = 0.0f;

  KVF_HD void AddRow(float s, float v) {
    const float d = Sub(s, m);  // +inf for the first row
    const bool raises = d > 0.0f;
    const float e = Exp(raises ? -d : d);
    const float rescale = raises ? e : 1.0f;
    const float weight = raises ? 1.0f : e;
    sum = Add(Mul(sum, rescale), weight);
    acc = Add(Mul(acc, rescale), Mul(weight, v));
    m = raises ? s : m;
  }

  // Folds in the state of a later block of rows of the same window.
  KVF_HD void Merge(const OnlineSoftmax& o) {
    const float d = Sub(o.m, m);
    const bool raises = d > 0.0f;
    const float e = Exp(raises ? -d : d);
    const float mine = raises ? e : 1.0f;
    const float theirs = raises ? 1.0f : e;
    sum = Add(Mul(sum, mine), Mul(o.sum, theirs));
    acc = Add(Mul(acc, mine), Mul(o.acc, theirs));
    m = raises ? o.m : m;
  }

  KVF_HD float Result() const { return Div(acc, sum); }
};

// Ratio 128 pools its window on a cluster of kC128Ctas CTAs (one per SM). Each CTA pools
// kC128BlocksPerCta blocks of consecutive rows (8 rows each, one block per group of 4
// warps), online, and merges them in order; then the CTAs' states are merged in order.
inline constexpr int kC128Ctas = 4;
inline constexpr int kC128BlocksPerCta = 4;
inline constexpr int kC128RowsPerBlock = 128 / (kC128Ctas * kC128BlocksPerCta);

// The kernels' thread layout for one 512-value row: 128 threads of 4 consecutive values,
// 32 threads a warp.
inline constexpr int kValuesPerThread = 4;
inline constexpr int kRowThreads = kHeadDim / kValuesPerThread;

// Sum of h[c]^2 over the row in the kernels' order: each thread sums its 4 values in
// order, each warp combines its 32 partial sums by an xor butterfly (offsets 16, 8, 4, 2,
// 1), and the 4 warp sums are added as (w0 + w1) + (w2 + w3).
inline float SumOfSquares(const float* h) {
  float warp_sums[4];
  for (int w = 0; w < 4; ++w) {
    float lane[32];
    for (int l = 0; l < 32; ++l) {
      const float* v = h + (32 * w + l) * kValuesPerThread;
      float s = 0.0f;
      for (int i = 0; i < kValuesPerThread; ++i) s = Add(s, Mul(v[i], v[i]));
      lane[l] = s;
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
      float next[32];
      for (int l = 0; l < 32; ++l) next[l] = Add(lane[l], lane[l ^ offset]);
      for (int l = 0; l < 32; ++l) lane[l] = next[l];
    }
    warp_sums[w] = lane[0];
  }
  return Add(Add(warp_sums[0], warp_sums[1]), Add(warp_sums[2], warp_sums[3]));
}

// 1 / sqrt(mean + eps), from the sum of squares of 512 values.
KVF_HD float InvRms(float sum_of_squares, float eps) {
  return Div(1.0f, Sqrt(Add(Mul(sum_of_squares, 1.0f / kHeadDim), eps)));
}

// Step 3's per-value product and step 4's rotation of one pair, rounded as the spec says.
KVF_HD float NormValue(float h, float inv_rms, float weight) {
  return Mul(Mul(h, inv_rms), weight);
}
KVF_HD void Rotate(float a, float b, float cos, float sin, float& out_a, float& out_b) {
  out_a = Sub(Mul(a, cos), Mul(b, sin));
  out_b = Add(Mul(a, sin), Mul(b, cos));
}

}  // namespace kvferry::compressor_math
