// The config file loader: every error names the file, line and key; flag > file > default.
#include "config/config.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <map>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

// The flags a test config may set: one of each type kvferryd's flags use.
ABSL_FLAG(std::string, t_listen, "127.0.0.1:1", "test string flag");
ABSL_FLAG(int32_t, t_threads, 3, "test int32 flag");
ABSL_FLAG(int64_t, t_bytes, 1 << 20, "test int64 flag");
ABSL_FLAG(double, t_grace, 10, "test double flag");
ABSL_FLAG(bool, t_insecure, false, "test bool flag");
ABSL_FLAG(std::string, t_api_token, "", "test secret flag");
ABSL_FLAG(std::string, t_config, "", "test excluded flag");

namespace kvferry::server::config {
namespace {

using ::testing::HasSubstr;

class ConfigTest : public ::testing::Test {
 protected:
  ConfigTest() { scope_ = {.defined_in = __FILE__, .excluded = {"t_config"}}; }
  // Every test starts from the defaults and leaves them behind.
  absl::FlagSaver saver_;
  FlagScope scope_;

  absl::StatusOr<ConfigFile> Parse(std::string_view text) {
    return config::Parse(text, "kvferryd.toml", scope_);
  }
  // Parse, then apply; the first error of either.
  absl::Status Apply(std::string_view text) {
    absl::StatusOr<ConfigFile> file = Parse(text);
    return file.ok() ? ApplyToFlags(*file, scope_) : file.status();
  }
};

// Expects an INVALID_ARGUMENT whose message has each of `parts`.
void ExpectError(const absl::Status& s, std::initializer_list<std::string_view> parts) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  for (std::string_view part : parts) EXPECT_THAT(std::string(s.message()), HasSubstr(part));
}

TEST_F(ConfigTest, SetsEveryFlagTypeFromItsTomlType) {
  ASSERT_TRUE(Apply(R"(
t_listen = "0.0.0.0:50051"
t_threads = 8
t_bytes = 1073741824
t_grace = 2.5
t_insecure = true
)").ok());
  EXPECT_EQ(absl::GetFlag(FLAGS_t_listen), "0.0.0.0:50051");
  EXPECT_EQ(absl::GetFlag(FLAGS_t_threads), 8);
  EXPECT_EQ(absl::GetFlag(FLAGS_t_bytes), int64_t{1} << 30);
  EXPECT_EQ(absl::GetFlag(FLAGS_t_grace), 2.5);
  EXPECT_TRUE(absl::GetFlag(FLAGS_t_insecure));
}

TEST_F(ConfigTest, DoubleFlagTakesAnIntegerAndKeepsEveryDigitOfAFloat) {
  ASSERT_TRUE(Apply("t_grace = 7").ok());
  EXPECT_EQ(absl::GetFlag(FLAGS_t_grace), 7.0);
  ASSERT_TRUE(Apply("t_grace = 0.1234567890123").ok());
  EXPECT_EQ(absl::GetFlag(FLAGS_t_grace), 0.1234567890123);
}

TEST_F(ConfigTest, AbsentKeysKeepTheirDefaults) {
  ASSERT_TRUE(Apply("t_threads = 8\n").ok());
  EXPECT_EQ(absl::GetFlag(FLAGS_t_listen), "127.0.0.1:1");
  EXPECT_EQ(absl::GetFlag(FLAGS_t_bytes), 1 << 20);
}

TEST_F(ConfigTest, CommandLineWinsButTheFileValueIsStillChecked) {
  absl::SetFlag(&FLAGS_t_threads, 5);  // as the command line would have
  scope_.set_on_command_line = [](std::string_view name) { return name == "t_threads"; };
  ASSERT_TRUE(Apply("t_threads = 8\nt_bytes = 4096\n").ok());
  EXPECT_EQ(absl::GetFlag(FLAGS_t_threads), 5);
  EXPECT_EQ(absl::GetFlag(FLAGS_t_bytes), 4096);
  // A bad file value fails even though the command line overrides it.
  ExpectError(Apply("\nt_threads = 99999999999\n"), {"kvferryd.toml:2:", "'t_threads'", "99999999999"});
  EXPECT_EQ(absl::GetFlag(FLAGS_t_threads), 5);
}

TEST_F(ConfigTest, EffectiveNamesEachFlagsSourceAndRedactsSecrets) {
  absl::SetFlag(&FLAGS_t_threads, 5);
  scope_.set_on_command_line = [](std::string_view name) { return name == "t_threads"; };
  absl::StatusOr<ConfigFile> file = Parse("t_bytes = 4096\nt_api_token = \"hunter2\"\n");
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_TRUE(ApplyToFlags(*file, scope_).ok());
  std::map<std::string, Setting> by_key;
  for (const Setting& s : Effective(&*file, scope_)) by_key[s.key] = s;
  // Every flag of this file but the excluded one, nothing of Abseil's own.
  EXPECT_EQ(by_key.size(), 6u);
  EXPECT_FALSE(by_key.contains("t_config"));
  EXPECT_FALSE(by_key.contains("flagfile"));
  EXPECT_EQ(by_key["t_threads"].source, "flag");
  EXPECT_EQ(by_key["t_threads"].value, "5");
  EXPECT_EQ(by_key["t_bytes"].source, "file");
  EXPECT_EQ(by_key["t_bytes"].value, "4096");
  EXPECT_EQ(by_key["t_listen"].source, "default");
  EXPECT_EQ(by_key["t_api_token"].value, "<redacted>");
  EXPECT_EQ(by_key["t_api_token"].source, "file");
  // Without a file, and with no secret set, nothing is redacted and nothing is "file".
  absl::SetFlag(&FLAGS_t_api_token, "");
  for (const Setting& s : Effective(nullptr, scope_)) {
    EXPECT_NE(s.source, "file") << s.key;
    EXPECT_NE(s.value, "<redacted>") << s.key;
  }
}

TEST_F(ConfigTest, SecretKeys) {
  EXPECT_TRUE(IsSecretKey("api_token"));
  EXPECT_TRUE(IsSecretKey("db_password"));
  EXPECT_TRUE(IsSecretKey("client_secret"));
  EXPECT_FALSE(IsSecretKey("auth_tokens"));  // a path to the token file
  EXPECT_FALSE(IsSecretKey("tls_key"));      // a path to the key file
  EXPECT_FALSE(IsSecretKey("peer_secret_file"));  // a path to the secret, not the secret
  EXPECT_FALSE(IsSecretKey("peer_token_file"));
}

TEST_F(ConfigTest, UnknownKeyNamesKeyAndLine) {
  ExpectError(Apply("t_threads = 1\n\nt_lisen = \"x\"\n"), {"kvferryd.toml:3:", "'t_lisen'", "unknown key"});
}

TEST_F(ConfigTest, AbseilsOwnAndExcludedFlagsAreUnknownKeys) {
  ExpectError(Apply("flagfile = \"/etc/x\""), {"kvferryd.toml:1:", "'flagfile'", "unknown key"});
  ExpectError(Apply("t_config = \"other.toml\""), {"'t_config'", "unknown key"});
}

TEST_F(ConfigTest, WrongTomlTypeNamesExpectedAndGiven) {
  ExpectError(Apply("t_listen = 50051"), {"kvferryd.toml:1:", "'t_listen'", "expected a string, got an integer"});
  ExpectError(Apply("t_threads = \"8\""), {"'t_threads'", "expected an integer, got a string"});
  ExpectError(Apply("t_threads = 8.5"), {"'t_threads'", "expected an integer, got a float"});
  ExpectError(Apply("t_grace = \"fast\""), {"'t_grace'", "expected a number, got a string"});
  ExpectError(Apply("t_insecure = 1"), {"'t_insecure'", "expected a boolean, got an integer"});
  ExpectError(Apply("t_listen = [\"a\"]"), {"'t_listen'", "got an array"});
  ExpectError(Apply("[t_listen]\nx = 1"), {"'t_listen'", "got a table"});
  ExpectError(Apply("t_listen = 1979-05-27"), {"'t_listen'", "got a date or time"});
}

TEST_F(ConfigTest, OutOfRangeIntegerIsABadValue) {
  ExpectError(Apply("\n\n\nt_threads = 4294967296"), {"kvferryd.toml:4:", "'t_threads'", "bad value '4294967296'"});
  EXPECT_EQ(absl::GetFlag(FLAGS_t_threads), 3);
}

TEST_F(ConfigTest, TomlSyntaxErrorNamesLineAndColumn) {
  ExpectError(Apply("t_threads = 1\nt_listen = \"unterminated\n"), {"kvferryd.toml:2:"});
  ExpectError(Apply("t_threads = 1\nt_threads = 2\n"), {"kvferryd.toml:2:"});  // a key twice
}

TEST_F(ConfigTest, MissingFileIsNotFoundAndNamesThePath) {
  absl::StatusOr<ConfigFile> file = Load("/nonexistent/kvferryd.toml", scope_);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(file.status().message()), HasSubstr("/nonexistent/kvferryd.toml"));
  EXPECT_THAT(std::string(file.status().message()), HasSubstr("No such file"));
}

TEST_F(ConfigTest, DirectoryIsNotAConfigFile) {
  absl::StatusOr<ConfigFile> file = Load("/", scope_);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(file.status().message()), HasSubstr("Is a directory"));
}

