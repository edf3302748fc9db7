// The compressor kernels. A row of 512 channels is handled by 128 threads of 4 consecutive
// channels (4 warps); the arithmetic is compressor_math.h's, in the order the CPU
// reference uses, so both produce the same pre-quantization rows.
#pragma once

#include <cooperative_groups.h>

#include "absl/status/statusor.h"

#include "kvferry/kernels/compressor_math.h"
#include "kvferry/kernels/cuda_compressor.h"
#include "kvferry/kernels/status_macros.h"
#include "record.cuh"

namespace kvferry::cuda::detail {

using compressor_math::OnlineSoftmax;
inline constexpr int kCompressValues = compressor_math::kValuesPerThread;  // 4
inline constexpr int kRowThreads = compressor_math::kRowThreads;          // 128
inline constexpr int kC128Ctas = compressor_math::kC128Ctas;              // 4 per cluster
inline constexpr int kC128Blocks = compressor_math::kC128BlocksPerCta;    // 4 per CTA
inline constexpr int kC128Threads = kRowThreads * kC128Blocks;            // 512

// Loads rows [first, first + kBatch) (those below `count`) of the window for row thread g.
template <int kRatio, int kBatch>
__device__ __forceinline__ void LoadRows(const float* __restrict__ kv,
                                         const float* __restrict__ score, int64_t first_position,
                                         int64_t end_pos, int64_t begin, int first, int count,
                                         int g, float4 (&s)[kBatch], float4 (&v)[kBatch]) {
  constexpr int64_t kWidth = int64_t{kRatio == 4 ? 2 : 1} * kHeadDim;
#pragma unroll
  for (int j = 0; j < kBatch; ++j) {
    const int64_t pos = begin + first + j;
    const int64_t half = (kRatio == 4 && end_pos - pos < 4) ? kHeadDim : 0;
    const int64_t at = (pos - first_position) * kWidth + half + kCompressValues * g;
    if (first + j < count) {
      s[j] = __ldg(reinterpret_cast<const float4*>(score + at));
      v[j] = __ldg(reinterpret_cast<const float4*>(kv + at));
    }
  }
}

template <int kBatch>
__device__ __forceinline__ void AddRows(const float4 (&s)[kBatch], const float4 (&v)[kBatch],
                                        int first, int count,
                                        OnlineSoftmax (&state)[kCompressValues]) {
#pragma unroll
  for (int j = 0; j < kBatch; ++j) {
    if (first + j < count) {
      state[0].AddRow(s[j].x, v[j].x);
      state[1].AddRow(s[j].y, v[j].y);
      state[2].AddRow(s[j].z, v[j].z);
      state[3].AddRow(s[j].w, v[j].w);
    }
  }
}

// Pools rows [begin, begin + count) of the window ending at end_pos into `state`, for the
// 4 channels of row thread g, kBatch rows at a time; the next batch's loads are issued
// before the current batch is folded in, so memory latency overlaps the arithmetic.
template <int kRatio, int kBatch>
__device__ __forceinline__ void PoolRows(const float* __restrict__ kv,
                                         const float* __restrict__ score, int64_t first_position,
                                         int64_t end_pos, int64_t begin, int count, int g,
                                         OnlineSoftmax (&state)[kCompressValues]) {
  float4 s[kBatch], v[kBatch], s_next[kBatch], v_next[kBatch];
  LoadRows<kRatio>(kv, score, first_position, end_pos, begin, 0, count, g, s, v);
  for (int first = 0; first < count; first += kBatch) {
    if (first + kBatch < count) {
      LoadRows<kRatio>(kv, score, first_position, end_pos, begin, first + kBatch, count, g,
                       s_next, v_next);
    }
    AddRows(s, v, first, count, state);
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      s[j] = s_next[j];
      v[j] = v_next[j];
    }
  }
}

// Sum over the 128 row threads (threads 0..127 of the block), in SumOfSquares' order.
__device__ __forceinline__ float RowSum(float x, int g, float* warp_sums) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    x = compressor_math::Add(x, __shfl_xor_sync(0xFFFFFFFFu, x, offset));
  }
  if ((g & 31) == 0) warp_sums[g >> 5] = x;
  asm volatile("bar.sync 1, 128;" ::: "memory");  // the 128 row threads only
  return compressor_math::Add(compressor_math::Add(warp_sums[0], warp_sums[1]),
                              compressor_math::Add(warp_sums[2], warp_sums[3]));
}

