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

// For memory of CUDA's virtual memory API (cuMemCreate with
// CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, e.g. PyTorch's expandable segments), which has no
// cudaIpc handle: `range` is the start of a run of allocations mapped back to back, of
// `allocation_sizes` bytes each, and `tensor_ptr` points into it. Fills tensor.vmm_pid,
// tensor.vmm_allocations (a descriptor exported per allocation) and tensor.offset. The
// daemon takes the descriptors from this process while RegisterKv runs; close them after
// it with CloseVmmDescriptors.
absl::Status DescribeVmmTensor(const void* range, const std::vector<uint64_t>& allocation_sizes,
                               const void* tensor_ptr, KvTensor& tensor);
void CloseVmmDescriptors(KvTensor& tensor);

// Maps an exported pool into this process (on the current CUDA device); the pointer is
// to layer 0, page 0. Close with ClosePoolMapping.
absl::StatusOr<uint8_t*> OpenPoolMapping(const PoolMapping& mapping);
absl::Status ClosePoolMapping(const PoolMapping& mapping, uint8_t* pointer);

}  // namespace kvferry::client
