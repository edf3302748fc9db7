// TLS credentials (gRPC's file-watching provider) and the plaintext-on-loopback rule.
#include "security/tls.h"

#include <arpa/inet.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <sys/stat.h>

#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kvferry/mutex.h"
#include "absl/time/clock.h"
#include "common/errors.h"
#include "common/log.h"

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

// A file's identity and change time: a different value means the file was rewritten.
std::string FileVersion(const std::string& path) {
  struct stat st;
  if (path.empty() || stat(path.c_str(), &st) != 0) return "";
  return absl::StrCat(st.st_dev, ":", st.st_ino, ":", st.st_size, ":", st.st_mtim.tv_sec, ".",
                      st.st_mtim.tv_nsec);
}

// The certificate, key and client CA of an HTTPS endpoint, loaded from their files and
// installed on each connection during its handshake (OpenSSL's certificate callback), so
// that a rotation reaches new connections without touching open ones. Thread-safe.
class CertificateFiles {
 public:
  explicit CertificateFiles(TlsOptions options) : options_(std::move(options)) {}

  // Loads the files if they changed since the last load (checked at most every
  // reload_seconds); false while nothing could ever be loaded.
  bool Refresh() ABSL_LOCKS_EXCLUDED(mu_) {
    kvferry::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    if (loaded_ != nullptr && now < next_check_) return true;
    next_check_ = now + absl::Seconds(std::max(1, options_.reload_seconds));
    const std::string version = FileVersion(options_.cert_file) + "|" +
                                FileVersion(options_.key_file) + "|" +
                                FileVersion(options_.client_ca_file);
    if (loaded_ != nullptr && version == version_) return true;
    if (std::shared_ptr<Loaded> fresh = Load(); fresh != nullptr) {
      loaded_ = std::move(fresh);
      version_ = version;
    } else {
      log::Error("metrics TLS: the certificate files do not load; the previous ones stay");
    }
    return loaded_ != nullptr;
  }

  // Installs the current certificate chain, key and client CA store on `ssl`.
  bool Apply(SSL* ssl) ABSL_LOCKS_EXCLUDED(mu_) {
    if (!Refresh()) return false;
    std::shared_ptr<Loaded> l;
    {
      kvferry::MutexLock lock(&mu_);
      l = loaded_;
    }
    if (SSL_use_certificate(ssl, l->cert.get()) != 1 ||
        SSL_use_PrivateKey(ssl, l->key.get()) != 1 || SSL_set1_chain(ssl, l->chain.get()) != 1) {
      return false;
    }
    return l->client_ca == nullptr || SSL_set1_verify_cert_store(ssl, l->client_ca.get()) == 1;
  }

 private:
  struct Loaded {
    std::shared_ptr<X509> cert;
    std::shared_ptr<STACK_OF(X509)> chain;
    std::shared_ptr<EVP_PKEY> key;
    std::shared_ptr<X509_STORE> client_ca;
  };

  std::shared_ptr<Loaded> Load() const {
    auto l = std::make_shared<Loaded>();
    std::unique_ptr<BIO, decltype(&BIO_free)> certs(BIO_new_file(options_.cert_file.c_str(), "r"),
                                                    &BIO_free);
    std::unique_ptr<BIO, decltype(&BIO_free)> key(BIO_new_file(options_.key_file.c_str(), "r"),
                                                  &BIO_free);
    if (certs == nullptr || key == nullptr) return nullptr;
    l->cert.reset(PEM_read_bio_X509(certs.get(), nullptr, nullptr, nullptr), &X509_free);
    l->chain.reset(sk_X509_new_null(), [](STACK_OF(X509) * s) { sk_X509_pop_free(s, X509_free); });
    while (X509* extra = PEM_read_bio_X509(certs.get(), nullptr, nullptr, nullptr)) {
      sk_X509_push(l->chain.get(), extra);
    }
    l->key.reset(PEM_read_bio_PrivateKey(key.get(), nullptr, nullptr, nullptr), &EVP_PKEY_free);
    if (l->cert == nullptr || l->key == nullptr || X509_check_private_key(l->cert.get(), l->key.get()) != 1) {
      return nullptr;
    }
    if (!options_.client_ca_file.empty()) {
      l->client_ca.reset(X509_STORE_new(), &X509_STORE_free);
      if (X509_STORE_load_file(l->client_ca.get(), options_.client_ca_file.c_str()) != 1) {
        return nullptr;
      }
    }
    return l;
  }

  const TlsOptions options_;
  kvferry::Mutex mu_;
  std::shared_ptr<Loaded> loaded_ ABSL_GUARDED_BY(mu_);
  std::string version_ ABSL_GUARDED_BY(mu_);
  absl::Time next_check_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::function<bool(ssl_ctx_st&)> HttpsSetup(const TlsOptions& options) {
  auto files = std::make_shared<CertificateFiles>(options);
  return [files, mutual = !options.client_ca_file.empty()](SSL_CTX& ctx) {
    if (!files->Refresh()) return false;
    SSL_CTX_set_min_proto_version(&ctx, TLS1_2_VERSION);
    // The callback owns a reference to the files for as long as the context lives.
    auto* held = new std::shared_ptr<CertificateFiles>(files);
    SSL_CTX_set_cert_cb(
        &ctx, [](SSL* ssl, void* arg) {
          return (*static_cast<std::shared_ptr<CertificateFiles>*>(arg))->Apply(ssl) ? 1 : 0;
        },
        held);
    static const int index = SSL_CTX_get_ex_new_index(
        0, nullptr, nullptr, nullptr, [](void*, void* ptr, CRYPTO_EX_DATA*, int, long, void*) {
          delete static_cast<std::shared_ptr<CertificateFiles>*>(ptr);
        });
    SSL_CTX_set_ex_data(&ctx, index, held);
    if (mutual) {
      SSL_CTX_set_verify(&ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
    }
    return true;
  };
}

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
