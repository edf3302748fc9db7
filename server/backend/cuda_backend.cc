// The cuda backend: device memory, pinned host staging, the CUDA kernels on a pool of
// streams (one per Submit in flight, so concurrent requests overlap on the device).
#include "backend/cuda_backend.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <unistd.h>

#include <cstring>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kvferry/mutex.h"
#include "common/errors.h"
#include "common/worker_process.h"
#include "kvferry/kernels/cuda_compressor.h"
#include "kvferry/kernels/cuda_ops.h"
#include "kvferry/kernels/status_macros.h"

namespace kvferry::server {
namespace {

absl::Status DeviceStatus(cudaError_t error, const char* what) {
  return WithReason(cuda::CudaStatus(error, what), ErrorReason::kDeviceError);
}

// Blocks of one memory kind, cached by power-of-two size instead of freed: cudaFree and
// cudaFreeHost synchronize the device, and request staging comes and goes all the time.
class BlockCache {
 public:
  static constexpr size_t kMaxCachedBlock = size_t{64} << 20;
  static constexpr size_t kMaxCachedBytes = size_t{1} << 30;

  // Rounds a small request up to its bucket and returns a cached block of it, or null.
  // Buckets: four per doubling (at most a quarter more than asked for), so that a burst of
  // large requests in flight at once fits the cache.
  void* Take(size_t& bytes) {
    if (bytes > kMaxCachedBlock) return nullptr;
    size_t below = 256;
    while (below * 2 < bytes) below <<= 1;  // below < bytes <= 2 * below, or bytes <= 256
    const size_t step = below / 4;
    const size_t rounded = bytes <= 256 ? 256 : (bytes + step - 1) / step * step;
    bytes = rounded;
    kvferry::MutexLock lock(&mu_);
    auto& blocks = blocks_[rounded];
    if (blocks.empty()) return nullptr;
    void* ptr = blocks.back();
    blocks.pop_back();
    cached_ -= rounded;
    return ptr;
  }
  // True when the block was kept.
  bool Put(void* ptr, size_t bytes) {
    if (bytes > kMaxCachedBlock) return false;
    kvferry::MutexLock lock(&mu_);
    if (cached_ + bytes > kMaxCachedBytes) return false;
    blocks_[bytes].push_back(ptr);
    cached_ += bytes;
    return true;
  }
  size_t cached() {
    kvferry::MutexLock lock(&mu_);
    return cached_;
  }
  std::vector<void*> Drain() {
    kvferry::MutexLock lock(&mu_);
    std::vector<void*> all;
    for (auto& [size, blocks] : blocks_) {
      all.insert(all.end(), blocks.begin(), blocks.end());
      blocks.clear();
    }
    cached_ = 0;
    return all;
  }

