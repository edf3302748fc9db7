// Minimal `--name value` parsing for the kvferry command's subcommands.
//
// Written by hand rather than with absl flags: absl flags are process-global, and each
// subcommand here has its own small set of required options.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <map>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"

namespace kvferry::cli {

class Args {
 public:
  // Parses argv-style `--name value` pairs. Fails on a positional word, an unknown name,
  // a repeated name or a missing value. `allowed` lists the names the subcommand takes.
  static absl::StatusOr<Args> Parse(const std::vector<std::string>& words,
                                    std::initializer_list<absl::string_view> allowed);

  // The value of a required option; error when absent.
  absl::StatusOr<std::string> Get(absl::string_view name) const;
  // A required option parsed as a base-10 integer.
  absl::StatusOr<int64_t> GetInt(absl::string_view name) const;

 private:
  std::map<std::string, std::string, std::less<>> values_;
};

}  // namespace kvferry::cli
