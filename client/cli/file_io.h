// Whole-file reads and writes for the offline format tools.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvferry::cli {

absl::StatusOr<std::vector<uint8_t>> ReadFileBytes(const std::string& path);

// Reads a file of little-endian elements of `element_size` bytes; error when the length is
// not a multiple of it.
template <typename T>
absl::StatusOr<std::vector<T>> ReadFileArray(const std::string& path);

// Writes through a temporary file and a rename, so a failed write leaves no partial file.
absl::Status WriteFileBytes(const std::string& path, std::span<const uint8_t> bytes);

}  // namespace kvferry::cli
