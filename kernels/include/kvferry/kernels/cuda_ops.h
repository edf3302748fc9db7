// CUDA launchers of the KV ops. Host-callable; every pointer in a params struct is device
// memory (or, for page copies, pinned host memory mapped into the device's address space).
//
// Each launcher validates its params on the host (geometry, sizes, alignment), enqueues
// one kernel on `stream` and checks the launch. It does not synchronize: the result is
// ready when the stream reaches it. Token locations and page ids live on the device and
// cannot be checked on the host before launch; the kernels skip any that are out of range
// (they never write outside the pool) and callers are expected to have validated them
// (kvferry::ValidateLocations) while the data was still on the host.
//
// Results are byte-identical to kvferry::reference for every op.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kvferry/kernels/format.h"
#include "kvferry/kernels/op_params.h"
#include "kvferry/kernels/ops.h"

namespace kvferry::cuda {

// The params structs live in op_params.h (shared with the CPU reference and the backends).
using kvferry::DequantizeGatherParams;
using kvferry::PageCopyParams;
using kvferry::QuantizeStoreParams;
using kvferry::TranscodeParams;

absl::Status QuantizeStore(const QuantizeStoreParams& params, cudaStream_t stream);

absl::Status DequantizeGather(const DequantizeGatherParams& params, cudaStream_t stream);

absl::Status Transcode(const TranscodeParams& params, cudaStream_t stream);

// pool pages → buffer.
absl::Status GatherPages(const PageCopyParams& params, cudaStream_t stream);
// buffer → pool pages.
absl::Status ScatterPages(const PageCopyParams& params, cudaStream_t stream);
// Zero every layer of the listed pages (params.buffer unused).
absl::Status ZeroPages(const PageCopyParams& params, cudaStream_t stream);

using kvferry::ExpandBlockIndicesParams;
absl::Status ExpandBlockIndices(const ExpandBlockIndicesParams& params, cudaStream_t stream);

// Maps a CUDA error to a Status (OK for cudaSuccess); `what` names the failed step.
absl::Status CudaStatus(cudaError_t error, const char* what);

}  // namespace kvferry::cuda
