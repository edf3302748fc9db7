// The compressor kernels: one CTA of 128 threads per compressed entry, 4 channels per thread.
#pragma once

#include "kvferry/kernels/cuda_compressor.h"
#include "record.cuh"

namespace kvferry::cuda::detail {

inline constexpr int kCompressThreads = 128;  // 4 warps; thread t owns dims 4t .. 4t+3
inline constexpr int kCompressValues = 4;
inline constexpr int kC128Splits = 8;         // CTAs per ratio-128 entry in the pooling pass

// Per-channel online-softmax state for the 4 channels of a thread.
struct PoolState {
  float m[kCompressValues], sum[kCompressValues], acc[kCompressValues];

  __device__ __forceinline__ void Init() {
#pragma unroll
    for (int i = 0; i < kCompressValues; ++i) {
      m[i] = -INFINITY;
      sum[i] = 0.0f;
      acc[i] = 0.0f;
    }
  }
  __device__ __forceinline__ void Add(float4 score, float4 kv) {
    const float s[4] = {score.x, score.y, score.z, score.w};
    const float v[4] = {kv.x, kv.y, kv.z, kv.w};
#pragma unroll
    for (int i = 0; i < kCompressValues; ++i) {
      const float m_new = fmaxf(m[i], s[i]);
      const float rescale = __expf(m[i] - m_new);
      const float e = __expf(s[i] - m_new);
      sum[i] = sum[i] * rescale + e;
      acc[i] = acc[i] * rescale + e * v[i];
      m[i] = m_new;
    }
  }
  // Merges another state (a split of the same window).
  __device__ __forceinline__ void Merge(float m2, float sum2, float acc2, int i) {
    const float m_new = fmaxf(m[i], m2);
    const float a = __expf(m[i] - m_new), b = __expf(m2 - m_new);
    sum[i] = sum[i] * a + sum2 * b;
    acc[i] = acc[i] * a + acc2 * b;
    m[i] = m_new;
  }
};

// Pools rows [begin, end] of the window ending at `end_pos` into `state` (ratio >= 2).
template <int kRatio>
__device__ __forceinline__ void PoolRows(const float* __restrict__ kv,
                                         const float* __restrict__ score, int64_t first_position,
                                         int64_t end_pos, int64_t begin, int64_t end,
                                         PoolState& state) {
  constexpr int64_t kWidth = int64_t{kRatio == 4 ? 2 : 1} * kHeadDim;
  const int t = threadIdx.x;
#pragma unroll 4
  for (int64_t pos = begin; pos <= end; ++pos) {
    const int64_t half = (kRatio == 4 && end_pos - pos < 4) ? kHeadDim : 0;
    const int64_t at = (pos - first_position) * kWidth + half + kCompressValues * t;
    state.Add(__ldg(reinterpret_cast<const float4*>(score + at)),
              __ldg(reinterpret_cast<const float4*>(kv + at)));
  }
}

// Block-wide sum over the 128 threads.
__device__ __forceinline__ float BlockSum(float x, float* shared4) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xFFFFFFFFu, x, offset);
  if ((threadIdx.x & 31) == 0) shared4[threadIdx.x >> 5] = x;
  __syncthreads();
  // Same order in every thread, so all agree bit for bit.
  return (shared4[0] + shared4[1]) + (shared4[2] + shared4[3]);
}

