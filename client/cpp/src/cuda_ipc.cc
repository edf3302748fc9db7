// CUDA helpers of the session API: IPC handles of device tensors, and pool exports opened.
#include "kvferry/client/cuda_ipc.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <unistd.h>

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvferry::client {
namespace {

absl::Status Cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

}  // namespace

absl::Status DescribeDevicePointer(const void* device_ptr, KvTensor& tensor) {
  // The allocation's base from the driver, found at run time (no driver library linked).
  using AddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  void* f = nullptr;
  cudaDriverEntryPointQueryResult found;
  if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault,
                                       &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    return absl::InternalError("the CUDA driver lacks cuMemGetAddressRange");
  }
  CUdeviceptr base = 0;
  size_t bytes = 0;
  if (reinterpret_cast<AddressRangeFn>(f)(&base, &bytes, reinterpret_cast<CUdeviceptr>(device_ptr)) !=
      CUDA_SUCCESS) {
    return absl::InvalidArgumentError("the pointer is not in a device allocation");
  }
  cudaIpcMemHandle_t handle;
  if (absl::Status s = Cuda(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base)),
                            "cudaIpcGetMemHandle");
      !s.ok()) {
    return s;
  }
  tensor.ipc_handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
  tensor.offset = reinterpret_cast<CUdeviceptr>(device_ptr) - base;
  return absl::OkStatus();
}

absl::Status DescribeVmmTensor(const void* range, const std::vector<uint64_t>& allocation_sizes,
                               const void* tensor_ptr, KvTensor& tensor) {
  using RetainFn = CUresult (*)(CUmemGenericAllocationHandle*, void*);
  using ExportFn = CUresult (*)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                                unsigned long long);
  using ReleaseFn = CUresult (*)(CUmemGenericAllocationHandle);
  void* retain = nullptr;
  void* export_fn = nullptr;
  void* release = nullptr;
  cudaDriverEntryPointQueryResult found;
  for (auto [name, f] : {std::pair{"cuMemRetainAllocationHandle", &retain},
                         std::pair{"cuMemExportToShareableHandle", &export_fn},
                         std::pair{"cuMemRelease", &release}}) {
    if (cudaGetDriverEntryPointByVersion(name, f, 12000, cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return absl::InternalError(absl::StrCat("the CUDA driver lacks ", name));
    }
  }
  const auto start = reinterpret_cast<uintptr_t>(range);
  uint64_t total = 0;
  for (uint64_t size : allocation_sizes) total += size;
  const auto at = reinterpret_cast<uintptr_t>(tensor_ptr);
  if (at < start || at >= start + total) {
    return absl::InvalidArgumentError("the tensor does not start within the allocations");
  }
  CloseVmmDescriptors(tensor);
  uint64_t offset = 0;
  for (uint64_t size : allocation_sizes) {
    CUmemGenericAllocationHandle handle = 0;
    if (reinterpret_cast<RetainFn>(retain)(&handle, reinterpret_cast<void*>(start + offset)) !=
        CUDA_SUCCESS) {
      CloseVmmDescriptors(tensor);
      return absl::InvalidArgumentError(
          absl::StrCat("no VMM allocation is mapped at offset ", offset, " of the range"));
    }
    int fd = -1;
    const CUresult exported = reinterpret_cast<ExportFn>(export_fn)(
        &fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    reinterpret_cast<ReleaseFn>(release)(handle);
    if (exported != CUDA_SUCCESS) {
      CloseVmmDescriptors(tensor);
      return absl::InvalidArgumentError(absl::StrCat(
          "the allocation at offset ", offset,
          " cannot be exported as a file descriptor (was it created with "
          "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR?)"));
    }
    tensor.vmm_allocations.push_back({fd, size});
    offset += size;
  }
  tensor.vmm_pid = static_cast<uint32_t>(getpid());
  tensor.ipc_handle.clear();
  tensor.offset = at - start;
  return absl::OkStatus();
}

void CloseVmmDescriptors(KvTensor& tensor) {
  for (const KvTensor::VmmAllocation& a : tensor.vmm_allocations) {
    if (a.fd >= 0) close(a.fd);
  }
  tensor.vmm_allocations.clear();
}

absl::StatusOr<uint8_t*> OpenPoolMapping(const PoolMapping& mapping) {
  if (mapping.ipc_handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InvalidArgumentError("not a CUDA IPC handle");
  }
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, mapping.ipc_handle.data(), sizeof(handle));
  void* ptr = nullptr;
  if (absl::Status s = Cuda(cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess),
                            "cudaIpcOpenMemHandle");
      !s.ok()) {
    return s;
  }
  return static_cast<uint8_t*>(ptr) + mapping.offset;
}

absl::Status ClosePoolMapping(const PoolMapping& mapping, uint8_t* pointer) {
  return Cuda(cudaIpcCloseMemHandle(pointer - mapping.offset), "cudaIpcCloseMemHandle");
}

}  // namespace kvferry::client
