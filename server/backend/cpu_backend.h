// The cpu backend: host memory, and the kernels' CPU ops run on the calling thread.
#pragma once

#include <memory>

#include "backend/backend.h"

namespace kvferry::server {

std::shared_ptr<Backend> MakeCpuBackend();

// Runs one op on host pointers, synchronously (shared by backends that fall back to it).
absl::Status RunOnHost(const Op& op);

}  // namespace kvferry::server
