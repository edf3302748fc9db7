// The token file: which token hash belongs to which tenant, and each tenant's quotas.
//
// One line per token: `<tenant> <sha256 hex of the token> [key=value ...]`, where a key is
// a resource of core/tenant.h (pools, pages, device_bytes, streams, staged_write_bytes)
// and a value is a count with an optional binary suffix K, M, G or T (8G = 8 << 30).
// Blank lines and lines starting with '#' are skipped. A tenant may have several tokens
// (several lines, e.g. while rotating one); its quotas are the keys of all its lines, and a
// key given twice with different values is an error. The daemon never sees a token in the
// clear: callers' tokens are hashed and compared with these hashes.
#pragma once

#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/tenant.h"

namespace kvferry::server {

struct TokenFile {
  absl::flat_hash_map<std::string, std::string> tenant_of_hash;  // sha256 hex → tenant
  absl::flat_hash_map<std::string, TenantQuota> quotas;          // tenant → quota
};

// INVALID_ARGUMENT naming the line number and what is wrong with it; the message never
// quotes a line (it holds a token hash).
absl::StatusOr<TokenFile> ParseTokenFile(absl::string_view text);

// Lower-case hex SHA-256 of `data`.
std::string Sha256Hex(absl::string_view data);

}  // namespace kvferry::server
