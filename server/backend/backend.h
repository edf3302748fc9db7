// The seam between the daemon and a device: memory, copies and the KV ops.
//
// A Backend owns nothing of the pools' bookkeeping; it moves bytes and runs kernels.
// Implementations are thread-safe: several requests may run ops at once (on the cuda
// backend each calling thread uses its own stream). "Device memory" is host memory on the
// cpu backend. Every call that returns returns after its work is complete.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvferry/kernels/format.h"
#include "kvferry/kernels/ops.h"

namespace kvferry::server {

class Backend;

// A block of device memory, freed on destruction.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  DeviceMemory(Backend* backend, void* ptr, size_t bytes) : backend_(backend), ptr_(ptr), bytes_(bytes) {}
  ~DeviceMemory();
  DeviceMemory(DeviceMemory&& other) noexcept { *this = std::move(other); }
  DeviceMemory& operator=(DeviceMemory&& other) noexcept;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  template <typename T = uint8_t>
  T* get() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  Backend* backend_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;

  // "cpu" or "cuda:N".
  virtual const std::string& device() const = 0;
  // Bytes that an Allocate could still get, as the device reports it.
  virtual absl::StatusOr<uint64_t> FreeBytes() = 0;

  // Allocates `bytes` of device memory, zero-filled unless `zero` is false (staging that is
  // overwritten anyway). RESOURCE_EXHAUSTED when it does not fit.
  virtual absl::StatusOr<DeviceMemory> Allocate(size_t bytes, bool zero = true) = 0;

  virtual absl::Status CopyToDevice(void* device_dst, const void* host_src, size_t bytes) = 0;
  virtual absl::Status CopyToHost(void* host_dst, const void* device_src, size_t bytes) = 0;
  virtual absl::Status CopyOnDevice(void* device_dst, const void* device_src, size_t bytes) = 0;
  virtual absl::Status Zero(void* device_dst, size_t bytes) = 0;

  // The ops of kernels/, on device pointers (see kvferry/kernels/ops.h for the contracts).
  virtual absl::Status QuantizeStore(const PoolGeometry& geometry, uint8_t* pool,
                                     const uint16_t* rows, const int64_t* locs, int64_t n) = 0;
  virtual absl::Status DequantizeGather(const PoolGeometry& geometry, const uint8_t* pool,
                                        const int64_t* locs, int64_t n, uint16_t* out) = 0;
  virtual absl::Status Transcode(const PoolGeometry& from, const uint8_t* src,
                                 const PoolGeometry& to, uint8_t* dst, const int64_t* locs,
                                 int64_t n) = 0;
  virtual absl::Status GatherPages(const PageCopyGeometry& geometry, const uint8_t* pool,
                                   const int64_t* pages, int64_t n, uint8_t* buffer) = 0;

 protected:
  friend class DeviceMemory;
  virtual void Release(void* ptr, size_t bytes) = 0;
};

// "cpu" or "cuda:N" (the latter only in builds with CUDA and on machines with that GPU).
absl::StatusOr<std::shared_ptr<Backend>> MakeBackend(const std::string& device);

// The daemon's default device: cuda:0 when a GPU is usable, else cpu.
std::string DefaultDevice();

}  // namespace kvferry::server
