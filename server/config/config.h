// kvferryd's configuration file: TOML whose top-level keys are the daemon's flags and whose
// [[pool]] tables are pools to create at start-up.
//
//   listen = "127.0.0.1:50051"        # any kvferryd flag, by its name, in its TOML type
//   cpu_threads = 8
//   [[pool]]
//   name = "lat"                      # required
//   layout = "v41"                    # required: v4, v41 or v41_fp4
//   num_pages = 4096                  # required
//   page_size = 64                    # default 64 tokens
//   num_layers = 61                   # default 1
//   device = "cuda:0"                 # default: the daemon's default device
//   tenant = "alice"                  # default: the default tenant (no --auth_tokens)
//
// The keys a file may set are found through Abseil's flag reflection, so a flag added to
// kvferryd is a config key without further code. Precedence: a flag given on the command
// line wins over the file, the file over the flag's default. Every error names the file,
// the line and the key. Not thread-safe against other users of the flags: call it at
// start-up, before other threads read them.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/types.h"

namespace kvferry::server::config {

// Which flags a file may set.
struct FlagScope {
  // Flags defined in this source file (the __FILE__ of their ABSL_FLAG) are the file's keys;
  // every other flag (Abseil's own --flagfile, a library's) is an unknown key.
  std::string defined_in;
  // Flags of that file a config file may not set (--config itself).
  std::vector<std::string> excluded;
  // True when the command line gave the flag: the file's value is still checked but not
  // applied. Unset: nothing was given on the command line.
  std::function<bool(std::string_view)> set_on_command_line;
};

// One top-level key: the flag's value as it would follow `--key=`.
struct FlagValue {
  std::string key;
  std::string value;
  int line = 0;
};

// One [[pool]] table, checked against the core's rules for a pool (Pool::ValidateConfig).
struct PoolSpec {
  PoolConfig config;
  std::string device;  // empty: the daemon's default device
  std::string tenant;  // empty: the default tenant
  int line = 0;        // of the [[pool]] header
};

struct ConfigFile {
  std::string path;
  std::vector<FlagValue> flags;  // in file order
  std::vector<PoolSpec> pools;   // in file order
};

// Reads and parses `path`. NOT_FOUND when it cannot be read; INVALID_ARGUMENT for TOML
// syntax, an unknown key, a value of the wrong TOML type, or a pool table that is
// incomplete or breaks a pool rule. Flag values are type-checked here and parsed by
// ApplyToFlags.
absl::StatusOr<ConfigFile> Load(const std::string& path, const FlagScope& scope);
// The same for text already read; `path` only names it in messages.
absl::StatusOr<ConfigFile> Parse(std::string_view text, const std::string& path,
                                 const FlagScope& scope);

// Sets every flag of `file` that the command line did not set, parsing each value as the
// command line would (an out-of-range integer, a bad double). Flags the command line set
// keep their value, but the file's value must still parse. INVALID_ARGUMENT naming the key
// and line of the first bad value; flags set before it stay set.
absl::Status ApplyToFlags(const ConfigFile& file, const FlagScope& scope);

// One flag's effective value and where it came from: "flag", "file" or "default".
struct Setting {
  std::string key;
  std::string value;  // "<redacted>" for a secret key with a value
  std::string source;
};

// Every flag in scope, by name, with its current value (call after ApplyToFlags). `file`
// may be null (no config file).
std::vector<Setting> Effective(const ConfigFile* file, const FlagScope& scope);

// Keys whose values are secrets themselves, never logged: names containing "password" or
// "secret", or ending in "_token", but not ending in "_file". Paths to files holding
// secrets (--tls_key, --auth_tokens, --peer_secret_file) are not secret.
bool IsSecretKey(std::string_view key);

}  // namespace kvferry::server::config
