// quantize-store instantiations for Layout::kV41Fp4 (all page sizes).
#include "quantize_store.cuh"

namespace kvferry::cuda::detail {
template absl::Status LaunchQuantizeStore<Layout::kV41Fp4>(const QuantizeStoreParams&,
                                                            const QuantizeShape&, cudaStream_t);
}  // namespace kvferry::cuda::detail
