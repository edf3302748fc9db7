// TLS credentials (gRPC's file-watching provider) and the plaintext-on-loopback rule.
#include "security/tls.h"

#include <arpa/inet.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <openssl/ssl.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/errors.h"

namespace kvferry::server {
namespace {

absl::Status Invalid(absl::string_view what) {
  return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest, what);
}

// Loads the files the way the handshakes will, so that bad files fail the start.
absl::Status CheckFiles(const TlsOptions& o) {
  std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)> ctx(SSL_CTX_new(TLS_server_method()),
                                                        &SSL_CTX_free);
  if (ctx == nullptr) return Invalid("TLS: cannot create an OpenSSL context");
  if (SSL_CTX_use_certificate_chain_file(ctx.get(), o.cert_file.c_str()) != 1) {
    return Invalid(absl::StrCat("--tls_cert ", o.cert_file, ": not a readable PEM certificate"));
  }
  if (SSL_CTX_use_PrivateKey_file(ctx.get(), o.key_file.c_str(), SSL_FILETYPE_PEM) != 1) {
    return Invalid(absl::StrCat("--tls_key ", o.key_file, ": not a readable PEM private key"));
  }
  if (SSL_CTX_check_private_key(ctx.get()) != 1) {
    return Invalid("--tls_key does not match --tls_cert");
  }
  if (!o.client_ca_file.empty() &&
      SSL_CTX_load_verify_locations(ctx.get(), o.client_ca_file.c_str(), nullptr) != 1) {
    return Invalid(
        absl::StrCat("--tls_client_ca ", o.client_ca_file, ": not a readable PEM certificate"));
  }
  return absl::OkStatus();
}

}  // namespace

bool IsLoopback(const std::string& address) {
  if (absl::StartsWith(address, "unix:") || absl::StartsWith(address, "unix-abstract:"))
    return true;
  absl::string_view rest = address;
  if (absl::StartsWith(rest, "ipv4:") || absl::StartsWith(rest, "ipv6:")) rest.remove_prefix(5);
  const size_t colon = rest.rfind(':');
  if (colon == absl::string_view::npos) return false;
  std::string host(rest.substr(0, colon));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host == "localhost") return true;
  in_addr v4;
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6;
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1) return IN6_IS_ADDR_LOOPBACK(&v6);
  return false;  // any other name may resolve to anything
}

absl::Status CheckPlaintextAllowed(const std::string& what, const std::string& address,
                                   bool allow_insecure_remote) {
  if (IsLoopback(address) || allow_insecure_remote) return absl::OkStatus();
  return Error(absl::StatusCode::kFailedPrecondition, ErrorReason::kInvalidRequest,
               absl::StrCat("refusing to serve ", what, " in plaintext on ", address,
                            ", which is not loopback: anyone who reaches it could read, "
                            "overwrite or delete every pool. Give --tls_cert and --tls_key "
                            "(and --auth_tokens), listen on 127.0.0.1, or pass "
                            "--allow_insecure_remote to accept the risk"));
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
    const std::string& listen, const TlsOptions& options) {
  if (options.cert_file.empty()) {
    if (!options.key_file.empty() || !options.client_ca_file.empty()) {
      return Invalid("--tls_key and --tls_client_ca need --tls_cert");
    }
    if (absl::Status s = CheckPlaintextAllowed("gRPC", listen, options.allow_insecure_remote);
        !s.ok()) {
      return s;
    }
    return grpc::InsecureServerCredentials();
  }
  if (options.key_file.empty()) return Invalid("--tls_cert needs --tls_key");
  if (absl::Status s = CheckFiles(options); !s.ok()) return s;
  const unsigned int refresh = static_cast<unsigned int>(std::max(1, options.reload_seconds));
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      options.key_file, options.cert_file, options.client_ca_file, refresh);
  grpc::experimental::TlsServerCredentialsOptions tls(provider);
  tls.watch_identity_key_cert_pairs();
  if (options.client_ca_file.empty()) {
    tls.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  } else {
    tls.watch_root_certs();
    tls.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  }
  return grpc::experimental::TlsServerCredentials(tls);
}

}  // namespace kvferry::server
