// The C++ client library against a real kvferryd: golden round trips byte for byte, error
// codes and reasons, deadlines, buffer checks, and the retry of calls that never connected.
#include <netinet/in.h>
#include <sys/socket.h>

#include <thread>

#include "common/golden.h"
#include "common/random_rows.h"
#include "daemon_harness.h"
#include "kvferry/client/client.h"

namespace kvferry {
namespace {

using client::Client;
using client::PageHandle;
using client::TokenLocation;

std::unique_ptr<Client> Connect(int port, absl::Duration timeout = absl::Seconds(30)) {
  client::ClientOptions options;
  options.target = "127.0.0.1:" + std::to_string(port);
  options.timeout = timeout;
  auto c = Client::Connect(options);
  EXPECT_TRUE(c.ok()) << c.status();
  return std::move(*c);
}

client::Layout ClientLayout(Layout l) {
  return l == Layout::kV4 ? client::Layout::kV4 : l == Layout::kV41 ? client::Layout::kV41 : client::Layout::kV41Fp4;
}

std::string Device() { return testing::TestDevice(); }

TEST(ClientGoldenTest, RowsPagesWorkspaceAndTranscodesRoundTripByteForByte) {
  testing::Daemon d;
  auto c = Connect(d.grpc_port());
  for (const testing::GoldenCase& g : testing::GoldenCases()) {
    const auto rows = testing::ReadArray<uint16_t>(g.file("input.bf16"));
    const auto locs = testing::ReadArray<int64_t>(g.file("locs.i64"));
    for (Layout layout : testing::AllLayouts()) {
      const std::string l = LayoutName(layout);
      const std::string name = g.name + "." + l;
      SCOPED_TRACE(name);
      auto info = c->CreatePool({name, ClientLayout(layout), static_cast<uint32_t>(g.page_size),
                                 static_cast<uint64_t>(g.num_pages), 1, Device()});
      ASSERT_TRUE(info.ok()) << info.status();
      EXPECT_EQ(static_cast<int64_t>(info->page_bytes), g.layout(layout).page_bytes);
      auto pages = c->AllocatePages(name, static_cast<uint32_t>(g.num_pages));
      ASSERT_TRUE(pages.ok()) << pages.status();
      std::vector<TokenLocation> where;
      for (int64_t loc : locs) {
        where.push_back({(*pages)[loc / g.page_size], static_cast<uint32_t>(loc % g.page_size)});
      }
      auto written = c->WriteTokens(name, 0, where, rows);
      ASSERT_TRUE(written.ok()) << written.status();
      EXPECT_EQ(written->tokens_written, locs.size());
      auto raw = c->ReadPages(name, *pages);
      ASSERT_TRUE(raw.ok()) << raw.status();
      EXPECT_EQ(*raw, testing::ReadBytes(g.file("pool." + l + ".bin")));
      auto v4 = c->ReadPages(name, *pages, {}, client::Layout::kV4);
      ASSERT_TRUE(v4.ok());
      EXPECT_EQ(*v4, testing::ReadBytes(g.file("transcode." + l + "_to_v4.bin")));
      auto workspace = c->ReadWorkspace(name, 0, where);
      ASSERT_TRUE(workspace.ok());
      EXPECT_EQ(*workspace, testing::ReadArray<uint16_t>(g.file("dequant." + l + ".bf16")));

      // The golden pool bytes through WritePages into a second pool, read back as stored.
      const std::string copy = name + ".copy";
      ASSERT_TRUE(c->CreatePool({copy, ClientLayout(layout), static_cast<uint32_t>(g.page_size),
                                 static_cast<uint64_t>(g.num_pages), 1, Device()}).ok());
      auto copy_pages = *c->AllocatePages(copy, static_cast<uint32_t>(g.num_pages));
      const auto golden = testing::ReadBytes(g.file("pool." + l + ".bin"));
      std::vector<client::PageBytes> page_bytes;
      for (size_t p = 0; p < copy_pages.size(); ++p) {
        page_bytes.push_back({copy_pages[p], 0,
                              std::span<const uint8_t>(golden).subspan(p * info->page_bytes, info->page_bytes)});
      }
      auto pw = c->WritePages(copy, ClientLayout(layout), page_bytes);
      ASSERT_TRUE(pw.ok()) << pw.status();
      EXPECT_EQ(pw->pages_written, copy_pages.size());
      EXPECT_EQ(*c->ReadPages(copy, copy_pages), golden);
    }
  }
  auto stats = c->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->pools.size(), 2 * 3 * testing::GoldenCases().size());
}

TEST(ClientErrorTest, CodesAndReasonsComeThrough) {
  testing::Daemon d;
  auto c = Connect(d.grpc_port());
  absl::Status s = c->DescribePool("nope").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client::ErrorReason(s), "POOL_NOT_FOUND");
  ASSERT_TRUE(c->CreatePool({"e", client::Layout::kV41, 16, 4, 1, Device()}).ok());
  auto pages = *c->AllocatePages("e", 2);
  std::vector<uint16_t> rows = testing::RandomRows(1, 1);
  rows[3] = 0x7F80;  // +Inf
  s = c->WriteTokens("e", 0, std::vector<TokenLocation>{{pages[0], 0}}, rows).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client::ErrorReason(s), "NON_FINITE_VALUE");
  ASSERT_TRUE(c->FreePages("e", std::vector<PageHandle>{pages[1]}).ok());
  s = c->ReadPages("e", std::vector<PageHandle>{pages[1]}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(client::ErrorReason(s), "STALE_PAGE_HANDLE");
  s = c->AllocatePages("e", 100).status();
  EXPECT_EQ(client::ErrorReason(s), "POOL_FULL");
  // Caller buffers of the wrong size are refused before anything is sent.
  std::vector<uint16_t> small(100);
  s = c->ReadWorkspaceInto("e", 0, std::vector<TokenLocation>{{pages[0], 0}}, small);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  std::vector<uint8_t> tiny(10);
  s = c->ReadPagesInto("e", std::vector<PageHandle>{pages[0]}, {}, std::nullopt, tiny).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(c->Health().ok());
}

