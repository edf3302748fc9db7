// TOML config file → flag values and start-up pools, through toml++ and Abseil's flag
// reflection.
#include "config/config.h"

#include <toml++/toml.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "core/pool.h"

namespace kvferry::server::config {
namespace {

absl::Status KeyError(const std::string& path, int line, absl::string_view key,
                      absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ":", line, ": key '", key, "': ", what));
}

int LineOf(const toml::source_region& region) { return static_cast<int>(region.begin.line); }

const char* TypeName(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::string: return "a string";
    case toml::node_type::integer: return "an integer";
    case toml::node_type::floating_point: return "a float";
    case toml::node_type::boolean: return "a boolean";
    case toml::node_type::table: return "a table";
    case toml::node_type::array: return "an array";
    case toml::node_type::date:
    case toml::node_type::time:
    case toml::node_type::date_time: return "a date or time";
    default: return "nothing";
  }
}

// Shortest text that reads back as the same double.
std::string DoubleText(double x) {
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), x);
  return std::string(buffer, result.ptr);
}

// Abseil reports a flag's file normalized (leading '/' dropped, or a prefix cut by a
// usage config): a flag is of `defined_in` when its reported file is a whole-component
// suffix of it.
bool DefinedIn(const absl::CommandLineFlag& flag, std::string_view defined_in) {
  const std::string file = flag.Filename();
  return !file.empty() && defined_in.ends_with(file) &&
         (file.size() == defined_in.size() || file.front() == '/' ||
          defined_in[defined_in.size() - file.size() - 1] == '/');
}

bool InScope(const absl::CommandLineFlag& flag, const FlagScope& scope) {
  const std::string name(flag.Name());
  return DefinedIn(flag, scope.defined_in) &&
         std::find(scope.excluded.begin(), scope.excluded.end(), name) == scope.excluded.end();
}

absl::string_view AbslView(std::string_view s) { return absl::string_view(s.data(), s.size()); }

const absl::CommandLineFlag* ScopedFlag(std::string_view key, const FlagScope& scope) {
  const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(AbslView(key));
  return flag != nullptr && !flag->IsRetired() && InScope(*flag, scope) ? flag : nullptr;
}

// The flag text of `node` for `flag`, or what was expected instead.
absl::StatusOr<std::string> FlagText(const absl::CommandLineFlag& flag, const toml::node& node) {
  const toml::node_type type = node.type();
  if (flag.IsOfType<bool>()) {
    if (type != toml::node_type::boolean) return absl::InvalidArgumentError("expected a boolean");
    return std::string(*node.value<bool>() ? "true" : "false");
  }
  if (flag.IsOfType<int32_t>() || flag.IsOfType<int64_t>() || flag.IsOfType<uint32_t>() ||
      flag.IsOfType<uint64_t>() || flag.IsOfType<int16_t>() || flag.IsOfType<uint16_t>()) {
    if (type != toml::node_type::integer) return absl::InvalidArgumentError("expected an integer");
    return absl::StrCat(*node.value<int64_t>());
  }
  if (flag.IsOfType<double>() || flag.IsOfType<float>()) {
    if (type == toml::node_type::integer) return absl::StrCat(*node.value<int64_t>());
    if (type != toml::node_type::floating_point) return absl::InvalidArgumentError("expected a number");
    return DoubleText(*node.value<double>());
  }
  // Strings, and every other flag type in its command-line spelling (e.g. a duration "5s").
  if (type != toml::node_type::string) return absl::InvalidArgumentError("expected a string");
  return std::string(*node.value<std::string_view>());
}

// One [[pool]] table.
absl::StatusOr<PoolSpec> ParsePool(const toml::table& table, const std::string& path) {
  PoolSpec spec;
  spec.line = LineOf(table.source());
  std::set<std::string> seen;
  for (auto&& entry : table) {
    // Not a structured binding: the lambdas below capture it (clang 14 cannot).
    const toml::key& key = entry.first;
    const toml::node& node = entry.second;
    const std::string name(key.str());
    const int line = LineOf(key.source());
    const std::string qualified = absl::StrCat("pool.", name);
    auto text = [&]() -> absl::StatusOr<std::string> {
      if (!node.is_string()) {
        return KeyError(path, line, qualified, absl::StrCat("expected a string, got ", TypeName(node)));
      }
      return std::string(*node.value<std::string_view>());
    };
    auto integer = [&]() -> absl::StatusOr<int64_t> {
      if (!node.is_integer()) {
        return KeyError(path, line, qualified, absl::StrCat("expected an integer, got ", TypeName(node)));
      }
      return *node.value<int64_t>();
    };
    auto small = [&](int* out) -> absl::Status {
      absl::StatusOr<int64_t> v = integer();
      if (!v.ok()) return v.status();
      if (*v < 0 || *v > (int64_t{1} << 30)) {
        return KeyError(path, line, qualified, absl::StrCat(*v, " is out of range"));
      }
      *out = static_cast<int>(*v);
      return absl::OkStatus();
    };
    absl::Status status;
    if (name == "name" || name == "device" || name == "tenant") {
      absl::StatusOr<std::string> v = text();
      if (!v.ok()) return v.status();
      (name == "name" ? spec.config.name : name == "device" ? spec.device : spec.tenant) = *v;
    } else if (name == "layout") {
      absl::StatusOr<std::string> v = text();
      if (!v.ok()) return v.status();
      if (!ParseLayoutName(*v, &spec.config.layout)) {
        return KeyError(path, line, qualified,
                        absl::StrCat("unknown layout '", *v, "': expected v4, v41 or v41_fp4"));
      }
    } else if (name == "num_pages") {
      absl::StatusOr<int64_t> v = integer();
      if (!v.ok()) return v.status();
      spec.config.num_pages = *v;
    } else if (name == "page_size") {
      status = small(&spec.config.page_size);
    } else if (name == "num_layers") {
      status = small(&spec.config.num_layers);
    } else {
      return KeyError(path, line, qualified,
                      "unknown key (a pool has name, layout, num_pages, page_size, num_layers, "
                      "device, tenant)");
    }
    if (!status.ok()) return status;
    seen.insert(name);
  }
  for (const char* required : {"name", "layout", "num_pages"}) {
    if (!seen.contains(required)) {
      return KeyError(path, spec.line, absl::StrCat("pool.", required), "missing in this [[pool]]");
    }
  }
  if (absl::Status s = Pool::ValidateConfig(spec.config); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ":", spec.line, ": pool '", spec.config.name, "': ", s.message()));
  }
  return spec;
}

}  // namespace

