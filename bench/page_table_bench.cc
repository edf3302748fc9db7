// The page table's share of a session Save or Load: the pin taken before the device work
// and the release after it, for the engine's pattern (one 1M-token layer of 16384 pages of
// 64 tokens per call, 32 layers). Every call holds the pool's table lock for this long, so
// the calls of one pool cannot start or finish faster than one per (pin + release).
//
// Usage: page_table_bench [Google Benchmark flags]
//   Save/threads:1   one layer's PinLayer + UnpinLayerPages, one caller
//   Save/threads:4   four callers, each its own layer of the same pages (an engine's
//                    layer-after-layer saves issued from four threads)
//   SaveFreshPages   one caller, layer after layer into pages freed and allocated again
//                    after every 32 layers (untimed): every mark sets its bits
//   Load/threads:N   the same with shared pins, released without marks
#include <benchmark/benchmark.h>

#include <vector>

#include "core/page_table.h"

namespace kvferry::server {
namespace {

constexpr int kPageSize = 64;
constexpr int kLayers = 32;
constexpr int64_t kPagesPerCall = (int64_t{1} << 20) / kPageSize;

// One table for every thread of a run: made by thread 0 before the others start.
struct Shared {
  PageTable table{"bench", kPagesPerCall, kPageSize, kLayers, 1};
  std::vector<PageHandle> handles = *table.Allocate(kPagesPerCall);
  std::vector<int64_t> ids;
  Shared() { ListIds(); }
  void ListIds() {
    ids.clear();
    for (const PageHandle& h : handles) ids.push_back(static_cast<int64_t>(h.page_id));
  }
};
Shared* shared = nullptr;

void Setup(const benchmark::State&) { shared = new Shared; }
void Teardown(const benchmark::State&) {
  delete shared;
  shared = nullptr;
}

// One layer's save as the table sees it: the pin, then the release marking every page.
bool SaveLayer(benchmark::State& state, int layer) {
  absl::StatusOr<PageTable::Pin> pin = shared->table.PinLayer(shared->handles, layer);
  if (!pin.ok()) {
    state.SkipWithError("pin failed");
    return false;
  }
  benchmark::DoNotOptimize(shared->table.UnpinLayerPages(*pin, shared->ids));
  return true;
}

void BM_Save(benchmark::State& state) {
  const int layer = state.thread_index() % kLayers;
  for (auto _ : state) {
    if (!SaveLayer(state, layer)) return;
  }
  state.SetItemsProcessed(state.iterations() * kPagesPerCall);
}

// As an engine saves a prefill: layer after layer into fresh pages (freed and allocated
// again, untimed, after every kLayers calls), so that every mark sets bits.
void BM_SaveFreshPages(benchmark::State& state) {
  int layer = 0;
  for (auto _ : state) {
    if (!SaveLayer(state, layer)) return;
    if (++layer == kLayers) {
      state.PauseTiming();
      layer = 0;
      const absl::StatusOr<std::vector<int64_t>> to_zero = shared->table.Free(shared->handles);
      if (!to_zero.ok()) {
        state.SkipWithError("free failed");
        return;
      }
      shared->table.Reclaimed(*to_zero);
      shared->handles = *shared->table.Allocate(kPagesPerCall);
      shared->ListIds();
      state.ResumeTiming();
    }
  }
  state.SetItemsProcessed(state.iterations() * kPagesPerCall);
}

void BM_Load(benchmark::State& state) {
  for (auto _ : state) {
    absl::StatusOr<PageTable::Pin> pin = shared->table.PinPages(shared->handles, false);
    if (!pin.ok()) {
      state.SkipWithError("pin failed");
      return;
    }
    benchmark::DoNotOptimize(shared->table.Unpin(*pin));
  }
  state.SetItemsProcessed(state.iterations() * kPagesPerCall);
}

BENCHMARK(BM_Save)->Setup(Setup)->Teardown(Teardown)->ThreadRange(1, 4)->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_SaveFreshPages)->Setup(Setup)->Teardown(Teardown)->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Load)->Setup(Setup)->Teardown(Teardown)->ThreadRange(1, 4)->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace kvferry::server

BENCHMARK_MAIN();
