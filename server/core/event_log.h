// The cache's event log: BlockStored / BlockRemoved per tenant, numbered, for routers.
//
// Every tenant has its own sequence (1, 2, ...) so that a router, which sees only its own
// tenant's events, can tell a gap from another tenant's traffic. The log keeps the last
// `capacity` events of each tenant; a reader asking for older ones learns that they are
// lost (and resynchronizes from a snapshot). The publisher id names this daemon lifetime:
// after a restart sequences start again under another id. Thread-safe; the block index
// appends while it holds its own lock, so a snapshot taken under that lock is exactly the
// state after the sequence it reports.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/node_hash_map.h"
#include "absl/time/time.h"
#include "kvferry/mutex.h"

namespace kvferry::server {

struct BlockEvent {
  enum class Kind : uint8_t { kStored = 1, kRemoved = 2 };
  // Why a block was removed.
  enum class Cause : uint8_t { kNone = 0, kEvicted, kNamespaceDeleted, kPoolDeleted, kShutdown };
  uint64_t sequence = 0;
  Kind kind = Kind::kStored;
  Cause cause = Cause::kNone;
  std::string name_space;  // the namespace's name
  std::string key;
  std::string pool;        // the member pool holding the block
  std::string tier;        // where its bytes live: the pool's device ("cpu", "cuda:0")
};

class EventLog {
 public:
  EventLog(uint64_t publisher_id, int64_t capacity)
      : publisher_id_(publisher_id), capacity_(capacity) {}

  uint64_t publisher_id() const { return publisher_id_; }
  // Numbers `event` in its tenant's sequence and keeps it.
  void Append(const std::string& tenant, BlockEvent event) ABSL_LOCKS_EXCLUDED(mu_);
  // The tenant's last sequence number (0: none yet).
  uint64_t sequence(const std::string& tenant) const ABSL_LOCKS_EXCLUDED(mu_);

  enum class ReadResult { kEvents, kTimeout, kLost, kClosed };
  // The tenant's events after `after`, at most `max`, waiting up to `wait` for one to come.
  // kLost when the event after `after` is no longer kept (or `after` is in the future);
  // kClosed once Close() was called. `*latest` is the tenant's last sequence number.
  ReadResult Read(const std::string& tenant, uint64_t after, size_t max, absl::Duration wait,
                  std::vector<BlockEvent>* out, uint64_t* latest) ABSL_LOCKS_EXCLUDED(mu_);
  // Wakes every reader with kClosed (shutdown).
  void Close() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct TenantLog {
    uint64_t last = 0;              // sequence of the newest event
    std::deque<BlockEvent> events;  // the newest `capacity_`, oldest first
  };

  const uint64_t publisher_id_;
  const int64_t capacity_;
  mutable kvferry::Mutex mu_;
  absl::node_hash_map<std::string, TenantLog> logs_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvferry::server
