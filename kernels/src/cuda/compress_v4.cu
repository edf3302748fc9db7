// compressor instantiations storing into Layout::kV4 pools (all ratios).
#include "compressor.cuh"

namespace kvferry::cuda::detail {
template absl::Status LaunchCompress<Layout::kV4>(const CompressorParams&, const CompressorWindows&,
                                                 cudaStream_t);
}  // namespace kvferry::cuda::detail
