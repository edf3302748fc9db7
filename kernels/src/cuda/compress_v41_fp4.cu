// compressor instantiations storing into Layout::kV41Fp4 pools (all ratios).
#include "compressor.cuh"

namespace kvferry::cuda::detail {
template absl::Status LaunchCompress<Layout::kV41Fp4>(const CompressorParams&, const CompressorWindows&,
                                                 cudaStream_t);
}  // namespace kvferry::cuda::detail
