// Small RAII helpers for GPU tests and benchmarks: device and pinned buffers, GPU check.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvferry::testing {

inline void CudaCheck(cudaError_t error, const char* what) {
  if (error != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(error));
  }
}

// True when a CUDA device is usable; GPU tests GTEST_SKIP otherwise.
inline bool HaveGpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

// A device allocation of `bytes`, freed on destruction.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    CudaCheck(cudaMalloc(&ptr_, bytes ? bytes : 1), "cudaMalloc");
  }
  template <typename T>
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size() * sizeof(T)) {
    Upload(host);
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }

  template <typename T>
  void Upload(const std::vector<T>& host) {
    CudaCheck(cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
              "upload");
  }
  template <typename T>
  std::vector<T> Download() const {
    std::vector<T> host(bytes_ / sizeof(T));
    CudaCheck(cudaDeviceSynchronize(), "kernel");
    CudaCheck(cudaMemcpy(host.data(), ptr_, host.size() * sizeof(T), cudaMemcpyDeviceToHost),
              "download");
    return host;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
};

// Pinned host memory, addressable from the device (UVA).
class PinnedBuffer {
 public:
  explicit PinnedBuffer(size_t bytes) : bytes_(bytes) {
    CudaCheck(cudaHostAlloc(&ptr_, bytes ? bytes : 1, cudaHostAllocMapped), "cudaHostAlloc");
  }
  ~PinnedBuffer() { cudaFreeHost(ptr_); }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  uint8_t* data() const { return static_cast<uint8_t*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
};

// Deterministic poison bytes, different per seed.
inline std::vector<uint8_t> Poison(size_t bytes, uint32_t seed) {
  std::vector<uint8_t> v(bytes);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(&v[i], &x, 8);
  }
  for (; i < bytes; ++i) v[i] = static_cast<uint8_t>(x >> (8 * (i & 7)));
  return v;
}

}  // namespace kvferry::testing
