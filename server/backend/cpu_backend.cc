// The cpu backend: host memory and the CPU ops, synchronous (Submit completes the work).
#include "backend/cpu_backend.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <string>
#include <utility>
#include <vector>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/errors.h"
#include "kvferry/kernels/cpu_ops.h"
#include "kvferry/kernels/ops.h"
#include "kvferry/kernels/status_macros.h"
#include "kvferry/kernels/validate.h"
#include "kvferry/mutex.h"

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
    if (p.single_pass) {
      return cpu::QuantizeStoreCheckedRows(
          p.geometry, Span(p.rows, p.num_tokens * kHeadDim), Span(p.locs, p.num_tokens),
          Span(p.pool, p.geometry.pool_bytes()), workers);
    }
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
  absl::Status operator()(const CopyRecordsParams& p) const {
    return cpu::CopyRecords(p.from, Span(p.src, p.from.pool_bytes()),
                            Span(p.src_locs, p.src_locs != nullptr ? p.num_tokens : 0), p.to,
                            Span(p.dst, p.to.pool_bytes()), Span(p.dst_locs, p.num_tokens),
                            workers);
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

// Memory is counted against a cap as it is committed, not compared with the free memory of
// one instant: what earlier pools were promised counts even before they touch it.
class CpuBackend final : public Backend {
 public:
  CpuBackend(int threads, uint64_t memory_limit)
      : workers_(threads > 0 ? threads : cpu::DefaultThreadCount()),
        limit_(memory_limit),
        pool_limit_(memory_limit - memory_limit / 8) {}

  ~CpuBackend() override { DropSpares(); }

  const std::string& device() const override { return device_; }
  bool host_memory() const override { return true; }

  absl::StatusOr<uint64_t> FreeBytes() override {
    if (limit_ > 0) {
      const uint64_t held = held_.load();
      return held < pool_limit_ ? pool_limit_ - held : 0;
    }
    const long pages = sysconf(_SC_AVPHYS_PAGES);
    const long page_size = sysconf(_SC_PAGESIZE);
    if (pages < 0 || page_size < 0) {
      return Error(absl::StatusCode::kInternal, ErrorReason::kDeviceError,
                   "cannot read free host memory");
    }
    return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size);
  }

  absl::StatusOr<Buffer> Allocate(size_t bytes, MemoryKind kind, bool zero) override {
    const size_t rounded = Rounded(bytes);
    if (limit_ > 0) {
      // Pools (zero-filled) leave an eighth of the cap to requests in flight.
      const uint64_t cap = zero && kind == MemoryKind::kDevice ? pool_limit_ : limit_;
      // Spare staging counts as committed; it goes first when the cap would refuse.
      if (rounded > cap || held_.load() > cap - rounded) DropSpares();
      uint64_t held = held_.load();
      do {
        if (rounded > cap || held > cap - rounded) {
          return Error(absl::StatusCode::kResourceExhausted, ErrorReason::kDeviceOutOfMemory,
                       absl::StrCat("cpu: ", bytes, " bytes requested, ", held, " of ", cap,
                                    " bytes (--cpu_memory_limit_bytes", cap == limit_ ? "" : ", less an eighth kept for requests in flight",
                                    ") already committed"));
        }
      } while (!held_.compare_exchange_weak(held, held + rounded));
    } else {
      KVF_ASSIGN_OR_RETURN(const uint64_t free_bytes, FreeBytes());
      if (bytes > free_bytes) {
        return Error(absl::StatusCode::kResourceExhausted, ErrorReason::kDeviceOutOfMemory,
                     absl::StrCat("cpu: ", bytes, " bytes requested, ", free_bytes,
                                  " bytes of host memory free"));
      }
      held_ += rounded;
    }
    if (kind == MemoryKind::kHostStaging) {
      if (void* spare = TakeSpare(rounded); spare != nullptr) {
        held_ -= rounded;  // the spare was counted already
        if (zero) std::memset(spare, 0, bytes);
        return Buffer(this, kind, spare, bytes);
      }
    }
    void* ptr = std::aligned_alloc(64, rounded);
    if (ptr == nullptr) {
      held_ -= rounded;
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
  void Release(MemoryKind kind, void* ptr, size_t bytes) override {
    const size_t rounded = Rounded(bytes);
    if (kind == MemoryKind::kHostStaging && KeepSpare(ptr, rounded)) return;  // still counted
    NotifyRelease(ptr);
    std::free(ptr);
    held_ -= rounded;
  }

 private:
  const std::string device_ = "cpu";
  cpu::ThreadPool workers_;
  // What an allocation of `bytes` takes and is counted as: 64-byte multiples (the ops'
  // vector paths and the 16-byte rule of the CUDA launchers want the alignment).
  static size_t Rounded(size_t bytes) { return (std::max<size_t>(bytes, 1) + 63) / 64 * 64; }

  // Freed host staging (write staging chunks, read buffers) is kept for the next request
  // of the same size, up to kSpareBytes in all: a fresh multi-MiB allocation page-faults
  // on every write, which cost 8 % of a write-heavy run's cycles. Spares stay counted in
  // held_ and are dropped first when the cap would refuse an allocation.
  static constexpr size_t kSpareBytes = size_t{64} << 20;
  static constexpr size_t kLargestSpare = size_t{16} << 20;
  void* TakeSpare(size_t rounded) {
    kvferry::MutexLock lock(&spares_mu_);
    for (size_t i = 0; i < spares_.size(); ++i) {
      if (spares_[i].second == rounded) {
        void* ptr = spares_[i].first;
        spares_[i] = spares_.back();
        spares_.pop_back();
        spare_bytes_ -= rounded;
        return ptr;
      }
    }
    return nullptr;
  }
  bool KeepSpare(void* ptr, size_t rounded) {
    if (rounded > kLargestSpare) return false;
    kvferry::MutexLock lock(&spares_mu_);
    if (spare_bytes_ + rounded > kSpareBytes) return false;
    spares_.emplace_back(ptr, rounded);
    spare_bytes_ += rounded;
    return true;
  }
  void DropSpares() {
    kvferry::MutexLock lock(&spares_mu_);
    for (const auto& [ptr, rounded] : spares_) {
      NotifyRelease(ptr);
      std::free(ptr);
      held_ -= rounded;
    }
    spares_.clear();
    spare_bytes_ = 0;
  }

  const uint64_t limit_;       // 0: no cap
  const uint64_t pool_limit_;  // what pools may take of it
  std::atomic<uint64_t> held_{0};
  kvferry::Mutex spares_mu_;
  std::vector<std::pair<void*, size_t>> spares_ ABSL_GUARDED_BY(spares_mu_);
  size_t spare_bytes_ ABSL_GUARDED_BY(spares_mu_) = 0;
};

}  // namespace

std::shared_ptr<Backend> MakeCpuBackend(int threads, uint64_t memory_limit_bytes) {
  return std::make_shared<CpuBackend>(threads, memory_limit_bytes);
}

uint64_t HostMemoryLimit() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  uint64_t limit = pages > 0 && page_size > 0
                       ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size)
                       : 0;
  // cgroup v2, then v1; "max" (v2) or a huge number (v1) means no limit of the cgroup.
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream in(path);
    std::string text;
    uint64_t cgroup = 0;
    if (in >> text && absl::SimpleAtoi(text, &cgroup) && cgroup > 0) {
      if (limit == 0 || cgroup < limit) limit = cgroup;
      break;
    }
  }
  return limit;
}

}  // namespace kvferry::server
