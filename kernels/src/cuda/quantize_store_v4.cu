// quantize-store instantiations for Layout::kV4 (all page sizes).
#include "quantize_store.cuh"

namespace kvferry::cuda::detail {
template absl::Status LaunchQuantizeStore<Layout::kV4>(const QuantizeStoreParams&,
                                                            const QuantizeShape&, cudaStream_t);
}  // namespace kvferry::cuda::detail
