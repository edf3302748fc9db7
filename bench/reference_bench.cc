// CPU reference throughput: quantize-store and dequantize-gather per layout, tokens/s.
#include <benchmark/benchmark.h>

#include "common/random_rows.h"
#include "kvferry/kernels/ops.h"

namespace kvferry {
namespace {

constexpr int64_t kTokens = 4096;
constexpr int kPageSize = 64;

// kTokens rows scattered over a pool twice their size, in the layout of range(0).
struct Inputs {
  explicit Inputs(benchmark::State& state)
      : g{static_cast<Layout>(state.range(0)), kPageSize, 2 * kTokens / kPageSize},
        rows(testing::RandomRows(kTokens, 1)),
        locs(testing::ScatteredLocations(kTokens, g.num_tokens(), 2)),
        pool(g.pool_bytes(), 0) {}

  // Counters for after the loop: tokens/s and bytes/s (rows + records), the layout.
  void Report(benchmark::State& state) const {
    state.SetItemsProcessed(state.iterations() * kTokens);
    state.SetBytesProcessed(state.iterations() * kTokens *
                            (kBf16RowBytes + GetLayoutInfo(g.layout).bytes_per_token()));
    state.SetLabel(LayoutName(g.layout));
  }

  PoolGeometry g;
  std::vector<uint16_t> rows;
  std::vector<int64_t> locs;
  std::vector<uint8_t> pool;
};

void BM_QuantizeStore(benchmark::State& state) {
  Inputs in(state);
  for (auto _ : state) {
    benchmark::DoNotOptimize(reference::QuantizeStore(in.g, in.rows, in.locs, in.pool));
    benchmark::ClobberMemory();
  }
  in.Report(state);
}

void BM_DequantizeGather(benchmark::State& state) {
  Inputs in(state);
  if (!reference::QuantizeStore(in.g, in.rows, in.locs, in.pool).ok()) {
    state.SkipWithError("setup failed");
  }
  std::vector<uint16_t> out(in.rows.size());
  for (auto _ : state) {
    benchmark::DoNotOptimize(reference::DequantizeGather(in.g, in.pool, in.locs, out));
    benchmark::ClobberMemory();
  }
  in.Report(state);
}

// Ceiling for comparison: copying the same bf16 bytes (memcpy), measured in the same run.
void BM_MemcpyCeiling(benchmark::State& state) {
  std::vector<uint8_t> src(kTokens * kBf16RowBytes, 1), dst(src.size());
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), src.size());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * kTokens);
  state.SetBytesProcessed(state.iterations() * 2 * src.size());
}

BENCHMARK(BM_QuantizeStore)->DenseRange(0, 2)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_DequantizeGather)->DenseRange(0, 2)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_MemcpyCeiling)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace kvferry

BENCHMARK_MAIN();
