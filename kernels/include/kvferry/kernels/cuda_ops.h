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
#include "kvferry/kernels/ops.h"

namespace kvferry::cuda {

struct QuantizeStoreParams {
  PoolGeometry geometry;
  const uint16_t* rows = nullptr;  // [num_tokens, 512] bf16, 16-byte aligned
  const int64_t* locs = nullptr;   // [num_tokens] token locations, unique
  int64_t num_tokens = 0;
  uint8_t* pool = nullptr;         // geometry.pool_bytes(), 16-byte aligned
};
absl::Status QuantizeStore(const QuantizeStoreParams& params, cudaStream_t stream);

struct DequantizeGatherParams {
  PoolGeometry geometry;
  const uint8_t* pool = nullptr;   // geometry.pool_bytes(), 16-byte aligned
  const int64_t* locs = nullptr;   // [num_tokens], repeats allowed
  int64_t num_tokens = 0;
  uint16_t* out = nullptr;         // row i at out[i * out_row_stride .. +512), bf16
  int64_t out_row_stride = kHeadDim;  // elements, >= 512; any value (aligned ones are faster)
};
absl::Status DequantizeGather(const DequantizeGatherParams& params, cudaStream_t stream);

struct TranscodeParams {
  PoolGeometry from;
  const uint8_t* src = nullptr;    // from.pool_bytes()
  PoolGeometry to;
  uint8_t* dst = nullptr;          // to.pool_bytes(); must not overlap src
  const int64_t* locs = nullptr;   // [num_tokens], unique, in range of both pools
  int64_t num_tokens = 0;
};
absl::Status Transcode(const TranscodeParams& params, cudaStream_t stream);

struct PageCopyParams {
  PageCopyGeometry geometry;       // pool = [num_layers][num_pages][page_bytes]
  uint8_t* pool = nullptr;
  const int64_t* pages = nullptr;  // [num_listed] page ids (unique for scatter)
  int64_t num_listed = 0;
  uint8_t* buffer = nullptr;       // [num_listed][num_layers][page_bytes]
};
// pool pages → buffer.
absl::Status GatherPages(const PageCopyParams& params, cudaStream_t stream);
// buffer → pool pages.
absl::Status ScatterPages(const PageCopyParams& params, cudaStream_t stream);

// Maps a CUDA error to a Status (OK for cudaSuccess); `what` names the failed step.
absl::Status CudaStatus(cudaError_t error, const char* what);

}  // namespace kvferry::cuda
