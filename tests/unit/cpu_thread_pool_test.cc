// The cpu worker pool: every item runs exactly once, small ranges stay on the caller, and
// concurrent callers share the workers.
#include "kvferry/kernels/cpu_thread_pool.h"

#include <atomic>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace kvferry::cpu {
namespace {

TEST(ThreadPoolTest, DefaultThreadCountIsPositive) { EXPECT_GE(DefaultThreadCount(), 1); }

TEST(ThreadPoolTest, EveryItemRunsExactlyOnceForAnySizeAndGrain) {
  for (const int threads : {1, 2, 5}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.num_threads(), threads);
    for (const int64_t n : {0, 1, 7, 100, 1001}) {
      for (const int64_t grain : {1, 3, 64, 5000}) {
        std::vector<std::atomic<int>> hits(n);
        pool.ParallelFor(n, grain, [&](int64_t begin, int64_t end) {
          ASSERT_LE(0, begin);
          ASSERT_LE(end, n);
          for (int64_t i = begin; i < end; ++i) ++hits[i];
        });
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << n << " " << grain;
      }
    }
  }
}

TEST(ThreadPoolTest, RangesBelowTwoGrainsRunOnTheCallingThread) {
  ThreadPool pool(4);
  const std::thread::id caller = std::this_thread::get_id();
  int calls = 0;
  pool.ParallelFor(199, 100, [&](int64_t begin, int64_t end) {
    EXPECT_EQ(std::this_thread::get_id(), caller);
    EXPECT_EQ(begin, 0);
    EXPECT_EQ(end, 199);
    ++calls;
  });
  EXPECT_EQ(calls, 1);
}

TEST(ThreadPoolTest, LargeRangesSplitIntoChunksOfAtLeastTheGrain) {
  ThreadPool pool(2);
  for (const int64_t n : {int64_t{250}, int64_t{1000}, int64_t{100000}}) {
    std::atomic<int> chunks{0};
    pool.ParallelFor(n, 100, [&](int64_t begin, int64_t end) {
      EXPECT_GE(end - begin, 100);
      ++chunks;
    });
    EXPECT_GE(chunks.load(), 2) << n;
    EXPECT_LE(chunks.load(), 8) << n;  // a few per thread
  }
}

TEST(ThreadPoolTest, ConcurrentCallersEachGetTheirWholeRange) {
  ThreadPool pool(3);
  std::vector<std::thread> callers;
  std::vector<int64_t> sums(6, 0);
  for (int c = 0; c < 6; ++c) {
    callers.emplace_back([&, c] {
      for (int round = 0; round < 50; ++round) {
        std::atomic<int64_t> sum{0};
        pool.ParallelFor(1000 + c, 10, [&](int64_t begin, int64_t end) {
          int64_t local = 0;
          for (int64_t i = begin; i < end; ++i) local += i;
          sum += local;
        });
        sums[c] += sum.load();
      }
    });
  }
  for (std::thread& t : callers) t.join();
  for (int c = 0; c < 6; ++c) {
    const int64_t n = 1000 + c;
    EXPECT_EQ(sums[c], 50 * n * (n - 1) / 2) << c;
  }
}

}  // namespace
}  // namespace kvferry::cpu
