// Tenant accounts: charges against quotas, refunds, the registry.
#include "core/tenant.h"

#include "absl/strings/str_cat.h"
#include "common/errors.h"

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

void TenantAccount::SetQuota(const TenantQuota& quota) {
  absl::MutexLock lock(&mu_);
  quota_ = quota;
}

absl::Status TenantAccount::Charge(Resource resource, int64_t amount) {
  const int i = static_cast<int>(resource);
  absl::MutexLock lock(&mu_);
  // Written so that no sum can overflow: the limit may be kUnlimited.
  if (amount > quota_.limit[i] || used_[i] > quota_.limit[i] - amount) {
    return Error(
        absl::StatusCode::kResourceExhausted, ErrorReason::kQuotaExceeded,
        absl::StrCat("quota exceeded: ", ResourceName(resource), " in use ", used_[i], ", asked ",
                     amount, ", limit ", quota_.limit[i], "; free some to continue"));
  }
  used_[i] += amount;
  return absl::OkStatus();
}

void TenantAccount::Refund(Resource resource, int64_t amount) {
  absl::MutexLock lock(&mu_);
  used_[static_cast<int>(resource)] -= amount;
}

int64_t TenantAccount::used(Resource resource) const {
  absl::MutexLock lock(&mu_);
  return used_[static_cast<int>(resource)];
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

std::shared_ptr<TenantAccount> TenantRegistry::Get(const std::string& name) {
  absl::MutexLock lock(&mu_);
  std::shared_ptr<TenantAccount>& account = accounts_[name];
  if (account == nullptr) account = std::make_shared<TenantAccount>(name);
  return account;
}

}  // namespace kvferry::server