TEST_F(ConfigTest, LoadReadsAFile) {
  char path[] = "/tmp/kvferry-config-test-XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  std::ofstream(path) << "t_threads = 9\n[[pool]]\nname = \"a\"\nlayout = \"v4\"\nnum_pages = 4\n";
  absl::StatusOr<ConfigFile> file = Load(path, scope_);
  std::remove(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->path, path);
  ASSERT_EQ(file->flags.size(), 1u);
  EXPECT_EQ(file->flags[0].line, 1);
  ASSERT_EQ(file->pools.size(), 1u);
  EXPECT_EQ(file->pools[0].line, 2);
}

TEST_F(ConfigTest, PoolsWithDefaultsAndEveryKey) {
  absl::StatusOr<ConfigFile> file = Parse(R"(
[[pool]]
name = "lat"
layout = "v41_fp4"
num_pages = 1024

[[pool]]
name = "lat"
tenant = "alice"
layout = "v41"
page_size = 16
num_pages = 8
num_layers = 61
device = "cuda:1"
)");
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ(file->pools.size(), 2u);
  const PoolSpec& a = file->pools[0];
  EXPECT_EQ(a.line, 2);
  EXPECT_EQ(a.config.name, "lat");
  EXPECT_EQ(a.config.layout, Layout::kV41Fp4);
  EXPECT_EQ(a.config.page_size, 64);
  EXPECT_EQ(a.config.num_pages, 1024);
  EXPECT_EQ(a.config.num_layers, 1);
  EXPECT_EQ(a.device, "");
  EXPECT_EQ(a.tenant, "");
  const PoolSpec& b = file->pools[1];
  EXPECT_EQ(b.line, 7);
  EXPECT_EQ(b.tenant, "alice");
  EXPECT_EQ(b.config.layout, Layout::kV41);
  EXPECT_EQ(b.config.page_size, 16);
  EXPECT_EQ(b.config.num_pages, 8);
  EXPECT_EQ(b.config.num_layers, 61);
  EXPECT_EQ(b.device, "cuda:1");
}

