// libFuzzer: the token file parser (an operator's file, re-read while the daemon runs).
// Beyond not crashing: an accepted file maps every token hash to a tenant that has a
// quota entry, and a refusal never quotes a token hash (64 hex digits) from the file.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/ascii.h"
#include "security/token_file.h"

namespace {

bool QuotesAHash(const std::string& message, const std::string& text) {
  for (size_t i = 0; i + 64 <= text.size(); ++i) {
    bool hex = true;
    for (size_t k = 0; k < 64 && hex; ++k) hex = absl::ascii_isxdigit(text[i + k]);
    if (hex && message.find(text.substr(i, 64)) != std::string::npos) return true;
  }
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  const auto parsed = kvferry::server::ParseTokenFile(text);
  if (!parsed.ok()) {
    if (parsed.status().code() != absl::StatusCode::kInvalidArgument) {
      std::fprintf(stderr, "refused with %s\n", parsed.status().ToString().c_str());
      std::abort();
    }
    if (QuotesAHash(std::string(parsed.status().message()), text)) {
      std::fprintf(stderr, "a refusal quotes a token hash\n");
      std::abort();
    }
    return 0;
  }
  for (const auto& [hash, tenant] : parsed->tenant_of_hash) {
    if (hash.size() != 64 || !parsed->quotas.contains(tenant)) {
      std::fprintf(stderr, "accepted hash of %zu characters or tenant without quota\n", hash.size());
      std::abort();
    }
  }
  return 0;
}
