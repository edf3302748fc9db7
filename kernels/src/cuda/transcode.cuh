// transcode: the records at [n] locations of a pool in layout From → the same locations of
// a pool in layout To, as quantize_To(dequantize_From(row)).
#pragma once

#include "record.cuh"

namespace kvferry::cuda::detail {

template <Layout From, Layout To, int kLog2Page>
__global__ void __launch_bounds__(kThreadsPerBlock)
    TranscodeKernel(const uint8_t* __restrict__ src, const int64_t* __restrict__ locs,
                    int64_t num_tokens, int64_t src_tokens, uint8_t* __restrict__ dst,
                    const int64_t* __restrict__ dst_locs,  // [n] or null: locs
                    int64_t dst_tokens) {
  TokenRecord rec;
  if (!ReadTokenRecord<From, kLog2Page>(src, locs, num_tokens, src_tokens, rec)) return;
  const int64_t to = dst_locs != nullptr ? __ldg(dst_locs + rec.token) : rec.loc;
  if (to < 0 || to >= dst_tokens) return;
  int64_t data, scale;
  Addressing<To, kLog2Page>::Locate(to, data, scale);
  StoreRecord<To>(rec.row, rec.lane, dst + data, dst + scale);
}

template <Layout From, Layout To>
absl::Status LaunchTranscodeTo(const TranscodeParams& p, cudaStream_t stream) {
  // Without dst_locs one location indexes both pools: bound it by the smaller.
  const int64_t src_tokens = p.dst_locs != nullptr || p.from.num_tokens() < p.to.num_tokens()
                                 ? p.from.num_tokens()
                                 : p.to.num_tokens();
  return DispatchPageSize(p.from.page_size, [&](auto log2_page) {
    constexpr int kLog2Page = decltype(log2_page)::value;
    return LaunchKernel(TranscodeKernel<From, To, kLog2Page>, BlocksFor(p.num_tokens),
                        kThreadsPerBlock, stream, "TranscodeKernel", p.src, p.locs,
                        p.num_tokens, src_tokens, p.dst, p.dst_locs,
                        p.dst_locs != nullptr ? p.to.num_tokens() : src_tokens);
  });
}

template <Layout From>
absl::Status LaunchTranscode(const TranscodeParams& p, cudaStream_t stream) {
  return DispatchLayout(p.to.layout, [&](auto to) {
    return LaunchTranscodeTo<From, decltype(to)::value>(p, stream);
  });
}

}  // namespace kvferry::cuda::detail
