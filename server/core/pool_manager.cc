// PoolManager: pools by tenant and name on their backends, incarnations, totals.
#include "core/pool_manager.h"

#include <algorithm>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/errors.h"
#include "common/log.h"
#include "kvferry/kernels/status_macros.h"
#include "kvferry/thread_name.h"

namespace kvferry::server {
namespace {

// The name is the client's: escaped and bounded (log::Quoted) before it is echoed.
absl::Status NotFound(const std::string& name) {
  return Error(absl::StatusCode::kNotFound, ErrorReason::kPoolNotFound,
               absl::StrCat("no pool named ", log::Quoted(name)));
}

}  // namespace

PoolManager::PoolManager(PoolManagerOptions options) : options_(std::move(options)) {
  // Incarnations start at a random point per daemon lifetime, so that a handle kept across
  // a restart is (almost surely) refused by a new pool of the same name as well.
  std::random_device random;
  kvferry::MutexLock lock(&mu_);
  next_incarnation_ = 1 + random() % (kMaxIncarnation - 1);
  if (options_.lease_check_period > absl::ZeroDuration()) {
    lease_thread_ = std::thread([this] {
      NameThisThread("kvf-leases");
      ExpireLeases();
    });
  }
}

PoolManager::~PoolManager() {
  {
    kvferry::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (lease_thread_.joinable()) lease_thread_.join();
}

void PoolManager::ExpireLeases() {
  while (true) {
    {
      kvferry::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(kvferry::Condition(this, &PoolManager::stopping),
                               options_.lease_check_period)) {
        return;
      }
    }
    const absl::Time now = absl::Now();
    for (const std::shared_ptr<Pool>& pool : List()) {
      if (const int64_t freed = pool->ExpireLeases(now); freed > 0) {
        log::Info("lease expired: {} pages of pool {} freed", freed, log::Quoted(pool->config().name));
      }
    }
  }
}

absl::StatusOr<std::shared_ptr<Backend>> PoolManager::BackendFor(const std::string& device) {
  {
    kvferry::MutexLock lock(&mu_);
    auto it = backends_.find(device);
    if (it != backends_.end()) return it->second;
  }
  KVF_ASSIGN_OR_RETURN(std::shared_ptr<Backend> backend,
                       options_.make_backend ? options_.make_backend(device)
                                              : MakeBackend(device, options_.backend));
  kvferry::MutexLock lock(&mu_);
  auto [it, made] = backends_.try_emplace(device, std::move(backend));
  if (made) it->second->set_release_listener(release_listener_);
  return it->second;
}

void PoolManager::SetReleaseListener(std::shared_ptr<ReleaseListener> listener) {
  kvferry::MutexLock lock(&mu_);
  release_listener_ = std::move(listener);
  for (auto& [device, backend] : backends_) backend->set_release_listener(release_listener_);
}

absl::StatusOr<std::shared_ptr<Pool>> PoolManager::Create(
    const std::shared_ptr<TenantAccount>& owner, PoolConfig config, const std::string& device) {
  KVF_RETURN_IF_ERROR(Pool::ValidateConfig(config));
  const Key key{owner->name(), config.name};
  uint64_t incarnation;
  {
    kvferry::MutexLock lock(&mu_);
    if (!pools_.try_emplace(key, nullptr).second) {
      return Error(absl::StatusCode::kAlreadyExists, ErrorReason::kPoolExists,
                   absl::StrCat("pool '", config.name, "' already exists"));
    }
    incarnation = next_incarnation_;
    next_incarnation_ = next_incarnation_ % kMaxIncarnation + 1;
  }
  // Built outside the lock: a large zero-fill must not stall every other request.
  absl::StatusOr<std::shared_ptr<Pool>> pool = [&]() -> absl::StatusOr<std::shared_ptr<Pool>> {
    KVF_ASSIGN_OR_RETURN(std::shared_ptr<Backend> backend,
                         BackendFor(device.empty() ? options_.default_device : device));
    return Pool::Create(config, std::move(backend), incarnation, options_.observer, owner);
  }();
  kvferry::MutexLock lock(&mu_);
  if (!pool.ok()) {
    pools_.erase(key);
    return pool.status();
  }
  pools_[key] = *pool;
  return pool;
}

absl::StatusOr<std::shared_ptr<Pool>> PoolManager::Get(const TenantAccount& owner,
                                                       const std::string& name) const {
  kvferry::ReaderMutexLock lock(&mu_);
  auto it = pools_.find(Key{owner.name(), name});
  if (it == pools_.end() || it->second == nullptr) return NotFound(name);
  return it->second;
}

absl::Status PoolManager::Delete(const TenantAccount& owner, const std::string& name) {
  std::shared_ptr<Pool> dropped;  // freed outside the lock, when its last user finishes
  {
    kvferry::MutexLock lock(&mu_);
    auto it = pools_.find(Key{owner.name(), name});
    if (it == pools_.end() || it->second == nullptr) return NotFound(name);
    dropped = std::move(it->second);
    pools_.erase(it);
  }
  dropped->MarkDeleted();
  if (on_delete_) on_delete_(*dropped);
  return absl::OkStatus();
}

std::vector<std::shared_ptr<Pool>> PoolManager::List() const {
  std::vector<std::shared_ptr<Pool>> pools;
  {
    kvferry::ReaderMutexLock lock(&mu_);
    for (const auto& [key, pool] : pools_) {
      if (pool != nullptr) pools.push_back(pool);
    }
  }
  auto key = [](const std::shared_ptr<Pool>& p) {
    return Key{p->owner() != nullptr ? p->owner()->name() : std::string(), p->config().name};
  };
  std::sort(pools.begin(), pools.end(),
            [&](const auto& a, const auto& b) { return key(a) < key(b); });
  return pools;
}

DaemonStats PoolManager::Stats() const { return StatsOf(List()); }

DaemonStats PoolManager::Stats(const TenantAccount& owner) const {
  std::vector<std::shared_ptr<Pool>> own = List();
  std::erase_if(own, [&](const std::shared_ptr<Pool>& p) {
    return p->owner() == nullptr || p->owner()->name() != owner.name();
  });
  return StatsOf(own);
}

DaemonStats PoolManager::StatsOf(const std::vector<std::shared_ptr<Pool>>& pools) const {
  DaemonStats out;
  for (const auto& pool : pools) {
    PoolStats s = pool->Stats();
    out.tokens_held += s.tokens_held;
    out.records_held += s.records_held;
    out.bytes_saved_vs_bf16 += s.bytes_saved_vs_bf16;
    out.bytes_saved_vs_v4 += s.bytes_saved_vs_v4;
    out.pool_bytes += s.pool_bytes;
    out.pools.push_back(std::move(s));
  }
  return out;
}

void PoolManager::Clear() {
  absl::flat_hash_map<Key, std::shared_ptr<Pool>> dropped;
  {
    kvferry::MutexLock lock(&mu_);
    dropped.swap(pools_);
  }
  for (auto& [key, pool] : dropped) {
    if (pool != nullptr) pool->MarkDeleted();
  }
}

}  // namespace kvferry::server
