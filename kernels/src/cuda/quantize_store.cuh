// quantize-store: [n, 512] bf16 rows + [n] locations → records in the pool.
#pragma once

#include "record.cuh"

namespace kvferry::cuda::detail {

template <Layout L, int kLog2Page>
__global__ void __launch_bounds__(kThreadsPerBlock)
    QuantizeStoreKernel(const uint16_t* __restrict__ rows,  // [n, 512] bf16
                        const int64_t* __restrict__ locs,   // [n]
                        int64_t num_tokens, int64_t pool_tokens,
                        uint8_t* __restrict__ pool) {
  const int lane = threadIdx.x & (kWarp - 1);
  const int64_t token = WarpToken();
  if (token >= num_tokens) return;
  // The row load does not depend on the location: issue both before either is used.
  LaneRow r;
  LoadBf16Row(rows + token * kHeadDim, lane, r);
  int64_t loc;
  if (!TokenLocation(locs, token, pool_tokens, loc)) return;
  int64_t data, scale;
  Addressing<L, kLog2Page>::Locate(loc, data, scale);
  StoreRecord<L>(r, lane, pool + data, pool + scale);
}

template <Layout L>
absl::Status LaunchQuantizeStore(const QuantizeStoreParams& p, cudaStream_t stream) {
  return DispatchPageSize(p.geometry.page_size, [&](auto log2_page) {
    constexpr int kLog2Page = decltype(log2_page)::value;
    return LaunchKernel(QuantizeStoreKernel<L, kLog2Page>, BlocksFor(p.num_tokens),
                        kThreadsPerBlock, stream, "QuantizeStoreKernel", p.rows, p.locs,
                        p.num_tokens, p.geometry.num_tokens(), p.pool);
  });
}

}  // namespace kvferry::cuda::detail