// Steps 3-5 for the thread's 4 pooled channels: RMSNorm, RoPE, optional FP4 fake
// quantization, and the store of the entry into `loc` of the pool.
template <Layout L, bool kFakeQuant>
__device__ __forceinline__ void FinishEntry(const float (&pooled)[kCompressValues],
                                            const CompressorParams& p, int64_t end_pos,
                                            int64_t entry, int64_t pool_tokens,
                                            float* shared4) {
  const int t = threadIdx.x;
  float v[kCompressValues];
  uint16_t bits[kCompressValues];
  float squares = 0.0f;
#pragma unroll
  for (int i = 0; i < kCompressValues; ++i) {
    v[i] = numerics::Bf16ToFloat(numerics::FloatToBf16(pooled[i]));
    squares += v[i] * v[i];
  }
  const float total = BlockSum(squares, shared4);
  const float inv_rms = rsqrtf(total / kHeadDim + p.eps);
  const uint2 w = __ldg(reinterpret_cast<const uint2*>(p.norm_weight) + t);
  const uint16_t weight[4] = {static_cast<uint16_t>(w.x), static_cast<uint16_t>(w.x >> 16),
                              static_cast<uint16_t>(w.y), static_cast<uint16_t>(w.y >> 16)};
#pragma unroll
  for (int i = 0; i < kCompressValues; ++i) {
    bits[i] = numerics::FloatToBf16(
        __fmul_rn(__fmul_rn(v[i], inv_rms), numerics::Bf16ToFloat(weight[i])));
    v[i] = numerics::Bf16ToFloat(bits[i]);
  }
  constexpr int kFirstRopeThread = kNopeDim / kCompressValues;  // 112
  if (t >= kFirstRopeThread) {
    const int64_t q = end_pos + 1 - p.ratio;
    const int pair = 2 * (t - kFirstRopeThread);  // this thread's pairs: pair, pair + 1
    const float2 cs = __ldg(reinterpret_cast<const float2*>(p.rope_cos + q * 32 + pair));
    const float2 sn = __ldg(reinterpret_cast<const float2*>(p.rope_sin + q * 32 + pair));
    const float c[2] = {cs.x, cs.y}, s[2] = {sn.x, sn.y};
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const float a = v[2 * k], b = v[2 * k + 1];
      bits[2 * k] = numerics::FloatToBf16(__fsub_rn(__fmul_rn(a, c[k]), __fmul_rn(b, s[k])));
      bits[2 * k + 1] = numerics::FloatToBf16(__fadd_rn(__fmul_rn(a, s[k]), __fmul_rn(b, c[k])));
    }
#pragma unroll
    for (int i = 0; i < kCompressValues; ++i) v[i] = numerics::Bf16ToFloat(bits[i]);
  }
  if (p.pre_quant_rows != nullptr) {
    uint2 out;
    out.x = bits[0] | (uint32_t{bits[1]} << 16);
    out.y = bits[2] | (uint32_t{bits[3]} << 16);
    reinterpret_cast<uint2*>(p.pre_quant_rows + entry * kHeadDim)[t] = out;
  }
  if constexpr (kFakeQuant) {
    // Quantize each 16-value tile (4 threads) as V41_FP4 does, and decode it back.
    const uint8_t code = Fp4ScaleCodeFast(GroupAmax<4>(v));
    const float s = E4m3ToFloatFast(code);
    UnpackE2m1(PackE2m1Half2(v, bits, s), s, bits);
#pragma unroll
    for (int i = 0; i < kCompressValues; ++i) v[i] = numerics::Bf16ToFloat(bits[i]);
  }
  const int64_t loc = __ldg(p.entry_locs + entry);
  const bool in_range = loc >= 0 && loc < pool_tokens;
  const RecordOffsets at = LocateRecord(p.geometry, in_range ? loc : 0);
  uint8_t* data = p.pool + at.data;
  uint8_t* scale = p.pool + at.scale;
  // Shuffles below need every lane, so out-of-range entries only skip the stores.
  if constexpr (L == Layout::kV41) {
    const uint8_t e = numerics::V41ScaleExponent(GroupAmax<8>(v));
    uint32_t codes[1];
    PackE4m3Words(v, numerics::Ue8m0Reciprocal(e), codes);
    if (in_range) {
      reinterpret_cast<uint32_t*>(data)[t] = codes[0];
      if ((t & 7) == 0) scale[t >> 3] = e;
    }
  } else if constexpr (L == Layout::kV4) {
    const uint8_t e = V4ScaleExponentBf16(GroupAmax<16>(v));
    if (t < kFirstRopeThread) {
      uint32_t codes[1];
      PackE4m3Words(v, numerics::Ue8m0Reciprocal(e), codes);
      if (in_range) {
        reinterpret_cast<uint32_t*>(data)[t] = codes[0];
        if ((t & 15) == 0) scale[t >> 4] = e;
      }
    } else if (in_range) {
      uint2 raw;
      raw.x = bits[0] | (uint32_t{bits[1]} << 16);
      raw.y = bits[2] | (uint32_t{bits[3]} << 16);
      reinterpret_cast<uint2*>(data + kNopeDim)[t - kFirstRopeThread] = raw;
      if (t == kFirstRopeThread) scale[7] = 0;
    }
  } else {
    const uint8_t code = Fp4ScaleCodeFast(GroupAmax<4>(v));
    const uint32_t packed = PackE2m1Half2(v, bits, E4m3ToFloatFast(code));
    if (in_range) {
      reinterpret_cast<uint16_t*>(data)[t] = static_cast<uint16_t>(packed);
      if ((t & 3) == 0) scale[t >> 2] = code;
    }
  }
}

