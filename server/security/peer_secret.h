// The secret the daemons of one deployment share, and what it proves between them.
//
// A transfer's receiver answers the sender's offer with a ready that names its UCX worker
// address, and the sender connects to that address. UCX trusts a worker address fully: a
// forged one crashes the process that unpacks it. Whoever can open a peer stream (any
// tenant with a token, or a server at a Push's `to_address`, which the client names) could
// forge one, so a sender connects only to an address the ready proves with the secret:
//
//   mac = HMAC-SHA256(secret, "kvferry peer ready v1" ‖ nonce ‖ transfer id ‖ worker
//         address ‖ host ‖ transports ‖ lane address 1 ‖ lane address 2 ‖ ...), each
//         variable-length field preceded by its length (a ready of one lane has none)
//
// where the nonce is the sender's, fresh in each offer: a mac proves that a daemon holding
// the secret made this ready, for this offer. A daemon asked to answer an offer only signs
// its own worker addresses, so answering offers lends no forger a mac for another address.
#pragma once

#include <span>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvferry::server {

// Shortest secret accepted, in bytes.
inline constexpr size_t kMinPeerSecretBytes = 16;

// The secret in `path`: its bytes with trailing whitespace (a final newline) removed.
// INVALID_ARGUMENT when it cannot be read or is shorter than kMinPeerSecretBytes; the
// message never quotes the file.
absl::StatusOr<std::string> ReadPeerSecret(const std::string& path);

// A fresh random nonce for an offer (16 bytes from OpenSSL's generator).
absl::StatusOr<std::string> PeerNonce();

// The mac of a ready, as above.
std::string PeerReadyMac(std::string_view secret, std::string_view nonce, uint64_t transfer_id,
                         std::string_view worker_address, std::string_view host,
                         std::string_view transport,
                         std::span<const std::string> lane_addresses = {});

// Whether `mac` is the mac of that ready (compared in constant time).
bool PeerReadyMacMatches(std::string_view mac, std::string_view secret, std::string_view nonce,
                         uint64_t transfer_id, std::string_view worker_address,
                         std::string_view host, std::string_view transport,
                         std::span<const std::string> lane_addresses = {});

}  // namespace kvferry::server
