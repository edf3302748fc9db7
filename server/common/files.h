// Reading a small file the daemon was pointed at (a token, a secret, a certificate).
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvferry::server {

// The bytes of the file at `path`; INVALID_ARGUMENT "cannot read <what> '<path>'" when it
// cannot be opened or read. The message never quotes the file.
absl::StatusOr<std::string> ReadFile(const std::string& path, absl::string_view what);

}  // namespace kvferry::server
