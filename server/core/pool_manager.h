// The daemon's pools by name, and the backends they live on.
#pragma once

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
};

// Thread-safe. A deleted pool's memory is freed when the last request using it finishes.
class PoolManager {
 public:
  explicit PoolManager(PoolManagerOptions options) : options_(std::move(options)) {}

  // INVALID_ARGUMENT (name, shape, device), ALREADY_EXISTS, RESOURCE_EXHAUSTED (memory).
  absl::StatusOr<std::shared_ptr<Pool>> Create(PoolConfig config, const std::string& device)
      ABSL_LOCKS_EXCLUDED(mu_);
  // NOT_FOUND when there is no such pool.
  absl::StatusOr<std::shared_ptr<Pool>> Get(const std::string& name) const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Delete(const std::string& name) ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<std::shared_ptr<Pool>> List() const ABSL_LOCKS_EXCLUDED(mu_);
  // Drops every pool (shutdown).
  void Clear() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::StatusOr<std::shared_ptr<Backend>> BackendFor(const std::string& device)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const PoolManagerOptions options_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Pool>> pools_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::shared_ptr<Backend>> backends_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvferry::server
