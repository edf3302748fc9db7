// DeviceMemory, the backend factory and the cpu backend (the reference ops on host memory).
#include "backend/backend.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "kvferry/kernels/status_macros.h"

#if defined(KVFERRY_HAVE_CUDA)
#include "backend/cuda_backend.h"
#endif

namespace kvferry::server {

DeviceMemory::~DeviceMemory() {
  if (backend_ != nullptr && ptr_ != nullptr) backend_->Release(ptr_, bytes_);
}

DeviceMemory& DeviceMemory::operator=(DeviceMemory&& other) noexcept {
  if (this != &other) {
    if (backend_ != nullptr && ptr_ != nullptr) backend_->Release(ptr_, bytes_);
    backend_ = other.backend_;
    ptr_ = other.ptr_;
    bytes_ = other.bytes_;
    other.backend_ = nullptr;
    other.ptr_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

namespace {

// The cpu backend: host memory and the CPU reference ops.
class CpuBackend final : public Backend {
 public:
  const std::string& device() const override { return device_; }

  absl::StatusOr<uint64_t> FreeBytes() override {
    const long pages = sysconf(_SC_AVPHYS_PAGES);
    const long page_size = sysconf(_SC_PAGESIZE);
    if (pages < 0 || page_size < 0) return absl::InternalError("cannot read free host memory");
    return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size);
  }

  absl::StatusOr<DeviceMemory> Allocate(size_t bytes, bool zero) override {
    KVF_ASSIGN_OR_RETURN(const uint64_t free_bytes, FreeBytes());
    if (bytes > free_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "cpu: ", bytes, " bytes requested, ", free_bytes, " bytes of host memory free"));
    }
    void* ptr = zero ? std::calloc(bytes == 0 ? 1 : bytes, 1) : std::malloc(bytes == 0 ? 1 : bytes);
    if (ptr == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("cpu: cannot allocate ", bytes, " bytes"));
    }
    return DeviceMemory(this, ptr, bytes);
  }

  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes) override {
    std::memmove(dst, src, bytes);
    return absl::OkStatus();
  }

  absl::Status Zero(void* dst, size_t bytes) override {
    std::memset(dst, 0, bytes);
    return absl::OkStatus();
  }

  absl::Status QuantizeStore(const PoolGeometry& g, uint8_t* pool, const uint16_t* rows,
                             const int64_t* locs, int64_t n) override {
    return reference::QuantizeStore(g, {rows, static_cast<size_t>(n) * kHeadDim},
                                    {locs, static_cast<size_t>(n)},
                                    {pool, static_cast<size_t>(g.pool_bytes())});
  }
  absl::Status DequantizeGather(const PoolGeometry& g, const uint8_t* pool, const int64_t* locs,
                                int64_t n, uint16_t* out) override {
    return reference::DequantizeGather(g, {pool, static_cast<size_t>(g.pool_bytes())},
                                       {locs, static_cast<size_t>(n)},
                                       {out, static_cast<size_t>(n) * kHeadDim});
  }
  absl::Status Transcode(const PoolGeometry& from, const uint8_t* src, const PoolGeometry& to,
                         uint8_t* dst, const int64_t* locs, int64_t n) override {
    return reference::Transcode(from, {src, static_cast<size_t>(from.pool_bytes())}, to,
                                {dst, static_cast<size_t>(to.pool_bytes())},
                                {locs, static_cast<size_t>(n)});
  }
  absl::Status GatherPages(const PageCopyGeometry& g, const uint8_t* pool, const int64_t* pages,
                           int64_t n, uint8_t* buffer) override {
    return reference::GatherPages(g, {pool, static_cast<size_t>(g.pool_bytes())},
                                  {pages, static_cast<size_t>(n)},
                                  {buffer, static_cast<size_t>(g.buffer_bytes(n))});
  }

 protected:
  void Release(void* ptr, size_t) override { std::free(ptr); }

 private:
  const std::string device_ = "cpu";
};

}  // namespace

absl::StatusOr<std::shared_ptr<Backend>> MakeBackend(const std::string& device) {
  if (device == "cpu") return std::make_shared<CpuBackend>();
  if (absl::StartsWith(device, "cuda:")) {
    int index;
    if (!absl::SimpleAtoi(device.substr(5), &index) || index < 0) {
      return absl::InvalidArgumentError(absl::StrCat("device '", device, "': bad GPU index"));
    }
#if defined(KVFERRY_HAVE_CUDA)
    return MakeCudaBackend(index);
#else
    return absl::FailedPreconditionError(
        absl::StrCat("device '", device, "': this kvferryd was built without CUDA"));
#endif
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown device '", device, "': expected \"cpu\" or \"cuda:N\""));
}

std::string DefaultDevice() {
#if defined(KVFERRY_HAVE_CUDA)
  if (CudaDeviceCount() > 0) return "cuda:0";
#endif
  return "cpu";
}

}  // namespace kvferry::server
