// Bearer tokens against the token file's hashes; the file watched for changes.
#include "security/authenticator.h"

#include <fstream>
#include <iterator>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/errors.h"
#include "common/log.h"
#include "kvferry/thread_name.h"
#include "security/token_file.h"

namespace kvferry::server {
namespace {

absl::Status Unauthenticated(absl::string_view why) {
  return Error(absl::StatusCode::kUnauthenticated, ErrorReason::kNotAuthenticated, why);
}

// A bearer token is far shorter; anything longer is refused before it is hashed.
constexpr size_t kMaxTokenBytes = 4096;

}  // namespace

absl::StatusOr<std::unique_ptr<TokenAuthenticator>> TokenAuthenticator::Start(
    TokenAuthOptions options, TenantRegistry* tenants) {
  std::unique_ptr<TokenAuthenticator> auth(new TokenAuthenticator(std::move(options), tenants));
  if (absl::Status s = auth->Reload(); !s.ok()) return s;
  auth->watcher_ = std::thread([raw = auth.get()] {
    NameThisThread("kvf-token-files");
    raw->Watch();
  });
  return auth;
}

TokenAuthenticator::~TokenAuthenticator() {
  {
    kvferry::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (watcher_.joinable()) watcher_.join();
}

TokenAuthenticator::FileVersion TokenAuthenticator::CurrentVersion() const {
  struct stat st;
  if (stat(options_.token_file.c_str(), &st) != 0) return FileVersion{};
  return FileVersion{st.st_dev, st.st_ino, st.st_size,
                     int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec};
}

absl::Status TokenAuthenticator::Reload() {
  kvferry::MutexLock one_reload(&reload_mu_);
  const FileVersion version = CurrentVersion();
  absl::StatusOr<TokenFile> file = [&]() -> absl::StatusOr<TokenFile> {
    std::ifstream in(options_.token_file);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (!in.is_open() || in.bad()) {
      return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                   absl::StrCat("cannot read the token file ", options_.token_file));
    }
    return ParseTokenFile(text);
  }();
  if (!file.ok()) {
    // Remember this version all the same: it is not retried until it changes again.
    kvferry::MutexLock lock(&mu_);
    loaded_ = version;
    return file.status();
  }
  absl::flat_hash_map<std::string, std::shared_ptr<TenantAccount>> tenant_of_hash;
  for (const auto& [hash, tenant] : file->tenant_of_hash) {
    std::shared_ptr<TenantAccount> account = tenants_->Get(tenant);
    account->SetQuota(file->quotas[tenant]);
    tenant_of_hash.emplace(hash, std::move(account));
  }
  const size_t count = tenant_of_hash.size();
  {
    kvferry::MutexLock lock(&mu_);
    tenant_of_hash_.swap(tenant_of_hash);
    loaded_ = version;
  }
  log::Info("token file loaded tokens={} tenants={}", count, file->quotas.size());
  return absl::OkStatus();
}

void TokenAuthenticator::Watch() {
  const absl::Duration period = absl::Seconds(options_.reload_seconds);
  while (true) {
    FileVersion loaded;
    {
      kvferry::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(kvferry::Condition(&stop_), period);
      if (stop_) return;
      loaded = loaded_;
    }
    if (CurrentVersion() == loaded) continue;
    if (absl::Status s = Reload(); !s.ok()) {
      log::Error("token file not reloaded, the previous tokens stay in force: {}",
                 std::string(s.message()));
    }
  }
}

absl::StatusOr<std::shared_ptr<TenantAccount>> TokenAuthenticator::Authenticate(
    const grpc::ServerContext& context) const {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end())
    return Unauthenticated("missing 'authorization: Bearer <token>' metadata");
  const absl::string_view value(it->second.data(), it->second.size());
  constexpr absl::string_view kScheme = "bearer ";
  if (value.size() <= kScheme.size() || value.size() > kScheme.size() + kMaxTokenBytes ||
      !absl::StartsWithIgnoreCase(value, kScheme)) {
    return Unauthenticated("authorization metadata must be 'Bearer <token>'");
  }
  const std::string hash = Sha256Hex(value.substr(kScheme.size()));
  kvferry::ReaderMutexLock lock(&mu_);
  auto found = tenant_of_hash_.find(hash);
  if (found == tenant_of_hash_.end()) return Unauthenticated("the token is not valid");
  return found->second;
}

}  // namespace kvferry::server
