// Time bounds of streaming calls: an idle timeout and a maximum duration, enforced by one
// thread that cancels the streams past either. One watchdog serves every service of a
// daemon.
//
// Streams meant to stay open (event subscriptions, worker sessions) say so: they are not
// bound by the maximum duration — a subscription still by the idle timeout, which its
// heartbeats keep away while the subscriber reads; a session not even by that once it is
// open (its worker may be quiet for hours; keepalive finds a dead one). At shutdown they
// are cancelled at once (CancelLongLived), while bounded calls get the grace period.
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
#include "core/tenant.h"
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
  // Cancels every long-lived stream now (the daemon is stopping): their handlers return
  // UNAVAILABLE (SHUTTING_DOWN) instead of holding the shutdown for its grace period.
  void CancelLongLived() ABSL_LOCKS_EXCLUDED(mu_);

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
  // From now on the stream is long-lived: no maximum duration, the idle timeout only where
  // `idle_checked`, cancelled at once when the daemon stops.
  void LongLived(bool idle_checked) {
    idle_checked_.store(idle_checked);
    long_lived_.store(true);
  }
  // OK while the watchdog has not cancelled the stream; else the error saying why.
  absl::Status Expired() const;

 private:
  friend class StreamWatchdog;
  StreamWatchdog* const watchdog_;
  grpc::ServerContext* const context_;
  const int64_t start_;
  std::atomic<int64_t> last_;
  std::atomic<int> expired_{0};  // 0, or the ErrorReason the stream was cancelled for
  std::atomic<bool> long_lived_{false};
  std::atomic<bool> idle_checked_{true};
};

// A streaming call's body under the stream rules every service shares: it holds one of
// `tenant`'s streams (RESOURCE_EXHAUSTED when none is left) and runs `body(watch)` watched
// by `watchdog`; a stream the watchdog ended answers with the watchdog's reason.
template <typename Body>
absl::Status RunStream(StreamWatchdog& watchdog, grpc::ServerContext* context,
                       const std::shared_ptr<TenantAccount>& tenant, Body&& body) {
  absl::StatusOr<ScopedCharge> slot = ScopedCharge::Take(tenant, Resource::kStreams, 1);
  if (!slot.ok()) return slot.status();
  const std::unique_ptr<StreamWatchdog::Watch> watch = watchdog.Start(context);
  const absl::Status status = body(*watch);
  if (absl::Status expired = watch->Expired(); !expired.ok()) return expired;
  return status;
}

// A watchdog for a service: null when `options.watchdog` (ServiceOptions) names the
// daemon's shared one, else a new one from its limits.
template <typename Options>
std::unique_ptr<StreamWatchdog> OwnWatchdog(const Options& options) {
  if (options.watchdog != nullptr) return nullptr;
  return std::make_unique<StreamWatchdog>(options.stream_limits, options.on_stream_expired);
}

}  // namespace kvferry::server