TEST_F(ConfigTest, PoolMissingARequiredKey) {
  ExpectError(Parse("[[pool]]\nlayout = \"v4\"\nnum_pages = 4\n").status(),
              {"kvferryd.toml:1:", "'pool.name'", "missing"});
  ExpectError(Parse("[[pool]]\nname = \"a\"\nnum_pages = 4\n").status(), {"'pool.layout'", "missing"});
  ExpectError(Parse("[[pool]]\nname = \"a\"\nlayout = \"v4\"\n").status(), {"'pool.num_pages'", "missing"});
}

TEST_F(ConfigTest, PoolUnknownKeyNamesItsLine) {
  ExpectError(Parse("[[pool]]\nname = \"a\"\nlayout = \"v4\"\nnum_pages = 4\npages = 4\n").status(),
              {"kvferryd.toml:5:", "'pool.pages'", "unknown key"});
}

TEST_F(ConfigTest, PoolBadLayout) {
  ExpectError(Parse("[[pool]]\nname = \"a\"\nlayout = \"fp8\"\nnum_pages = 4\n").status(),
              {"kvferryd.toml:3:", "'pool.layout'", "unknown layout 'fp8'"});
}

TEST_F(ConfigTest, PoolWrongTypes) {
  ExpectError(Parse("[[pool]]\nname = 7\n").status(), {"kvferryd.toml:2:", "'pool.name'", "expected a string"});
  ExpectError(Parse("[[pool]]\nnum_pages = \"4\"\n").status(), {"'pool.num_pages'", "expected an integer"});
  ExpectError(Parse("[[pool]]\npage_size = 6.4\n").status(), {"'pool.page_size'", "expected an integer"});
  ExpectError(Parse("[[pool]]\nnum_layers = 1e12\n").status(), {"'pool.num_layers'", "expected an integer"});
  ExpectError(Parse("[[pool]]\nnum_layers = 10000000000\n").status(), {"'pool.num_layers'", "out of range"});
}

TEST_F(ConfigTest, PoolBreakingACoreRuleIsRefusedWithTheCoresReason) {
  ExpectError(Parse("[[pool]]\nname = \"a\"\nlayout = \"v4\"\nnum_pages = 4\npage_size = 48\n").status(),
              {"kvferryd.toml:1:", "pool 'a'", "page size 48 is not a power of two"});
  ExpectError(Parse("[[pool]]\nname = \"a b\"\nlayout = \"v4\"\nnum_pages = 4\n").status(),
              {"pool name may only use"});
  ExpectError(Parse("[[pool]]\nname = \"a\"\nlayout = \"v4\"\nnum_pages = 0\n").status(),
              {"num_pages 0 is not in"});
}

TEST_F(ConfigTest, DuplicatePoolNamesBothLines) {
  ExpectError(Parse("[[pool]]\nname = \"a\"\nlayout = \"v4\"\nnum_pages = 4\n"
                    "[[pool]]\nname = \"a\"\nlayout = \"v41\"\nnum_pages = 4\n")
                  .status(),
              {"kvferryd.toml:5:", "pool 'a' is already defined at line 1"});
}

TEST_F(ConfigTest, PoolMustBeAnArrayOfTables) {
  ExpectError(Parse("[pool]\nname = \"a\"\n").status(), {"kvferryd.toml:1:", "'pool'", "[[pool]]"});
  ExpectError(Parse("pool = 3\n").status(), {"'pool'", "[[pool]]"});
}

}  // namespace
}  // namespace kvferry::server::config
