// transcode instantiations from Layout::kV4 to every layout (all page sizes).
#include "transcode.cuh"

namespace kvferry::cuda::detail {
template absl::Status LaunchTranscode<Layout::kV4>(const TranscodeParams&, cudaStream_t);
}  // namespace kvferry::cuda::detail
