// The cuda backend: device memory and the CUDA kernels, one stream per calling thread.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "backend/backend.h"

namespace kvferry::server {

// Number of usable CUDA devices (0 when there is no driver or GPU).
int CudaDeviceCount();

absl::StatusOr<std::shared_ptr<Backend>> MakeCudaBackend(int device_index);

}  // namespace kvferry::server
