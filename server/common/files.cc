#include "common/files.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/errors.h"

namespace kvferry::server {

absl::StatusOr<std::string> ReadFile(const std::string& path, absl::string_view what) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (!in) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                 absl::StrCat("cannot read ", what, " '", path, "'"));
  }
  return text.str();
}

}  // namespace kvferry::server
