// Compressor benchmark: µs per launch (graph replay) for N input tokens, ratios 4 and 128,
// against the bytes-moved floor at the device-to-device copy bandwidth of the same run.
//
// N input tokens are N new positions; their closing windows are compressed (at least one:
// below the ratio, the window that the last token closes), and the rows each window reads
// before the first new token are passed as history, as a decode step would.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/compressor_device.h"
#include "common/cuda_testing.h"
#include "cuda_timing.h"
#include "kvferry/kernels/cuda_compressor.h"

namespace kvferry {
namespace {

using testing::DeviceBuffer;

// Per-launch microseconds of cuda::Compress(p) by graph replay.
double GraphUs(int reps, int launches, const CompressorParams& p) {
  return bench::GraphLaunchUs(reps, launches, [&](cudaStream_t stream) {
    const absl::Status s = cuda::Compress(p, stream);
    if (!s.ok()) {
      std::fprintf(stderr, "compress: %s\n", s.ToString().c_str());
      std::exit(1);
    }
  });
}

int Main() {
  const int reps = 20;
  const double bandwidth = bench::CopyBandwidth(reps);
  std::printf("D2D copy: %.0f GB/s (read+write)\n\n", bandwidth / 1e9);
  std::printf("| ratio | layout | input tokens | entries | µs per launch | bytes-moved floor µs | × floor |\n"
              "|---|---|---|---|---|---|---|\n");
  for (int ratio : {4, 128}) {
    for (Layout layout : {Layout::kV4, Layout::kV41Fp4}) {
      for (int64_t tokens : {1, 32, 128, 1024, 4096, 16384}) {
        // New positions [B, E) with E a multiple of 128; rows from the first row that the
        // first closing window at or after B reads.
        const int64_t span = CompressorSpan(ratio);
        const int64_t e = 32768, b = e - tokens;
        const int64_t first_end = b + (ratio - 1 - b % ratio) % ratio;
        const int64_t first_row = first_end - span + 1;
        const int64_t rows = e - first_row;
        const auto in = testing::MakeCompressorInputs(ratio, first_row, rows, 1 << 16, 3);
        const PoolGeometry g{layout, 64, 1024};
        const testing::DeviceCompressorInputs device(in);
        DeviceBuffer pool(g.pool_bytes());
        const CompressorParams p = device.Params(in.Params(g, pool.as<uint8_t>()));
        const double us = GraphUs(reps, 20, p);
        // Bytes the launch must move: each entry reads span rows of 512 kv and 512 score
        // fp32 values (ratio 4: half rows of 8), 32 cos and 32 sin, and writes a record.
        const int64_t entries = in.windows.count;
        const double bytes =
            entries * (span * 2.0 * kHeadDim * 4.0 + 256.0 + GetLayoutInfo(layout).bytes_per_token());
        const double floor_us = bytes / bandwidth * 1e6;
        std::printf("| %d | %s | %lld | %lld | %.1f | %.2f | %.1f |\n", ratio, LayoutName(layout),
                    (long long)tokens, (long long)entries, us, floor_us, us / floor_us);
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace kvferry

int main() { return kvferry::Main(); }
