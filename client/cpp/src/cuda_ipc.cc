// CUDA helpers of the session API: IPC handles of device tensors, and pool exports opened.
#include "kvferry/client/cuda_ipc.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstring>

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