 private:
  kvferry::Mutex mu_;
  absl::flat_hash_map<size_t, std::vector<void*>> blocks_ ABSL_GUARDED_BY(mu_);
  size_t cached_ ABSL_GUARDED_BY(mu_) = 0;
};

class CudaBackend;

// Driver calls are found at run time so that kvferryd links no driver library (it starts on
// machines without one and uses the cpu backend there). Sets fn to `name`'s entry point, or
// returns false.
template <typename Fn>
bool FindDriverCall(const char* name, Fn& fn) {
  void* f = nullptr;
  cudaDriverEntryPointQueryResult found;
  if (cudaGetDriverEntryPointByVersion(name, &f, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return false;
  }
  fn = reinterpret_cast<Fn>(f);
  return true;
}

using AddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
AddressRangeFn AddressRange() {
  static const AddressRangeFn fn = [] {
    AddressRangeFn f = nullptr;
    FindDriverCall("cuMemGetAddressRange", f);
    return f;
  }();
  return fn;
}

// The driver's virtual memory calls, found at run time like cuMemGetAddressRange.
struct VmmDriver {
  decltype(&cuMemImportFromShareableHandle) import_handle = nullptr;
  decltype(&cuMemGetAllocationPropertiesFromHandle) properties = nullptr;
  decltype(&cuMemAddressReserve) reserve = nullptr;
  decltype(&cuMemAddressFree) free_range = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  bool ok = false;

  static const VmmDriver& Get() {
    static const VmmDriver driver = [] {
      VmmDriver d;
      d.ok = FindDriverCall("cuMemImportFromShareableHandle", d.import_handle) &&
             FindDriverCall("cuMemGetAllocationPropertiesFromHandle", d.properties) &&
             FindDriverCall("cuMemAddressReserve", d.reserve) &&
             FindDriverCall("cuMemAddressFree", d.free_range) && FindDriverCall("cuMemMap", d.map) &&
             FindDriverCall("cuMemUnmap", d.unmap) && FindDriverCall("cuMemSetAccess", d.set_access) &&
             FindDriverCall("cuMemRelease", d.release);
      return d;
    }();
    return driver;
  }
};

std::string DriverError(CUresult r) { return absl::StrCat("CUDA driver error ", static_cast<int>(r)); }

// A worker's VMM allocations mapped back to back into a range this process reserved;
// destroying it unmaps them (the allocations' memory is the worker's: it outlives this).
class VmmMapping final : public ImportedMemory {
 public:
  VmmMapping(int device, CUdeviceptr base, uint64_t bytes) : device_(device), base_(base), bytes_(bytes) {}
  ~VmmMapping() override {
    const VmmDriver& d = VmmDriver::Get();
    cudaSetDevice(device_);
    if (mapped_ > 0) d.unmap(base_, mapped_);
    d.free_range(base_, bytes_);
  }
  uint8_t* base() const override { return reinterpret_cast<uint8_t*>(base_); }
  uint64_t bytes() const override { return mapped_; }
  // Maps `size` bytes of `handle` at the end of what is mapped.
  absl::Status Append(CUmemGenericAllocationHandle handle, uint64_t size) {
    const CUresult r = VmmDriver::Get().map(base_ + mapped_, size, 0, handle, 0);
    if (r != CUDA_SUCCESS) {
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                   absl::StrCat("cannot map ", size, " bytes of a VMM allocation at offset ",
                                mapped_, " (", DriverError(r),
                                "): is the size larger than the allocation, or not a multiple of its granularity?"));
    }
    mapped_ += size;
    return absl::OkStatus();
  }

 private:
  const int device_;
  const CUdeviceptr base_;
  const uint64_t bytes_;  // reserved
  uint64_t mapped_ = 0;
};

absl::Status AllocationOf(const void* ptr, uint8_t** base, uint64_t* bytes) {
  const AddressRangeFn range = AddressRange();
  if (range == nullptr) {
    return Error(absl::StatusCode::kInternal, ErrorReason::kDeviceError,
                 "the CUDA driver lacks cuMemGetAddressRange");
  }
  CUdeviceptr b = 0;
  size_t n = 0;
  if (range(&b, &n, reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                 "the pointer is not in a device allocation");
  }
  *base = reinterpret_cast<uint8_t*>(b);
  *bytes = n;
  return absl::OkStatus();
}

// An opened IPC handle; closing it unmaps the allocation from this process.
class IpcMapping final : public ImportedMemory {
 public:
  IpcMapping(int device, uint8_t* base, uint64_t bytes) : device_(device), base_(base), bytes_(bytes) {}
  ~IpcMapping() override {
    cudaSetDevice(device_);
    cudaIpcCloseMemHandle(base_);
  }
  uint8_t* base() const override { return base_; }
  uint64_t bytes() const override { return bytes_; }

