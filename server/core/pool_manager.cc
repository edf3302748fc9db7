// PoolManager: named pools on their backends.
#include "core/pool_manager.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kvferry/kernels/status_macros.h"

namespace kvferry::server {
namespace {

absl::Status ValidateName(const std::string& name) {
  if (name.empty() || name.size() > 128) {
    return absl::InvalidArgumentError("pool name must have 1 to 128 characters");
  }
  for (char c : name) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-')) {
      return absl::InvalidArgumentError(
          absl::StrCat("pool name '", name, "' may only use letters, digits, '_', '.', '-'"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<Backend>> PoolManager::BackendFor(const std::string& device) {
  auto it = backends_.find(device);
  if (it != backends_.end()) return it->second;
  KVF_ASSIGN_OR_RETURN(std::shared_ptr<Backend> backend, MakeBackend(device));
  backends_[device] = backend;
  return backend;
}

absl::StatusOr<std::shared_ptr<Pool>> PoolManager::Create(PoolConfig config,
                                                          const std::string& device) {
  KVF_RETURN_IF_ERROR(ValidateName(config.name));
  absl::MutexLock lock(&mu_);
  if (pools_.contains(config.name)) {
    return absl::AlreadyExistsError(absl::StrCat("pool '", config.name, "' already exists"));
  }
  KVF_ASSIGN_OR_RETURN(std::shared_ptr<Backend> backend,
                       BackendFor(device.empty() ? options_.default_device : device));
  KVF_ASSIGN_OR_RETURN(std::shared_ptr<Pool> pool,
                       Pool::Create(config, std::move(backend), options_.observer));
  pools_[config.name] = pool;
  return pool;
}

absl::StatusOr<std::shared_ptr<Pool>> PoolManager::Get(const std::string& name) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = pools_.find(name);
  if (it == pools_.end()) return absl::NotFoundError(absl::StrCat("no pool named '", name, "'"));
  return it->second;
}

absl::Status PoolManager::Delete(const std::string& name) {
  std::shared_ptr<Pool> dropped;  // freed outside the lock
  absl::MutexLock lock(&mu_);
  auto it = pools_.find(name);
  if (it == pools_.end()) return absl::NotFoundError(absl::StrCat("no pool named '", name, "'"));
  dropped = std::move(it->second);
  pools_.erase(it);
  return absl::OkStatus();
}

std::vector<std::shared_ptr<Pool>> PoolManager::List() const {
  absl::ReaderMutexLock lock(&mu_);
  std::vector<std::shared_ptr<Pool>> pools;
  for (const auto& [name, pool] : pools_) pools.push_back(pool);
  std::sort(pools.begin(), pools.end(),
            [](const auto& a, const auto& b) { return a->config().name < b->config().name; });
  return pools;
}

void PoolManager::Clear() {
  absl::flat_hash_map<std::string, std::shared_ptr<Pool>> dropped;
  {
    absl::MutexLock lock(&mu_);
    dropped.swap(pools_);
  }
}

}  // namespace kvferry::server
