// Time bounds of streaming calls: an idle timeout and a maximum duration, enforced by one
// thread that cancels the streams past either.
//
// gRPC's synchronous API blocks a handler in Read() or Write() for as long as the client
// neither sends nor reads; only cancelling the call from another thread ends that wait.
// Cancelling sends the client CANCELLED (the trailers with a reason cannot follow a
// cancelled call); the handler then returns STREAM_IDLE_TIMEOUT or STREAM_TOO_LONG, which
// the metrics and the log record, and drops the stream's staged work as for any client
// gone.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/errors.h"
#include "kvferry/mutex.h"

namespace kvferry::server {

struct StreamLimits {
  // A stream that neither receives nor sends a message for this long is cancelled;
  // zero: no idle timeout.
  absl::Duration idle_timeout = absl::Seconds(60);
  // A stream open this long is cancelled; zero: no limit.
  absl::Duration max_duration = absl::Minutes(10);
};

// Thread-safe.
class StreamWatchdog {
 public:
  class Watch;

  // `on_expired` is told of each stream cancelled (metrics); may be empty.
  StreamWatchdog(StreamLimits limits, std::function<void(ErrorReason)> on_expired);
  ~StreamWatchdog();

  // Watches `context` until the returned Watch is destroyed (before the handler returns).
  std::unique_ptr<Watch> Start(grpc::ServerContext* context) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Run() ABSL_LOCKS_EXCLUDED(mu_);
  bool stopping() const ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stop_; }

  const StreamLimits limits_;
  const std::function<void(ErrorReason)> on_expired_;
  kvferry::Mutex mu_;
  absl::flat_hash_set<Watch*> watched_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// One watched stream. Touch() after every message received or sent.
class StreamWatchdog::Watch {
 public:
  Watch(StreamWatchdog* watchdog, grpc::ServerContext* context);
  ~Watch();
  void Touch() { last_ = absl::GetCurrentTimeNanos(); }
  // OK while the watchdog has not cancelled the stream; else the error saying why.
  absl::Status Expired() const;

 private:
  friend class StreamWatchdog;
  StreamWatchdog* const watchdog_;
  grpc::ServerContext* const context_;
  const int64_t start_;
  std::atomic<int64_t> last_;
  std::atomic<int> expired_{0};  // 0, or the ErrorReason the stream was cancelled for
};

}  // namespace kvferry::server
