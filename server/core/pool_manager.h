// The daemon's pools by name, the backends they live on, and daemon-wide stats.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/pool.h"

namespace kvferry::server {

struct PoolManagerOptions {
  // Device of pools created without one: "cpu" or "cuda:N".
  std::string default_device = "cpu";
  // Receives device op timings (metrics); may be null.
  OpObserver* observer = nullptr;
  // Options of the backends made by MakeBackend.
  BackendOptions backend;
  // Makes the backend of a device; default MakeBackend (tests inject faults here).
  std::function<absl::StatusOr<std::shared_ptr<Backend>>(const std::string&)> make_backend;
};

// Thread-safe. Creating a pool (device allocation and zero-fill) holds no lock that other
// requests need: the name is reserved first, the pool built outside the lock. A deleted
// pool's memory is freed when the last request using it finishes; requests still running
// on it fail with ABORTED (POOL_DELETED) instead of storing into it.
class PoolManager {
 public:
  explicit PoolManager(PoolManagerOptions options);

  // INVALID_ARGUMENT (name, shape, device), ALREADY_EXISTS, RESOURCE_EXHAUSTED (memory).
  absl::StatusOr<std::shared_ptr<Pool>> Create(PoolConfig config, const std::string& device)
      ABSL_LOCKS_EXCLUDED(mu_);
  // NOT_FOUND when there is no such pool.
  absl::StatusOr<std::shared_ptr<Pool>> Get(const std::string& name) const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Delete(const std::string& name) ABSL_LOCKS_EXCLUDED(mu_);
  // Every pool, by name.
  std::vector<std::shared_ptr<Pool>> List() const ABSL_LOCKS_EXCLUDED(mu_);
  // Every pool's stats and the totals.
  DaemonStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);
  // Drops every pool (shutdown).
  void Clear() ABSL_LOCKS_EXCLUDED(mu_);
  // Called with each pool Delete removes (e.g. to revoke its exports). Set before serving.
  void SetDeleteListener(std::function<void(const Pool&)> listener) { on_delete_ = std::move(listener); }

  // The backend of a device ("cpu", "cuda:N"), made on first use.
  absl::StatusOr<std::shared_ptr<Backend>> BackendFor(const std::string& device)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  std::function<void(const Pool&)> on_delete_;
  const PoolManagerOptions options_;
  mutable absl::Mutex mu_;
  // A name maps to null while its pool is being created.
  absl::flat_hash_map<std::string, std::shared_ptr<Pool>> pools_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::shared_ptr<Backend>> backends_ ABSL_GUARDED_BY(mu_);
  uint64_t next_incarnation_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvferry::server
