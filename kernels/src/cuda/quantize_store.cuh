// quantize-store: [n, 512] bf16 rows + [n] locations → records in the pool.
#pragma once

#include "record.cuh"

namespace kvferry::cuda::detail {

template <Layout L, int kLog2Page, int kChunks>
__global__ void __launch_bounds__(kThreadsPerBlock)
    QuantizeStoreKernel(const uint16_t* __restrict__ rows,  // [n, 512] bf16
                        const int64_t* __restrict__ locs,   // [n]
                        int64_t num_tokens, int64_t pool_tokens,
                        uint8_t* __restrict__ pool, bool early_launch,
                        const int64_t* __restrict__ row_offsets,  // [n] or null
                        uint32_t* __restrict__ nonfinite) {       // flag or null
  int t;
  const int64_t token = ThreadToken<kChunks>(t, early_launch);
  if (token >= num_tokens) return;
  const uint16_t* row =
      rows + (row_offsets != nullptr ? __ldg(row_offsets + token) : token * kHeadDim);
  // The row loads do not depend on the location: issue them all before any is used.
  if constexpr (kChunks == 2) {
    RowShare<2> r;
    LoadBf16Row(row, t, r);
    if (nonfinite != nullptr && (AnyNonFinite(r.bits[0]) || AnyNonFinite(r.bits[1]))) {
      atomicOr(nonfinite, 1u);
    }
    int64_t loc;
    if (!TokenLocation(locs, token, pool_tokens, loc)) return;
    int64_t data, scale;
    Addressing<L, kLog2Page>::Locate(loc, data, scale);
    StoreRecord<L>(r, t, pool + data, pool + scale);
  } else {
    // One chunk per thread (small launches). The thread also loads the other chunk of its
    // pair, t ^ 1, of the same tile: its own amax then covers two lanes, which saves the
    // first shuffle (all of them for V41_FP4, whose tiles are two chunks).
    const uint4 own = __ldg(reinterpret_cast<const uint4*>(row) + t);
    const uint4 pair = __ldg(reinterpret_cast<const uint4*>(row) + (t ^ 1));
    int64_t loc;
    if (!TokenLocation(locs, token, pool_tokens, loc)) return;
    float v[kChunk], pair_v[kChunk];
    uint16_t bits[kChunk], pair_bits[kChunk];
    SplitBf16(own, bits, v);
    SplitBf16(pair, pair_bits, pair_v);
    if (nonfinite != nullptr && AnyNonFinite(bits)) atomicOr(nonfinite, 1u);
    int64_t data, scale;
    Addressing<L, kLog2Page>::Locate(loc, data, scale);
    StoreChunk<L, 2>(v, bits, fmaxf(Amax(v), Amax(pair_v)), t, pool + data, pool + scale);
  }
}

template <Layout L>
absl::Status LaunchQuantizeStore(const QuantizeStoreParams& p, const QuantizeShape& shape,
                                 cudaStream_t stream) {
  const int64_t threads_total = p.num_tokens * (kRowChunks / shape.chunks);
  const int64_t blocks = (threads_total + shape.threads - 1) / shape.threads;
  return DispatchPageSize(p.geometry.page_size, [&](auto log2_page) {
    constexpr int kLog2Page = decltype(log2_page)::value;
    return LaunchKernel(shape.chunks == 1 ? QuantizeStoreKernel<L, kLog2Page, 1>
                                          : QuantizeStoreKernel<L, kLog2Page, 2>,
                        blocks, shape.threads, stream, "QuantizeStoreKernel", p.rows, p.locs,
                        p.num_tokens, p.geometry.num_tokens(), p.pool, shape.early_launch,
                        p.row_offsets, p.nonfinite);
  });
}

}  // namespace kvferry::cuda::detail
