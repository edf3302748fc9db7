// StreamWatchdog: one thread that cancels idle and overlong streams.
#include "service/stream_watchdog.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "kvferry/thread_name.h"

namespace kvferry::server {

StreamWatchdog::StreamWatchdog(StreamLimits limits, std::function<void(ErrorReason)> on_expired)
    : limits_(limits), on_expired_(std::move(on_expired)) {
  if (limits_.idle_timeout > absl::ZeroDuration() || limits_.max_duration > absl::ZeroDuration()) {
    thread_ = std::thread([this] {
      NameThisThread("kvf-watchdog");
      Run();
    });
  }
}

StreamWatchdog::~StreamWatchdog() {
  {
    kvferry::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

std::unique_ptr<StreamWatchdog::Watch> StreamWatchdog::Start(grpc::ServerContext* context) {
  return std::make_unique<Watch>(this, context);
}

StreamWatchdog::Watch::Watch(StreamWatchdog* watchdog, grpc::ServerContext* context)
    : watchdog_(watchdog), context_(context), start_(absl::GetCurrentTimeNanos()), last_(start_) {
  kvferry::MutexLock lock(&watchdog_->mu_);
  watchdog_->watched_.insert(this);
}

StreamWatchdog::Watch::~Watch() {
  // Under the lock: the watchdog never cancels a context whose handler has returned.
  kvferry::MutexLock lock(&watchdog_->mu_);
  watchdog_->watched_.erase(this);
}

void StreamWatchdog::CancelLongLived() {
  kvferry::MutexLock lock(&mu_);
  for (Watch* w : watched_) {
    int none = 0;
    if (w->long_lived_.load() &&
        w->expired_.compare_exchange_strong(none, static_cast<int>(ErrorReason::kShuttingDown))) {
      w->context_->TryCancel();
    }
  }
}

absl::Status StreamWatchdog::Watch::Expired() const {
  const int reason = expired_.load();
  if (reason == 0) return absl::OkStatus();
  if (static_cast<ErrorReason>(reason) == ErrorReason::kShuttingDown) {
    return Error(absl::StatusCode::kUnavailable, ErrorReason::kShuttingDown,
                 "the daemon is stopping");
  }
  if (static_cast<ErrorReason>(reason) == ErrorReason::kStreamIdleTimeout) {
    return Error(absl::StatusCode::kCancelled, ErrorReason::kStreamIdleTimeout,
                 absl::StrCat("the stream was idle for ",
                              absl::FormatDuration(watchdog_->limits_.idle_timeout),
                              " (--stream_idle_timeout_seconds); its work was dropped"));
  }
  return Error(absl::StatusCode::kCancelled, ErrorReason::kStreamTooLong,
               absl::StrCat("the stream was open for ",
                            absl::FormatDuration(watchdog_->limits_.max_duration),
                            " (--max_stream_seconds); its work was dropped"));
}

void StreamWatchdog::Run() {
  // Checks often enough that a stream ends within about a tenth of its limit past it.
  absl::Duration shortest = absl::InfiniteDuration();
  for (absl::Duration d : {limits_.idle_timeout, limits_.max_duration}) {
    if (d > absl::ZeroDuration()) shortest = std::min(shortest, d);
  }
  const absl::Duration period = std::clamp(shortest / 10, absl::Milliseconds(50), absl::Seconds(1));
  const int64_t idle = absl::ToInt64Nanoseconds(limits_.idle_timeout);
  const int64_t longest = absl::ToInt64Nanoseconds(limits_.max_duration);
  kvferry::MutexLock lock(&mu_);
  while (!mu_.AwaitWithTimeout(kvferry::Condition(this, &StreamWatchdog::stopping), period)) {
    const int64_t now = absl::GetCurrentTimeNanos();
    for (Watch* w : watched_) {
      if (w->expired_.load() != 0) continue;
      const bool long_lived = w->long_lived_.load();
      ErrorReason reason;
      if (idle > 0 && (!long_lived || w->idle_checked_.load()) && now - w->last_.load() > idle) {
        reason = ErrorReason::kStreamIdleTimeout;
      } else if (longest > 0 && !long_lived && now - w->start_ > longest) {
        reason = ErrorReason::kStreamTooLong;
      } else {
        continue;
      }
      int none = 0;
      if (!w->expired_.compare_exchange_strong(none, static_cast<int>(reason))) continue;
      w->context_->TryCancel();
      log::Info("stream cancelled: {} peer={}", ReasonName(reason), log::Quoted(w->context_->peer()));
      if (on_expired_) on_expired_(reason);
    }
  }
}

}  // namespace kvferry::server
