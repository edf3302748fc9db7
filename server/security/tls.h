// Transport security of the listeners: TLS / mutual TLS credentials with certificate files
// re-read when they change, and the rule that plaintext stays on loopback.
#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

struct ssl_ctx_st;  // OpenSSL's SSL_CTX

namespace kvferry::server {

struct TlsOptions {
  std::string cert_file;       // server certificate chain (PEM); empty: plaintext
  std::string key_file;        // its private key (PEM); needed with cert_file
  std::string client_ca_file;  // mutual TLS: clients must present a certificate it signed
  // How often the files are checked; a change is served to new connections from then on,
  // open connections and streams keep theirs.
  int reload_seconds = 10;
  // Plaintext on an address other than loopback; off by default, since anyone reaching
  // the port could then read and overwrite every pool.
  bool allow_insecure_remote = false;
};

// True for 127.0.0.0/8, [::1], localhost and unix sockets.
bool IsLoopback(const std::string& address);

// The gRPC credentials of `listen`: TLS (mutual when client_ca_file is set) when cert_file
// is set, else plaintext — refused (FAILED_PRECONDITION, saying why) off loopback unless
// allow_insecure_remote. INVALID_ARGUMENT when a file is missing, unreadable, not PEM, or
// the key does not match the certificate: checked here so that a daemon that would fail
// every handshake does not start.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
    const std::string& listen, const TlsOptions& options);

// The same TLS for an HTTPS endpoint (/metrics): sets up an SSL_CTX whose handshakes use
// the files' current contents (re-read every reload_seconds when they changed; a change
// that does not load keeps the previous ones), requiring a client certificate signed by
// client_ca_file when it is set. Call after ServerCredentials() accepted the options.
std::function<bool(ssl_ctx_st&)> HttpsSetup(const TlsOptions& options);

// The plaintext rule alone, for a listener that has no TLS (`what` names it in the error).
absl::Status CheckPlaintextAllowed(const std::string& what, const std::string& address,
                                   bool allow_insecure_remote);

}  // namespace kvferry::server
