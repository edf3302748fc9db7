// The cpu backend: host memory, and the kernels' CPU ops run on the calling thread.
#pragma once

#include <memory>

#include "backend/backend.h"

namespace kvferry::server {

// `threads`: workers the vectorized ops split large requests across (the calling thread
// included); 0 means the cores this process may use. `memory_limit_bytes`: the cap of
// BackendOptions::cpu_memory_limit_bytes (0: none).
std::shared_ptr<Backend> MakeCpuBackend(int threads = 0, uint64_t memory_limit_bytes = 0);

}  // namespace kvferry::server
