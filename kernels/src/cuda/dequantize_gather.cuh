// dequantize-gather: [n] locations → [n, 512] bf16 workspace rows at any row stride.
#pragma once

#include "record.cuh"

namespace kvferry::cuda::detail {

template <Layout L, int kLog2Page, bool kAlignedOut>
__global__ void __launch_bounds__(kThreadsPerBlock)
    DequantizeGatherKernel(const uint8_t* __restrict__ pool,
                           const int64_t* __restrict__ locs,  // [n]
                           int64_t num_tokens, int64_t pool_tokens,
                           uint16_t* __restrict__ out,  // [n, out_row_stride] bf16
                           int64_t out_row_stride,
                           const int64_t* __restrict__ out_offsets) {  // [n] or null
  TokenRecord rec;
  if (!ReadTokenRecord<L, kLog2Page>(pool, locs, num_tokens, pool_tokens, rec)) return;
  uint16_t* row = out + (out_offsets != nullptr ? __ldg(out_offsets + rec.token)
                                                : rec.token * out_row_stride);
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    uint16_t* dst = row + kChunk * ChunkOf<2>(rec.lane, k);
    if constexpr (kAlignedOut) {
      *reinterpret_cast<uint4*>(dst) = JoinBf16(rec.row.bits[k]);
    } else {
#pragma unroll
      for (int j = 0; j < kChunk; ++j) dst[j] = rec.row.bits[k][j];
    }
  }
}

template <Layout L>
absl::Status LaunchDequantizeGather(const DequantizeGatherParams& p, cudaStream_t stream) {
  const bool aligned = reinterpret_cast<uintptr_t>(p.out) % 16 == 0 &&
                       (p.out_offsets != nullptr ? p.out_offset_align % kChunk == 0
                                                 : p.out_row_stride % kChunk == 0);
  return DispatchPageSize(p.geometry.page_size, [&](auto log2_page) {
    constexpr int kLog2Page = decltype(log2_page)::value;
    return LaunchKernel(aligned ? DequantizeGatherKernel<L, kLog2Page, true>
                                : DequantizeGatherKernel<L, kLog2Page, false>,
                        BlocksFor(p.num_tokens), kThreadsPerBlock, stream,
                        "DequantizeGatherKernel", p.pool, p.locs, p.num_tokens,
                        p.geometry.num_tokens(), p.out, p.out_row_stride, p.out_offsets);
  });
}

}  // namespace kvferry::cuda::detail
