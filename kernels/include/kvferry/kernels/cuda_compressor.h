// CUDA launcher of the KV compressors (see compressor.h for the semantics).
#pragma once

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "kvferry/kernels/compressor.h"

namespace kvferry::cuda {

// Every pointer in params is device memory. Validates the params on the host
// (ValidateCompressorParams), then enqueues the work on `stream` without synchronizing:
// one fused launch for ratios 1, 2 and 4; for ratio 128, a split pooling launch and a
// finishing launch (stream-ordered scratch from cudaMallocAsync). Entry locations and
// input values live on the device and are not checked: locations out of range are
// skipped, and the caller validates values while they are still on the host.
//
// Results match reference::Compress to spec/compressor.md's tolerances: the pre-quantization
// row within 1 bf16 ulp for >= 99.9 % of values and 2 ulp for all, and the stored bytes are
// exactly the reference quantizer's bytes for that row.
absl::Status Compress(const CompressorParams& params, cudaStream_t stream);

}  // namespace kvferry::cuda
