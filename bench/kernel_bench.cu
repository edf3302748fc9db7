// CUDA kernel benchmark: bandwidth at 1M tokens against a device-to-device copy measured in
// the same run, per-launch latency by graph replay, and page gather/scatter throughput.
//
// Usage: kernel_bench [--tokens N] [--reps R] [--shapes]   (prints Markdown tables)
//   --shapes adds the quantize-store launch-shape sweep behind ChooseQuantizeShape.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "common/cuda_testing.h"
#include "cuda_timing.h"
#include "common/random_rows.h"
#include "kvferry/kernels/cuda_ops.h"
#include "record.cuh"

namespace kvferry {
namespace {

using testing::CudaCheck;
using testing::DeviceBuffer;

void Ok(const absl::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "kernel_bench: %s\n", s.ToString().c_str());
    std::exit(1);
  }
}

using bench::GraphLaunchUs;
using bench::MedianMs;

// Quantize-store latency of every launch shape (one chunk per thread at 32..256 threads per
// block, a warp per token at 256) against the shape ChooseQuantizeShape picks, in µs. The
// alternatives use the chosen shape's early-launch setting.
void ShapeSweep(int reps, const uint16_t* rows, int page_size) {
  using cuda::detail::QuantizeShape;
  std::printf("| quantize-store µs by launch shape | tokens | chosen | chosen, early launch flipped | 1 chunk, 32 thr | 64 | 128 | 256 | 2 chunks, 256 thr |\n|---|---|---|---|---|---|---|---|---|\n");
  for (Layout layout : {Layout::kV4, Layout::kV41, Layout::kV41Fp4}) {
    const PoolGeometry g{layout, page_size, 1024};
    DeviceBuffer pool(g.pool_bytes());
    for (int64_t n : {1, 2, 8, 16, 32, 64, 128, 256, 512, 1024, 2048}) {
      DeviceBuffer d_locs(testing::ScatteredLocations(n, g.num_tokens(), 3));
      const cuda::QuantizeStoreParams params{g, rows, d_locs.as<int64_t>(), n, pool.as<uint8_t>()};
      const QuantizeShape chosen = cuda::detail::ChooseQuantizeShape(n);
      const bool early = chosen.early_launch;
      const QuantizeShape shapes[] = {{chosen.chunks, chosen.threads, !early},
                                      {1, 32, early},  {1, 64, early},  {1, 128, early},
                                      {1, 256, early}, {2, 256, early}};
      std::printf("| %s | %lld | %.3f", LayoutName(layout), static_cast<long long>(n),
                  GraphLaunchUs(reps, 200, [&](cudaStream_t s) {
                    Ok(cuda::QuantizeStore(params, s));
                  }));
      for (const QuantizeShape& shape : shapes) {
        std::printf(" | %.3f", GraphLaunchUs(reps, 200, [&](cudaStream_t s) {
          Ok(cuda::detail::DispatchLayout(layout, [&](auto l) {
            return cuda::detail::LaunchQuantizeStore<decltype(l)::value>(params, shape, s);
          }));
        }));
      }
      std::printf(" |\n");
    }
  }
  std::printf("\n");
}

