// libFuzzer: the vectorized, multi-threaded host ops (kvferry::cpu) against the reference
// (kvferry::reference), the bit-exact definition. For any geometry, rows, records and
// locations the fuzzer makes up, both must return the same status (code and message) and
// leave byte-identical outputs, written or untouched. cpu::CopyRecords, which has no
// reference op, is checked against the spec's record addressing written out here.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <utility>
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

// Where the spec (kv-formats §3) puts a token's data row and scale row in a pool.
std::pair<int64_t, int64_t> SpecRecord(const PoolGeometry& g, int64_t loc) {
  const kvferry::LayoutInfo info = kvferry::GetLayoutInfo(g.layout);
  const int64_t page = loc / g.page_size, slot = loc % g.page_size;
  return {page * g.page_bytes() + slot * info.data_bytes,
          page * g.page_bytes() + int64_t{g.page_size} * info.data_bytes + slot * info.scale_bytes};
}

void CopyRecords(FuzzedDataProvider& in) {
  PoolGeometry from{PickLayout(in), PickPageSize(in), in.ConsumeIntegralInRange<int64_t>(-1, 4)};
  PoolGeometry to{in.ConsumeIntegralInRange<int>(0, 7) == 0 ? PickLayout(in) : from.layout,
                  PickPageSize(in), in.ConsumeIntegralInRange<int64_t>(-1, 4)};
  auto valid = [](const PoolGeometry& g) {
    return kvferry::IsValidPageSize(g.page_size) && g.num_pages > 0;
  };
  const std::vector<uint8_t> src = Fill<uint8_t>(in, valid(from) ? from.pool_bytes() : 64);
  const size_t n = in.ConsumeIntegralInRange<size_t>(0, 200);
  const bool identity = in.ConsumeBool();
  const std::vector<int64_t> src_locs =
      identity ? std::vector<int64_t>{} : Locations(in, n, valid(from) ? from.num_tokens() : 4);
  const std::vector<int64_t> dst_locs = Locations(in, n, valid(to) ? to.num_tokens() : 4);
  const std::vector<uint8_t> before = Fill<uint8_t>(in, valid(to) ? to.pool_bytes() : 64);
  std::vector<uint8_t> dst = before;
  const absl::Status s =
      kvferry::cpu::CopyRecords(from, src, src_locs, to, dst, dst_locs, MaybeWorkers(in));
  // The oracle: valid pools of one layout, every location in range, no destination twice.
  bool ok = valid(from) && valid(to) && from.layout == to.layout &&
            (!identity || static_cast<int64_t>(n) <= from.num_tokens());
  std::vector<char> seen(ok ? to.num_tokens() : 0, 0);
  for (size_t i = 0; ok && i < n; ++i) {
    const int64_t a = identity ? static_cast<int64_t>(i) : src_locs[i], b = dst_locs[i];
    ok = a >= 0 && a < from.num_tokens() && b >= 0 && b < to.num_tokens() && !seen[b]++;
  }
  if (s.ok() != ok) {
    std::fprintf(stderr, "CopyRecords: status %s, the oracle says %s\n", s.ToString().c_str(),
                 ok ? "valid" : "invalid");
    std::abort();
  }
  std::vector<uint8_t> expected = before;
  if (ok) {
    const kvferry::LayoutInfo info = kvferry::GetLayoutInfo(to.layout);
    for (size_t i = 0; i < n; ++i) {
      const auto [sd, ss] = SpecRecord(from, identity ? static_cast<int64_t>(i) : src_locs[i]);
      const auto [dd, ds] = SpecRecord(to, dst_locs[i]);
      std::memcpy(expected.data() + dd, src.data() + sd, info.data_bytes);
      std::memcpy(expected.data() + ds, src.data() + ss, info.scale_bytes);
    }
  }
  if (expected != dst) {
    std::fprintf(stderr, "CopyRecords: the pool differs from the oracle's (status %s)\n",
                 s.ToString().c_str());
    std::abort();
  }
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
  switch (in.ConsumeIntegralInRange<int>(0, 4)) {
    case 0: QuantizeStore(in); break;
    case 1: DequantizeGather(in); break;
    case 2: Transcode(in); break;
    case 3: CopyRecords(in); break;
    default: PageCopy(in); break;
  }
  return 0;
}
