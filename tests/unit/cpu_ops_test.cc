// The cpu fast path against the goldens and the CPU reference: byte for byte, on every
// instruction set compiled in, single- and multi-threaded, and on invalid input.
#include "kvferry/kernels/cpu_ops.h"

#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "common/adversarial_rows.h"
#include "common/cpu_targets.h"
#include "common/golden.h"
#include "common/random_rows.h"
#include "common/stored_rows.h"
#include "gtest/gtest.h"
#include "kvferry/kernels/ops.h"
#include "kvferry/kernels/validate.h"

namespace kvferry {
namespace {

using testing::FirstDifference;
using testing::ForEachCpuTarget;
using testing::ReadArray;
using testing::ReadBytes;

TEST(CpuTargetsTest, DispatchFollowsTheForcedTarget) {
  const std::vector<int64_t> targets = testing::CpuTargets();
  ASSERT_FALSE(targets.empty());
  std::string names;
  ForEachCpuTarget([&] { names += std::string(cpu::DispatchedTargetName()) + " "; });
  std::string expected;
  for (const int64_t t : targets) expected += std::string(hwy::TargetName(t)) + " ";
  EXPECT_EQ(names, expected);
  RecordProperty("targets", names);
#if defined(__x86_64__)
  // Every x86-64 has SSSE3-or-better hardware in practice, and the portable fallback is
  // always compiled: at least two targets are exercised.
  EXPECT_GE(targets.size(), 2u) << names;
#endif
}

// ---------------------------------------------------------------- goldens

class CpuGoldenTest : public ::testing::TestWithParam<testing::GoldenParam> {
 protected:
  void SetUp() override { c_ = testing::LoadGoldenCase(GetParam().case_name); }
  std::string Name() const { return LayoutName(GetParam().layout); }
  testing::GoldenCase c_;
  cpu::ThreadPool workers_{2};
};

TEST_P(CpuGoldenTest, QuantizeStoreReproducesPool) {
  const auto rows = ReadArray<uint16_t>(c_.file("input.bf16"));
  const auto locs = ReadArray<int64_t>(c_.file("locs.i64"));
  const auto golden = ReadBytes(c_.file("pool." + Name() + ".bin"));
  const PoolGeometry g = c_.geometry(GetParam().layout);
  ForEachCpuTarget([&] {
    std::vector<uint8_t> pool(g.pool_bytes(), 0);
    ASSERT_TRUE(cpu::QuantizeStore(g, rows, locs, pool, &workers_).ok());
    EXPECT_EQ(FirstDifference(pool, golden), -1);
    // The single-pass store of rows already found finite (the daemon's commit).
    std::vector<uint8_t> checked(g.pool_bytes(), 0);
    ASSERT_TRUE(cpu::QuantizeStoreCheckedRows(g, rows, locs, checked, &workers_).ok());
    EXPECT_EQ(FirstDifference(checked, golden), -1);
  });
}

TEST_P(CpuGoldenTest, DequantizeGatherReproducesRows) {
  const auto locs = ReadArray<int64_t>(c_.file("locs.i64"));
  const auto pool = ReadBytes(c_.file("pool." + Name() + ".bin"));
  const auto golden = ReadArray<uint16_t>(c_.file("dequant." + Name() + ".bf16"));
  ForEachCpuTarget([&] {
    std::vector<uint16_t> rows(locs.size() * kHeadDim, 0xFFFF);
    ASSERT_TRUE(
        cpu::DequantizeGather(c_.geometry(GetParam().layout), pool, locs, rows, kHeadDim, &workers_)
            .ok());
    EXPECT_EQ(FirstDifference(rows, golden), -1);
  });
}

TEST_P(CpuGoldenTest, TranscodeToV4ReproducesGolden) {
  const auto locs = ReadArray<int64_t>(c_.file("locs.i64"));
  const auto src = ReadBytes(c_.file("pool." + Name() + ".bin"));
  const auto golden = ReadBytes(c_.file("transcode." + Name() + "_to_v4.bin"));
  const PoolGeometry to = c_.geometry(Layout::kV4);
  ForEachCpuTarget([&] {
    std::vector<uint8_t> dst(to.pool_bytes(), 0);
    ASSERT_TRUE(cpu::Transcode(c_.geometry(GetParam().layout), src, to, dst, locs, &workers_).ok());
    EXPECT_EQ(FirstDifference(dst, golden), -1);
  });
}

INSTANTIATE_TEST_SUITE_P(Golden, CpuGoldenTest,
                         ::testing::ValuesIn(testing::AllGoldenParams()),
                         [](const ::testing::TestParamInfo<testing::GoldenParam>& info) {
                           return testing::GoldenParamName(info.param);
                         });

// ---------------------------------------------------------------- against the reference

std::vector<int64_t> SequentialLocations(int64_t n, int64_t first) {
  std::vector<int64_t> locs(n);
  for (int64_t i = 0; i < n; ++i) locs[i] = first + i;
  return locs;
}

// Random latent-like rows and adversarial rows, both layouts of location.
struct RowSet {
  std::string name;
  std::vector<uint16_t> rows;
  std::vector<int64_t> locs;
};

std::vector<RowSet> RowSets(const PoolGeometry& g, int64_t n) {
  return {{"latent_scattered", testing::RandomRows(n, 31),
           testing::ScatteredLocations(n, g.num_tokens(), 32)},
          {"adversarial_scattered", testing::AdversarialRows(n, 33),
           testing::ScatteredLocations(n, g.num_tokens(), 34)},
          {"adversarial_sequential", testing::AdversarialRows(n, 35),
           SequentialLocations(n, g.num_tokens() - n)}};
}

class CpuVsReferenceTest : public ::testing::TestWithParam<Layout> {
 protected:
  cpu::ThreadPool workers_{3};
};

TEST_P(CpuVsReferenceTest, QuantizeStoreMatchesReference) {
  for (const int page_size : {1, 16, 64, 256}) {
    const PoolGeometry g{GetParam(), page_size, 1024 / page_size + 3};
    for (const RowSet& set : RowSets(g, 600)) {
      SCOPED_TRACE(set.name + " page size " + std::to_string(page_size));
      // A pool with earlier content, so bytes the op must not touch are visible.
      std::vector<uint8_t> before(g.pool_bytes());
      testing::FastRandom rng(page_size);
      for (uint8_t& b : before) b = static_cast<uint8_t>(rng.Next());
      std::vector<uint8_t> expected = before;
      ASSERT_TRUE(reference::QuantizeStore(g, set.rows, set.locs, expected).ok());
      ForEachCpuTarget([&] {
        for (cpu::ThreadPool* workers : {static_cast<cpu::ThreadPool*>(nullptr), &workers_}) {
          std::vector<uint8_t> pool = before;
          ASSERT_TRUE(cpu::QuantizeStore(g, set.rows, set.locs, pool, workers).ok());
          ASSERT_EQ(FirstDifference(pool, expected), -1) << (workers ? "threads" : "inline");
          pool = before;
          ASSERT_TRUE(cpu::QuantizeStoreCheckedRows(g, set.rows, set.locs, pool, workers).ok());
          ASSERT_EQ(FirstDifference(pool, expected), -1)
              << "checked rows, " << (workers ? "threads" : "inline");
        }
      });
    }
  }
}

TEST_P(CpuVsReferenceTest, DequantizeGatherMatchesReferenceWithRepeatsAndStrides) {
  for (const int page_size : {1, 16, 64, 256}) {
    const PoolGeometry g{GetParam(), page_size, 1024 / page_size + 3};
    for (const RowSet& set : RowSets(g, 600)) {
      SCOPED_TRACE(set.name + " page size " + std::to_string(page_size));
      std::vector<uint8_t> pool(g.pool_bytes(), 0);
      ASSERT_TRUE(reference::QuantizeStore(g, set.rows, set.locs, pool).ok());
      // Read back every stored location, some twice, and some never-written (zero) slots.
      std::vector<int64_t> reads = set.locs;
      for (int i = 0; i < 100; ++i) reads.push_back(set.locs[(i * 7) % set.locs.size()]);
      for (int64_t loc = 0; loc < 40; ++loc) reads.push_back(loc);
      for (const int64_t stride :
           {int64_t{kHeadDim}, int64_t{kHeadDim + 3}, int64_t{2 * kHeadDim}}) {
        const size_t size = (reads.size() - 1) * stride + kHeadDim;
        std::vector<uint16_t> expected(size, 0xBEEF);
        ASSERT_TRUE(reference::DequantizeGather(g, pool, reads, expected, stride).ok());
        ForEachCpuTarget([&] {
          for (cpu::ThreadPool* workers : {static_cast<cpu::ThreadPool*>(nullptr), &workers_}) {
            std::vector<uint16_t> out(size, 0xBEEF);
            ASSERT_TRUE(cpu::DequantizeGather(g, pool, reads, out, stride, workers).ok());
            ASSERT_EQ(FirstDifference(out, expected), -1) << "stride " << stride;
          }
        });
      }
    }
  }
}

TEST_P(CpuVsReferenceTest, TranscodeMatchesReferenceToEveryLayout) {
  const PoolGeometry from{GetParam(), 16, 70};
  for (const RowSet& set : RowSets(from, 700)) {
    SCOPED_TRACE(set.name);
    std::vector<uint8_t> src(from.pool_bytes(), 0);
    ASSERT_TRUE(reference::QuantizeStore(from, set.rows, set.locs, src).ok());
    for (const Layout to_layout : testing::AllLayouts()) {
      // A destination of another page size and fewer pages: locations must fit both.
      const PoolGeometry to{to_layout, 64, 12};
      std::vector<int64_t> locs;
      for (const int64_t loc : set.locs) {
        if (loc < to.num_tokens()) locs.push_back(loc);
      }
      std::vector<uint8_t> expected(to.pool_bytes(), 0x11);
      ASSERT_TRUE(reference::Transcode(from, src, to, expected, locs).ok());
      ForEachCpuTarget([&] {
        std::vector<uint8_t> dst(to.pool_bytes(), 0x11);
        ASSERT_TRUE(cpu::Transcode(from, src, to, dst, locs, &workers_).ok());
        ASSERT_EQ(FirstDifference(dst, expected), -1) << LayoutName(to_layout);
      });
    }
  }
}

// Rows quantized into one pool and their records moved to other locations of a pool of
// another page size give the bytes of the reference storing the same rows there directly:
// the records do not depend on where they lie.
TEST_P(CpuVsReferenceTest, CopiedRecordsEqualTheReferenceStoringAtTheDestination) {
  const PoolGeometry from{GetParam(), 64, 12};
  for (const int page_size : {1, 16, 256}) {
    const PoolGeometry to{GetParam(), page_size, 2048 / page_size + 1};
    for (const RowSet& set : RowSets(to, 700)) {
      SCOPED_TRACE(set.name + " page size " + std::to_string(page_size));
      std::vector<uint8_t> staged(from.pool_bytes(), 0);
      const std::vector<int64_t> at = testing::ScatteredLocations(700, from.num_tokens(), 5);
      ASSERT_TRUE(reference::QuantizeStore(from, set.rows, at, staged).ok());
      std::vector<uint8_t> before(to.pool_bytes());
      testing::FastRandom rng(page_size + 1);
      for (uint8_t& b : before) b = static_cast<uint8_t>(rng.Next());
      std::vector<uint8_t> expected = before;
      ASSERT_TRUE(reference::QuantizeStore(to, set.rows, set.locs, expected).ok());
      // The same rows stored at 0, 1, ... of a pool: the identity source list.
      std::vector<uint8_t> packed(from.pool_bytes(), 0);
      ASSERT_TRUE(reference::QuantizeStore(from, set.rows, SequentialLocations(700, 0), packed).ok());
      ForEachCpuTarget([&] {
        for (cpu::ThreadPool* workers : {static_cast<cpu::ThreadPool*>(nullptr), &workers_}) {
          std::vector<uint8_t> pool = before;
          ASSERT_TRUE(cpu::CopyRecords(from, staged, at, to, pool, set.locs, workers).ok());
          ASSERT_EQ(FirstDifference(pool, expected), -1) << (workers ? "threads" : "inline");
          pool = before;
          ASSERT_TRUE(cpu::CopyRecords(from, packed, {}, to, pool, set.locs, workers).ok());
          ASSERT_EQ(FirstDifference(pool, expected), -1)
              << "identity source, " << (workers ? "threads" : "inline");
        }
      });
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, CpuVsReferenceTest,
                         ::testing::Values(Layout::kV4, Layout::kV41, Layout::kV41Fp4),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return std::string(LayoutName(info.param));
                         });

TEST(CpuPageCopyTest, GatherScatterAndZeroMatchReference) {
  cpu::ThreadPool workers(3);
  // Pages of 40 KiB, three layers: large enough that the copies split across threads.
  const PageCopyGeometry g{40 * 1024 + 8, 64, 3};
  std::vector<uint8_t> pool(g.pool_bytes());
  testing::FastRandom rng(5);
  for (uint8_t& b : pool) b = static_cast<uint8_t>(rng.Next());
  std::vector<int64_t> pages = testing::ScatteredLocations(50, g.num_pages, 6);
  std::vector<int64_t> with_repeats = pages;
  with_repeats.insert(with_repeats.end(), {pages[3], pages[3], 0});
  for (cpu::ThreadPool* threads : {static_cast<cpu::ThreadPool*>(nullptr), &workers}) {
    std::vector<uint8_t> expected(g.buffer_bytes(with_repeats.size()), 0);
    std::vector<uint8_t> buffer(expected.size(), 0);
    ASSERT_TRUE(reference::GatherPages(g, pool, with_repeats, expected).ok());
    ASSERT_TRUE(cpu::GatherPages(g, pool, with_repeats, buffer, threads).ok());
    EXPECT_EQ(FirstDifference(buffer, expected), -1);

    std::vector<uint8_t> scattered_expected(pool.size(), 0x77), scattered(pool.size(), 0x77);
    const std::span<const uint8_t> unique_buffer(buffer.data(), g.buffer_bytes(pages.size()));
    ASSERT_TRUE(reference::ScatterPages(g, unique_buffer, pages, scattered_expected).ok());
    ASSERT_TRUE(cpu::ScatterPages(g, unique_buffer, pages, scattered, threads).ok());
    EXPECT_EQ(FirstDifference(scattered, scattered_expected), -1);

    std::vector<uint8_t> zeroed_expected = pool, zeroed = pool;
    ASSERT_TRUE(reference::ZeroPages(g, with_repeats, zeroed_expected).ok());
    ASSERT_TRUE(cpu::ZeroPages(g, with_repeats, zeroed, threads).ok());
    EXPECT_EQ(FirstDifference(zeroed, zeroed_expected), -1);
  }
}

TEST(CpuThreadsTest, LargeRequestsGiveTheSameBytesOnAnyPoolSize) {
  // 5000 rows: enough for every thread of the pools below to take a share.
  const PoolGeometry g{Layout::kV41Fp4, 64, 100};
  const int64_t n = 5000;
  const auto rows = testing::AdversarialRows(n, 41);
  const auto locs = testing::ScatteredLocations(n, g.num_tokens(), 42);
  std::vector<uint8_t> single(g.pool_bytes(), 0);
  ASSERT_TRUE(cpu::QuantizeStore(g, rows, locs, single).ok());
  std::vector<uint16_t> single_rows(n * kHeadDim);
  ASSERT_TRUE(cpu::DequantizeGather(g, single, locs, single_rows).ok());
  for (const int threads : {2, 3, 8}) {
    cpu::ThreadPool workers(threads);
    std::vector<uint8_t> pool(g.pool_bytes(), 0);
    ASSERT_TRUE(cpu::QuantizeStore(g, rows, locs, pool, &workers).ok());
    EXPECT_EQ(FirstDifference(pool, single), -1) << threads;
    std::vector<uint16_t> out(n * kHeadDim);
    ASSERT_TRUE(cpu::DequantizeGather(g, pool, locs, out, kHeadDim, &workers).ok());
    EXPECT_EQ(FirstDifference(out, single_rows), -1) << threads;
  }
}

// A span of `size` bytes inside `storage` starting `misalign` bytes past a 64-byte boundary.
template <typename T>
std::span<T> AtAlignment(std::vector<T>& storage, size_t size, size_t misalign) {
  storage.assign(size + 128 / sizeof(T), T{0x5A});
  const auto address = reinterpret_cast<uintptr_t>(storage.data());
  const size_t skip = ((64 - address % 64) % 64 + misalign) / sizeof(T);
  return std::span<T>(storage).subspan(skip, size);
}

TEST(CpuStreamingTest, OutputsBeyondTheCachesGiveTheReferenceBytesAtAnyAlignment) {
  // 16384 V4 records (9.6 MB), workspace rows (16 MiB) and V41 records transcoded from the
  // V4 ones (8.7 MB): past the size where the cpu path writes with non-temporal stores.
  const PoolGeometry g{Layout::kV4, 64, 300};
  const PoolGeometry v41{Layout::kV41, 64, 300};
  const int64_t n = 16384;
  auto rows = testing::AdversarialRows(n, 51);
  const auto latent = testing::RandomRows(n / 2, 52);
  std::copy(latent.begin(), latent.end(), rows.begin());
  const auto locs = testing::ScatteredLocations(n, g.num_tokens(), 53);
  std::vector<uint8_t> expected(g.pool_bytes(), 0);
  ASSERT_TRUE(reference::QuantizeStore(g, rows, locs, expected).ok());
  std::vector<uint16_t> expected_rows(rows.size());
  ASSERT_TRUE(reference::DequantizeGather(g, expected, locs, expected_rows).ok());
  std::vector<uint8_t> expected_v41(v41.pool_bytes(), 0);
  ASSERT_TRUE(reference::Transcode(g, expected, v41, expected_v41, locs).ok());
  cpu::ThreadPool workers(2);
  ForEachCpuTarget([&] {
    for (const size_t misalign : {0, 2, 24, 62}) {
      for (cpu::ThreadPool* threads : {static_cast<cpu::ThreadPool*>(nullptr), &workers}) {
        std::vector<uint8_t> pool_storage;
        const std::span<uint8_t> pool = AtAlignment(pool_storage, g.pool_bytes(), misalign);
        std::fill(pool.begin(), pool.end(), 0);
        ASSERT_TRUE(cpu::QuantizeStore(g, rows, locs, pool, threads).ok());
        EXPECT_TRUE(std::equal(pool.begin(), pool.end(), expected.begin())) << misalign;
        std::vector<uint16_t> out_storage;
        const std::span<uint16_t> out = AtAlignment(out_storage, rows.size(), misalign);
        ASSERT_TRUE(cpu::DequantizeGather(g, pool, locs, out, kHeadDim, threads).ok());
        EXPECT_TRUE(std::equal(out.begin(), out.end(), expected_rows.begin())) << misalign;
        // The workspace's lines are streamed whole where the rows cover them whole; the
        // bytes around it, in the lines it begins and ends inside, are not written.
        EXPECT_TRUE(std::all_of(out_storage.data(), out.data(),
                                [](uint16_t v) { return v == 0x5A; }))
            << misalign;
        EXPECT_TRUE(std::all_of(out.data() + out.size(), out_storage.data() + out_storage.size(),
                                [](uint16_t v) { return v == 0x5A; }))
            << misalign;
        std::vector<uint8_t> transcoded_storage;
        const std::span<uint8_t> transcoded =
            AtAlignment(transcoded_storage, v41.pool_bytes(), misalign);
        std::fill(transcoded.begin(), transcoded.end(), 0);
        ASSERT_TRUE(cpu::Transcode(g, pool, v41, transcoded, locs, threads).ok());
        EXPECT_TRUE(std::equal(transcoded.begin(), transcoded.end(), expected_v41.begin()))
            << misalign;
      }
    }
  });
}

// ---------------------------------------------------------------- invalid input

// Runs the reference and the cpu op on copies of the same output and expects the same status
// (code and message) and an output left as it was.
template <typename Output, typename Reference, typename Cpu>
void ExpectSameRejection(const std::vector<Output>& output, const Reference& reference_op,
                         const Cpu& cpu_op) {
  std::vector<Output> reference_out = output, cpu_out = output;
  const absl::Status expected = reference_op(std::span<Output>(reference_out));
  ASSERT_FALSE(expected.ok());
  cpu::ThreadPool workers(2);
  ForEachCpuTarget([&] {
    const absl::Status got = cpu_op(std::span<Output>(cpu_out), &workers);
    EXPECT_EQ(got.code(), expected.code());
    EXPECT_EQ(got.message(), expected.message());
    EXPECT_TRUE(cpu_out == output) << "output changed by a rejected call: " << got;
  });
}

class CpuInvalidTest : public ::testing::Test {
 protected:
  void SetUp() override {
    pool_.assign(g_.pool_bytes(), 0);
    ASSERT_TRUE(reference::QuantizeStore(g_, testing::RandomRows(8, 3),
                                         std::vector<int64_t>{0, 5, 17, 30, 31, 40, 63, 2}, pool_)
                    .ok());
  }

  void ExpectStoreRejected(const PoolGeometry& g, const std::vector<uint16_t>& rows,
                           const std::vector<int64_t>& locs) {
    ExpectSameRejection(
        pool_,
        [&](std::span<uint8_t> pool) { return reference::QuantizeStore(g, rows, locs, pool); },
        [&](std::span<uint8_t> pool, cpu::ThreadPool* w) {
          return cpu::QuantizeStore(g, rows, locs, pool, w);
        });
  }

  const PoolGeometry g_{Layout::kV41, 16, 4};
  std::vector<uint8_t> pool_;
};

TEST_F(CpuInvalidTest, NonFiniteRowsAreRejectedWithTheFirstBadValue) {
  // Large enough that the finite check is split across threads; bad values in both halves.
  const PoolGeometry g{Layout::kV4, 64, 40};
  pool_.assign(g.pool_bytes(), 0x3C);
  auto rows = testing::RandomRows(2000, 9);
  rows[1900 * 512 + 7] = 0xFF80;
  rows[1200 * 512 + 100] = 0x7FC1;
  ExpectStoreRejected(g, rows, testing::ScatteredLocations(2000, g.num_tokens(), 1));
  rows[3] = 0x7F80;
  ExpectStoreRejected(g, rows, testing::ScatteredLocations(2000, g.num_tokens(), 1));
  // In V4's RoPE dims, which are copied rather than quantized: still rejected.
  auto rope = testing::RandomRows(2000, 9);
  rope[1500 * 512 + 500] = 0xFFC0;
  ExpectStoreRejected(g, rope, testing::ScatteredLocations(2000, g.num_tokens(), 1));
}

TEST_F(CpuInvalidTest, ARowPromisedFiniteThatIsNotIsAnInternalError) {
  const PoolGeometry g{Layout::kV41Fp4, 16, 40};
  auto rows = testing::RandomRows(300, 12);
  rows[290 * 512 + 3] = 0x7FC0;
  std::vector<uint8_t> pool(g.pool_bytes(), 0);
  const absl::Status s = cpu::QuantizeStoreCheckedRows(
      g, rows, testing::ScatteredLocations(300, g.num_tokens(), 13), pool);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_NE(s.message().find("row 290"), std::string::npos) << s;
}

TEST_F(CpuInvalidTest, BadShapesGeometriesAndLocationsAreRejected) {
  const auto rows = testing::RandomRows(3, 9);
  auto partial = rows;
  partial.pop_back();
  ExpectStoreRejected(g_, partial, {1, 3, 4});
  ExpectStoreRejected(g_, rows, {1, 3});
  ExpectStoreRejected(g_, rows, {1, 64, 3});
  ExpectStoreRejected(g_, rows, {1, -1, 3});
  ExpectStoreRejected(g_, rows, {7, 3, 7});
  ExpectStoreRejected(PoolGeometry{Layout::kV41, 48, 4}, rows, {1, 2, 3});
  ExpectStoreRejected(PoolGeometry{static_cast<Layout>(7), 16, 4}, rows, {1, 2, 3});
  ExpectStoreRejected(PoolGeometry{Layout::kV41, 16, 5}, rows, {1, 2, 3});
  ExpectStoreRejected(PoolGeometry{Layout::kV41, 16, 0}, rows, {1, 2, 3});
}

TEST_F(CpuInvalidTest, RepeatedLocationAmongManyIsRejected) {
  // Dense enough for the cpu path's bitmap check; the repeat is far apart.
  const PoolGeometry g{Layout::kV41Fp4, 16, 100};
  pool_.assign(g.pool_bytes(), 0);
  auto locs = testing::ScatteredLocations(1500, g.num_tokens(), 4);
  locs[1400] = locs[17];
  ExpectStoreRejected(g, testing::RandomRows(1500, 9), locs);
}

TEST_F(CpuInvalidTest, DequantizeRejectsBadLocationsStridesAndShortWorkspaces) {
  const std::vector<uint16_t> out(3 * 600, 0x1234);
  auto expect = [&](std::vector<int64_t> locs, int64_t stride, size_t size) {
    ExpectSameRejection(
        std::vector<uint16_t>(out.begin(), out.begin() + size),
        [&](std::span<uint16_t> o) {
          return reference::DequantizeGather(g_, pool_, locs, o, stride);
        },
        [&](std::span<uint16_t> o, cpu::ThreadPool* w) {
          return cpu::DequantizeGather(g_, pool_, locs, o, stride, w);
        });
  };
  expect({0, 99}, 512, 1024);
  expect({0, -5}, 512, 1024);
  expect({0, 1}, 256, 1024);
  expect({0, 1, 2}, 600, 2 * 600 + kHeadDim - 1);
  ExpectSameRejection(
      out,
      [&](std::span<uint16_t> o) {
        return reference::DequantizeGather(g_, std::span(pool_).first(100), {}, o);
      },
      [&](std::span<uint16_t> o, cpu::ThreadPool* w) {
        return cpu::DequantizeGather(g_, std::span(pool_).first(100), {}, o, 512, w);
      });
}

TEST_F(CpuInvalidTest, TranscodeRejectsRepeatsAndLocationsOutsideEitherPool) {
  const PoolGeometry to{Layout::kV4, 16, 2};
  const std::vector<uint8_t> dst(to.pool_bytes(), 0x5A);
  for (const std::vector<int64_t>& locs :
       {std::vector<int64_t>{5, 5}, std::vector<int64_t>{1, 40}, std::vector<int64_t>{-2}}) {
    ExpectSameRejection(
        dst, [&](std::span<uint8_t> d) { return reference::Transcode(g_, pool_, to, d, locs); },
        [&](std::span<uint8_t> d, cpu::ThreadPool* w) {
          return cpu::Transcode(g_, pool_, to, d, locs, w);
        });
  }
}

TEST_F(CpuInvalidTest, CopyRecordsRejectsMismatchesAndBadLocationsWritingNothing) {
  const PoolGeometry from{Layout::kV41, 16, 2};
  std::vector<uint8_t> src(from.pool_bytes(), 0x5A);
  auto expect_rejected = [&](const PoolGeometry& to, std::span<const int64_t> src_locs,
                             std::span<const int64_t> dst_locs, const std::string& says) {
    std::vector<uint8_t> dst = pool_;
    cpu::ThreadPool workers(2);
    const absl::Status s = cpu::CopyRecords(from, src, src_locs, to, dst, dst_locs, &workers);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(says), std::string::npos) << s;
    EXPECT_EQ(FirstDifference(dst, pool_), -1) << s;
  };
  const std::vector<int64_t> two = {0, 1}, three = {0, 1, 2};
  expect_rejected(PoolGeometry{Layout::kV4, 16, 4}, two, two, "layout");
  expect_rejected(g_, two, three, "2 source locations for 3");
  expect_rejected(g_, std::vector<int64_t>{0, 32}, two, "source location");
  expect_rejected(g_, two, std::vector<int64_t>{3, 64}, "destination location");
  expect_rejected(g_, two, std::vector<int64_t>{9, 9}, "destination location");
  expect_rejected(g_, {}, SequentialLocations(33, 0),
                  "33 records asked of a source pool of 32 tokens");
  // Source repeats are fine: one record copied to two places.
  std::vector<uint8_t> dst = pool_;
  ASSERT_TRUE(cpu::CopyRecords(from, src, std::vector<int64_t>{3, 3}, g_, dst,
                               std::vector<int64_t>{10, 20})
                  .ok());
  EXPECT_NE(FirstDifference(dst, pool_), -1);
}

TEST_F(CpuInvalidTest, PageOpsRejectWhatTheReferenceRejects) {
  const PageCopyGeometry pg{g_.page_bytes(), g_.num_pages, 1};
  const std::vector<uint8_t> buffer(pg.buffer_bytes(2), 0xEE);
  for (const std::vector<int64_t>& pages :
       {std::vector<int64_t>{1, 1}, std::vector<int64_t>{0, 4}, std::vector<int64_t>{-1, 0}}) {
    ExpectSameRejection(
        pool_, [&](std::span<uint8_t> p) { return reference::ScatterPages(pg, buffer, pages, p); },
        [&](std::span<uint8_t> p, cpu::ThreadPool* w) {
          return cpu::ScatterPages(pg, buffer, pages, p, w);
        });
    ExpectSameRejection(
        buffer,
        [&](std::span<uint8_t> b) {
          return reference::GatherPages(pg, pool_, std::vector<int64_t>{0, 9}, b);
        },
        [&](std::span<uint8_t> b, cpu::ThreadPool* w) {
          return cpu::GatherPages(pg, pool_, std::vector<int64_t>{0, 9}, b, w);
        });
  }
  ExpectSameRejection(
      pool_,
      [&](std::span<uint8_t> p) {
        return reference::ZeroPages(pg, std::vector<int64_t>{2, 4}, p);
      },
      [&](std::span<uint8_t> p, cpu::ThreadPool* w) {
        return cpu::ZeroPages(pg, std::vector<int64_t>{2, 4}, p, w);
      });
  ExpectSameRejection(
      pool_,
      [&](std::span<uint8_t> p) {
        return reference::ZeroPages(PageCopyGeometry{0, 4, 1}, std::vector<int64_t>{1}, p);
      },
      [&](std::span<uint8_t> p, cpu::ThreadPool* w) {
        return cpu::ZeroPages(PageCopyGeometry{0, 4, 1}, std::vector<int64_t>{1}, p, w);
      });
}

// CopyFiniteBf16 against the shared validator (scalar code of its own): every byte copied,
// and the same verdict, for lengths around the vector widths, both pointers misaligned, and
// each kind of non-finite value (and the largest finite ones) at every position.
TEST(CpuCopyFiniteTest, CopiesEveryByteAndFindsEveryValueThatIsNotFinite) {
  const std::vector<uint16_t> rows = testing::RandomRows(2, 5);
  const uint16_t planted[] = {0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF,  // ±Inf, NaNs
                              0x7F7F, 0xFF7F, 0x8000};                 // finite: max, -0
  ForEachCpuTarget([&] {
    for (const size_t bytes : {0, 1, 2, 3, 62, 64, 66, 127, 128, 130, 190, 256, 258, 1026}) {
      for (const size_t src_at : {0, 1, 3}) {
        for (const size_t dst_at : {0, 1, 2}) {
          // One spare byte each, so that no pointer is null when `bytes` is 0.
          std::vector<uint8_t> src(src_at + bytes + 1), dst(dst_at + bytes + 1, 0xAB);
          std::memcpy(src.data() + src_at, rows.data(), bytes);
          const std::span<const uint8_t> in(src.data() + src_at, bytes);
          EXPECT_TRUE(cpu::CopyFiniteBf16(in, dst.data() + dst_at)) << bytes;
          ASSERT_EQ(0, std::memcmp(dst.data() + dst_at, in.data(), bytes)) << bytes;
          ASSERT_EQ(dst[dst_at + bytes], 0xAB) << "wrote past the end";
          for (size_t value = 0; 2 * value + 1 < bytes; value += (bytes > 300 ? 37 : 1)) {
            for (const uint16_t v : planted) {
              std::vector<uint8_t> bad(src.begin(), src.end());
              bad[src_at + 2 * value] = static_cast<uint8_t>(v);
              bad[src_at + 2 * value + 1] = static_cast<uint8_t>(v >> 8);
              const std::span<const uint8_t> bad_in(bad.data() + src_at, bytes);
              const bool finite = ValidateFiniteBytes(bad_in).ok();
              ASSERT_EQ(cpu::CopyFiniteBf16(bad_in, dst.data() + dst_at), finite)
                  << bytes << " bytes, value " << value << " = 0x" << std::hex << v;
              ASSERT_EQ(0, std::memcmp(dst.data() + dst_at, bad_in.data(), bytes));
            }
          }
        }
      }
    }
    // A buffer of many vectors with one NaN at its first, a middle and its last value.
    std::vector<uint8_t> big(1 << 20);
    std::memcpy(big.data(), testing::RandomRows(1024, 9).data(), big.size());
    std::vector<uint8_t> out(big.size());
    EXPECT_TRUE(cpu::CopyFiniteBf16(big, out.data()));
    EXPECT_EQ(big, out);
    for (const size_t value : {size_t{0}, big.size() / 4 + 3, big.size() / 2 - 1}) {
      std::vector<uint8_t> bad = big;
      bad[2 * value] = 0xC0;
      bad[2 * value + 1] = 0x7F;
      EXPECT_FALSE(cpu::CopyFiniteBf16(bad, out.data())) << value;
      EXPECT_EQ(bad, out);
    }
  });
}

}  // namespace
}  // namespace kvferry
