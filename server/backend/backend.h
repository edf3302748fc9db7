// The seam between the daemon and a device: where bytes live, and who runs the ops.
//
// Two halves, kept apart because callers mix them: a Backend allocates memory of its
// device (MemoryKind::kDevice) and host staging the device reaches fast
// (MemoryKind::kHostStaging: pinned on cuda, plain on cpu), and it runs the ops of
// kernels/ (the params structs of kvferry/kernels/op_params.h and compressor.h) on any
// pointers it can address — its own buffers, or memory it did not allocate (another
// process's tensors opened over CUDA IPC, a host tier).
//
// Completion is explicit: Submit() enqueues a list of ops that run in order and returns a
// Completion; the ops' outputs may be read (by the host, or by any later Submit) only after
// Completion::Wait() returned OK. Run() is Submit() + Wait(). An error from Submit means no
// op of the list ran past the failing one's launch; the ops before it may have run.
// Implementations are thread-safe: any number of threads may Submit at once.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <variant>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvferry/kernels/compressor.h"
#include "kvferry/kernels/format.h"
#include "kvferry/kernels/op_params.h"
#include "kvferry/mutex.h"

namespace kvferry::server {

class Backend;
class WorkerProcess;

enum class MemoryKind {
  kDevice,       // the backend's device memory (host memory on cpu)
  kHostStaging,  // host memory for copies to and from the device (pinned on cuda)
};

// The extent of one allocation, for a transport that registers memory per allocation.
struct MemoryBlock {
  const void* base = nullptr;
  size_t bytes = 0;
};

// A block of backend memory, released on destruction.
class Buffer {
 public:
  Buffer() = default;
  Buffer(Backend* backend, MemoryKind kind, void* ptr, size_t bytes)
      : backend_(backend), kind_(kind), ptr_(ptr), bytes_(bytes) {}
  ~Buffer() { Reset(); }
  Buffer(Buffer&& other) noexcept { *this = std::move(other); }
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  template <typename T = uint8_t>
  T* get() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }
  MemoryKind kind() const { return kind_; }
  MemoryBlock block() const { return {ptr_, bytes_}; }
  void Reset();

 private:
  Backend* backend_ = nullptr;
  MemoryKind kind_ = MemoryKind::kDevice;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// ---- ops -----------------------------------------------------------------------------------

// bytes from src to dst, each in memory the backend addresses (host or device).
struct CopyOp {
  void* dst = nullptr;
  const void* src = nullptr;
  size_t bytes = 0;
};
struct FillZeroOp {
  void* dst = nullptr;
  size_t bytes = 0;
};
struct GatherPagesOp {
  PageCopyParams params;  // pool pages → buffer
};
struct ScatterPagesOp {
  PageCopyParams params;  // buffer → pool pages (pages unique)
};
struct ZeroPagesOp {
  PageCopyParams params;  // every layer of the listed pages ← 0 (buffer unused)
};
struct CompressOp {
  CompressorParams params;
};

using Op = std::variant<CopyOp, FillZeroOp, QuantizeStoreParams, DequantizeGatherParams,
                        TranscodeParams, GatherPagesOp, ScatterPagesOp, ZeroPagesOp, CompressOp,
                        ExpandBlockIndicesParams, CopyRecordsParams>;

// The name of an op's kind ("quantize_store", ...), for metrics and fault injection.
const char* OpName(const Op& op);

// The end of a submitted list of ops. Move-only; destroying it waits for the ops.
class Completion {
 public:
  class Impl {
   public:
    virtual ~Impl() = default;
    virtual absl::Status Wait() = 0;
    virtual bool Ready() = 0;
  };
  Completion() = default;  // already complete, OK
  explicit Completion(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
  Completion(Completion&&) noexcept = default;
  Completion& operator=(Completion&& other) noexcept {
    if (this != &other) {
      Wait().IgnoreError();
      impl_ = std::move(other.impl_);
    }
    return *this;
  }
  ~Completion() { Wait().IgnoreError(); }

  // Blocks until every op is complete and visible; returns the first error of any of them.
  // Later calls return the same status.
  absl::Status Wait() {
    if (impl_ != nullptr) {
      status_ = impl_->Wait();
      impl_.reset();
    }
    return status_;
  }
  // True once Wait() would not block.
  bool Ready() { return impl_ == nullptr || impl_->Ready(); }

 private:
  std::unique_ptr<Impl> impl_;
  absl::Status status_;
};

// Memory of another process on this backend's device (opened from a CUDA IPC handle),
// mapped while the object lives.
class ImportedMemory {
 public:
  virtual ~ImportedMemory() = default;
  // The start of the exporter's allocation, and its size in bytes.
  virtual uint8_t* base() const = 0;
  virtual uint64_t bytes() const = 0;
};

// One allocation of a worker's VMM range: its descriptor in the worker, bytes mapped.
struct VmmAllocation {
  int fd = -1;
  uint64_t size = 0;
};

// A block of this backend's memory as another process opens it.
struct ExportedMemory {
  std::string ipc_handle;  // cudaIpcMemHandle_t bytes of the allocation
  uint64_t offset = 0;     // from the allocation's base to the exported pointer
};

// Told the base of an allocation just before its backend frees it (not when the backend
// keeps the block for reuse): whoever registered the block with a transport (UCX) releases
// that registration first. Called on the freeing thread; must not call back into the backend.
class ReleaseListener {
 public:
  virtual ~ReleaseListener() = default;
  virtual void Released(void* base) = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;

