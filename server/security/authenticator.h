// Who is calling: the tenant of every call, from its `authorization: Bearer <token>`.
#pragma once

#include <grpcpp/grpcpp.h>
#include <sys/stat.h>

#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kvferry/mutex.h"
#include "core/tenant.h"

namespace kvferry::server {

class Authenticator {
 public:
  virtual ~Authenticator() = default;
  // The caller's tenant; UNAUTHENTICATED (NOT_AUTHENTICATED) when it may not call.
  virtual absl::StatusOr<std::shared_ptr<TenantAccount>> Authenticate(
      const grpc::ServerContext& context) const = 0;
};

// No tokens: every caller is the one default tenant (named "").
class OpenAuthenticator final : public Authenticator {
 public:
  explicit OpenAuthenticator(std::shared_ptr<TenantAccount> tenant) : tenant_(std::move(tenant)) {}
  absl::StatusOr<std::shared_ptr<TenantAccount>> Authenticate(
      const grpc::ServerContext&) const override {
    return tenant_;
  }

 private:
  const std::shared_ptr<TenantAccount> tenant_;
};

struct TokenAuthOptions {
  std::string token_file;  // security/token_file.h describes it
  // How often the file is checked for a change (and re-read when it changed). Revoking a
  // token takes effect within this, or at once on Reload() (SIGHUP).
  double reload_seconds = 5;
};

// Tokens of a token file. A call's token is hashed (SHA-256) and looked up; the daemon
// keeps only the hashes. Thread-safe.
class TokenAuthenticator final : public Authenticator {
 public:
  // Reads the file (an invalid or unreadable file is an error) and starts watching it.
  static absl::StatusOr<std::unique_ptr<TokenAuthenticator>> Start(TokenAuthOptions options,
                                                                   TenantRegistry* tenants);
  ~TokenAuthenticator() override;

  absl::StatusOr<std::shared_ptr<TenantAccount>> Authenticate(
      const grpc::ServerContext& context) const override ABSL_LOCKS_EXCLUDED(mu_);

  // Re-reads the file now. On an error the tokens in force stay as they were (a bad edit
  // must not lock every client out, nor keep a revoked token) and the error is returned.
  absl::Status Reload() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  TokenAuthenticator(TokenAuthOptions options, TenantRegistry* tenants)
      : options_(std::move(options)), tenants_(tenants) {}
  void Watch() ABSL_LOCKS_EXCLUDED(mu_);

  // What identifies one version of the file (rewritten in place or replaced by a rename).
  struct FileVersion {
    dev_t device = 0;
    ino_t inode = 0;
    off_t size = -1;
    int64_t mtime_ns = -1;
    bool operator==(const FileVersion&) const = default;
  };
  FileVersion CurrentVersion() const;

  const TokenAuthOptions options_;
  TenantRegistry* const tenants_;
  mutable kvferry::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<TenantAccount>> tenant_of_hash_
      ABSL_GUARDED_BY(mu_);
  FileVersion loaded_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  kvferry::Mutex reload_mu_;  // one reload at a time (watcher and SIGHUP)
  std::thread watcher_;
};

}  // namespace kvferry::server