// Steps 3-5 for row thread g's 4 pooled channels: RMSNorm, RoPE, optional FP4 fake
// quantization, and the store of entry `entry` into its pool location.
template <Layout L, bool kFakeQuant>
__device__ __forceinline__ void FinishEntry(const float (&pooled)[kCompressValues],
                                            const CompressorParams& p, int64_t end_pos,
                                            int64_t entry, int g, float* warp_sums) {
  using namespace compressor_math;
  float v[kCompressValues];
  uint16_t bits[kCompressValues];
  float squares = 0.0f;
#pragma unroll
  for (int i = 0; i < kCompressValues; ++i) {
    v[i] = numerics::Bf16ToFloat(numerics::FloatToBf16(pooled[i]));
    squares = Add(squares, Mul(v[i], v[i]));
  }
  const float inv_rms = InvRms(RowSum(squares, g, warp_sums), p.eps);
  const uint2 w = __ldg(reinterpret_cast<const uint2*>(p.norm_weight) + g);
  const uint16_t weight[4] = {static_cast<uint16_t>(w.x), static_cast<uint16_t>(w.x >> 16),
                              static_cast<uint16_t>(w.y), static_cast<uint16_t>(w.y >> 16)};
#pragma unroll
  for (int i = 0; i < kCompressValues; ++i) {
    bits[i] = numerics::FloatToBf16(NormValue(v[i], inv_rms, numerics::Bf16ToFloat(weight[i])));
    v[i] = numerics::Bf16ToFloat(bits[i]);
  }
  constexpr int kFirstRopeThread = kNopeDim / kCompressValues;  // 112
  if (g >= kFirstRopeThread) {
    const int64_t q = end_pos + 1 - p.ratio;
    const int pair = 2 * (g - kFirstRopeThread);  // this thread's pairs: pair, pair + 1
    const float2 cs = __ldg(reinterpret_cast<const float2*>(p.rope_cos + q * 32 + pair));
    const float2 sn = __ldg(reinterpret_cast<const float2*>(p.rope_sin + q * 32 + pair));
    float r[4];
    Rotate(v[0], v[1], cs.x, sn.x, r[0], r[1]);
    Rotate(v[2], v[3], cs.y, sn.y, r[2], r[3]);
#pragma unroll
    for (int i = 0; i < kCompressValues; ++i) {
      bits[i] = numerics::FloatToBf16(r[i]);
      v[i] = numerics::Bf16ToFloat(bits[i]);
    }
  }
  if (p.pre_quant_rows != nullptr) {
    uint2 out;
    out.x = bits[0] | (uint32_t{bits[1]} << 16);
    out.y = bits[2] | (uint32_t{bits[3]} << 16);
    reinterpret_cast<uint2*>(p.pre_quant_rows + entry * kHeadDim)[g] = out;
  }
  if constexpr (kFakeQuant) {
    // Quantize each 16-value tile (4 threads) as V41_FP4 does, and decode it back.
    const uint8_t code = Fp4ScaleCodeFast(GroupAmax<4>(v));
    const float s = E4m3ToFloatFast(code);
    UnpackE2m1(EncodeE2m1(v, E2m1Multiplier(s)), s, bits);
#pragma unroll
    for (int i = 0; i < kCompressValues; ++i) v[i] = numerics::Bf16ToFloat(bits[i]);
  }
  const int64_t loc = __ldg(p.entry_locs + entry);
  const bool in_range = loc >= 0 && loc < p.geometry.num_tokens();
  const RecordOffsets at = LocateRecord(p.geometry, in_range ? loc : 0);
  uint8_t* data = p.pool + at.data;
  uint8_t* scale = p.pool + at.scale;
  // The shuffles below need every lane, so an out-of-range entry only skips the stores.
  if constexpr (L == Layout::kV41) {
    const uint8_t e = numerics::V41ScaleExponent(GroupAmax<8>(v));
    uint32_t codes[1];
    PackE4m3Words(v, numerics::Ue8m0Reciprocal(e), codes);
    if (in_range) {
      reinterpret_cast<uint32_t*>(data)[g] = codes[0];
      if ((g & 7) == 0) scale[g >> 3] = e;
    }
  } else if constexpr (L == Layout::kV4) {
    const uint8_t e = V4ScaleExponentBf16(GroupAmax<16>(v));
    if (g < kFirstRopeThread) {
      uint32_t codes[1];
      PackE4m3Words(v, numerics::Ue8m0Reciprocal(e), codes);
      if (in_range) {
        reinterpret_cast<uint32_t*>(data)[g] = codes[0];
        if ((g & 15) == 0) scale[g >> 4] = e;
      }
    } else if (in_range) {
      uint2 raw;
      raw.x = bits[0] | (uint32_t{bits[1]} << 16);
      raw.y = bits[2] | (uint32_t{bits[3]} << 16);
      reinterpret_cast<uint2*>(data + kNopeDim)[g - kFirstRopeThread] = raw;
      if (g == kFirstRopeThread) scale[7] = 0;
    }
  } else {
    const uint8_t code = Fp4ScaleCodeFast(GroupAmax<4>(v));
    const uint32_t packed = EncodeE2m1(v, E2m1Multiplier(E4m3ToFloatFast(code)));
    if (in_range) {
      reinterpret_cast<uint16_t*>(data)[g] = static_cast<uint16_t>(packed);
      if ((g & 3) == 0) scale[g >> 2] = code;
    }
  }
}