int Main(int argc, char** argv) {
  int64_t tokens = 1 << 20;
  int reps = 30;
  bool shapes = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--shapes")) shapes = true;
    if (i + 1 < argc && !std::strcmp(argv[i], "--tokens")) tokens = std::atoll(argv[++i]);
    if (i + 1 < argc && !std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[++i]);
  }
  cudaDeviceProp prop;
  CudaCheck(cudaGetDeviceProperties(&prop, 0), "device");
  std::printf("device: %s, %d SMs, L2 %d MiB\n\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20);
  const int page_size = 64;

  // Latency first, on a quiet GPU: a CUDA graph of 200 launches replayed `reps` times, the
  // median replay / 200. A launch of a few tokens touches a few L2 lines, and how far their
  // L2 slices are from the SM moves it by a few hundredths of a µs; so each figure is the
  // median over 5 rounds, each with its own locations and rows, interleaved over the layouts.
  {
    const auto latency_rows = testing::RandomRows(4096, 1);
    DeviceBuffer d_latency_rows(latency_rows);
    const int64_t sizes[] = {1, 8, 64, 512};
    const Layout layouts[] = {Layout::kV4, Layout::kV41, Layout::kV41Fp4};
    constexpr int kRounds = 5;
    std::vector<double> us[3][4];
    for (int round = 0; round < kRounds; ++round) {
      for (int l = 0; l < 3; ++l) {
        const PoolGeometry g{layouts[l], page_size, 1024};
        DeviceBuffer pool(g.pool_bytes());
        for (int i = 0; i < 4; ++i) {
          const int64_t n = sizes[i];
          DeviceBuffer d_small(testing::ScatteredLocations(n, g.num_tokens(), 3 + round));
          const uint16_t* round_rows = d_latency_rows.as<uint16_t>() + round * n * kHeadDim;
          us[l][i].push_back(GraphLaunchUs(reps, 200, [&](cudaStream_t s) {
            Ok(cuda::QuantizeStore({g, round_rows, d_small.as<int64_t>(), n, pool.as<uint8_t>()}, s));
          }));
        }
      }
    }
    std::printf("| quantize-store latency (graph replay, per launch) | layout | 1 | 8 | 64 | 512 tokens |\n|---|---|---|---|---|---|\n");
    for (int l = 0; l < 3; ++l) {
      std::printf("| µs | %s", LayoutName(layouts[l]));
      for (int i = 0; i < 4; ++i) {
        std::sort(us[l][i].begin(), us[l][i].end());
        std::printf(" | %.2f (%.2f–%.2f)", us[l][i][kRounds / 2], us[l][i].front(), us[l][i].back());
      }
      std::printf(" |\n");
    }
    std::printf("| launch shape | - |");
    for (int64_t n : sizes) {
      const auto shape = cuda::detail::ChooseQuantizeShape(n);
      std::printf(" %d chunk(s)/thread, %d threads/block%s |", shape.chunks, shape.threads,
                  shape.early_launch ? ", early launch" : "");
    }
    std::printf("\n\n");
    if (shapes) ShapeSweep(reps, d_latency_rows.as<uint16_t>(), page_size);
  }

  // Ceiling: device-to-device copy of 1 GiB (bytes read + written per second).
  const double ceiling = bench::CopyBandwidth(reps) / 1e9;
  std::printf("| figure | layout | value | ceiling | fraction |\n|---|---|---|---|---|\n");
  std::printf("| D2D copy 1 GiB (read+write) | - | %.0f GB/s | - | - |\n", ceiling);

  const auto host_rows = testing::RandomRows(4096, 1);
  std::vector<uint16_t> rows(tokens * kHeadDim);
  for (int64_t t = 0; t < tokens; ++t) {
    std::memcpy(&rows[t * kHeadDim], &host_rows[(t % 4096) * kHeadDim], kBf16RowBytes);
  }
  DeviceBuffer d_rows(rows);
  rows.clear();
  rows.shrink_to_fit();
  const auto locs = testing::ScatteredLocations(tokens, tokens, 2);
  std::vector<int64_t> sequential(tokens);
  std::iota(sequential.begin(), sequential.end(), 0);
  DeviceBuffer d_scattered(locs), d_sequential(sequential);
  DeviceBuffer d_out(tokens * kBf16RowBytes);

  for (const bool scattered : {false, true})
  for (Layout layout : {Layout::kV4, Layout::kV41, Layout::kV41Fp4}) {
    const char* order = scattered ? "scattered" : "sequential";
    const DeviceBuffer& d_locs = scattered ? d_scattered : d_sequential;
    const PoolGeometry g{layout, page_size, tokens / page_size};
    DeviceBuffer pool(g.pool_bytes());
    const double record = GetLayoutInfo(layout).bytes_per_token();
    const double q_ms = MedianMs(reps, [&] {
      Ok(cuda::QuantizeStore({g, d_rows.as<uint16_t>(), d_locs.as<int64_t>(), tokens,
                              pool.as<uint8_t>()}, nullptr));
    });
    const double q_gbs = tokens * (kBf16RowBytes + 8 + record) / (q_ms * 1e-3) / 1e9;
    std::printf("| quantize-store %lld tokens, %s | %s | %.0f GB/s (%.1f Gtok/s) | %.0f GB/s | %.1f %% |\n",
                (long long)tokens, order, LayoutName(layout), q_gbs, tokens / (q_ms * 1e-3) / 1e9,
                ceiling, 100.0 * q_gbs / ceiling);
    const double d_ms = MedianMs(reps, [&] {
      Ok(cuda::DequantizeGather({g, pool.as<uint8_t>(), d_locs.as<int64_t>(), tokens,
                                 d_out.as<uint16_t>(), kHeadDim}, nullptr));
    });
    const double d_gbs = tokens * (kBf16RowBytes + 8 + record) / (d_ms * 1e-3) / 1e9;
    std::printf("| dequantize-gather %lld tokens, %s | %s | %.0f GB/s (%.1f Gtok/s) | %.0f GB/s | %.1f %% |\n",
                (long long)tokens, order, LayoutName(layout), d_gbs, tokens / (d_ms * 1e-3) / 1e9,
                ceiling, 100.0 * d_gbs / ceiling);
    if (layout != Layout::kV4) {
      const PoolGeometry v4{Layout::kV4, page_size, g.num_pages};
      DeviceBuffer dst(v4.pool_bytes());
      const double t_ms = MedianMs(reps, [&] {
        Ok(cuda::Transcode({g, pool.as<uint8_t>(), v4, dst.as<uint8_t>(), d_locs.as<int64_t>(),
                            tokens}, nullptr));
      });
      const double t_gbs = tokens * (record + 8 + 584) / (t_ms * 1e-3) / 1e9;
      std::printf("| transcode to v4 %lld tokens, %s | %s | %.0f GB/s (%.1f Gtok/s) | %.0f GB/s | %.1f %% |\n",
                  (long long)tokens, order, LayoutName(layout), t_gbs, tokens / (t_ms * 1e-3) / 1e9,
                  ceiling, 100.0 * t_gbs / ceiling);
    }
  }

  // Page gather: 4096 V4 pages of 64 tokens, 1 layer, to device and to pinned host memory.
  {
    const PageCopyGeometry g{PageBytes(Layout::kV4, page_size), 8192, 1};
    DeviceBuffer pool(g.pool_bytes());
    std::vector<int64_t> pages(4096);
    std::iota(pages.begin(), pages.end(), 0);
    std::reverse(pages.begin(), pages.end());
    DeviceBuffer d_pages(pages), d_buffer(g.buffer_bytes(pages.size()));
    testing::PinnedBuffer pinned(g.buffer_bytes(pages.size()));
    const double bytes = static_cast<double>(g.buffer_bytes(pages.size()));
    const double dev_ms = MedianMs(reps, [&] {
      Ok(cuda::GatherPages({g, pool.as<uint8_t>(), d_pages.as<int64_t>(), 4096,
                            d_buffer.as<uint8_t>()}, nullptr));
    });
    const double host_ms = MedianMs(reps, [&] {
      Ok(cuda::GatherPages({g, pool.as<uint8_t>(), d_pages.as<int64_t>(), 4096, pinned.data()},
                           nullptr));
    });
    const double d2h_ms = MedianMs(reps, [&] {
      CudaCheck(cudaMemcpyAsync(pinned.data(), d_buffer.as<void>(), bytes, cudaMemcpyDeviceToHost), "d2h");
    });
    std::printf("\n| page gather (4096 v4 pages, %.0f MB) | value | ceiling | fraction |\n|---|---|---|---|\n",
                bytes / 1e6);
    std::printf("| to device buffer (read+write) | %.0f GB/s | %.0f GB/s (D2D copy) | %.1f %% |\n",
                2 * bytes / (dev_ms * 1e-3) / 1e9, ceiling,
                100.0 * 2 * bytes / (dev_ms * 1e-3) / 1e9 / ceiling);
    std::printf("| to pinned host | %.1f GB/s | %.1f GB/s (cudaMemcpy D2H) | %.1f %% |\n",
                bytes / (host_ms * 1e-3) / 1e9, bytes / (d2h_ms * 1e-3) / 1e9,
                100.0 * d2h_ms / host_ms);
  }
  return 0;
}

}  // namespace
}  // namespace kvferry

int main(int argc, char** argv) { return kvferry::Main(argc, argv); }
