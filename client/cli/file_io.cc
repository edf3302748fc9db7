// Whole-file reads and atomic writes.
#include "file_io.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "kvferry/kernels/status_macros.h"

namespace kvferry::cli {

absl::StatusOr<std::vector<uint8_t>> ReadFileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  }
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading ", path));
  return bytes;
}

template <typename T>
absl::StatusOr<std::vector<T>> ReadFileArray(const std::string& path) {
  if constexpr (std::is_same_v<T, uint8_t>) return ReadFileBytes(path);
  KVF_ASSIGN_OR_RETURN(const std::vector<uint8_t> bytes, ReadFileBytes(path));
  if (bytes.size() % sizeof(T) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, " holds ", bytes.size(),
                                                   " bytes, not a multiple of ", sizeof(T)));
  }
  std::vector<T> values(bytes.size() / sizeof(T));
  std::memcpy(values.data(), bytes.data(), bytes.size());
  return values;
}

template absl::StatusOr<std::vector<uint8_t>> ReadFileArray<uint8_t>(const std::string&);
template absl::StatusOr<std::vector<uint16_t>> ReadFileArray<uint16_t>(const std::string&);
template absl::StatusOr<std::vector<int64_t>> ReadFileArray<int64_t>(const std::string&);

absl::Status WriteFileBytes(const std::string& path, std::span<const uint8_t> bytes) {
  const std::string temp = path + ".tmp";
  std::FILE* f = std::fopen(temp.c_str(), "wb");
  if (f == nullptr) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot create ", temp, ": ", std::strerror(errno)));
  }
  const size_t written = std::fwrite(bytes.data(), 1, bytes.size(), f);
  const bool closed = std::fclose(f) == 0;
  if (written != bytes.size() || !closed || std::rename(temp.c_str(), path.c_str()) != 0) {
    std::remove(temp.c_str());
    return absl::DataLossError(absl::StrCat("cannot write ", path, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace kvferry::cli
