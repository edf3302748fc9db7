// compressor instantiations storing into Layout::kV41 pools (all ratios).
#include "compressor.cuh"

namespace kvferry::cuda::detail {
template absl::Status LaunchCompress<Layout::kV41>(const CompressorParams&, const CompressorWindows&,
                                                 cudaStream_t);
}  // namespace kvferry::cuda::detail