// Ratios 1, 2, 4: one CTA pools and finishes one entry.
template <Layout L, int kRatio, bool kFakeQuant>
__global__ void __launch_bounds__(kCompressThreads)
    CompressKernel(const CompressorParams p, int64_t first_end) {
  __shared__ float shared4[4];
  WaitForPrerequisiteGrid();
  AllowDependentGridLaunch();
  const int64_t entry = blockIdx.x;
  const int64_t end_pos = first_end + entry * kRatio;
  float pooled[kCompressValues];
  if constexpr (kRatio == 1) {
    const float4 kv = __ldg(reinterpret_cast<const float4*>(
                                p.kv + (end_pos - p.first_position) * kHeadDim) + threadIdx.x);
    pooled[0] = kv.x;
    pooled[1] = kv.y;
    pooled[2] = kv.z;
    pooled[3] = kv.w;
  } else {
    constexpr int64_t kSpan = kRatio == 4 ? 8 : kRatio;
    PoolState state;
    state.Init();
    const int64_t begin = end_pos - kSpan + 1 > 0 ? end_pos - kSpan + 1 : 0;
    PoolRows<kRatio>(p.kv, p.score, p.first_position, end_pos, begin, end_pos, state);
#pragma unroll
    for (int i = 0; i < kCompressValues; ++i) pooled[i] = __fdiv_rn(state.acc[i], state.sum[i]);
  }
  FinishEntry<L, kFakeQuant>(pooled, p, end_pos, entry, p.geometry.num_tokens(), shared4);
}

// Ratio 128, pass 1: CTA (entry, split) pools 128 / kC128Splits rows into a partial state:
// partial[(entry * splits + split) * 3 + {0: m, 1: sum, 2: acc}][512].
// (A template only so that each layout's translation unit may define it.)
template <int kSplits>
__global__ void __launch_bounds__(kCompressThreads)
    C128PoolKernel(const CompressorParams p, int64_t first_end, float* __restrict__ partial) {
  WaitForPrerequisiteGrid();
  const int64_t entry = blockIdx.x / kSplits;
  const int split = blockIdx.x % kSplits;
  const int64_t end_pos = first_end + entry * 128;
  constexpr int kRows = 128 / kSplits;
  PoolState state;
  state.Init();
  const int64_t begin = end_pos - 127 + int64_t{split} * kRows;
  PoolRows<128>(p.kv, p.score, p.first_position, end_pos, begin, begin + kRows - 1, state);
  float4* out = reinterpret_cast<float4*>(partial + (blockIdx.x * int64_t{3}) * kHeadDim);
  out[threadIdx.x] = make_float4(state.m[0], state.m[1], state.m[2], state.m[3]);
  out[kCompressThreads + threadIdx.x] =
      make_float4(state.sum[0], state.sum[1], state.sum[2], state.sum[3]);
  out[2 * kCompressThreads + threadIdx.x] =
      make_float4(state.acc[0], state.acc[1], state.acc[2], state.acc[3]);
  AllowDependentGridLaunch();
}

