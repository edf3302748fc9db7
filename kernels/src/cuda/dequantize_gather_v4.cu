// dequantize-gather instantiations for Layout::kV4 (all page sizes, both output paths).
#include "dequantize_gather.cuh"

namespace kvferry::cuda::detail {
template absl::Status LaunchDequantizeGather<Layout::kV4>(const DequantizeGatherParams&,
                                                         cudaStream_t);
}  // namespace kvferry::cuda::detail