// Ratios 1, 2, 4: one CTA of 128 threads pools and finishes one entry.
template <Layout L, int kRatio, bool kFakeQuant>
__global__ void __launch_bounds__(kRowThreads, 8)
    CompressKernel(const CompressorParams p, int64_t first_end) {
  __shared__ float warp_sums[4];
  WaitForPrerequisiteGrid();
  AllowDependentGridLaunch();
  const int g = threadIdx.x;
  const int64_t entry = blockIdx.x;
  const int64_t end_pos = first_end + entry * kRatio;
  float pooled[kCompressValues];
  if constexpr (kRatio == 1) {
    const float4 kv = __ldg(reinterpret_cast<const float4*>(
                                p.kv + (end_pos - p.first_position) * kHeadDim) + g);
    pooled[0] = kv.x;
    pooled[1] = kv.y;
    pooled[2] = kv.z;
    pooled[3] = kv.w;
  } else {
    constexpr int64_t kSpan = kRatio == 4 ? 8 : kRatio;
    OnlineSoftmax state[kCompressValues];
    const int64_t begin = end_pos - kSpan + 1 > 0 ? end_pos - kSpan + 1 : 0;
    PoolRows<kRatio, 2>(p.kv, p.score, p.first_position, end_pos, begin,
                        static_cast<int>(end_pos - begin + 1), g, state);
#pragma unroll
    for (int i = 0; i < kCompressValues; ++i) pooled[i] = state[i].Result();
  }
  FinishEntry<L, kFakeQuant>(pooled, p, end_pos, entry, g, warp_sums);
}

