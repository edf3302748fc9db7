// Token file parsing and SHA-256.
#include "security/token_file.h"

#include <openssl/evp.h>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/errors.h"

namespace kvferry::server {
namespace {

absl::Status LineError(int line, absl::string_view what) {
  return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
               absl::StrCat("token file line ", line, ": ", what));
}

bool ValidTenant(absl::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    if (!(absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-')) {
      return false;
    }
  }
  return true;
}

bool ValidHash(absl::string_view hex) {
  if (hex.size() != 64) return false;
  for (char c : hex) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

// "8G" → 8 << 30; false when not a non-negative count or it overflows.
bool ParseAmount(absl::string_view text, int64_t* out) {
  int shift = 0;
  if (!text.empty()) {
    switch (absl::ascii_toupper(static_cast<unsigned char>(text.back()))) {
      case 'K': shift = 10; break;
      case 'M': shift = 20; break;
      case 'G': shift = 30; break;
      case 'T': shift = 40; break;
      default: break;
    }
    if (shift != 0) text.remove_suffix(1);
  }
  int64_t n;
  if (!absl::SimpleAtoi(text, &n) || n < 0 || n > (INT64_MAX >> shift)) return false;
  *out = n << shift;
  return true;
}

bool ResourceOf(absl::string_view key, Resource* out) {
  for (int i = 0; i < kNumResources; ++i) {
    if (key == ResourceName(static_cast<Resource>(i))) {
      *out = static_cast<Resource>(i);
      return true;
    }
  }
  return false;
}

}  // namespace

absl::StatusOr<TokenFile> ParseTokenFile(absl::string_view text) {
  TokenFile file;
  // Keys set so far per tenant, to refuse conflicting repeats.
  absl::flat_hash_map<std::string, TenantQuota> set;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line.front() == '#') continue;
    const std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (fields.size() < 2)
      return LineError(line_number, "expected '<tenant> <sha256 hex> [key=value ...]'");
    const std::string tenant(fields[0]);
    if (!ValidTenant(tenant)) {
      return LineError(line_number, "tenant must have 1 to 64 letters, digits, '_', '.', '-'");
    }
    if (!ValidHash(fields[1])) {
      return LineError(line_number, "the second field must be 64 hex digits (sha256 of the token)");
    }
    const std::string hash = absl::AsciiStrToLower(fields[1]);
    if (auto [it, inserted] = file.tenant_of_hash.try_emplace(hash, tenant); !inserted) {
      return LineError(line_number, "this token hash is already listed");
    }
    TenantQuota& quota = file.quotas[tenant];
    TenantQuota& given = set[tenant];  // kUnlimited where not given yet
    for (size_t i = 2; i < fields.size(); ++i) {
      const std::vector<absl::string_view> kv = absl::StrSplit(fields[i], absl::MaxSplits('=', 1));
      Resource resource;
      if (kv.size() != 2 || !ResourceOf(kv[0], &resource)) {
        return LineError(line_number,
                         "quota fields are key=value with key pools, pages, device_bytes, "
                         "streams or staged_write_bytes");
      }
      int64_t amount;
      if (!ParseAmount(kv[1], &amount)) {
        return LineError(
            line_number,
            absl::StrCat(ResourceName(resource), ": expected a count with optional K, M, G or T"));
      }
      if (given[resource] != TenantQuota::kUnlimited && given[resource] != amount) {
        return LineError(line_number, absl::StrCat(ResourceName(resource),
                                                   " differs from an earlier line of this tenant"));
      }
      given[resource] = amount;
      quota[resource] = amount;
    }
  }
  return file;
}

std::string Sha256Hex(absl::string_view data) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_Digest(data.data(), data.size(), digest, &length, EVP_sha256(), nullptr);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * length);
  for (unsigned int i = 0; i < length; ++i) {
    out += kHex[digest[i] >> 4];
    out += kHex[digest[i] & 15];
  }
  return out;
}

}  // namespace kvferry::server
