// Tenant accounts: charges against quotas, refunds, the registry.
#include "core/tenant.h"

#include "absl/strings/str_cat.h"
#include "common/errors.h"
#include "kvferry/kernels/status_macros.h"

namespace kvferry::server {

const char* ResourceName(Resource resource) {
  switch (resource) {
    case Resource::kPools: return "pools";
    case Resource::kPages: return "pages";
    case Resource::kDeviceBytes: return "device_bytes";
    case Resource::kStreams: return "streams";
    case Resource::kStagedWriteBytes: return "staged_write_bytes";
  }
  return "unknown";
}

std::shared_ptr<TenantAccount> TenantAccount::DaemonWide(TenantQuota budget,
                                                        RefusalObserver on_refusal) {
  auto account = std::make_shared<TenantAccount>("", budget, nullptr, budget, std::move(on_refusal));
  account->daemon_wide_ = true;
  return account;
}

void TenantAccount::SetQuota(const TenantQuota& quota) {
  TenantQuota merged = quota;
  for (int i = 0; i < kNumResources; ++i) {
    if (merged.limit[i] == TenantQuota::kUnlimited) merged.limit[i] = defaults_.limit[i];
  }
  kvferry::MutexLock lock(&mu_);
  quota_ = merged;
}

absl::Status TenantAccount::ChargeOwn(Resource resource, int64_t amount) {
  const int i = static_cast<int>(resource);
  int64_t in_use = 0, limit = 0;
  {
    kvferry::MutexLock lock(&mu_);
    // Written so that no sum can overflow: the limit may be kUnlimited.
    if (amount <= quota_.limit[i] && used_[i] <= quota_.limit[i] - amount) {
      used_[i] += amount;
      return absl::OkStatus();
    }
    in_use = used_[i];
    limit = quota_.limit[i];
  }
  if (on_refusal_) on_refusal_(resource, daemon_wide_);
  if (daemon_wide_) {
    return Error(absl::StatusCode::kResourceExhausted, ErrorReason::kDaemonBudgetExhausted,
                 absl::StrCat("daemon budget exhausted: ", ResourceName(resource), " in use ",
                              in_use, " by all clients, asked ", amount, ", budget ", limit,
                              "; nothing was allocated, retry later"));
  }
  return Error(absl::StatusCode::kResourceExhausted, ErrorReason::kQuotaExceeded,
               absl::StrCat("quota exceeded: ", ResourceName(resource), " in use ", in_use,
                            ", asked ", amount, ", limit ", limit, "; free some to continue"));
}

absl::Status TenantAccount::Charge(Resource resource, int64_t amount) {
  KVF_RETURN_IF_ERROR(ChargeOwn(resource, amount));
  if (daemon_ != nullptr) {
    if (absl::Status s = daemon_->Charge(resource, amount); !s.ok()) {
      kvferry::MutexLock lock(&mu_);
      used_[static_cast<int>(resource)] -= amount;
      return s;
    }
  }
  return absl::OkStatus();
}

void TenantAccount::Refund(Resource resource, int64_t amount) {
  {
    kvferry::MutexLock lock(&mu_);
    used_[static_cast<int>(resource)] -= amount;
  }
  if (daemon_ != nullptr) daemon_->Refund(resource, amount);
}

int64_t TenantAccount::used(Resource resource) const {
  kvferry::MutexLock lock(&mu_);
  return used_[static_cast<int>(resource)];
}

int64_t TenantAccount::limit(Resource resource) const {
  kvferry::MutexLock lock(&mu_);
  return quota_.limit[static_cast<int>(resource)];
}

absl::StatusOr<ScopedCharge> ScopedCharge::Take(std::shared_ptr<TenantAccount> account,
                                                Resource resource, int64_t amount) {
  if (absl::Status s = account->Charge(resource, amount); !s.ok()) return s;
  ScopedCharge charge;
  charge.account_ = std::move(account);
  charge.resource_ = resource;
  charge.amount_ = amount;
  return charge;
}

ScopedCharge& ScopedCharge::operator=(ScopedCharge&& other) noexcept {
  if (this != &other) {
    if (account_) account_->Refund(resource_, amount_);
    account_ = std::move(other.account_);
    resource_ = other.resource_;
    amount_ = other.amount_;
    other.account_ = nullptr;
    other.amount_ = 0;
  }
  return *this;
}

ScopedCharge::~ScopedCharge() {
  if (account_) account_->Refund(resource_, amount_);
}

TenantRegistry::TenantRegistry(TenantLimits limits)
    : limits_(std::move(limits)),
      daemon_(TenantAccount::DaemonWide(limits_.daemon, limits_.on_refusal)) {}

std::shared_ptr<TenantAccount> TenantRegistry::Get(const std::string& name) {
  kvferry::MutexLock lock(&mu_);
  std::shared_ptr<TenantAccount>& account = accounts_[name];
  if (account == nullptr) {
    account = std::make_shared<TenantAccount>(name, limits_.per_tenant, daemon_,
                                              limits_.per_tenant, limits_.on_refusal);
  }
  return account;
}

}  // namespace kvferry::server