// Leased pages: renewed explicitly they stay; left alone past their lease the daemon frees
// them (their handles go stale); plain pages are never touched.
TEST(ClientLeaseTest, RenewedPagesStayAndForgottenOnesAreFreed) {
  testing::Daemon d;
  auto c = Connect(d.grpc_port());
  ASSERT_TRUE(c->CreatePool({"l", client::Layout::kV4, 16, 8, 1, Device()}).ok());
  auto kept = c->AllocatePages("l", 2, absl::Seconds(2));
  auto forgotten = c->AllocatePages("l", 2, absl::Seconds(1));
  auto plain = c->AllocatePages("l", 2);
  ASSERT_TRUE(kept.ok() && forgotten.ok() && plain.ok());
  EXPECT_EQ(c->AllocatePages("l", 1, absl::Seconds(-1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Until the forgotten pages are freed (the daemon sweeps every 0.5 s), at most 15 s. They
  // are not read meanwhile: a read renews a lease.
  uint64_t used = 6;
  for (int i = 0; i < 60 && used > 4; ++i) {
    ASSERT_TRUE(c->RenewPages("l", *kept).ok());
    absl::SleepFor(absl::Milliseconds(250));
    auto info = c->DescribePool("l");
    ASSERT_TRUE(info.ok());
    used = info->pages_used;
  }
  EXPECT_EQ(used, 4u);
  const absl::Status forgotten_status = c->ReadPages("l", *forgotten).status();
  EXPECT_EQ(client::ErrorReason(forgotten_status), "STALE_PAGE_HANDLE") << forgotten_status;
  EXPECT_TRUE(c->ReadPages("l", *kept).ok());
  EXPECT_TRUE(c->ReadPages("l", *plain).ok());
  // Renewing a page that was freed is refused, and renews nothing.
  std::vector<PageHandle> mixed = {(*kept)[0], (*forgotten)[0]};
  EXPECT_EQ(client::ErrorReason(c->RenewPages("l", mixed)), "STALE_PAGE_HANDLE");
  auto info = c->DescribePool("l");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->pages_used, 4u);
}

TEST(ClientDeadlineTest, ACallPastItsDeadlineFailsWithDeadlineExceeded) {
  testing::Daemon d;
  auto c = Connect(d.grpc_port());
  ASSERT_TRUE(c->CreatePool({"big", client::Layout::kV4, 4096, 64, 1, Device()}).ok());
  auto pages = *c->AllocatePages("big", 64);  // 153 MB of pages
  auto s = c->ReadPages("big", pages, {}, client::Layout::kV41, client::CallOptions{absl::Milliseconds(1)});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDeadlineExceeded) << s.status();
  EXPECT_TRUE(c->Health().ok());
}

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

TEST(ClientRetryTest, ACallThatNeverConnectedIsRetriedUntilTheDaemonListens) {
  const int port = FreePort();
  client::ClientOptions options;
  options.target = "127.0.0.1:" + std::to_string(port);
  options.max_attempts = 8;
  options.first_backoff = absl::Milliseconds(100);  // 100 .. 6400 ms: 12.7 s in all
  auto c = *Client::Connect(options);
  std::unique_ptr<testing::Daemon> d;
  std::thread starter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    d = std::make_unique<testing::Daemon>(
        std::vector<std::string>{"--listen=127.0.0.1:" + std::to_string(port)});
  });
  const absl::Status s = c->Health();
  starter.join();
  EXPECT_TRUE(s.ok()) << s;
  // Nothing listens: UNAVAILABLE after the attempts.
  options.target = "127.0.0.1:" + std::to_string(FreePort());
  options.max_attempts = 2;
  auto dead = *Client::Connect(options);
  EXPECT_EQ(dead->ListPools().status().code(), absl::StatusCode::kUnavailable);
}

