// CUDA helpers of the session API (library kvferry::client_cuda, built with CUDA): describe
// a device tensor for RegisterKv, and open a pool export in this process.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "kvferry/client/session.h"

namespace kvferry::client {

// The IPC handle and offset of the allocation holding `device_ptr` (any pointer into a
// cudaMalloc'ed block); fills `tensor.ipc_handle` and `tensor.offset`.
absl::Status DescribeDevicePointer(const void* device_ptr, KvTensor& tensor);

// Maps an exported pool into this process (on the current CUDA device); the pointer is
// to layer 0, page 0. Close with ClosePoolMapping.
absl::StatusOr<uint8_t*> OpenPoolMapping(const PoolMapping& mapping);
absl::Status ClosePoolMapping(const PoolMapping& mapping, uint8_t* pointer);

}  // namespace kvferry::client
