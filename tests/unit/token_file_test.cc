// The security layer's pure parts: token file parsing, SHA-256, the loopback rule.
#include "security/token_file.h"

#include "common/errors.h"
#include "gtest/gtest.h"
#include "security/tls.h"

namespace kvferry::server {
namespace {

// sha256("alice-token"), computed with `printf %s alice-token | sha256sum`.
constexpr char kAliceHash[] = "9c220f200955d76c0a38d308225e0ef10c5f971acaf2f8d1d8f732affa5bd1dc";

TEST(TokenFileTest, Sha256MatchesTheStandardVectors) {
  // FIPS 180-2 examples.
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Sha256Hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Sha256Hex("alice-token"), kAliceHash);
}

TEST(TokenFileTest, LinesMapHashesToTenantsWithQuotas) {
  const std::string bob(64, 'B');
  absl::StatusOr<TokenFile> file = ParseTokenFile(
      std::string("# comment\n\n  alice ") + kAliceHash + " pools=4 device_bytes=8G\n" + "bob\t" +
      bob + "\n" + "alice " + std::string(64, 'c') + " streams=2 staged_write_bytes=1M\n");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->tenant_of_hash.size(), 3u);
  EXPECT_EQ(file->tenant_of_hash.at(kAliceHash), "alice");
  EXPECT_EQ(file->tenant_of_hash.at(std::string(64, 'b')), "bob") << "hashes are lower-cased";
  const TenantQuota& alice = file->quotas.at("alice");
  EXPECT_EQ(alice[Resource::kPools], 4);
  EXPECT_EQ(alice[Resource::kDeviceBytes], int64_t{8} << 30);
  EXPECT_EQ(alice[Resource::kStreams], 2);
  EXPECT_EQ(alice[Resource::kStagedWriteBytes], int64_t{1} << 20);
  EXPECT_EQ(alice[Resource::kPages], TenantQuota::kUnlimited);
  EXPECT_EQ(file->quotas.at("bob")[Resource::kPools], TenantQuota::kUnlimited);
}

TEST(TokenFileTest, BadLinesAreRefusedByNumberWithoutQuotingThem) {
  const std::string h(64, 'a');
  for (const std::string& text : std::vector<std::string>{
           "alice\n", "alice 1234\n", "al ice " + h + "\n", "alice " + h + " pools\n",
           "alice " + h + " colour=red\n", "alice " + h + " pools=-1\n",
           "alice " + h + " pools=9999999T\n", "alice " + h + "\nbob " + h + "\n",
           "alice " + h + " pools=1\nalice " + std::string(64, 'd') + " pools=2\n"}) {
    absl::StatusOr<TokenFile> file = ParseTokenFile(text);
    ASSERT_FALSE(file.ok()) << text;
    EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(file.status().message().find("token file line"), absl::string_view::npos);
    EXPECT_EQ(file.status().message().find(h), absl::string_view::npos) << "a hash was echoed";
  }
  EXPECT_TRUE(ParseTokenFile("").ok()) << "no tokens: every call refused, which is valid";
}

TEST(PlaintextRuleTest, OnlyLoopbackIsLoopback) {
  for (const char* a : {"127.0.0.1:50051", "127.8.9.10:1", "localhost:1", "[::1]:50051",
                        "ipv4:127.0.0.1:5", "unix:/run/kvferry.sock"}) {
    EXPECT_TRUE(IsLoopback(a)) << a;
    EXPECT_TRUE(CheckPlaintextAllowed("gRPC", a, false).ok()) << a;
  }
  for (const char* a : {"0.0.0.0:50051", "[::]:50051", "10.0.0.5:1", "example.com:1", ":50051",
                        "128.0.0.1:1", "127.0.0.1.example.com:1"}) {
    EXPECT_FALSE(IsLoopback(a)) << a;
    const absl::Status s = CheckPlaintextAllowed("gRPC", a, false);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << a;
    EXPECT_TRUE(CheckPlaintextAllowed("gRPC", a, true).ok()) << a;
  }
}

}  // namespace
}  // namespace kvferry::server