// The cache calls of the C++ client: rows put by key load back as the goldens' dequantized
// rows; records round-trip; a lease ends and the reason reaches the caller.
TEST(ClientCacheTest, PutLookupLoadByKeyMatchTheGoldens) {
  testing::Daemon d;
  auto c = Connect(d.grpc_port());
  const testing::GoldenCase gc = testing::LoadGoldenCase("latent_p64");
  const auto input = testing::ReadArray<uint16_t>(gc.file("input.bf16"));
  const auto dequant = testing::ReadArray<uint16_t>(gc.file("dequant.v41.bf16"));
  const int blocks = static_cast<int>(gc.tokens / gc.page_size);
  ASSERT_TRUE(c->CreatePool({"kv", client::Layout::kV41, 64, 16, 1, Device()}).ok());
  absl::StatusOr<client::NamespaceInfo> ns =
      c->CreateNamespace({"n", "model", "all", "salt", 64, {"kv"}, 0});
  ASSERT_TRUE(ns.ok()) << ns.status();
  ASSERT_EQ(ns->members.size(), 1u);
  EXPECT_EQ(ns->members[0].page_size, 64u);
  std::vector<std::string> keys;
  std::vector<client::BlockRows> rows;
  for (int b = 0; b < blocks; ++b) {
    keys.push_back("key" + std::to_string(b));
    rows.push_back({keys.back(), 0, 0,
                    std::span<const uint16_t>(input).subspan(static_cast<size_t>(b) * 64 * 512, 64 * 512)});
  }
  absl::StatusOr<client::PutResult> put = c->PutRows(ns->ref(), "kv", rows);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->blocks_stored, static_cast<uint64_t>(blocks));
  keys.push_back("missing");
  absl::StatusOr<client::LookupResult> hit =
      c->Lookup(ns->ref(), keys, {.pools = {}, .lease_ttl = absl::Seconds(30)});
  ASSERT_TRUE(hit.ok()) << hit.status();
  EXPECT_EQ(hit->hit_blocks, static_cast<uint64_t>(blocks));
  EXPECT_EQ(hit->hit_tokens, static_cast<uint64_t>(blocks) * 64);
  absl::StatusOr<std::vector<uint16_t>> loaded = c->LoadRows(ns->ref(), hit->lease_id, "kv", 0);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(std::equal(loaded->begin(), loaded->end(), dequant.begin()));
  EXPECT_EQ(loaded->size(), static_cast<size_t>(blocks) * 64 * 512);
  absl::StatusOr<std::vector<uint8_t>> pages = c->LoadPages(ns->ref(), hit->lease_id, "kv", {}, std::nullopt, {1, 2});
  ASSERT_TRUE(pages.ok()) << pages.status();
  ASSERT_EQ(pages->size(), 2u * 33792);
  // The records of blocks 1 and 2 put again under new keys load back byte for byte.
  const std::vector<client::BlockRecords> records = {
      {"copy1", 0, std::span<const uint8_t>(*pages).subspan(0, 33792)},
      {"copy2", 0, std::span<const uint8_t>(*pages).subspan(33792)}};
  ASSERT_TRUE(c->PutPages(ns->ref(), "kv", client::Layout::kV41, records).ok());
  const std::vector<std::string> copies = {"copy1", "copy2"};
  absl::StatusOr<client::LookupResult> copy_hit =
      c->Lookup(ns->ref(), copies, {.pools = {}, .lease_ttl = absl::Seconds(30)});
  ASSERT_TRUE(copy_hit.ok());
  absl::StatusOr<std::vector<uint8_t>> again = c->LoadPages(ns->ref(), copy_hit->lease_id, "kv");
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(*again == *pages);
  ASSERT_TRUE(c->ReleaseLease(ns->ref(), hit->lease_id).ok());
  loaded = c->LoadRows(ns->ref(), hit->lease_id, "kv", 0);
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(client::ErrorReason(loaded.status()), "LEASE_EXPIRED");
  client::NamespaceRef wrong = ns->ref();
  wrong.digest ^= 1;
  EXPECT_EQ(client::ErrorReason(c->Lookup(wrong, keys).status()), "NAMESPACE_MISMATCH");
  ASSERT_TRUE(c->DeleteNamespace("n").ok());
  EXPECT_EQ(c->DescribeNamespace("n").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvferry
