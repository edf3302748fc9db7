// The peer secret: reading its file, and the mac a ready carries (server/security/peer_secret.h).
#include "security/peer_secret.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <set>
#include <vector>

namespace kvferry::server {
namespace {

std::string Hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

// A file in the test's temporary directory holding `text`.
std::string TempFile(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + "/peer_secret_test_" + std::to_string(getpid()) + name;
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

// The mac against one computed by Python's hmac module over the message the header
// describes (independent of this code):
//   m = b"kvferry peer ready v1" + le64(len(nonce)) + nonce + le64(tid) + le64(len(addr))
//       + addr + le64(len(host)) + host + le64(len(tp)) + tp
//   hmac.new(secret, m, hashlib.sha256).hexdigest()
TEST(PeerSecretTest, TheMacIsHmacSha256OverTheLengthPrefixedFields) {
  std::string nonce;
  for (int i = 0; i < 16; ++i) nonce.push_back(static_cast<char>(i));
  const std::string address("\x00\x01worker\xff", 9);
  const std::string mac =
      PeerReadyMac("0123456789abcdef-shared", nonce, 0x1234567890, address, "boot-id-1", "tcp");
  EXPECT_EQ(Hex(mac), "85498ccb223e2fc490f44736474fb6c1a11396bcf349b8a6de5fc32497023924");
  EXPECT_TRUE(PeerReadyMacMatches(mac, "0123456789abcdef-shared", nonce, 0x1234567890, address,
                                  "boot-id-1", "tcp"));
}

// A ready of several lanes: the other lanes' addresses follow, each length-prefixed (the
// same Python, m + le64(len(a1)) + a1 + le64(len(a2)) + a2 with a1 = b"lane-1\x00",
// a2 = b"lane-2"); the addresses, their order and their number are covered.
TEST(PeerSecretTest, TheMacCoversEveryLaneAddressInOrder) {
  std::string nonce;
  for (int i = 0; i < 16; ++i) nonce.push_back(static_cast<char>(i));
  const std::string address("\x00\x01worker\xff", 9);
  const std::vector<std::string> lanes = {std::string("lane-1\0", 7), "lane-2"};
  const std::string secret = "0123456789abcdef-shared";
  const std::string mac =
      PeerReadyMac(secret, nonce, 0x1234567890, address, "boot-id-1", "tcp", lanes);
  EXPECT_EQ(Hex(mac), "11ce123492b1b9e68a0ea942b814d3b4980a4f709f56c04f9cc60c34c406799f");
  EXPECT_TRUE(PeerReadyMacMatches(mac, secret, nonce, 0x1234567890, address, "boot-id-1", "tcp",
                                  lanes));
  const std::vector<std::string> swapped = {lanes[1], lanes[0]};
  const std::vector<std::string> fewer = {lanes[0]};
  const std::vector<std::string> other = {lanes[0], "lane-3"};
  for (const auto& changed : {swapped, fewer, other, std::vector<std::string>{}}) {
    EXPECT_FALSE(PeerReadyMacMatches(mac, secret, nonce, 0x1234567890, address, "boot-id-1",
                                     "tcp", changed));
  }
}

// Any field changed, or another secret, and the mac no longer matches; nor does a cut or
// empty mac. Moving a byte from one field to the next changes the message too (the lengths).
TEST(PeerSecretTest, AnyChangeOfSecretNonceOrFieldBreaksTheMatch) {
  const std::string secret = "a-secret-of-enough-bytes", nonce = "nonce-0123456789";
  const std::string mac = PeerReadyMac(secret, nonce, 7, "addr", "host", "tcp");
  EXPECT_TRUE(PeerReadyMacMatches(mac, secret, nonce, 7, "addr", "host", "tcp"));
  EXPECT_FALSE(PeerReadyMacMatches(mac, "a-secret-of-enough-byteS", nonce, 7, "addr", "host", "tcp"));
  EXPECT_FALSE(PeerReadyMacMatches(mac, secret, "nonce-0123456788", 7, "addr", "host", "tcp"));
  EXPECT_FALSE(PeerReadyMacMatches(mac, secret, nonce, 8, "addr", "host", "tcp"));
  EXPECT_FALSE(PeerReadyMacMatches(mac, secret, nonce, 7, "addR", "host", "tcp"));
  EXPECT_FALSE(PeerReadyMacMatches(mac, secret, nonce, 7, "add", "rhost", "tcp"));
  EXPECT_FALSE(PeerReadyMacMatches(mac, secret, nonce, 7, "addr", "host", "sm"));
  EXPECT_FALSE(PeerReadyMacMatches(mac.substr(0, 16), secret, nonce, 7, "addr", "host", "tcp"));
  EXPECT_FALSE(PeerReadyMacMatches("", secret, nonce, 7, "addr", "host", "tcp"));
}

TEST(PeerSecretTest, NoncesAreSixteenFreshBytes) {
  std::set<std::string> seen;
  for (int i = 0; i < 1000; ++i) {
    absl::StatusOr<std::string> nonce = PeerNonce();
    ASSERT_TRUE(nonce.ok()) << nonce.status();
    EXPECT_EQ(nonce->size(), 16u);
    seen.insert(*nonce);
  }
  EXPECT_EQ(seen.size(), 1000u);
}

// The file's bytes less trailing whitespace; a short secret or a missing file is refused
// with a message that names the file but never quotes it.
TEST(PeerSecretTest, TheFileIsReadTrimmedAndShortOrMissingFilesAreRefused) {
  const std::string good = TempFile("good", "8f14e45fceea167a5a36dedd4bea2543\n");
  absl::StatusOr<std::string> secret = ReadPeerSecret(good);
  ASSERT_TRUE(secret.ok()) << secret.status();
  EXPECT_EQ(*secret, "8f14e45fceea167a5a36dedd4bea2543");
  const std::string short_file = TempFile("short", "tooshort-secret\n\n");  // 15 bytes
  absl::StatusOr<std::string> refused = ReadPeerSecret(short_file);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("15 bytes"), std::string::npos) << refused.status();
  EXPECT_EQ(refused.status().message().find("tooshort"), std::string::npos) << refused.status();
  absl::StatusOr<std::string> missing = ReadPeerSecret(good + ".missing");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().message().find(".missing"), std::string::npos) << missing.status();
  std::remove(good.c_str());
  std::remove(short_file.c_str());
}

}  // namespace
}  // namespace kvferry::server
