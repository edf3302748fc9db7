// EventLog: per-tenant numbered ring of block events, readers that wait with a timeout.
#include "core/event_log.h"

#include <utility>

namespace kvferry::server {

void EventLog::Append(const std::string& tenant, BlockEvent event) {
  kvferry::MutexLock lock(&mu_);
  TenantLog& log = logs_[tenant];
  event.sequence = ++log.last;
  log.events.push_back(std::move(event));
  while (static_cast<int64_t>(log.events.size()) > capacity_) log.events.pop_front();
}

uint64_t EventLog::sequence(const std::string& tenant) const {
  kvferry::ReaderMutexLock lock(&mu_);
  auto it = logs_.find(tenant);
  return it == logs_.end() ? 0 : it->second.last;
}

EventLog::ReadResult EventLog::Read(const std::string& tenant, uint64_t after, size_t max,
                                    absl::Duration wait, std::vector<BlockEvent>* out,
                                    uint64_t* latest) {
  kvferry::MutexLock lock(&mu_);
  TenantLog& log = logs_[tenant];
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return closed_ || log.last != after; };
  mu_.AwaitWithTimeout(kvferry::Condition(&ready), wait);
  *latest = log.last;
  if (closed_) return ReadResult::kClosed;
  if (after > log.last) return ReadResult::kLost;
  if (after == log.last) return ReadResult::kTimeout;
  const uint64_t oldest = log.events.empty() ? log.last + 1 : log.events.front().sequence;
  if (after + 1 < oldest) return ReadResult::kLost;
  for (size_t i = after + 1 - oldest; i < log.events.size() && out->size() < max; ++i) {
    out->push_back(log.events[i]);
  }
  return ReadResult::kEvents;
}

void EventLog::Close() {
  kvferry::MutexLock lock(&mu_);
  closed_ = true;
}

}  // namespace kvferry::server
