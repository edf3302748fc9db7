// Buffer, op names, Run, and the backend factory.
#include "backend/backend.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "backend/cpu_backend.h"
#include "common/errors.h"
#include "common/log.h"
#include "kvferry/kernels/status_macros.h"

#if defined(KVFERRY_HAVE_CUDA)
#include "backend/cuda_backend.h"
#endif

namespace kvferry::server {

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    Reset();
    backend_ = other.backend_;
    kind_ = other.kind_;
    ptr_ = other.ptr_;
    bytes_ = other.bytes_;
    other.backend_ = nullptr;
    other.ptr_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

void Buffer::Reset() {
  if (backend_ != nullptr && ptr_ != nullptr) backend_->Release(kind_, ptr_, bytes_);
  backend_ = nullptr;
  ptr_ = nullptr;
  bytes_ = 0;
}

const char* OpName(const Op& op) {
  struct Namer {
    const char* operator()(const CopyOp&) const { return "copy"; }
    const char* operator()(const FillZeroOp&) const { return "fill_zero"; }
    const char* operator()(const QuantizeStoreParams&) const { return "quantize_store"; }
    const char* operator()(const DequantizeGatherParams&) const { return "dequantize_gather"; }
    const char* operator()(const TranscodeParams&) const { return "transcode"; }
    const char* operator()(const GatherPagesOp&) const { return "gather_pages"; }
    const char* operator()(const ScatterPagesOp&) const { return "scatter_pages"; }
    const char* operator()(const ZeroPagesOp&) const { return "zero_pages"; }
    const char* operator()(const CompressOp&) const { return "compress"; }
    const char* operator()(const ExpandBlockIndicesParams&) const { return "expand_indices"; }
    const char* operator()(const CopyRecordsParams&) const { return "copy_records"; }
  };
  return std::visit(Namer{}, op);
}

absl::StatusOr<std::shared_ptr<ImportedMemory>> Backend::ImportIpc(const std::string&) {
  return Error(absl::StatusCode::kFailedPrecondition, ErrorReason::kUnknownDevice,
               absl::StrCat("CUDA IPC needs a cuda device; this is ", device()));
}

absl::StatusOr<std::shared_ptr<ImportedMemory>> Backend::ImportVmm(
    const WorkerProcess&, std::span<const VmmAllocation>) {
  return Error(absl::StatusCode::kFailedPrecondition, ErrorReason::kUnknownDevice,
               absl::StrCat("CUDA VMM memory needs a cuda device; this is ", device()));
}

absl::StatusOr<ExportedMemory> Backend::ExportIpc(const void*) {
  return Error(absl::StatusCode::kFailedPrecondition, ErrorReason::kUnknownDevice,
               absl::StrCat("CUDA IPC needs a cuda device; this is ", device()));
}

void Backend::set_release_listener(std::shared_ptr<ReleaseListener> listener) {
  kvferry::MutexLock lock(&listener_mu_);
  listener_ = std::move(listener);
}

void Backend::NotifyRelease(void* base) {
  std::shared_ptr<ReleaseListener> listener;
  {
    kvferry::MutexLock lock(&listener_mu_);
    listener = listener_;
  }
  if (listener != nullptr) listener->Released(base);
}

absl::Status Backend::Run(std::span<const Op> ops) {
  KVF_ASSIGN_OR_RETURN(Completion done, Submit(ops));
  return done.Wait();
}

absl::StatusOr<std::shared_ptr<Backend>> MakeBackend(const std::string& device,
                                                     const BackendOptions& options) {
  if (device == "cpu") return MakeCpuBackend(options.cpu_threads, options.cpu_memory_limit_bytes);
  if (absl::StartsWith(device, "cuda:")) {
    int index;
    if (!absl::SimpleAtoi(device.substr(5), &index) || index < 0) {
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kUnknownDevice,
                   absl::StrCat("device ", log::Quoted(device), ": bad GPU index"));
    }
#if defined(KVFERRY_HAVE_CUDA)
    return MakeCudaBackend(index);
#else
    return Error(absl::StatusCode::kFailedPrecondition, ErrorReason::kUnknownDevice,
                 absl::StrCat("device ", log::Quoted(device), ": this kvferryd was built without CUDA"));
#endif
  }
  return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kUnknownDevice,
               absl::StrCat("unknown device ", log::Quoted(device),
                            ": expected \"cpu\" or \"cuda:N\""));
}

std::string DefaultDevice() {
#if defined(KVFERRY_HAVE_CUDA)
  if (CudaDeviceCount() > 0) return "cuda:0";
#endif
  return "cpu";
}

}  // namespace kvferry::server
