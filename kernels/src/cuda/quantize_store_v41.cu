// quantize-store instantiations for Layout::kV41 (all page sizes).
#include "quantize_store.cuh"

namespace kvferry::cuda::detail {
template absl::Status LaunchQuantizeStore<Layout::kV41>(const QuantizeStoreParams&,
                                                            const QuantizeShape&, cudaStream_t);
}  // namespace kvferry::cuda::detail