// Ratio 128. The window's 16 row blocks of 8 rows are folded in two levels: the 4 blocks
// of each group in order, then the 4 groups in order (compressor_math.h). Two shapes
// compute exactly that:
// - kCluster: a cluster of 4 CTAs of 512 threads per entry, one CTA per SM, for few
//   entries. CTA r is group r; its warp group w (4 warps, 128 threads) pools block w for
//   all 512 channels; CTA 0 merges the other CTAs' states, read from their shared memory.
// - otherwise one CTA of 512 threads per entry: warp group r is group r and pools its 4
//   blocks one after the other; warp group 0 merges the others' states.
template <Layout L, bool kCluster>
__global__ void __launch_bounds__(kC128Threads)
    Compress128Kernel(const CompressorParams p, int64_t first_end) {
  __shared__ float4 block_state[kC128Blocks - 1][3][kRowThreads];  // m, sum, acc
  __shared__ float4 cta_state[3][kRowThreads];
  __shared__ float warp_sums[4];
  namespace cg = cooperative_groups;
  WaitForPrerequisiteGrid();
  AllowDependentGridLaunch();
  const int g = threadIdx.x % kRowThreads;
  const int warp_group = threadIdx.x / kRowThreads;
  const int64_t entry = kCluster ? blockIdx.x / kC128Ctas : blockIdx.x;
  const int64_t end_pos = first_end + entry * 128;
  constexpr int kRows = compressor_math::kC128RowsPerBlock;
  OnlineSoftmax state[kCompressValues];
  auto store = [&](float4 (&to)[3][kRowThreads]) {
    to[0][g] = make_float4(state[0].m, state[1].m, state[2].m, state[3].m);
    to[1][g] = make_float4(state[0].sum, state[1].sum, state[2].sum, state[3].sum);
    to[2][g] = make_float4(state[0].acc, state[1].acc, state[2].acc, state[3].acc);
  };
  auto merge = [&](const float4* m, const float4* sum, const float4* acc) {
    state[0].Merge(OnlineSoftmax{m->x, sum->x, acc->x});
    state[1].Merge(OnlineSoftmax{m->y, sum->y, acc->y});
    state[2].Merge(OnlineSoftmax{m->z, sum->z, acc->z});
    state[3].Merge(OnlineSoftmax{m->w, sum->w, acc->w});
  };
  if constexpr (kCluster) {
    cg::cluster_group cluster = cg::this_cluster();
    const int rank = static_cast<int>(cluster.block_rank());
    PoolRows<128, 4>(p.kv, p.score, p.first_position, end_pos,
                     end_pos - 127 + (rank * kC128Blocks + warp_group) * kRows, kRows, g, state);
    if (warp_group > 0) store(block_state[warp_group - 1]);
    __syncthreads();
    if (warp_group == 0) {
      for (int b = 0; b < kC128Blocks - 1; ++b) {
        merge(&block_state[b][0][g], &block_state[b][1][g], &block_state[b][2][g]);
      }
      if (rank > 0) store(cta_state);
    }
    cluster.sync();  // every CTA's state is in its shared memory
    if (rank == 0 && warp_group == 0) {
      for (int r = 1; r < kC128Ctas; ++r) {
        float4* remote = cluster.map_shared_rank(&cta_state[0][0], r);
        merge(remote + g, remote + kRowThreads + g, remote + 2 * kRowThreads + g);
      }
    }
    cluster.sync();  // CTA 0 has read the others' shared memory; they may exit
    if (rank != 0 || warp_group != 0) return;
  } else {
    for (int b = 0; b < kC128Blocks; ++b) {
      OnlineSoftmax block[kCompressValues];
      PoolRows<128, 4>(p.kv, p.score, p.first_position, end_pos,
                       end_pos - 127 + (warp_group * kC128Blocks + b) * kRows, kRows, g, block);
#pragma unroll
      for (int i = 0; i < kCompressValues; ++i) {
        if (b == 0) {
          state[i] = block[i];
        } else {
          state[i].Merge(block[i]);
        }
      }
    }
    if (warp_group > 0) store(block_state[warp_group - 1]);
    __syncthreads();
    if (warp_group > 0) return;
    for (int r = 0; r < kC128Ctas - 1; ++r) {
      merge(&block_state[r][0][g], &block_state[r][1][g], &block_state[r][2][g]);
    }
  }
  float pooled[kCompressValues];
#pragma unroll
  for (int i = 0; i < kCompressValues; ++i) pooled[i] = state[i].Result();
  FinishEntry<L, false>(pooled, p, end_pos, entry, g, warp_sums);
}

// Entries up to which ratio 128 runs on clusters (4 SMs per entry): about one wave.
inline absl::StatusOr<int64_t> ClusterEntryLimit() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError("cannot read the multiprocessor count");
  }
  return sms / kC128Ctas;
}

// Ratios 1, 2 and 4 (one CTA per entry), with the FP4 fake quantization when asked for
// (validation allows it for ratios 1 and 2 only; V41_FP4 pools never take it).
template <Layout L, int kRatio>
absl::Status LaunchRowCompress(const CompressorParams& p, const CompressorWindows& w,
                               cudaStream_t stream, const char* name) {
  if constexpr (L != Layout::kV41Fp4 && kRatio != 4) {
    if (p.fp4_fake_quant) {
      return LaunchKernel(CompressKernel<L, kRatio, true>, w.count, kRowThreads, stream, name, p,
                          w.first_end);
    }
  }
  return LaunchKernel(CompressKernel<L, kRatio, false>, w.count, kRowThreads, stream, name, p,
                      w.first_end);
}

// Per-layout launcher (one explicit instantiation per .cu file).
template <Layout L>
absl::Status LaunchCompress(const CompressorParams& p, const CompressorWindows& w,
                            cudaStream_t stream) {
  switch (p.ratio) {
    case 1:
      return LaunchRowCompress<L, 1>(p, w, stream, "CompressKernel<1>");
    case 2:
      return LaunchRowCompress<L, 2>(p, w, stream, "CompressKernel<2>");
    case 4:
      return LaunchRowCompress<L, 4>(p, w, stream, "CompressKernel<4>");
    case 128: {
      KVF_ASSIGN_OR_RETURN(const int64_t limit, ClusterEntryLimit());
      if (w.count <= limit) {
        return LaunchClusterKernel(Compress128Kernel<L, true>, w.count * kC128Ctas, kC128Threads,
                                   kC128Ctas, stream, "Compress128Kernel<cluster>", p,
                                   w.first_end);
      }
      return LaunchKernel(Compress128Kernel<L, false>, w.count, kC128Threads, stream,
                          "Compress128Kernel", p, w.first_end);
    }
  }
  return absl::InvalidArgumentError("unsupported ratio");
}

}  // namespace kvferry::cuda::detail
