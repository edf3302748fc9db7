// The cpu backend: host memory and the CPU ops, synchronous (Submit completes the work).
#include "backend/cpu_backend.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/errors.h"
#include "kvferry/kernels/cpu_ops.h"
#include "kvferry/kernels/ops.h"
#include "kvferry/kernels/status_macros.h"
#include "kvferry/kernels/validate.h"

namespace kvferry::server {
namespace {

template <typename T>
std::span<T> Span(T* p, int64_t count) {
  return {p, static_cast<size_t>(count)};
}

absl::Status NotOnHost(const char* what) {
  return Error(absl::StatusCode::kFailedPrecondition, ErrorReason::kUnknownDevice,
               absl::StrCat(what, " (memory of another process) needs a cuda pool"));
}

// The ops on host memory: the vectorized CPU path (byte-identical to the reference), with
// large requests split across the backend's workers.
struct HostRunner {
  cpu::ThreadPool* workers;
  absl::Status operator()(const CopyOp& op) const {
    if (op.bytes > 0) std::memmove(op.dst, op.src, op.bytes);
    return absl::OkStatus();
  }
  absl::Status operator()(const FillZeroOp& op) const {
    if (op.bytes > 0) std::memset(op.dst, 0, op.bytes);
    return absl::OkStatus();
  }
  absl::Status operator()(const QuantizeStoreParams& p) const {
    if (p.row_offsets != nullptr || p.nonfinite != nullptr) return NotOnHost("rows read in place");
    return cpu::QuantizeStore(p.geometry, Span(p.rows, p.num_tokens * kHeadDim),
                              Span(p.locs, p.num_tokens), Span(p.pool, p.geometry.pool_bytes()),
                              workers);
  }
  absl::Status operator()(const DequantizeGatherParams& p) const {
    if (p.out_offsets != nullptr) return NotOnHost("rows written in place");
    const int64_t out_elems =
        p.num_tokens == 0 ? 0 : (p.num_tokens - 1) * p.out_row_stride + kHeadDim;
    return cpu::DequantizeGather(p.geometry, Span(p.pool, p.geometry.pool_bytes()),
                                 Span(p.locs, p.num_tokens), Span(p.out, out_elems),
                                 p.out_row_stride, workers);
  }
  absl::Status operator()(const TranscodeParams& p) const {
    if (p.dst_locs != nullptr) return NotOnHost("records transcoded in place");
    return cpu::Transcode(p.from, Span(p.src, p.from.pool_bytes()), p.to,
                          Span(p.dst, p.to.pool_bytes()), Span(p.locs, p.num_tokens), workers);
  }
  absl::Status operator()(const GatherPagesOp& op) const {
    const PageCopyParams& p = op.params;
    if (p.buffer_pages != nullptr) return NotOnHost("pages copied in place");
    return cpu::GatherPages(p.geometry, Span(p.pool, p.geometry.pool_bytes()),
                            Span(p.pages, p.num_listed),
                            Span(p.buffer, p.geometry.buffer_bytes(p.num_listed)), workers);
  }
  absl::Status operator()(const ScatterPagesOp& op) const {
    const PageCopyParams& p = op.params;
    if (p.buffer_pages != nullptr) return NotOnHost("pages copied in place");
    return cpu::ScatterPages(p.geometry, Span(p.buffer, p.geometry.buffer_bytes(p.num_listed)),
                             Span(p.pages, p.num_listed), Span(p.pool, p.geometry.pool_bytes()),
                             workers);
  }
  absl::Status operator()(const ZeroPagesOp& op) const {
    const PageCopyParams& p = op.params;
    return cpu::ZeroPages(p.geometry, Span(p.pages, p.num_listed),
                          Span(p.pool, p.geometry.pool_bytes()), workers);
  }
  absl::Status operator()(const CompressOp& op) const { return reference::Compress(op.params); }
  absl::Status operator()(const ExpandBlockIndicesParams& p) const {
    for (int64_t i = 0; i < p.num_listed; ++i) {
      for (int t = 0; t < p.page_size; ++t) {
        p.row_offsets[i * p.page_size + t] = p.row0 + p.blocks[i] * p.block_stride + t * p.token_stride;
        p.locs[i * p.page_size + t] = p.pages[i] * p.page_size + t;
      }
    }
    return absl::OkStatus();
  }
};

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int threads)
      : workers_(threads > 0 ? threads : cpu::DefaultThreadCount()) {}

  const std::string& device() const override { return device_; }

  absl::StatusOr<uint64_t> FreeBytes() override {
    const long pages = sysconf(_SC_AVPHYS_PAGES);
    const long page_size = sysconf(_SC_PAGESIZE);
    if (pages < 0 || page_size < 0) {
      return Error(absl::StatusCode::kInternal, ErrorReason::kDeviceError,
                   "cannot read free host memory");
    }
    return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size);
  }

  absl::StatusOr<Buffer> Allocate(size_t bytes, MemoryKind kind, bool zero) override {
    KVF_ASSIGN_OR_RETURN(const uint64_t free_bytes, FreeBytes());
    if (bytes > free_bytes) {
      return Error(absl::StatusCode::kResourceExhausted, ErrorReason::kDeviceOutOfMemory,
                   absl::StrCat("cpu: ", bytes, " bytes requested, ", free_bytes,
                                " bytes of host memory free"));
    }
    // 64-byte alignment: the ops' vector paths and the 16-byte rule of the CUDA launchers.
    const size_t rounded = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
    void* ptr = std::aligned_alloc(64, rounded);
    if (ptr == nullptr) {
      return Error(absl::StatusCode::kResourceExhausted, ErrorReason::kDeviceOutOfMemory,
                   absl::StrCat("cpu: cannot allocate ", bytes, " bytes"));
    }
    if (zero) std::memset(ptr, 0, bytes);
    return Buffer(this, kind, ptr, bytes);
  }

  absl::StatusOr<Completion> Submit(std::span<const Op> ops) override {
    for (const Op& op : ops) {
      KVF_RETURN_IF_ERROR(
          WithReason(std::visit(HostRunner{&workers_}, op), ErrorReason::kDeviceError));
    }
    return Completion();
  }

 protected:
  void Release(MemoryKind, void* ptr, size_t) override { std::free(ptr); }

 private:
  const std::string device_ = "cpu";
  cpu::ThreadPool workers_;
};

}  // namespace

std::shared_ptr<Backend> MakeCpuBackend(int threads) {
  return std::make_shared<CpuBackend>(threads);
}

}  // namespace kvferry::server