// Ratio 128, pass 2: merge the splits of an entry and finish it.
template <Layout L>
__global__ void __launch_bounds__(kCompressThreads)
    C128FinishKernel(const CompressorParams p, int64_t first_end,
                     const float* __restrict__ partial) {
  __shared__ float shared4[4];
  WaitForPrerequisiteGrid();
  AllowDependentGridLaunch();
  const int64_t entry = blockIdx.x;
  PoolState state;
  state.Init();
  for (int split = 0; split < kC128Splits; ++split) {
    const float4* in = reinterpret_cast<const float4*>(
        partial + ((entry * kC128Splits + split) * int64_t{3}) * kHeadDim);
    const float4 m = in[threadIdx.x], sum = in[kCompressThreads + threadIdx.x],
                 acc = in[2 * kCompressThreads + threadIdx.x];
    state.Merge(m.x, sum.x, acc.x, 0);
    state.Merge(m.y, sum.y, acc.y, 1);
    state.Merge(m.z, sum.z, acc.z, 2);
    state.Merge(m.w, sum.w, acc.w, 3);
  }
  float pooled[kCompressValues];
#pragma unroll
  for (int i = 0; i < kCompressValues; ++i) pooled[i] = __fdiv_rn(state.acc[i], state.sum[i]);
  FinishEntry<L, false>(pooled, p, first_end + entry * 128, entry, p.geometry.num_tokens(),
                        shared4);
}

// Per-layout launcher (one explicit instantiation per .cu file).
template <Layout L>
absl::Status LaunchCompress(const CompressorParams& p, const CompressorWindows& w,
                            cudaStream_t stream) {
  switch (p.ratio) {
    case 1:
      if constexpr (L != Layout::kV41Fp4) {
        if (p.fp4_fake_quant) {
          return LaunchKernel(CompressKernel<L, 1, true>, w.count, kCompressThreads, stream,
                              "CompressKernel<1>", p, w.first_end);
        }
      }
      return LaunchKernel(CompressKernel<L, 1, false>, w.count, kCompressThreads, stream,
                          "CompressKernel<1>", p, w.first_end);
    case 2:
      if constexpr (L != Layout::kV41Fp4) {
        if (p.fp4_fake_quant) {
          return LaunchKernel(CompressKernel<L, 2, true>, w.count, kCompressThreads, stream,
                              "CompressKernel<2>", p, w.first_end);
        }
      }
      return LaunchKernel(CompressKernel<L, 2, false>, w.count, kCompressThreads, stream,
                          "CompressKernel<2>", p, w.first_end);
    case 4:
      return LaunchKernel(CompressKernel<L, 4, false>, w.count, kCompressThreads, stream,
                          "CompressKernel<4>", p, w.first_end);
    case 128: {
      float* partial = nullptr;
      const size_t bytes = static_cast<size_t>(w.count) * kC128Splits * 3 * kHeadDim * sizeof(float);
      if (absl::Status s = CudaStatus(cudaMallocAsync(reinterpret_cast<void**>(&partial), bytes, stream),
                                      "compressor scratch");
          !s.ok()) {
        return s;
      }
      const absl::Status pooled =
          LaunchKernel(C128PoolKernel<kC128Splits>, w.count * kC128Splits, kCompressThreads, stream,
                       "C128PoolKernel", p, w.first_end, partial);
      const absl::Status finished =
          pooled.ok() ? LaunchKernel(C128FinishKernel<L>, w.count, kCompressThreads, stream,
                                     "C128FinishKernel", p, w.first_end,
                                     static_cast<const float*>(partial))
                      : pooled;
      const absl::Status freed = CudaStatus(cudaFreeAsync(partial, stream), "compressor scratch");
      return finished.ok() ? freed : finished;
    }
  }
  return absl::InvalidArgumentError("unsupported ratio");
}

}  // namespace kvferry::cuda::detail
