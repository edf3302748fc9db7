#include "security/peer_secret.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/errors.h"
#include "common/files.h"
#include "kvferry/kernels/status_macros.h"

namespace kvferry::server {
namespace {

void AppendU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void AppendField(std::string& out, std::string_view field) {
  AppendU64(out, field.size());
  out.append(field);
}

}  // namespace

absl::StatusOr<std::string> ReadPeerSecret(const std::string& path) {
  KVF_ASSIGN_OR_RETURN(std::string secret, ReadFile(path, "the peer secret file"));
  absl::StripTrailingAsciiWhitespace(&secret);
  if (secret.size() < kMinPeerSecretBytes) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                 absl::StrCat("the peer secret file '", path, "' holds ", secret.size(),
                              " bytes; a peer secret has at least ", kMinPeerSecretBytes,
                              " (e.g. `openssl rand -hex 32`)"));
  }
  return secret;
}

absl::StatusOr<std::string> PeerNonce() {
  std::string nonce(16, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(nonce.data()),
                 static_cast<int>(nonce.size())) != 1) {
    // Only when OpenSSL cannot seed its generator; a predictable nonce would let a recorded
    // ready be replayed, so nothing is offered without one.
    return Error(absl::StatusCode::kInternal, ErrorReason::kInternalError,
                 "no random nonce for the offer: OpenSSL's generator failed");
  }
  return nonce;
}

std::string PeerReadyMac(std::string_view secret, std::string_view nonce, uint64_t transfer_id,
                         std::string_view worker_address, std::string_view host,
                         std::string_view transport, std::span<const std::string> lane_addresses) {
  std::string message = "kvferry peer ready v1";
  AppendField(message, nonce);
  AppendU64(message, transfer_id);
  AppendField(message, worker_address);
  AppendField(message, host);
  AppendField(message, transport);
  for (const std::string& address : lane_addresses) AppendField(message, address);
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
       reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac, &length);
  return std::string(reinterpret_cast<const char*>(mac), length);
}

bool PeerReadyMacMatches(std::string_view mac, std::string_view secret, std::string_view nonce,
                         uint64_t transfer_id, std::string_view worker_address,
                         std::string_view host, std::string_view transport,
                         std::span<const std::string> lane_addresses) {
  const std::string want =
      PeerReadyMac(secret, nonce, transfer_id, worker_address, host, transport, lane_addresses);
  return mac.size() == want.size() && CRYPTO_memcmp(mac.data(), want.data(), want.size()) == 0;
}

}  // namespace kvferry::server