 private:
  const int device_;
  uint8_t* const base_;
  const uint64_t bytes_;
};

struct Launcher {
  cudaStream_t stream;
  absl::Status operator()(const CopyOp& op) const {
    if (op.bytes == 0) return absl::OkStatus();
    return DeviceStatus(cudaMemcpyAsync(op.dst, op.src, op.bytes, cudaMemcpyDefault, stream),
                        "cudaMemcpyAsync");
  }
  absl::Status operator()(const FillZeroOp& op) const {
    if (op.bytes == 0) return absl::OkStatus();
    return DeviceStatus(cudaMemsetAsync(op.dst, 0, op.bytes, stream), "cudaMemsetAsync");
  }
  absl::Status operator()(const QuantizeStoreParams& p) const {
    return cuda::QuantizeStore(p, stream);
  }
  absl::Status operator()(const DequantizeGatherParams& p) const {
    return cuda::DequantizeGather(p, stream);
  }
  absl::Status operator()(const TranscodeParams& p) const { return cuda::Transcode(p, stream); }
  absl::Status operator()(const GatherPagesOp& op) const {
    return cuda::GatherPages(op.params, stream);
  }
  absl::Status operator()(const ScatterPagesOp& op) const {
    return cuda::ScatterPages(op.params, stream);
  }
  absl::Status operator()(const ZeroPagesOp& op) const { return cuda::ZeroPages(op.params, stream); }
  absl::Status operator()(const CompressOp& op) const { return cuda::Compress(op.params, stream); }
  absl::Status operator()(const ExpandBlockIndicesParams& p) const {
    return cuda::ExpandBlockIndices(p, stream);
  }
  // Staged records exist only on host memory pools (a cuda pool's writes stage bf16 rows
  // and quantize them on the device).
  absl::Status operator()(const CopyRecordsParams&) const {
    return Error(absl::StatusCode::kFailedPrecondition, ErrorReason::kUnknownDevice,
                 "copying stored records runs on host memory pools only");
  }
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int index) : index_(index), device_(absl::StrCat("cuda:", index)) {}
  ~CudaBackend() override {
    DropCaches();
    cudaSetDevice(index_);
    kvferry::MutexLock lock(&streams_mu_);
    for (cudaStream_t s : streams_) cudaStreamDestroy(s);
  }

  const std::string& device() const override { return device_; }
  absl::Status BindThread() override { return UseDevice(); }

