// The cpu fast path's worker pool: chunked ParallelFor over a job queue.
//
// Hand-written rather than taken from a library: the build's libraries offer none with a
// caller-sized fixed pool and a blocking parallel-for (Highway's contrib thread pool is not
// in Debian's libhwy 1.0.3), and this one is small.
#include <sched.h>

#include <algorithm>
#include <atomic>

#include "kvferry/kernels/cpu_thread_pool.h"
#include "kvferry/thread_name.h"

namespace kvferry::cpu {
namespace {

constexpr int kChunksPerThread = 4;

}  // namespace

int DefaultThreadCount() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  return std::max(1, CPU_COUNT(&set));
}

// One ParallelFor call. It lives on the caller's stack; the caller returns only once every
// chunk is done and no worker still holds the job.
struct ThreadPool::Job {
  Job(absl::FunctionRef<void(int64_t, int64_t)> f, int64_t size, int chunks)
      : fn(f), n(size), num_chunks(chunks) {}

  absl::FunctionRef<void(int64_t, int64_t)> fn;
  const int64_t n;
  const int num_chunks;
  std::atomic<int> next_chunk{0};
  int chunks_done = 0;  // guarded by the pool's mu_
  int users = 0;        // workers inside RunChunks; guarded by the pool's mu_
};

ThreadPool::ThreadPool(int num_threads) {
  for (int i = 1; i < num_threads; ++i) {
    workers_.emplace_back([this, i] {
      NameThisThread("kvf-cpu-" + std::to_string(i));
      WorkerLoop();
    });
  }
}

ThreadPool::~ThreadPool() {
  {
    kvferry::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (std::thread& worker : workers_) worker.join();
}

int ThreadPool::RunChunks(Job& job) {
  int ran = 0;
  for (int c = job.next_chunk.fetch_add(1); c < job.num_chunks; c = job.next_chunk.fetch_add(1)) {
    // Even split: chunk sizes differ by at most one item.
    job.fn(job.n * c / job.num_chunks, job.n * (c + 1) / job.num_chunks);
    ++ran;
  }
  return ran;
}

bool ThreadPool::HasWork() const { return stop_ || !queue_.empty(); }

void ThreadPool::WorkerLoop() {
  kvferry::MutexLock lock(&mu_);
  while (true) {
    mu_.Await(kvferry::Condition(this, &ThreadPool::HasWork));
    if (queue_.empty()) return;  // stop_ and nothing left
    Job* job = queue_.front();
    if (job->next_chunk.load() >= job->num_chunks) {
      queue_.pop_front();  // every chunk claimed: the callers and other workers finish it
      continue;
    }
    ++job->users;
    mu_.Unlock();
    const int ran = RunChunks(*job);
    mu_.Lock();
    job->chunks_done += ran;
    --job->users;
  }
}

void ThreadPool::ParallelFor(int64_t n, int64_t min_grain,
                             absl::FunctionRef<void(int64_t, int64_t)> fn) {
  if (n <= 0) return;
  // A few chunks per thread, claimed one at a time: a thread slowed down (by another
  // process on its core, say) takes fewer, instead of holding up the call.
  const int64_t max_chunks = n / std::max<int64_t>(1, min_grain);
  const int chunks =
      static_cast<int>(std::min<int64_t>(kChunksPerThread * num_threads(), max_chunks));
  if (chunks <= 1) {
    fn(0, n);
    return;
  }
  Job job(fn, n, chunks);
  {
    kvferry::MutexLock lock(&mu_);
    queue_.push_back(&job);
  }
  const int ran = RunChunks(job);
  kvferry::MutexLock lock(&mu_);
  job.chunks_done += ran;
  auto finished = [&job]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return job.chunks_done == job.num_chunks && job.users == 0;
  };
  mu_.Await(kvferry::Condition(&finished));
  // Workers drop exhausted jobs lazily; this one must not outlive the call in the queue.
  if (auto it = std::find(queue_.begin(), queue_.end(), &job); it != queue_.end()) {
    queue_.erase(it);
  }
}

}  // namespace kvferry::cpu
