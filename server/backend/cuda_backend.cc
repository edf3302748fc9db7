// The cuda backend. Each calling thread works on its own per-thread default stream, so
// concurrent requests overlap on the device; every call synchronizes that stream before it
// returns.
#include "backend/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kvferry/kernels/cuda_ops.h"
#include "kvferry/kernels/status_macros.h"

namespace kvferry::server {
namespace {

using cuda::CudaStatus;

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int index) : index_(index), device_(absl::StrCat("cuda:", index)) {}
  ~CudaBackend() override { DropCache(); }

  const std::string& device() const override { return device_; }

  absl::StatusOr<uint64_t> FreeBytes() override {
    KVF_RETURN_IF_ERROR(UseDevice());
    size_t free_bytes = 0, total = 0;
    KVF_RETURN_IF_ERROR(CudaStatus(cudaMemGetInfo(&free_bytes, &total), "cudaMemGetInfo"));
    return free_bytes;
  }

  absl::StatusOr<DeviceMemory> Allocate(size_t bytes, bool zero) override {
    void* ptr = TakeCached(bytes);
    if (ptr == nullptr) {
      KVF_ASSIGN_OR_RETURN(const uint64_t free_bytes, FreeBytes());
      if (bytes > free_bytes) DropCache();  // cached blocks may be what is missing
      if (bytes > free_bytes + cached_bytes()) {
        return absl::ResourceExhaustedError(absl::StrCat(device_, ": ", bytes,
                                                         " bytes requested, ", free_bytes,
                                                         " bytes free"));
      }
      const cudaError_t error = cudaMalloc(&ptr, bytes == 0 ? 1 : bytes);
      if (error != cudaSuccess) {
        cudaGetLastError();
        return absl::ResourceExhaustedError(absl::StrCat(
            device_, ": cudaMalloc of ", bytes, " bytes: ", cudaGetErrorString(error)));
      }
    }
    DeviceMemory memory(this, ptr, bytes);
    if (zero) {
      KVF_RETURN_IF_ERROR(
          CudaStatus(cudaMemsetAsync(ptr, 0, bytes, cudaStreamPerThread), "zero-fill"));
      KVF_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(cudaStreamPerThread), "zero-fill"));
    }
    return memory;
  }

  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
    return Copy(dst, src, bytes, cudaMemcpyHostToDevice);
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    return Copy(dst, src, bytes, cudaMemcpyDeviceToHost);
  }
  absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes) override {
    return Copy(dst, src, bytes, cudaMemcpyDeviceToDevice);
  }

  absl::Status Zero(void* dst, size_t bytes) override {
    if (bytes == 0) return absl::OkStatus();
    KVF_RETURN_IF_ERROR(UseDevice());
    KVF_RETURN_IF_ERROR(
        CudaStatus(cudaMemsetAsync(dst, 0, bytes, cudaStreamPerThread), "cudaMemsetAsync"));
    return CudaStatus(cudaStreamSynchronize(cudaStreamPerThread), "zero");
  }

  absl::Status QuantizeStore(const PoolGeometry& g, uint8_t* pool, const uint16_t* rows,
                             const int64_t* locs, int64_t n) override {
    KVF_RETURN_IF_ERROR(UseDevice());
    return Finish(cuda::QuantizeStore({g, rows, locs, n, pool}, cudaStreamPerThread));
  }
  absl::Status DequantizeGather(const PoolGeometry& g, const uint8_t* pool, const int64_t* locs,
                                int64_t n, uint16_t* out) override {
    KVF_RETURN_IF_ERROR(UseDevice());
    return Finish(cuda::DequantizeGather({g, pool, locs, n, out, kHeadDim}, cudaStreamPerThread));
  }
  absl::Status Transcode(const PoolGeometry& from, const uint8_t* src, const PoolGeometry& to,
                         uint8_t* dst, const int64_t* locs, int64_t n) override {
    KVF_RETURN_IF_ERROR(UseDevice());
    return Finish(cuda::Transcode({from, src, to, dst, locs, n}, cudaStreamPerThread));
  }
  absl::Status GatherPages(const PageCopyGeometry& g, const uint8_t* pool, const int64_t* pages,
                           int64_t n, uint8_t* buffer) override {
    KVF_RETURN_IF_ERROR(UseDevice());
    return Finish(cuda::GatherPages({g, const_cast<uint8_t*>(pool), pages, n, buffer},
                                    cudaStreamPerThread));
  }

 protected:
  // Small blocks (request staging and scratch) go back to a cache instead of cudaFree,
  // which synchronizes the device; pools and large blocks are freed at once.
  void Release(void* ptr, size_t bytes) override {
    if (bytes <= kMaxCachedBlock) {
      absl::MutexLock lock(&cache_mu_);
      if (cached_ + bytes <= kMaxCachedBytes) {
        cache_[bytes].push_back(ptr);
        cached_ += bytes;
        return;
      }
    }
    cudaSetDevice(index_);
    cudaFree(ptr);
  }

 private:
  static constexpr size_t kMaxCachedBlock = size_t{64} << 20;
  static constexpr size_t kMaxCachedBytes = size_t{1} << 30;

  // Rounds a small request up to a power of two (its cache bucket) and returns a cached
  // block of that size, or null.
  void* TakeCached(size_t& bytes) {
    if (bytes > kMaxCachedBlock) return nullptr;
    size_t rounded = 256;
    while (rounded < bytes) rounded <<= 1;
    bytes = rounded;
    absl::MutexLock lock(&cache_mu_);
    auto& blocks = cache_[rounded];
    void* ptr = nullptr;
    if (!blocks.empty()) {
      ptr = blocks.back();
      blocks.pop_back();
      cached_ -= rounded;
    }
    return ptr;
  }
  size_t cached_bytes() {
    absl::MutexLock lock(&cache_mu_);
    return cached_;
  }
  void DropCache() {
    absl::MutexLock lock(&cache_mu_);
    cudaSetDevice(index_);
    for (auto& [size, blocks] : cache_) {
      for (void* p : blocks) cudaFree(p);
      blocks.clear();
    }
    cached_ = 0;
  }

  // Makes this backend's device current on the calling thread.
  absl::Status UseDevice() { return CudaStatus(cudaSetDevice(index_), "cudaSetDevice"); }

  absl::Status Copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
    if (bytes == 0) return absl::OkStatus();
    KVF_RETURN_IF_ERROR(UseDevice());
    KVF_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(dst, src, bytes, kind, cudaStreamPerThread), "cudaMemcpyAsync"));
    KVF_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(cudaStreamPerThread), "copy"));
    return absl::OkStatus();
  }

  // Waits for a launched op; a launch error is returned as is.
  absl::Status Finish(absl::Status launched) {
    if (!launched.ok()) return launched;
    return CudaStatus(cudaStreamSynchronize(cudaStreamPerThread), "kernel");
  }

  const int index_;
  const std::string device_;
  absl::Mutex cache_mu_;
  absl::flat_hash_map<size_t, std::vector<void*>> cache_ ABSL_GUARDED_BY(cache_mu_);
  size_t cached_ ABSL_GUARDED_BY(cache_mu_) = 0;
};

}  // namespace

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

absl::StatusOr<std::shared_ptr<Backend>> MakeCudaBackend(int device_index) {
  const int count = CudaDeviceCount();
  if (device_index >= count) {
    return absl::FailedPreconditionError(absl::StrCat(
        "device cuda:", device_index, " does not exist (", count, " CUDA devices here)"));
  }
  return std::make_shared<CudaBackend>(device_index);
}

}  // namespace kvferry::server