  absl::Status SynchronizeDevice() override {
    KVF_RETURN_IF_ERROR(UseDevice());
    return DeviceStatus(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }

  absl::StatusOr<uint64_t> FreeBytes() override {
    KVF_RETURN_IF_ERROR(UseDevice());
    size_t free_bytes = 0, total = 0;
    KVF_RETURN_IF_ERROR(DeviceStatus(cudaMemGetInfo(&free_bytes, &total), "cudaMemGetInfo"));
    return free_bytes;
  }

  absl::StatusOr<Buffer> Allocate(size_t bytes, MemoryKind kind, bool zero) override {
    KVF_RETURN_IF_ERROR(UseDevice());
    BlockCache& cache = kind == MemoryKind::kDevice ? device_cache_ : host_cache_;
    void* ptr = cache.Take(bytes);
    if (ptr == nullptr) {
      if (kind == MemoryKind::kDevice) {
        KVF_ASSIGN_OR_RETURN(const uint64_t free_bytes, FreeBytes());
        if (bytes > free_bytes) DropCaches();  // cached blocks may be what is missing
        if (bytes > free_bytes + cache.cached()) {
          return Error(absl::StatusCode::kResourceExhausted, ErrorReason::kDeviceOutOfMemory,
                       absl::StrCat(device_, ": ", bytes, " bytes requested, ", free_bytes,
                                    " bytes free"));
        }
      }
      const cudaError_t error = kind == MemoryKind::kDevice
                                    ? cudaMalloc(&ptr, bytes == 0 ? 1 : bytes)
                                    : cudaHostAlloc(&ptr, bytes == 0 ? 1 : bytes, cudaHostAllocPortable);
      if (error != cudaSuccess) {
        cudaGetLastError();
        return Error(absl::StatusCode::kResourceExhausted, ErrorReason::kDeviceOutOfMemory,
                     absl::StrCat(device_, kind == MemoryKind::kDevice ? ": cudaMalloc of " : ": cudaHostAlloc of ",
                                  bytes, " bytes: ", cudaGetErrorString(error)));
      }
    }
    Buffer buffer(this, kind, ptr, bytes);
    if (zero) KVF_RETURN_IF_ERROR(Run(FillZeroOp{ptr, bytes}));
    return buffer;
  }

  absl::StatusOr<std::shared_ptr<ImportedMemory>> ImportIpc(const std::string& handle) override {
    if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                   absl::StrCat("an IPC handle has ", sizeof(cudaIpcMemHandle_t), " bytes, not ",
                                handle.size()));
    }
    KVF_RETURN_IF_ERROR(UseDevice());
    kvferry::MutexLock lock(&imports_mu_);
    if (auto it = imports_.find(handle); it != imports_.end()) {
      if (std::shared_ptr<ImportedMemory> live = it->second.lock()) return live;
    }
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    void* ptr = nullptr;
    if (const cudaError_t e = cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess);
        e != cudaSuccess) {
      cudaGetLastError();
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                   absl::StrCat(device_, ": cannot open the IPC handle: ", cudaGetErrorString(e)));
    }
    uint8_t* base = nullptr;
    uint64_t bytes = 0;
    if (absl::Status s = AllocationOf(ptr, &base, &bytes); !s.ok()) {
      cudaIpcCloseMemHandle(ptr);
      return s;
    }
    auto mapping = std::make_shared<IpcMapping>(index_, static_cast<uint8_t*>(ptr),
                                                bytes - (static_cast<uint8_t*>(ptr) - base));
    imports_[handle] = mapping;
    return std::shared_ptr<ImportedMemory>(mapping);
  }

  absl::StatusOr<std::shared_ptr<ImportedMemory>> ImportVmm(
      const WorkerProcess& worker, std::span<const VmmAllocation> allocations) override {
    const VmmDriver& d = VmmDriver::Get();
    if (!d.ok) {
      return Error(absl::StatusCode::kFailedPrecondition, ErrorReason::kDeviceError,
                   "the CUDA driver lacks the virtual memory calls");
    }
    if (allocations.empty()) {
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                   "no VMM allocation named");
    }
    unsigned __int128 total = 0;
    for (const VmmAllocation& a : allocations) {
      if (a.size == 0 || a.fd < 0) {
        return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                     absl::StrCat("VMM allocation (descriptor ", a.fd, ", ", a.size,
                                  " bytes): a descriptor and a size above 0 are needed"));
      }
      total += a.size;
    }
    if (total > (static_cast<unsigned __int128>(1) << 44)) {
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kTensorOutOfBounds,
                   "the VMM allocations exceed 16 TiB");
    }
    KVF_RETURN_IF_ERROR(UseDevice());
    CUdeviceptr base = 0;
    if (const CUresult r = d.reserve(&base, static_cast<size_t>(total), 0, 0, 0); r != CUDA_SUCCESS) {
      return Error(absl::StatusCode::kResourceExhausted, ErrorReason::kDeviceOutOfMemory,
                   absl::StrCat(device_, ": cannot reserve ", static_cast<uint64_t>(total),
                                " bytes of address space (", DriverError(r), ")"));
    }
    auto mapping = std::make_shared<VmmMapping>(index_, base, static_cast<uint64_t>(total));
    for (const VmmAllocation& a : allocations) {
      KVF_ASSIGN_OR_RETURN(const int fd, worker.TakeFd(a.fd));
      CUmemGenericAllocationHandle handle = 0;
      const CUresult imported = d.import_handle(&handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
      close(fd);  // the handle holds the allocation
      if (imported != CUDA_SUCCESS) {
        return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                     absl::StrCat("descriptor ", a.fd, " of worker process ", worker.pid(),
                                  " is not a CUDA VMM allocation (", DriverError(imported), ")"));
      }
      struct Release {
        CUmemGenericAllocationHandle h;
        ~Release() { VmmDriver::Get().release(h); }  // a mapping keeps its own reference
      } release{handle};
      CUmemAllocationProp prop = {};
      if (const CUresult r = d.properties(&prop, handle); r != CUDA_SUCCESS) {
        return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                     absl::StrCat("descriptor ", a.fd, ": no allocation properties (", DriverError(r), ")"));
      }
      if (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop.location.id != index_) {
        return Error(absl::StatusCode::kFailedPrecondition, ErrorReason::kDeviceMismatch,
                     absl::StrCat("descriptor ", a.fd, ": the allocation is not on ", device_));
      }
      KVF_RETURN_IF_ERROR(mapping->Append(handle, a.size));
    }
    CUmemAccessDesc access = {};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = index_;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if (const CUresult r = d.set_access(base, static_cast<size_t>(total), &access, 1); r != CUDA_SUCCESS) {
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                   absl::StrCat("cannot make the VMM range accessible on ", device_, " (",
                                DriverError(r), ")"));
    }
    return std::shared_ptr<ImportedMemory>(std::move(mapping));
  }

  absl::StatusOr<ExportedMemory> ExportIpc(const void* ptr) override {
    KVF_RETURN_IF_ERROR(UseDevice());
    uint8_t* base = nullptr;
    uint64_t bytes = 0;
    KVF_RETURN_IF_ERROR(AllocationOf(ptr, &base, &bytes));
    cudaIpcMemHandle_t h;
    KVF_RETURN_IF_ERROR(DeviceStatus(cudaIpcGetMemHandle(&h, base), "cudaIpcGetMemHandle"));
    ExportedMemory out;
    out.ipc_handle.assign(reinterpret_cast<const char*>(&h), sizeof(h));
    out.offset = static_cast<uint64_t>(static_cast<const uint8_t*>(ptr) - base);
    return out;
  }

  absl::StatusOr<Completion> Submit(std::span<const Op> ops) override {
    KVF_RETURN_IF_ERROR(UseDevice());
    KVF_ASSIGN_OR_RETURN(cudaStream_t stream, TakeStream());
    const Launcher launch{stream};
    for (const Op& op : ops) {
      if (absl::Status s = std::visit(launch, op); !s.ok()) {
        // Ops before the failing one may still be running: let them finish before the
        // stream is reused, and report the launch error.
        cudaStreamSynchronize(stream);
        GiveStream(stream);
        return WithReason(s, ErrorReason::kDeviceError);
      }
    }
    return Completion(std::make_unique<StreamCompletion>(this, stream));
  }

 protected:
  void Release(MemoryKind kind, void* ptr, size_t bytes) override {
    BlockCache& cache = kind == MemoryKind::kDevice ? device_cache_ : host_cache_;
    if (cache.Put(ptr, bytes)) return;
    NotifyRelease(ptr);
    cudaSetDevice(index_);
    if (kind == MemoryKind::kDevice) {
      cudaFree(ptr);
    } else {
      cudaFreeHost(ptr);
    }
  }

 private:
  class StreamCompletion final : public Completion::Impl {
   public:
    StreamCompletion(CudaBackend* backend, cudaStream_t stream) : backend_(backend), stream_(stream) {}
    absl::Status Wait() override {
      cudaSetDevice(backend_->index_);
      const absl::Status s = DeviceStatus(cudaStreamSynchronize(stream_), "device op");
      backend_->GiveStream(stream_);
      return s;
    }
    bool Ready() override { return cudaStreamQuery(stream_) != cudaErrorNotReady; }

   private:
    CudaBackend* const backend_;
    const cudaStream_t stream_;
  };

  absl::StatusOr<cudaStream_t> TakeStream() {
    {
      kvferry::MutexLock lock(&streams_mu_);
      if (!idle_.empty()) {
        cudaStream_t s = idle_.back();
        idle_.pop_back();
        return s;
      }
    }
    cudaStream_t s;
    KVF_RETURN_IF_ERROR(
        DeviceStatus(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate"));
    kvferry::MutexLock lock(&streams_mu_);
    streams_.push_back(s);
    return s;
  }
  void GiveStream(cudaStream_t s) {
    kvferry::MutexLock lock(&streams_mu_);
    idle_.push_back(s);
  }

  void DropCaches() {
    cudaSetDevice(index_);
    for (void* p : device_cache_.Drain()) {
      NotifyRelease(p);
      cudaFree(p);
    }
    for (void* p : host_cache_.Drain()) {
      NotifyRelease(p);
      cudaFreeHost(p);
    }
  }

  // Makes this backend's device current on the calling thread.
  absl::Status UseDevice() { return DeviceStatus(cudaSetDevice(index_), "cudaSetDevice"); }

  const int index_;
  const std::string device_;
  BlockCache device_cache_, host_cache_;
  kvferry::Mutex streams_mu_;
  std::vector<cudaStream_t> streams_ ABSL_GUARDED_BY(streams_mu_);  // every stream made
  std::vector<cudaStream_t> idle_ ABSL_GUARDED_BY(streams_mu_);
  kvferry::Mutex imports_mu_;
  // Open mappings by handle bytes: one allocation is opened once however often registered.
  absl::flat_hash_map<std::string, std::weak_ptr<ImportedMemory>> imports_ ABSL_GUARDED_BY(imports_mu_);
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
    return Error(absl::StatusCode::kFailedPrecondition, ErrorReason::kUnknownDevice,
                 absl::StrCat("device cuda:", device_index, " does not exist (", count,
                              " CUDA devices here)"));
  }
  return std::make_shared<CudaBackend>(device_index);
}

}  // namespace kvferry::server
