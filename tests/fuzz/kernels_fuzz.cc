// libFuzzer: the vectorized, multi-threaded host ops (kvferry::cpu) against the reference
// (kvferry::reference), the bit-exact definition. For any geometry, rows, records and
// locations the fuzzer makes up, both must return the same status (code and message) and
// leave byte-identical outputs, written or untouched.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kvferry/kernels/cpu_ops.h"
#include "kvferry/kernels/cpu_thread_pool.h"
#include "kvferry/kernels/format.h"
#include "kvferry/kernels/ops.h"
#include "fuzz/fuzz_data.h"

namespace {

using kvferry::Layout;
using kvferry::PageCopyGeometry;
using kvferry::PoolGeometry;
using kvferry::fuzz::Fill;

kvferry::cpu::ThreadPool& Workers() {
  static auto* pool = new kvferry::cpu::ThreadPool(3);
  return *pool;
}

[[noreturn]] void Mismatch(const char* op, const absl::Status& ref, const absl::Status& fast) {
  std::fprintf(stderr, "%s: reference and fast path differ\n  reference: %s\n  fast:      %s\n",
               op, ref.ToString().c_str(), fast.ToString().c_str());
  std::abort();
}

void Compare(const char* op, const absl::Status& ref, const absl::Status& fast,
             const void* ref_out, const void* fast_out, size_t bytes) {
  if (ref != fast) Mismatch(op, ref, fast);
  if (bytes != 0 && std::memcmp(ref_out, fast_out, bytes) != 0) {
    std::fprintf(stderr, "%s: outputs differ (status %s)\n", op, ref.ToString().c_str());
    std::abort();
  }
}

Layout PickLayout(FuzzedDataProvider& in) {
  return static_cast<Layout>(in.ConsumeIntegralInRange<int>(0, kvferry::kNumLayouts - 1));
}

// Mostly the page sizes the daemon accepts, sometimes anything (the validators' business).
int PickPageSize(FuzzedDataProvider& in) {
  static constexpr int kSizes[] = {1, 2, 16, 64, 128, 256, 3, 0};
  if (in.ConsumeIntegralInRange<int>(0, 15) == 0) return in.ConsumeIntegralInRange<int>(-4, 300);
  return kSizes[in.ConsumeIntegralInRange<size_t>(0, std::size(kSizes) - 1)];
}

std::vector<int64_t> Locations(FuzzedDataProvider& in, size_t n, int64_t limit) {
  std::vector<int64_t> locs(n);
  const bool unique = in.ConsumeBool();
  for (size_t i = 0; i < n; ++i) {
    if (unique && limit > 0 && static_cast<int64_t>(n) <= limit) {
      locs[i] = static_cast<int64_t>((i * 7919 + in.ConsumeIntegral<uint8_t>()) % limit);
    } else {
      locs[i] = in.ConsumeIntegralInRange<int64_t>(-2, limit + 1);
    }
  }
  return locs;
}

kvferry::cpu::ThreadPool* MaybeWorkers(FuzzedDataProvider& in) {
  return in.ConsumeBool() ? &Workers() : nullptr;
}

void QuantizeStore(FuzzedDataProvider& in) {
  PoolGeometry g{PickLayout(in), PickPageSize(in), in.ConsumeIntegralInRange<int64_t>(-1, 6)};
  const bool valid = g.page_size > 0 && g.num_pages >= 0;
  const size_t n = in.ConsumeIntegralInRange<size_t>(0, in.ConsumeBool() ? 8 : 600);
  const size_t values = n * kvferry::kHeadDim + (in.ConsumeIntegralInRange<int>(0, 7) == 0);
  const std::vector<uint16_t> rows = kvferry::fuzz::Bf16(in, values, 2);
  const std::vector<int64_t> locs = Locations(in, n, valid ? g.num_tokens() : 4);
  const size_t pool_bytes = valid ? static_cast<size_t>(g.pool_bytes()) : 64;
  std::vector<uint8_t> ref = Fill<uint8_t>(in, pool_bytes);
  std::vector<uint8_t> fast = ref;
  const absl::Status r = kvferry::reference::QuantizeStore(g, rows, locs, ref);
  const absl::Status f = kvferry::cpu::QuantizeStore(g, rows, locs, fast, MaybeWorkers(in));
  Compare("QuantizeStore", r, f, ref.data(), fast.data(), ref.size());
}

void DequantizeGather(FuzzedDataProvider& in) {
  PoolGeometry g{PickLayout(in), PickPageSize(in), in.ConsumeIntegralInRange<int64_t>(-1, 6)};
  const bool valid = g.page_size > 0 && g.num_pages >= 0;
  const std::vector<uint8_t> pool = Fill<uint8_t>(in, valid ? g.pool_bytes() : 64);  // any records
  const size_t n = in.ConsumeIntegralInRange<size_t>(0, in.ConsumeBool() ? 8 : 600);
  const std::vector<int64_t> locs = Locations(in, n, valid ? g.num_tokens() : 4);
  const int64_t stride = kvferry::kHeadDim + in.ConsumeIntegralInRange<int64_t>(-1, 3);
  const int64_t out_values = static_cast<int64_t>(n) * stride + in.ConsumeIntegralInRange<int>(-1, 1);
  std::vector<uint16_t> ref = Fill<uint16_t>(in, std::max<int64_t>(0, out_values));
  std::vector<uint16_t> fast = ref;
  const absl::Status r = kvferry::reference::DequantizeGather(g, pool, locs, ref, stride);
  const absl::Status f =
      kvferry::cpu::DequantizeGather(g, pool, locs, fast, stride, MaybeWorkers(in));
  Compare("DequantizeGather", r, f, ref.data(), fast.data(), ref.size() * 2);
}

void Transcode(FuzzedDataProvider& in) {
  const int page_size = PickPageSize(in);
  const int64_t num_pages = in.ConsumeIntegralInRange<int64_t>(0, 4);
  PoolGeometry from{PickLayout(in), page_size, num_pages};
  PoolGeometry to{PickLayout(in), in.ConsumeIntegralInRange<int>(0, 7) == 0 ? PickPageSize(in)
                                                                            : page_size,
                  in.ConsumeIntegralInRange<int>(0, 7) == 0 ? num_pages + 1 : num_pages};
  const bool valid = page_size > 0 && to.page_size > 0;
  const std::vector<uint8_t> src = Fill<uint8_t>(in, valid ? from.pool_bytes() : 64);
  const size_t n = in.ConsumeIntegralInRange<size_t>(0, 300);
  const std::vector<int64_t> locs =
      Locations(in, n, valid ? std::min(from.num_tokens(), to.num_tokens()) : 4);
  std::vector<uint8_t> ref = Fill<uint8_t>(in, valid ? to.pool_bytes() : 64);
  std::vector<uint8_t> fast = ref;
  const absl::Status r = kvferry::reference::Transcode(from, src, to, ref, locs);
  const absl::Status f = kvferry::cpu::Transcode(from, src, to, fast, locs, MaybeWorkers(in));
  Compare("Transcode", r, f, ref.data(), fast.data(), ref.size());
}

void PageCopy(FuzzedDataProvider& in) {
  PageCopyGeometry g{in.ConsumeIntegralInRange<int64_t>(-1, 4096),
                     in.ConsumeIntegralInRange<int64_t>(-1, 8),
                     in.ConsumeIntegralInRange<int>(0, 4)};
  const bool valid = g.page_bytes >= 0 && g.num_pages >= 0 && g.num_layers >= 0;
  const size_t pool_bytes =
      valid ? std::max<int64_t>(0, g.pool_bytes() + in.ConsumeIntegralInRange<int>(-1, 1)) : 64;
  const size_t n = in.ConsumeIntegralInRange<size_t>(0, 12);
  const std::vector<int64_t> pages = Locations(in, n, valid ? g.num_pages : 4);
  const size_t buffer_bytes =
      valid ? std::max<int64_t>(0, g.buffer_bytes(n) + in.ConsumeIntegralInRange<int>(-1, 1)) : 64;
  const int which = in.ConsumeIntegralInRange<int>(0, 2);
  std::vector<uint8_t> pool = Fill<uint8_t>(in, pool_bytes);
  std::vector<uint8_t> buffer = Fill<uint8_t>(in, buffer_bytes);
  kvferry::cpu::ThreadPool* workers = MaybeWorkers(in);
  if (which == 0) {
    std::vector<uint8_t> ref = buffer, fast = buffer;
    Compare("GatherPages", kvferry::reference::GatherPages(g, pool, pages, ref),
            kvferry::cpu::GatherPages(g, pool, pages, fast, workers), ref.data(), fast.data(),
            ref.size());
  } else if (which == 1) {
    std::vector<uint8_t> ref = pool, fast = pool;
    Compare("ScatterPages", kvferry::reference::ScatterPages(g, buffer, pages, ref),
            kvferry::cpu::ScatterPages(g, buffer, pages, fast, workers), ref.data(), fast.data(),
            ref.size());
  } else {
    std::vector<uint8_t> ref = pool, fast = pool;
    Compare("ZeroPages", kvferry::reference::ZeroPages(g, pages, ref),
            kvferry::cpu::ZeroPages(g, pages, fast, workers), ref.data(), fast.data(), ref.size());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  switch (in.ConsumeIntegralInRange<int>(0, 3)) {
    case 0: QuantizeStore(in); break;
    case 1: DequantizeGather(in); break;
    case 2: Transcode(in); break;
    default: PageCopy(in); break;
  }
  return 0;
}
