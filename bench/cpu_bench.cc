// CPU fast path throughput: every op and layout on one core and on all cores, in tokens/s
// and GB/s, against the CPU reference and against memcpy of the same bytes out of DRAM,
// all measured in the same run. Buffers are sized far beyond the last-level cache.
//
// Usage: cpu_bench [--tokens N] [--threads T] [--reps R]
//   --tokens   tokens per call (default 262144: 256 MiB of bf16 rows)
//   --threads  size of the "all cores" pool (default: the cores this process may use)
//   --reps     timed calls per figure, the median is reported (default 5; the reference 1)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <new>
#include <string>
#include <vector>

#include "common/random_rows.h"
#include "hwy/targets.h"
#include "kvferry/kernels/cpu_ops.h"
#include "kvferry/kernels/ops.h"

namespace kvferry {
namespace {

constexpr int kPageSize = 64;
constexpr int64_t kLocationBytes = sizeof(int64_t);

struct Options {
  int64_t tokens = int64_t{1} << 18;
  int threads = cpu::DefaultThreadCount();
  int reps = 5;
  std::string target;  // empty: the best instruction set
};

// Pools are allocated as the daemon's backends allocate them, 64-byte aligned (a record's
// data row then starts and ends on cache lines); std::vector's large blocks start 16 bytes
// past one. The workspaces stay std::vectors: the cpu path streams them at any alignment.
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}  // NOLINT: allocator rebinding
  T* allocate(size_t n) {
    void* p = std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { std::free(p); }
  friend bool operator==(const LineAligned&, const LineAligned&) { return true; }
};
using PoolBytes = std::vector<uint8_t, LineAligned<uint8_t>>;

// Median wall time of `reps` calls of fn, after one untimed call (page faults, tables).
double MedianSeconds(int reps, const std::function<void()>& fn) {
  fn();
  std::vector<double> times;
  for (int r = 0; r < reps; ++r) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    times.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

void Check(const absl::Status& status) {
  if (!status.ok()) {
    std::fprintf(stderr, "cpu_bench: %s\n", status.ToString().c_str());
    std::exit(1);
  }
}

// The ceiling: memcpy of `bytes` between two DRAM buffers, on one core or split over the
// pool; GB/s counts bytes read plus bytes written. Measured again next to every figure, so
// that other load on a shared machine moves a figure and its ceiling alike.
class Ceiling {
 public:
  Ceiling(int64_t bytes, int reps, cpu::ThreadPool& workers)
      : src_(bytes, 1), dst_(bytes, 2), reps_(reps), workers_(workers) {}

  double GBs(bool all) {
    const int64_t size = static_cast<int64_t>(src_.size());
    const double seconds = MedianSeconds(reps_, [&] {
      if (!all) {
        std::memcpy(dst_.data(), src_.data(), size);
        return;
      }
      workers_.ParallelFor(size, 1 << 20, [&](int64_t b, int64_t e) {
        std::memcpy(dst_.data() + b, src_.data() + b, e - b);
      });
    });
    return 2.0 * static_cast<double>(size) / seconds / 1e9;
  }

 private:
  std::vector<uint8_t> src_, dst_;
  int reps_;
  cpu::ThreadPool& workers_;
};

class Table {
 public:
  explicit Table(Ceiling& ceiling) : ceiling_(ceiling) {}

  // One figure: `bytes_per_token` moved per token, `seconds` for `tokens` tokens; `all`
  // says which copy rate it is compared with; `reference_seconds` the reference's time for
  // the same call.
  void Add(const std::string& op, const std::string& layout, const std::string& locations, bool all,
           int64_t tokens, double bytes_per_token, double seconds, double reference_seconds) {
    const double gbs = tokens * bytes_per_token / seconds / 1e9;
    const double copy = ceiling_.GBs(all);
    char line[320];
    char speedup[32];
    std::snprintf(speedup, sizeof(speedup), "%.1f×", reference_seconds / seconds);
    std::snprintf(line, sizeof(line),
                  "| %s | %s | %s | %s | %.3g M | %.2f | %.1f | %.0f %% | %s |\n", op.c_str(),
                  layout.c_str(), locations.c_str(), all ? "all" : "1", tokens / seconds / 1e6, gbs,
                  copy, 100 * gbs / copy, speedup);
    std::fputs(line, stdout);
    std::fflush(stdout);
  }

 private:
  Ceiling& ceiling_;
};

int Main(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--tokens"))
      o.tokens = std::max<int64_t>(kPageSize, std::atoll(argv[i + 1]));
    if (!std::strcmp(argv[i], "--threads")) o.threads = std::max(1, std::atoi(argv[i + 1]));
    if (!std::strcmp(argv[i], "--reps")) o.reps = std::max(1, std::atoi(argv[i + 1]));
    if (!std::strcmp(argv[i], "--target")) o.target = argv[i + 1];
  }
  // --target AVX2 (etc.): run on that instruction set instead of the best one.
  if (!o.target.empty()) {
    int64_t chosen = 0;
    for (const int64_t t : hwy::SupportedAndGeneratedTargets()) {
      if (o.target == hwy::TargetName(t)) chosen = t;
    }
    if (chosen == 0) {
      std::fprintf(stderr, "--target %s: not one this CPU and build offer\n", o.target.c_str());
      return 2;
    }
    hwy::SetSupportedTargetsForTest(chosen);
  }
  o.tokens = o.tokens / kPageSize * kPageSize;
  cpu::ThreadPool workers(o.threads);
  const int64_t n = o.tokens;

  Ceiling ceiling(n * kBf16RowBytes, o.reps, workers);
  std::printf("cpu_bench: %lld tokens, page size %d, %d threads for \"all\", target %s\n",
              static_cast<long long>(n), kPageSize, o.threads, cpu::DispatchedTargetName());
  std::printf(
      "ceiling: memcpy of %lld MiB out of DRAM, %.2f GB/s on one core, %.2f GB/s on all "
      "(at the start; each row has its own)\n\n",
      static_cast<long long>(n * kBf16RowBytes >> 20), ceiling.GBs(false), ceiling.GBs(true));
  std::printf(
      "| op | layout | locations | cores | tokens/s | GB/s | copy GB/s | %% of copy | × reference "
      "|\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  Table table(ceiling);

  // One op on one core and on all: `call(workers)` with nullptr and with the pool; the
  // reference timed once on the same inputs.
  auto measure = [&](const char* op, const char* layout, const char* order, double bytes,
                     const std::function<absl::Status(cpu::ThreadPool*)>& call,
                     const std::function<absl::Status()>& reference_call) {
    const double ref = MedianSeconds(1, [&] { Check(reference_call()); });
    for (cpu::ThreadPool* w : {static_cast<cpu::ThreadPool*>(nullptr), &workers}) {
      table.Add(op, layout, order, w != nullptr, n, bytes,
                MedianSeconds(o.reps, [&] { Check(call(w)); }), ref);
    }
  };

  const std::vector<uint16_t> rows = testing::RandomRows(n, 1);
  std::vector<uint16_t> out(rows.size());
  const std::vector<int64_t> sequential = [n] {
    std::vector<int64_t> locs(n);
    for (int64_t i = 0; i < n; ++i) locs[i] = i;
    return locs;
  }();
  for (const Layout layout : {Layout::kV4, Layout::kV41, Layout::kV41Fp4}) {
    // A pool twice the request: scattered locations are a random half of its slots.
    const PoolGeometry g{layout, kPageSize, 2 * n / kPageSize};
    const std::vector<int64_t> scattered = testing::ScatteredLocations(n, g.num_tokens(), 2);
    PoolBytes pool(g.pool_bytes(), 0);
    const char* name = LayoutName(layout);
    const double record = GetLayoutInfo(layout).bytes_per_token();
    const double bytes = kBf16RowBytes + kLocationBytes + record;
    for (const std::vector<int64_t>* locs : {&sequential, &scattered}) {
      const char* order = locs == &sequential ? "sequential" : "scattered";
      measure(
          "quantize-store", name, order, bytes,
          [&](cpu::ThreadPool* w) { return cpu::QuantizeStore(g, rows, *locs, pool, w); },
          [&] { return reference::QuantizeStore(g, rows, *locs, pool); });
      // The daemon's staging of rows on the cpu backend: checked, scaled and coded in one pass.
      measure(
          "quantize-store, rows checked", name, order, bytes,
          [&](cpu::ThreadPool* w) { return cpu::QuantizeStoreCheckedRows(g, rows, *locs, pool, w); },
          [&] { return reference::QuantizeStore(g, rows, *locs, pool); });
    }
    for (const std::vector<int64_t>* locs : {&sequential, &scattered}) {
      const char* order = locs == &sequential ? "sequential" : "scattered";
      measure(
          "dequantize-gather", name, order, bytes,
          [&](cpu::ThreadPool* w) {
            return cpu::DequantizeGather(g, pool, *locs, out, kHeadDim, w);
          },
          [&] { return reference::DequantizeGather(g, pool, *locs, out); });
    }
    if (layout != Layout::kV4) {
      const PoolGeometry to{Layout::kV4, kPageSize, g.num_pages};
      PoolBytes dst(to.pool_bytes(), 0);
      measure(
          "transcode to v4", name, "sequential",
          record + kLocationBytes + GetLayoutInfo(Layout::kV4).bytes_per_token(),
          [&](cpu::ThreadPool* w) { return cpu::Transcode(g, pool, to, dst, sequential, w); },
          [&] { return reference::Transcode(g, pool, to, dst, sequential); });
    }
  }

  // Page copies: every other page of a V4 pool twice the request (one layer), to and from
  // a page buffer; GB/s counts bytes read plus written (zeroing: written).
  const PoolGeometry v4{Layout::kV4, kPageSize, 2 * n / kPageSize};
  const PageCopyGeometry pg{v4.page_bytes(), v4.num_pages, 1};
  PoolBytes pool(pg.pool_bytes(), 3);
  std::vector<int64_t> pages(n / kPageSize);
  for (size_t i = 0; i < pages.size(); ++i) pages[i] = 2 * static_cast<int64_t>(i);
  std::vector<uint8_t> buffer(pg.buffer_bytes(pages.size()), 4);
  const double page_copy_bytes = 2.0 * v4.page_bytes() / kPageSize;
  measure(
      "gather pages", "v4", "every other page", page_copy_bytes,
      [&](cpu::ThreadPool* w) { return cpu::GatherPages(pg, pool, pages, buffer, w); },
      [&] { return reference::GatherPages(pg, pool, pages, buffer); });
  measure(
      "scatter pages", "v4", "every other page", page_copy_bytes,
      [&](cpu::ThreadPool* w) { return cpu::ScatterPages(pg, buffer, pages, pool, w); },
      [&] { return reference::ScatterPages(pg, buffer, pages, pool); });
  measure(
      "zero pages", "v4", "every other page", page_copy_bytes / 2,
      [&](cpu::ThreadPool* w) { return cpu::ZeroPages(pg, pages, pool, w); },
      [&] { return reference::ZeroPages(pg, pages, pool); });

  // The coding alone: 2048 tokens (2 MiB of rows) that stay in the caches, one core, the
  // best of 200 calls: what a token costs when memory is not the bound.
  std::printf("\ncompute alone (2048 tokens in cache, one core, best of 200), ns per token:\n\n"
              "| op | v4 | v41 | v41_fp4 |\n|---|---|---|---|\n");
  constexpr int64_t kInCache = 2048;
  const std::vector<uint16_t> small(rows.begin(), rows.begin() + kInCache * kHeadDim);
  std::vector<uint16_t> small_out(small.size());
  const std::vector<int64_t> first(sequential.begin(), sequential.begin() + kInCache);
  auto best_ns = [&](const std::function<void()>& fn) {
    double best = 1e30;
    for (int r = 0; r < 200; ++r) {
      const auto start = std::chrono::steady_clock::now();
      fn();
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    return best / kInCache * 1e9;
  };
  const char* ops[] = {"quantize-store", "quantize-store, rows checked", "dequantize-gather"};
  for (int op = 0; op < 3; ++op) {
    std::printf("| %s |", ops[op]);
    for (const Layout layout : {Layout::kV4, Layout::kV41, Layout::kV41Fp4}) {
      const PoolGeometry g{layout, kPageSize, kInCache / kPageSize};
      PoolBytes small_pool(g.pool_bytes(), 0);
      Check(cpu::QuantizeStore(g, small, first, small_pool));
      const double ns = best_ns([&] {
        if (op == 0) Check(cpu::QuantizeStore(g, small, first, small_pool));
        if (op == 1) Check(cpu::QuantizeStoreCheckedRows(g, small, first, small_pool));
        if (op == 2) Check(cpu::DequantizeGather(g, small_pool, first, small_out));
      });
      std::printf(" %.0f |", ns);
    }
    std::printf("\n");
  }
  return 0;
}

}  // namespace
}  // namespace kvferry

int main(int argc, char** argv) { return kvferry::Main(argc, argv); }
