// The daemon's pools by tenant and name, the backends they live on, and daemon-wide stats.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/synchronization/mutex.h"
#include "kvferry/mutex.h"
#include "core/pool.h"
#include "core/tenant.h"

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
  // How often leased pages past their lease are freed; zero: never (no thread).
  absl::Duration lease_check_period = absl::Milliseconds(500);
};

// Thread-safe. Creating a pool (device allocation and zero-fill) holds no lock that other
// requests need: the name is reserved first, the pool built outside the lock. A deleted
// pool's memory is freed when the last request using it finishes; requests still running
// on it fail with ABORTED (POOL_DELETED) instead of storing into it.
//
// Pools are namespaced by tenant: a pool is named by (owner, name), so two tenants may each
// have a pool "p", and a tenant asking for another's pool gets NOT_FOUND exactly as for a
// name nobody uses (the other pool's existence is not revealed).
class PoolManager {
 public:
  explicit PoolManager(PoolManagerOptions options);
  ~PoolManager();

  // INVALID_ARGUMENT (name, shape, device), ALREADY_EXISTS (the owner has a pool of that
  // name), RESOURCE_EXHAUSTED (memory, or the owner's quota: QUOTA_EXCEEDED).
  absl::StatusOr<std::shared_ptr<Pool>> Create(const std::shared_ptr<TenantAccount>& owner,
                                               PoolConfig config, const std::string& device)
      ABSL_LOCKS_EXCLUDED(mu_);
  // NOT_FOUND when the owner has no such pool.
  absl::StatusOr<std::shared_ptr<Pool>> Get(const TenantAccount& owner,
                                            const std::string& name) const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Delete(const TenantAccount& owner, const std::string& name)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Every pool of every tenant, by tenant and name.
  std::vector<std::shared_ptr<Pool>> List() const ABSL_LOCKS_EXCLUDED(mu_);
  // Every pool's stats and the totals (the metrics endpoint).
  DaemonStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);
  // The owner's pools' stats and their totals.
  DaemonStats Stats(const TenantAccount& owner) const ABSL_LOCKS_EXCLUDED(mu_);
  // Drops every pool (shutdown).
  void Clear() ABSL_LOCKS_EXCLUDED(mu_);
  // Called with each pool Delete removes (e.g. to revoke its exports). Set before serving.
  void SetDeleteListener(std::function<void(const Pool&)> listener) { on_delete_ = std::move(listener); }

  // Told of every allocation each backend, made already or later, frees
  // (Backend::set_release_listener).
  void SetReleaseListener(std::shared_ptr<ReleaseListener> listener) ABSL_LOCKS_EXCLUDED(mu_);

  // The backend of a device ("cpu", "cuda:N"), made on first use.
  absl::StatusOr<std::shared_ptr<Backend>> BackendFor(const std::string& device)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // (tenant name, pool name)
  using Key = std::pair<std::string, std::string>;
  DaemonStats StatsOf(const std::vector<std::shared_ptr<Pool>>& pools) const;

  // Frees expired leases of every pool each lease_check_period until stop_.
  void ExpireLeases() ABSL_LOCKS_EXCLUDED(mu_);
  bool stopping() const ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stop_; }

  std::function<void(const Pool&)> on_delete_;
  const PoolManagerOptions options_;
  mutable kvferry::Mutex mu_;
  // A key maps to null while its pool is being created.
  absl::flat_hash_map<Key, std::shared_ptr<Pool>> pools_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::shared_ptr<Backend>> backends_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<ReleaseListener> release_listener_ ABSL_GUARDED_BY(mu_);
  uint64_t next_incarnation_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread lease_thread_;
};

}  // namespace kvferry::server