absl::StatusOr<ConfigFile> Load(const std::string& path, const FlagScope& scope) {
  std::error_code error;
  if (std::filesystem::is_directory(path, error)) {
    // A directory opens and reads as an empty, valid document.
    return absl::NotFoundError(absl::StrCat("cannot read config file '", path, "': Is a directory"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("cannot read config file '", path, "': ", std::strerror(errno)));
  }
  std::stringstream text;
  text << in.rdbuf();
  if (in.bad()) {
    return absl::NotFoundError(
        absl::StrCat("cannot read config file '", path, "': ", std::strerror(errno)));
  }
  return Parse(text.str(), path, scope);
}

absl::StatusOr<ConfigFile> Parse(std::string_view text, const std::string& path,
                                 const FlagScope& scope) {
  toml::table root;
  try {
    root = toml::parse(text, path);
  } catch (const toml::parse_error& error) {
    return absl::InvalidArgumentError(absl::StrCat(path, ":", error.source().begin.line, ":",
                                                   error.source().begin.column, ": ",
                                                   std::string(error.description())));
  }
  ConfigFile file;
  file.path = path;
  for (auto&& [key, node] : root) {
    const std::string name(key.str());
    const int line = LineOf(key.source());
    if (name == "pool") {
      const toml::array* pools = node.as_array();
      if (pools == nullptr || !pools->is_array_of_tables()) {
        return KeyError(path, line, name, "expected [[pool]] tables");
      }
      for (const toml::node& pool : *pools) {
        absl::StatusOr<PoolSpec> spec = ParsePool(*pool.as_table(), path);
        if (!spec.ok()) return spec.status();
        for (const PoolSpec& earlier : file.pools) {
          if (earlier.config.name == spec->config.name && earlier.tenant == spec->tenant) {
            return absl::InvalidArgumentError(absl::StrCat(
                path, ":", spec->line, ": pool '", spec->config.name,
                "' is already defined at line ", earlier.line));
          }
        }
        file.pools.push_back(*std::move(spec));
      }
      continue;
    }
    const absl::CommandLineFlag* flag = ScopedFlag(name, scope);
    if (flag == nullptr) {
      return KeyError(path, line, name, "unknown key (not a kvferryd flag)");
    }
    absl::StatusOr<std::string> value = FlagText(*flag, node);
    if (!value.ok()) {
      return KeyError(path, line, name,
                      absl::StrCat(value.status().message(), ", got ", TypeName(node)));
    }
    file.flags.push_back(FlagValue{name, *std::move(value), line});
  }
  return file;
}

absl::Status ApplyToFlags(const ConfigFile& file, const FlagScope& scope) {
  for (const FlagValue& v : file.flags) {
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(v.key);
    if (flag == nullptr || !InScope(*flag, scope)) {
      return KeyError(file.path, v.line, v.key, "unknown key (not a kvferryd flag)");
    }
    const bool keep = scope.set_on_command_line && scope.set_on_command_line(v.key);
    // Abseil parses without storing only through ParseFrom: a command-line value is put back.
    const std::string previous = flag->CurrentValue();
    std::string error;
    if (!flag->ParseFrom(v.value, &error)) {
      return KeyError(file.path, v.line, v.key,
                      absl::StrCat("bad value '", IsSecretKey(v.key) ? "<redacted>" : v.value,
                                   "': ", error));
    }
    if (keep && !flag->ParseFrom(previous, &error)) {
      return absl::InternalError(absl::StrCat("cannot restore --", v.key, ": ", error));
    }
  }
  return absl::OkStatus();
}

std::vector<Setting> Effective(const ConfigFile* file, const FlagScope& scope) {
  std::vector<Setting> out;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (flag->IsRetired() || !InScope(*flag, scope)) continue;
    const std::string key(name);
    std::string source = "default";
    if (scope.set_on_command_line && scope.set_on_command_line(key)) {
      source = "flag";
    } else if (file != nullptr &&
               std::any_of(file->flags.begin(), file->flags.end(),
                           [&](const FlagValue& v) { return v.key == key; })) {
      source = "file";
    }
    std::string value = flag->CurrentValue();
    if (IsSecretKey(key) && !value.empty()) value = "<redacted>";
    out.push_back(Setting{key, std::move(value), std::move(source)});
  }
  std::sort(out.begin(), out.end(),
            [](const Setting& a, const Setting& b) { return a.key < b.key; });
  return out;
}

bool IsSecretKey(std::string_view key) {
  // A path names where a secret is kept (peer_secret_file, password_file), not the secret.
  if (key.ends_with("_file")) return false;
  return key.find("password") != std::string_view::npos ||
         key.find("secret") != std::string_view::npos || key.ends_with("_token");
}

}  // namespace kvferry::server::config
