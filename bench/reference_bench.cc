// CPU reference throughput: quantize-store and dequantize-gather per layout, tokens/s.
#include <benchmark/benchmark.h>

#include "common/random_rows.h"
#include "kvferry/kernels/ops.h"

namespace kvferry {
namespace {

constexpr int64_t kTokens = 4096;
constexpr int kPageSize = 64;

void BM_QuantizeStore(benchmark::State& state) {
  const PoolGeometry g{static_cast<Layout>(state.range(0)), kPageSize, 2 * kTokens / kPageSize};
  const auto rows = testing::RandomRows(kTokens, 1);
  const auto locs = testing::ScatteredLocations(kTokens, g.num_tokens(), 2);
  std::vector<uint8_t> pool(g.pool_bytes(), 0);
  for (auto _ : state) {
    benchmark::DoNotOptimize(reference::QuantizeStore(g, rows, locs, pool));
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * kTokens);
  state.SetBytesProcessed(state.iterations() * kTokens *
                          (kBf16RowBytes + GetLayoutInfo(g.layout).bytes_per_token()));
  state.SetLabel(LayoutName(g.layout));
}

void BM_DequantizeGather(benchmark::State& state) {
  const PoolGeometry g{static_cast<Layout>(state.range(0)), kPageSize, 2 * kTokens / kPageSize};
  const auto rows = testing::RandomRows(kTokens, 1);
  const auto locs = testing::ScatteredLocations(kTokens, g.num_tokens(), 2);
  std::vector<uint8_t> pool(g.pool_bytes(), 0);
  if (!reference::QuantizeStore(g, rows, locs, pool).ok()) state.SkipWithError("setup failed");
  std::vector<uint16_t> out(rows.size());
  for (auto _ : state) {
    benchmark::DoNotOptimize(reference::DequantizeGather(g, pool, locs, out));
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * kTokens);
  state.SetBytesProcessed(state.iterations() * kTokens *
                          (kBf16RowBytes + GetLayoutInfo(g.layout).bytes_per_token()));
  state.SetLabel(LayoutName(g.layout));
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
