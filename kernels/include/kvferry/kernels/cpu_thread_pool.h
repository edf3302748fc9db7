// A fixed set of worker threads that split one range of work (rows, pages) across cores.
#pragma once

#include <cstdint>
#include <deque>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "kvferry/mutex.h"

namespace kvferry::cpu {

// The cores this process may run on (sched_getaffinity), at least 1: the default size of a
// pool.
int DefaultThreadCount();

// `num_threads` threads of work: num_threads - 1 workers started now, plus the thread that
// calls ParallelFor, which always takes part. Thread-safe: several threads may call
// ParallelFor at once; their ranges share the workers. Destruction waits for the workers
// and must not race with a ParallelFor.
class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(begin, end) on disjoint chunks covering [0, n), each of at least `min_grain`
  // items (a few per thread at most), and returns once all have run. A range too small for
  // two chunks runs on the calling thread alone, so small requests never pay for a hand-off.
  void ParallelFor(int64_t n, int64_t min_grain, absl::FunctionRef<void(int64_t, int64_t)> fn);

 private:
  struct Job;

  // Runs chunks of `job` until none are left; returns how many this thread ran.
  static int RunChunks(Job& job);
  void WorkerLoop();
  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  kvferry::Mutex mu_;
  std::deque<Job*> queue_ ABSL_GUARDED_BY(mu_);  // jobs with chunks not yet claimed
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace kvferry::cpu
