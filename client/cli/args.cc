// Parsing of `--name value` options.
#include "args.h"

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kvferry/kernels/status_macros.h"

namespace kvferry::cli {

absl::StatusOr<Args> Args::Parse(const std::vector<std::string>& words,
                                 std::initializer_list<absl::string_view> allowed) {
  Args args;
  for (size_t i = 0; i < words.size(); i += 2) {
    const std::string& word = words[i];
    if (word.size() < 3 || word.rfind("--", 0) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", word, "'"));
    }
    std::string name = word.substr(2);
    if (std::find(allowed.begin(), allowed.end(), absl::string_view(name)) == allowed.end()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown option --", name));
    }
    if (i + 1 >= words.size()) {
      return absl::InvalidArgumentError(absl::StrCat("option --", name, " needs a value"));
    }
    if (!args.values_.emplace(name, words[i + 1]).second) {
      return absl::InvalidArgumentError(absl::StrCat("option --", name, " given twice"));
    }
  }
  return args;
}

absl::StatusOr<std::string> Args::Get(absl::string_view name) const {
  auto it = values_.find(name);
  if (it == values_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("missing option --", name));
  }
  return it->second;
}

absl::StatusOr<int64_t> Args::GetInt(absl::string_view name) const {
  KVF_ASSIGN_OR_RETURN(const std::string text, Get(name));
  int64_t value;
  if (!absl::SimpleAtoi(text, &value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("option --", name, " takes an integer, got '", text, "'"));
  }
  return value;
}

}  // namespace kvferry::cli