  // The listener told of every allocation freed from now on (null: none).
  void set_release_listener(std::shared_ptr<ReleaseListener> listener);

  // "cpu" or "cuda:N".
  virtual const std::string& device() const = 0;
  // True when the device's memory is host memory the CPU addresses directly (cpu): callers
  // may then skip staging copies between the two kinds.
  virtual bool host_memory() const { return false; }
  // Makes the calling thread use this backend's device (cuda: its context current there),
  // for a library that takes device pointers on that thread (UCX); nothing on cpu.
  virtual absl::Status BindThread() { return absl::OkStatus(); }
  // Bytes of device memory that an Allocate could still get, as the device reports it.
  virtual absl::StatusOr<uint64_t> FreeBytes() = 0;
  // Waits until every operation this process queued on the device has ended, whoever queued
  // it (a transport's copies on its own streams among them); nothing on cpu.
  virtual absl::Status SynchronizeDevice() { return absl::OkStatus(); }

  // `bytes` of memory of `kind`, zero-filled when `zero` (else contents are unspecified).
  // RESOURCE_EXHAUSTED (reason DEVICE_OUT_OF_MEMORY) when it does not fit.
  virtual absl::StatusOr<Buffer> Allocate(size_t bytes, MemoryKind kind, bool zero) = 0;
  absl::StatusOr<Buffer> Allocate(size_t bytes) { return Allocate(bytes, MemoryKind::kDevice, true); }

  // Opens another process's allocation on this device. FAILED_PRECONDITION where the
  // backend cannot (cpu); INVALID_ARGUMENT (INVALID_REQUEST) for a handle the driver refuses.
  // Handles of one allocation share one mapping.
  virtual absl::StatusOr<std::shared_ptr<ImportedMemory>> ImportIpc(const std::string& handle);
  // Maps the VMM allocations of `worker` (descriptors of POSIX file descriptor handles)
  // back to back into one range of this process, in order. FAILED_PRECONDITION where the
  // backend cannot (cpu), an allocation is on another device, or the worker's descriptors
  // cannot be taken; INVALID_ARGUMENT for a descriptor or size the driver refuses. Nothing
  // stays mapped on failure.
  virtual absl::StatusOr<std::shared_ptr<ImportedMemory>> ImportVmm(
      const WorkerProcess& worker, std::span<const VmmAllocation> allocations);
  // The handle another process opens `ptr`'s allocation with.
  virtual absl::StatusOr<ExportedMemory> ExportIpc(const void* ptr);

  // Enqueues `ops`, in order; see the file comment for the contract.
  virtual absl::StatusOr<Completion> Submit(std::span<const Op> ops) = 0;
  // Submit and wait.
  absl::Status Run(std::span<const Op> ops);
  absl::Status Run(const Op& op) { return Run(std::span<const Op>(&op, 1)); }

 protected:
  friend class Buffer;
  virtual void Release(MemoryKind kind, void* ptr, size_t bytes) = 0;
  // Implementations call this with each block's base just before they free it.
  void NotifyRelease(void* base);

 private:
  kvferry::Mutex listener_mu_;
  std::shared_ptr<ReleaseListener> listener_ ABSL_GUARDED_BY(listener_mu_);
};

struct BackendOptions {
  // cpu: workers the vectorized ops split large requests across (the calling thread
  // included); 0 means the cores this process may use (its CPU affinity).
  int cpu_threads = 0;
  // cpu: bytes of host memory the backend may hold at once (pools, staging, read buffers),
  // counted as they are allocated and freed; 0: no cap. Pools (the zero-filled
  // allocations) may take all but an eighth of it, which stays for the staging and read
  // buffers of requests in flight: when pools fill the cap, reads still get their buffers.
  uint64_t cpu_memory_limit_bytes = 0;
};

// Host memory this process may use: the machine's physical memory, or the cgroup's
// memory.max (v2) / memory.limit_in_bytes (v1) where that is lower.
uint64_t HostMemoryLimit();

// "cpu" or "cuda:N" (the latter only in builds with CUDA and on machines with that GPU).
absl::StatusOr<std::shared_ptr<Backend>> MakeBackend(const std::string& device,
                                                     const BackendOptions& options = {});

// The daemon's default device: cuda:0 when a GPU is usable, else cpu.
std::string DefaultDevice();

}  // namespace kvferry::server
