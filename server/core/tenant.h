// Tenants: who owns pools, and the quotas their resources are charged against.
//
// A tenant is a name (from the token file; the empty name is the one default tenant of a
// daemon without tokens) and an account: for each resource, what is in use and the limit.
// Pools charge their creation (pools, device bytes) and their allocated pages; staged
// writes charge their staging bytes; the service charges each open stream. Everything is
// refunded when it is released, so a tenant at its limit recovers by freeing. No gRPC.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kvferry/mutex.h"

namespace kvferry::server {

enum class Resource {
  kPools,             // pools that exist (a deleted pool counts until its memory is freed)
  kPages,             // pages allocated, over all the tenant's pools
  kDeviceBytes,       // device memory of the tenant's pools
  kStreams,           // streaming calls open at once
  kStagedWriteBytes,  // host staging held by writes in flight
};
inline constexpr int kNumResources = 5;

// The key of a resource in the token file ("device_bytes").
const char* ResourceName(Resource resource);

// Limits per resource; kUnlimited where none is set.
struct TenantQuota {
  static constexpr int64_t kUnlimited = std::numeric_limits<int64_t>::max();
  std::array<int64_t, kNumResources> limit = {kUnlimited, kUnlimited, kUnlimited, kUnlimited,
                                              kUnlimited};
  int64_t& operator[](Resource r) { return limit[static_cast<int>(r)]; }
  int64_t operator[](Resource r) const { return limit[static_cast<int>(r)]; }
};

// Called with each refused charge: the resource, and whether the daemon-wide budget (true)
// or the tenant's own quota (false) refused it. Must not call back into the account.
using RefusalObserver = std::function<void(Resource, bool daemon_wide)>;

// Thread-safe.
class TenantAccount {
 public:
  // A tenant. Every charge is also taken from `daemon` (may be null), the account of the
  // budgets all tenants share: a charge either fits both or takes nothing. `defaults`: the
  // limits SetQuota() uses for each resource it leaves unlimited.
  explicit TenantAccount(std::string name, TenantQuota quota = {},
                         std::shared_ptr<TenantAccount> daemon = nullptr,
                         TenantQuota defaults = {}, RefusalObserver on_refusal = {})
      : name_(std::move(name)), daemon_(std::move(daemon)), defaults_(defaults),
        on_refusal_(std::move(on_refusal)), quota_(quota) {}
  // The daemon-wide account: its refusals are DAEMON_BUDGET_EXHAUSTED, not QUOTA_EXCEEDED.
  static std::shared_ptr<TenantAccount> DaemonWide(TenantQuota budget, RefusalObserver on_refusal);

  const std::string& name() const { return name_; }
  // New limits apply to later charges; what is in use stays (it may now exceed them).
  // A resource left unlimited in `quota` takes its limit from the account's defaults.
  void SetQuota(const TenantQuota& quota) ABSL_LOCKS_EXCLUDED(mu_);

  // Takes `amount` of `resource`, or nothing: RESOURCE_EXHAUSTED (QUOTA_EXCEEDED) when it
  // would pass the tenant's limit, (DAEMON_BUDGET_EXHAUSTED) when it would pass the
  // daemon-wide budget. The message names the resource and numbers, not the tenant.
  absl::Status Charge(Resource resource, int64_t amount) ABSL_LOCKS_EXCLUDED(mu_);
  void Refund(Resource resource, int64_t amount) ABSL_LOCKS_EXCLUDED(mu_);
  int64_t used(Resource resource) const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t limit(Resource resource) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::Status ChargeOwn(Resource resource, int64_t amount) ABSL_LOCKS_EXCLUDED(mu_);

  const std::string name_;
  const std::shared_ptr<TenantAccount> daemon_;
  const TenantQuota defaults_;
  const RefusalObserver on_refusal_;
  bool daemon_wide_ = false;  // set once by DaemonWide(), before the account is shared
  mutable kvferry::Mutex mu_;
  TenantQuota quota_ ABSL_GUARDED_BY(mu_);
  std::array<int64_t, kNumResources> used_ ABSL_GUARDED_BY(mu_) = {};
};

// A charge refunded when it is destroyed (a stream's slot). Movable.
class ScopedCharge {
 public:
  ScopedCharge() = default;
  // Charges `amount`; the error of Charge() when over the quota.
  static absl::StatusOr<ScopedCharge> Take(std::shared_ptr<TenantAccount> account,
                                           Resource resource, int64_t amount);
  ScopedCharge(ScopedCharge&& other) noexcept { *this = std::move(other); }
  ScopedCharge& operator=(ScopedCharge&& other) noexcept;
  ~ScopedCharge();

 private:
  std::shared_ptr<TenantAccount> account_;
  Resource resource_ = Resource::kStreams;
  int64_t amount_ = 0;
};

// What bounds the tenants of a daemon.
struct TenantLimits {
  // Budgets of all tenants together (the daemon-wide account); kUnlimited where none.
  TenantQuota daemon;
  // The quota of each tenant where the token file gives none (without a token file: of the
  // one default tenant, i.e. of all callers together).
  TenantQuota per_tenant;
  // Told of every refused charge (metrics); may be empty.
  RefusalObserver on_refusal;
};

// Every tenant's account, by name; accounts live as long as the registry (a tenant whose
// token is revoked keeps its pools, unreachable until a token names it again). Thread-safe.
class TenantRegistry {
 public:
  explicit TenantRegistry(TenantLimits limits = {});
  // The account of `name`, created with the per-tenant defaults on first use.
  std::shared_ptr<TenantAccount> Get(const std::string& name) ABSL_LOCKS_EXCLUDED(mu_);
  // The daemon-wide account every tenant's charges are also taken from.
  const std::shared_ptr<TenantAccount>& daemon() const { return daemon_; }

 private:
  const TenantLimits limits_;
  const std::shared_ptr<TenantAccount> daemon_;
  kvferry::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<TenantAccount>> accounts_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvferry::server
