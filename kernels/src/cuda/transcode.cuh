// transcode: the records at [n] locations of a pool in layout From → the same locations of
// a pool in layout To, as quantize_To(dequantize_From(row)).
#pragma once

#include "record.cuh"

namespace kvferry::cuda::detail {

template <Layout From, Layout To, int kLog2Page>
__global__ void __launch_bounds__(kThreadsPerBlock)
    TranscodeKernel(const uint8_t* __restrict__ src, const int64_t* __restrict__ locs,
                    int64_t num_tokens, int64_t pool_tokens, uint8_t* __restrict__ dst) {
  TokenRecord rec;
  if (!ReadTokenRecord<From, kLog2Page>(src, locs, num_tokens, pool_tokens, rec)) return;
  int64_t data, scale;
  Addressing<To, kLog2Page>::Locate(rec.loc, data, scale);
  StoreRecord<To>(rec.row, rec.lane, dst + data, dst + scale);
}

template <Layout From, Layout To>
absl::Status LaunchTranscodeTo(const TranscodeParams& p, cudaStream_t stream) {
  const int64_t pool_tokens = p.from.num_tokens() < p.to.num_tokens() ? p.from.num_tokens()
                                                                      : p.to.num_tokens();
  return DispatchPageSize(p.from.page_size, [&](auto log2_page) {
    constexpr int kLog2Page = decltype(log2_page)::value;
    return LaunchKernel(TranscodeKernel<From, To, kLog2Page>, BlocksFor(p.num_tokens),
                        kThreadsPerBlock, stream, "TranscodeKernel", p.src, p.locs,
                        p.num_tokens, pool_tokens, p.dst);
  });
}

template <Layout From>
absl::Status LaunchTranscode(const TranscodeParams& p, cudaStream_t stream) {
  return DispatchLayout(p.to.layout, [&](auto to) {
    return LaunchTranscodeTo<From, decltype(to)::value>(p, stream);
  });
}

}  // namespace kvferry::cuda::detail
