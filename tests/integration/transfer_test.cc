// Pages between two real kvferryd processes over UCX (Push and Pull), on loopback, once per
// transport: TCP, and shared memory.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <fstream>
#include <future>
#include <map>
#include <random>
#include <regex>
#include <set>

#include "common/golden.h"
#include "common/random_rows.h"
#include "daemon_harness.h"
#include "metrics_scrape.h"
#include "kvferry/v1/transfer.grpc.pb.h"
#include "security/peer_secret.h"
#include "service/peer_channel.h"

namespace kvferry {
namespace {

using testing::Daemon;
using testing::Location;

std::string AsBytes(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

std::string Address(const Daemon& d) { return "127.0.0.1:" + std::to_string(d.grpc_port()); }

struct Outcome {
  grpc::Status status;
  std::string reason;
  v1::TransferPagesResponse response;
  double seconds = 0;
};

Outcome Push(Daemon& from, const std::string& pool, const std::vector<v1::PageHandle>& pages,
             const std::string& to_address, const std::string& to_pool,
             const std::vector<v1::PageHandle>& to_pages, v1::Layout transcode_to = v1::LAYOUT_UNSPECIFIED,
             std::vector<uint32_t> layers = {}) {
  auto stub = v1::Transfer::NewStub(from.channel());
  grpc::ClientContext ctx;
  v1::PushRequest req;
  req.set_pool(pool);
  for (const auto& p : pages) *req.add_pages() = p;
  for (uint32_t l : layers) req.add_layers(l);
  req.set_transcode_to(transcode_to);
  req.set_to_address(to_address);
  req.set_to_pool(to_pool);
  for (const auto& p : to_pages) *req.add_to_pages() = p;
  Outcome out;
  const auto start = std::chrono::steady_clock::now();
  out.status = stub->Push(&ctx, req, &out.response);
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  out.reason = testing::ReasonOf(ctx);
  return out;
}

Outcome Pull(Daemon& to, const std::string& pool, const std::vector<v1::PageHandle>& pages,
             const std::string& from_address, const std::string& from_pool,
             const std::vector<v1::PageHandle>& from_pages,
             v1::Layout transcode_to = v1::LAYOUT_UNSPECIFIED) {
  auto stub = v1::Transfer::NewStub(to.channel());
  grpc::ClientContext ctx;
  v1::PullRequest req;
  req.set_from_address(from_address);
  req.set_from_pool(from_pool);
  for (const auto& p : from_pages) *req.add_from_pages() = p;
  req.set_transcode_to(transcode_to);
  req.set_pool(pool);
  for (const auto& p : pages) *req.add_pages() = p;
  Outcome out;
  const auto start = std::chrono::steady_clock::now();
  out.status = stub->Pull(&ctx, req, &out.response);
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  out.reason = testing::ReasonOf(ctx);
  return out;
}

// Every page of a fresh pool, in page-id order.
// When the tests kill or freeze a transfer's peer, in ms after the call starts: the first,
// then, where the machine finished the transfer before it, the next ones.
constexpr std::array<int, 4> kInterruptDelaysMs = {150, 50, 15, 3};
// Pages (of 64 tokens) the tests that interrupt a transfer move: enough that the transfer
// outlasts the first interruption. Under a sanitizer a third: every copy is several times
// slower there.
#if defined(KVFERRY_TEST_ASAN) || defined(KVFERRY_TEST_TSAN)
constexpr int kInterruptedPages = 1000;
#else
constexpr int kInterruptedPages = 3000;
#endif

std::vector<v1::PageHandle> AllPages(Daemon& d, const std::string& pool, int count) {
  std::map<uint64_t, v1::PageHandle> by_id;
  // In calls of at most 65536 pages, the most one reply carries.
  for (int at = 0; at < count; at += 65536) {
    for (const auto& h : testing::Allocate(d, pool, std::min(count - at, 65536))) {
      by_id[h.page_id()] = h;
    }
  }
  std::vector<v1::PageHandle> pages;
  for (const auto& [id, h] : by_id) pages.push_back(h);
  return pages;
}

// A V41 pool on each daemon ("src" on a, "dst" on b) of `pages` pages of `page_size` tokens
// and `layers` layers, and `allocated` pages of each allocated (in page order). On `device`,
// or the test device when empty.
struct PoolPair {
  std::vector<v1::PageHandle> src, dst;
};
PoolPair CreatePools(Daemon& a, Daemon& b, int page_size, int pages, int layers, int allocated,
                     const std::string& device = "") {
  testing::CreatePool(a, "src", Layout::kV41, page_size, pages, layers, device);
  testing::CreatePool(b, "dst", Layout::kV41, page_size, pages, layers, device);
  return PoolPair{AllPages(a, "src", allocated), AllPages(b, "dst", allocated)};
}

// How often `what` occurs in the captured log of `d`.
int LogCount(Daemon& d, const std::string& what) {
  const std::string log = d.Log();
  int n = 0;
  for (size_t at = log.find(what); at != std::string::npos; at = log.find(what, at + 1)) ++n;
  return n;
}

// Slots 0, step, 2 step, ... (below `page_size`) of every page, page by page.
std::vector<v1::TokenLocation> EveryStep(const std::vector<v1::PageHandle>& pages,
                                         uint32_t page_size, uint32_t step) {
  std::vector<v1::TokenLocation> where;
  for (const auto& p : pages) {
    for (uint32_t s = 0; s < page_size; s += step) where.push_back(Location(p, s));
  }
  return where;
}

// A pool on `d` holding golden case `c` in `layout` (layer 0): returns its pages in id order.
std::vector<v1::PageHandle> GoldenPool(Daemon& d, const std::string& name,
                                       const testing::GoldenCase& c, Layout layout,
                                       const std::string& device = "") {
  testing::CreatePool(d, name, layout, c.page_size, c.num_pages, 1, device);
  const auto pages = AllPages(d, name, static_cast<int>(c.num_pages));
  const auto rows = testing::ReadArray<uint16_t>(c.file("input.bf16"));
  const auto locs = testing::ReadArray<int64_t>(c.file("locs.i64"));
  std::vector<v1::TokenLocation> where;
  for (int64_t loc : locs) where.push_back(Location(pages.at(loc / c.page_size), loc % c.page_size));
  EXPECT_TRUE(testing::WriteTokens(d, name, 0, where, rows, 1000).ok());
  return pages;
}

std::string ReadAll(Daemon& d, const std::string& pool, const std::vector<v1::PageHandle>& pages,
                    std::vector<uint32_t> layers = {}) {
  std::string bytes;
  std::string reason;
  const grpc::Status s =
      testing::ReadPages(d, pool, pages, &bytes, v1::LAYOUT_UNSPECIFIED, layers, &reason);
  EXPECT_TRUE(s.ok()) << "reading pool '" << pool << "': " << s.error_message() << " ("
                      << reason << ")";
  return bytes;
}

// Reads `pages` of `pool` until they read zero (what a failed transfer into them leaves once
// its rollback ran) or `seconds` passed; returns the last read.
std::string ReadUntilZero(Daemon& d, const std::string& pool,
                          const std::vector<v1::PageHandle>& pages, int seconds) {
  std::string now;
  for (auto until = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
       std::chrono::steady_clock::now() < until;
       std::this_thread::sleep_for(std::chrono::milliseconds(100))) {
    now = ReadAll(d, pool, pages);
    if (now == std::string(now.size(), '\0')) break;
  }
  return now;
}

// Whether a write into `page` commits within `seconds`: no transfer holds the page.
bool WriteCommitsAtOnce(Daemon& d, const std::string& pool, const v1::PageHandle& page,
                        int seconds, uint64_t seed) {
  auto write = std::async(std::launch::async, [&] {
    return testing::WriteTokens(d, pool, 0, {Location(page, 3)}, testing::RandomRows(1, seed));
  });
  if (write.wait_for(std::chrono::seconds(seconds)) != std::future_status::ready) {
    write.wait();  // the future's end would wait anyway; the test has failed already
    return false;
  }
  return write.get().ok();
}

// ---- per transport -------------------------------------------------------------------------

// The parameter names the UCX transports: "tcp", or "cma" for shared memory — cross-memory
// attach moves the bytes, TCP carries UCX's small control messages (UCX 1.13's posix and
// sysv transports cannot report a dead peer, so they are not enough alone; see
// TransferOffTest).
//
// "cuda" (label gpu, pools on KVFERRY_TEST_DEVICE=cuda:N): tcp with UCX's CUDA transports,
// so that a UCX built with them moves the GPU pools' pages in device memory (cuda_ipc
// between the two daemons); the transfers there are twenty times larger (6 GB), to be
// killed while bytes still move.
class TransferTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam().rfind("cuda", 0) == 0 && testing::TestDevice().rfind("cuda:", 0) != 0) {
      GTEST_SKIP() << "needs KVFERRY_TEST_DEVICE=cuda:N";
    }
  }
  std::vector<std::string> Flags() const {
    if (GetParam() == "cuda") {
      return {"--ucx_transports=tcp,cuda_copy,cuda_ipc", "--ucx_lanes=1", "--max_write_bytes=17179869184",
              "--max_staged_write_bytes=34359738368", "--tenant_max_staged_write_bytes=17179869184"};
    }
    // GPU pools through pinned host staging (no CUDA transport asked for, whatever UCX
    // offers), their messages over three lanes.
    if (GetParam() == "cuda_lanes") {
      return {"--ucx_transports=tcp", "--ucx_lanes=3", "--max_write_bytes=17179869184",
              "--max_staged_write_bytes=34359738368", "--tenant_max_staged_write_bytes=17179869184"};
    }
    // One page per message, so that every transfer spreads over the lanes.
    if (GetParam() == "lanes") {
      return {"--ucx_transports=tcp", "--ucx_lanes=3", "--peer_message_bytes=1"};
    }
    return {GetParam() == "cma" ? "--ucx_transports=tcp,cma" : "--ucx_transports=" + GetParam(),
            "--ucx_lanes=1"};
  }
  int Scale() const { return GetParam().rfind("cuda", 0) == 0 ? 20 : 1; }
  // The lanes a transfer between two daemons of Flags() runs on.
  int Lanes() const { return GetParam() == "lanes" || GetParam() == "cuda_lanes" ? 3 : 1; }
};

TEST_P(TransferTest, GoldenPoolsArePushedAndPulledByteForByteAndTranscoded) {
  Daemon a(Flags()), b(Flags());
  for (const testing::GoldenCase& c : testing::GoldenCases()) {
    for (Layout layout : testing::AllLayouts()) {
      const std::string l = LayoutName(layout);
      const std::string name = c.name + "." + l;
      SCOPED_TRACE(name);
      const auto src = GoldenPool(a, name, c, layout);
      const std::string golden = AsBytes(testing::ReadBytes(c.file("pool." + l + ".bin")));
      ASSERT_EQ(ReadAll(a, name, src), golden);

      // Push into pages of another order: page i of the source lands in dst[i].
      testing::CreatePool(b, name, layout, c.page_size, c.num_pages);
      auto dst = AllPages(b, name, static_cast<int>(c.num_pages));
      std::reverse(dst.begin(), dst.end());
      Outcome pushed = Push(a, name, src, Address(b), name, dst);
      ASSERT_TRUE(pushed.status.ok()) << pushed.status.error_message();
      EXPECT_EQ(pushed.response.pages(), static_cast<uint64_t>(c.num_pages));
      EXPECT_EQ(pushed.response.bytes(), golden.size());
      EXPECT_EQ(ReadAll(b, name, dst), golden);

      // Pull the same pages back into a fresh pool on a.
      const std::string back = name + ".back";
      testing::CreatePool(a, back, layout, c.page_size, c.num_pages);
      const auto back_pages = AllPages(a, back, static_cast<int>(c.num_pages));
      Outcome pulled = Pull(a, back, back_pages, Address(b), name, dst);
      ASSERT_TRUE(pulled.status.ok()) << pulled.status.error_message();
      EXPECT_EQ(pulled.response.bytes(), golden.size());
      EXPECT_EQ(ReadAll(a, back, back_pages), golden);

      // Transcoded on the way: a V4 pool on b gets the golden transcode of this layout.
      const std::string v4 = name + ".v4";
      testing::CreatePool(b, v4, Layout::kV4, c.page_size, c.num_pages);
      const auto v4_pages = AllPages(b, v4, static_cast<int>(c.num_pages));
      Outcome transcoded = Push(a, name, src, Address(b), v4, v4_pages, v1::LAYOUT_V4);
      ASSERT_TRUE(transcoded.status.ok()) << transcoded.status.error_message();
      EXPECT_EQ(ReadAll(b, v4, v4_pages),
                AsBytes(testing::ReadBytes(c.file("transcode." + l + "_to_v4.bin"))));
      // And pulled transcoded: from the V41_FP4-or-other pool on a into a V4 pool on b.
      const std::string v4_pull = name + ".v4pull";
      testing::CreatePool(b, v4_pull, Layout::kV4, c.page_size, c.num_pages);
      const auto v4_pull_pages = AllPages(b, v4_pull, static_cast<int>(c.num_pages));
      Outcome pulled_v4 = Pull(b, v4_pull, v4_pull_pages, Address(a), name, src, v1::LAYOUT_V4);
      ASSERT_TRUE(pulled_v4.status.ok()) << pulled_v4.status.error_message();
      EXPECT_EQ(ReadAll(b, v4_pull, v4_pull_pages),
                AsBytes(testing::ReadBytes(c.file("transcode." + l + "_to_v4.bin"))));
    }
  }
  // Both sides count the bytes per peer.
  const std::string metrics = testing::Metrics(a);
  EXPECT_NE(metrics.find("kvferry_peer_bytes_total{peer=\"" + Address(b) + "\",direction=\"sent\"}"),
            std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("kvferry_peer_transfer_seconds_count{op=\"push\"}"), std::string::npos);
}

TEST_P(TransferTest, ListedLayersLandInTheSameLayersAndTheOthersStayZero) {
  Daemon a(Flags()), b(Flags());
  const PoolPair pools = CreatePools(a, b, 16, 8, 3, 4);
  const std::vector<v1::PageHandle>& src = pools.src;
  const std::vector<v1::PageHandle>& dst = pools.dst;
  const std::vector<v1::TokenLocation> where = EveryStep(src, 16, 3);
  for (int layer = 0; layer < 3; ++layer) {
    const auto rows = testing::RandomRows(where.size(), 100 + layer);
    ASSERT_TRUE(testing::WriteTokens(a, "src", layer, where, rows).ok());
  }
  Outcome pushed = Push(a, "src", src, Address(b), "dst", dst, v1::LAYOUT_UNSPECIFIED, {2, 0});
  ASSERT_TRUE(pushed.status.ok()) << pushed.status.error_message();
  EXPECT_EQ(pushed.response.pages(), 8u);
  EXPECT_EQ(ReadAll(b, "dst", dst, {0}), ReadAll(a, "src", src, {0}));
  EXPECT_EQ(ReadAll(b, "dst", dst, {2}), ReadAll(a, "src", src, {2}));
  EXPECT_EQ(ReadAll(b, "dst", dst, {1}), std::string(ReadAll(a, "src", src, {1}).size(), '\0'));
}

// A cpu destination receives straight into pages whose listed layers hold nothing yet, and
// stages the bytes (committing them all at once) when any of them holds a record; the bytes
// that land are the source's either way. Which path ran is read from the destination's
// debug log.
TEST_P(TransferTest, FreshPagesAreReceivedInPlaceAndPagesWithRecordsAreStaged) {
  std::vector<std::string> debug = Flags();
  debug.push_back("--log_level=debug");
  Daemon a(Flags()), b(debug, /*capture_log=*/true);
  // Receiving in place is what a host memory pool does, whatever the test device.
  const PoolPair pools = CreatePools(a, b, 16, 8, 2, 4, "cpu");
  const std::vector<v1::PageHandle>& src = pools.src;
  const std::vector<v1::PageHandle>& dst = pools.dst;
  const std::vector<v1::TokenLocation> where = EveryStep(src, 16, 5);
  auto count = [&](const std::string& what) { return LogCount(b, what); };
  ASSERT_TRUE(testing::WriteTokens(a, "src", 0, where, testing::RandomRows(where.size(), 1)).ok());
  Outcome first = Push(a, "src", src, Address(b), "dst", dst, v1::LAYOUT_UNSPECIFIED, {0});
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_EQ(ReadAll(b, "dst", dst, {0}), ReadAll(a, "src", src, {0}));
  EXPECT_EQ(count("push received:"), 1);
  EXPECT_EQ(count(" in place,"), 1);
  // Over as many lanes as both daemons have.
  EXPECT_EQ(count("; " + std::to_string(Lanes()) + " lane(s))"), 1);
  // Layer 0 of the destination holds records now: the next push into it is staged.
  ASSERT_TRUE(testing::WriteTokens(a, "src", 0, where, testing::RandomRows(where.size(), 2)).ok());
  Outcome second = Push(a, "src", src, Address(b), "dst", dst, v1::LAYOUT_UNSPECIFIED, {0});
  ASSERT_TRUE(second.status.ok()) << second.status.error_message();
  EXPECT_EQ(ReadAll(b, "dst", dst, {0}), ReadAll(a, "src", src, {0}));
  EXPECT_EQ(count("push received:"), 2);
  EXPECT_EQ(count(" in place,"), 1);
  // Layer 1 still holds nothing: in place again, layer 0 untouched.
  const std::string layer0 = ReadAll(b, "dst", dst, {0});
  ASSERT_TRUE(testing::WriteTokens(a, "src", 1, where, testing::RandomRows(where.size(), 3)).ok());
  Outcome third = Push(a, "src", src, Address(b), "dst", dst, v1::LAYOUT_UNSPECIFIED, {1});
  ASSERT_TRUE(third.status.ok()) << third.status.error_message();
  EXPECT_EQ(ReadAll(b, "dst", dst, {1}), ReadAll(a, "src", src, {1}));
  EXPECT_EQ(ReadAll(b, "dst", dst, {0}), layer0);
  EXPECT_EQ(count(" in place,"), 2);

  // The pool's memory was registered with UCX at the first push received in place (its
  // pages are one block), kept for the next ones, and its registration goes with the pool.
  const double pool_bytes = PageBytes(Layout::kV41, 16) * 8.0 * 2;
  const double registered = testing::Sample(testing::Metrics(b), "kvferry_ucx_registered_bytes");
  EXPECT_GE(registered, pool_bytes);
  ASSERT_TRUE(testing::DeletePool(b, "dst").ok());
  EXPECT_EQ(testing::Sample(testing::Metrics(b), "kvferry_ucx_registered_bytes"),
            registered - pool_bytes);
}

// A page per message: a push of 16 messages into the test device's pools (GPU pools on a GPU
// run) lands whole, spread over as many lanes as both daemons have; with "cuda_lanes" each
// message goes through pinned host staging and on to the device as it arrives.
TEST_P(TransferTest, MessagesSpreadOverTheLanesLandWhole) {
  std::vector<std::string> flags = Flags();
  flags.push_back("--peer_message_bytes=1");
  std::vector<std::string> debug = flags;
  debug.push_back("--log_level=debug");
  Daemon a(flags), b(debug, /*capture_log=*/true);
  const PoolPair pools = CreatePools(a, b, 16, 8, 2, 8);
  const std::vector<v1::TokenLocation> where = EveryStep(pools.src, 16, 1);
  for (int layer = 0; layer < 2; ++layer) {
    ASSERT_TRUE(testing::WriteTokens(a, "src", layer, where,
                                     testing::RandomRows(where.size(), 40 + layer)).ok());
  }
  Outcome pushed = Push(a, "src", pools.src, Address(b), "dst", pools.dst);
  ASSERT_TRUE(pushed.status.ok()) << pushed.status.error_message();
  EXPECT_EQ(ReadAll(b, "dst", pools.dst), ReadAll(a, "src", pools.src));
  EXPECT_EQ(LogCount(b, "; " + std::to_string(Lanes()) + " lane(s))"), 1);
  if (GetParam() == "cuda_lanes") {
    EXPECT_EQ(LogCount(b, "through host staging, copied to the device as it arrived, "), 1);
  }
}

// The page lists may come packed (PageList, as the clients send them): the same pages
// move; a list given both ways, or packed lists of two lengths, are refused.
TEST_P(TransferTest, PackedPageListsMoveTheSamePages) {
  Daemon a(Flags()), b(Flags());
  const PoolPair pools = CreatePools(a, b, 16, 8, 2, 6);
  const std::vector<v1::TokenLocation> where = EveryStep(pools.src, 16, 3);
  ASSERT_TRUE(testing::WriteTokens(a, "src", 1, where, testing::RandomRows(where.size(), 9)).ok());
  auto push = [&](const v1::PushRequest& req, std::string* reason) {
    auto stub = v1::Transfer::NewStub(a.channel());
    grpc::ClientContext ctx;
    v1::TransferPagesResponse resp;
    const grpc::Status s = stub->Push(&ctx, req, &resp);
    *reason = testing::ReasonOf(ctx);
    return s;
  };
  v1::PushRequest req;
  req.set_pool("src");
  *req.mutable_page_list() = testing::PackPages(pools.src);
  req.set_to_address(Address(b));
  req.set_to_pool("dst");
  std::vector<v1::PageHandle> dst = pools.dst;
  std::reverse(dst.begin(), dst.end());
  *req.mutable_to_page_list() = testing::PackPages(dst);
  std::string reason;
  ASSERT_TRUE(push(req, &reason).ok()) << reason;
  EXPECT_EQ(ReadAll(b, "dst", dst), ReadAll(a, "src", pools.src));
  // The same push again (a retry of one whose answer was lost, transfer.proto): the
  // destination holds the same bytes.
  ASSERT_TRUE(push(req, &reason).ok()) << reason;
  EXPECT_EQ(ReadAll(b, "dst", dst), ReadAll(a, "src", pools.src));

  v1::PullRequest pull;
  pull.set_from_address(Address(b));
  pull.set_from_pool("dst");
  *pull.mutable_from_page_list() = testing::PackPages(dst);
  testing::CreatePool(a, "back", Layout::kV41, 16, 8, 2);
  const std::vector<v1::PageHandle> back = AllPages(a, "back", 6);
  pull.set_pool("back");
  *pull.mutable_page_list() = testing::PackPages(back);
  {
    auto stub = v1::Transfer::NewStub(a.channel());
    grpc::ClientContext ctx;
    v1::TransferPagesResponse resp;
    ASSERT_TRUE(stub->Pull(&ctx, pull, &resp).ok());
  }
  EXPECT_EQ(ReadAll(a, "back", back), ReadAll(a, "src", pools.src));

  const std::string before = ReadAll(b, "dst", dst);
  v1::PushRequest both = req;
  for (const auto& p : dst) *both.add_to_pages() = p;
  v1::PushRequest uneven = req;
  *uneven.mutable_page_list() = testing::PackPages(pools.src, 1);
  for (const v1::PushRequest& bad : {both, uneven}) {
    const grpc::Status s = push(bad, &reason);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_EQ(reason, "INVALID_REQUEST");
  }
  EXPECT_EQ(ReadAll(b, "dst", dst), before);
}

TEST_P(TransferTest, RefusedTransfersChangeNothingAtTheDestination) {
  Daemon a(Flags()), b(Flags());
  testing::CreatePool(a, "src", Layout::kV41Fp4, 16, 8);
  testing::CreatePool(b, "dst", Layout::kV41Fp4, 16, 8);
  testing::CreatePool(b, "v4", Layout::kV4, 16, 8);
  const auto src = AllPages(a, "src", 4);
  auto dst = AllPages(b, "dst", 4);
  std::vector<v1::TokenLocation> where;
  for (const auto& p : src) where.push_back(Location(p, 5));
  ASSERT_TRUE(testing::WriteTokens(a, "src", 0, where, testing::RandomRows(where.size(), 7)).ok());
  // The destination already holds something of its own.
  std::vector<v1::TokenLocation> mine;
  for (const auto& p : dst) mine.push_back(Location(p, 9));
  ASSERT_TRUE(testing::WriteTokens(b, "dst", 0, mine, testing::RandomRows(mine.size(), 8)).ok());
  const std::string before = ReadAll(b, "dst", dst);

  // A stale destination handle: freed (and its page allocated again) after the caller got it.
  const v1::PageHandle stale = dst[2];
  ASSERT_TRUE(testing::FreePages(b, "dst", {stale}).ok());
  const auto again = testing::Allocate(b, "dst", 1);
  Outcome r = Push(a, "src", src, Address(b), "dst", dst);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(r.reason, "STALE_PAGE_HANDLE") << r.status.error_message();
  dst[2] = again.at(0);
  std::string after = ReadAll(b, "dst", dst);
  EXPECT_EQ(after.substr(0, after.size() / 2), before.substr(0, before.size() / 2));

  // Another layout without transcoding; a count mismatch; a pool that is not there.
  r = Push(a, "src", src, Address(b), "v4", AllPages(b, "v4", 4));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(r.reason, "LAYOUT_MISMATCH");
  r = Push(a, "src", src, Address(b), "dst", {dst[0]});
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  r = Push(a, "src", src, Address(b), "nope", dst);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(r.reason, "POOL_NOT_FOUND");
  // A repeated destination page.
  r = Push(a, "src", src, Address(b), "dst", {dst[0], dst[0], dst[1], dst[3]});
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(r.reason, "DUPLICATE_PAGE");
  // A stale source handle (pull): nothing moves.
  ASSERT_TRUE(testing::FreePages(a, "src", {src[1]}).ok());
  r = Pull(b, "dst", dst, Address(a), "src", src);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(r.reason, "STALE_PAGE_HANDLE");
  const size_t q = before.size() / 4;  // one page
  EXPECT_EQ(ReadAll(b, "dst", {dst[0], dst[1], dst[3]}),
            before.substr(0, 2 * q) + before.substr(3 * q));

  // Nobody listens at the peer address: UNAVAILABLE, quickly.
  r = Push(a, "src", {src[0]}, "127.0.0.1:1", "dst", {dst[0]});
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(r.reason, "PEER_UNAVAILABLE");
  EXPECT_LT(r.seconds, 10.0);
  // Both daemons serve on.
  EXPECT_EQ(ReadAll(b, "dst", {dst[0]}), before.substr(0, before.size() / 4));
}

// kill -9 of either side mid-transfer: the other side's call fails within the bound, its
// pools are unharmed, its staging is released, and it keeps serving.
TEST_P(TransferTest, APeerKilledMidTransferFailsTheCallWithinTheBound) {
  const int kPages = kInterruptedPages * Scale();  // x 64 tokens x 528 B x 3 layers
  for (const bool kill_destination : {true, false}) {
    SCOPED_TRACE(kill_destination ? "destination killed" : "source killed");
    // Killed once bytes are moving (the victim's staging or reads are under way): 150 ms in,
    // and where the machine finished the transfer before that, again with new daemons and
    // the kill earlier.
    for (const int delay_ms : kInterruptDelaysMs) {
      Daemon a(Flags()), b(Flags());
      const PoolPair pools = CreatePools(a, b, 64, kPages, 3, kPages);
      const std::vector<v1::PageHandle>& src = pools.src;
      const std::vector<v1::PageHandle>& dst = pools.dst;
      std::vector<v1::TokenLocation> where;
      for (int i = 0; i < 64; ++i) where.push_back(Location(src[i], i % 64));
      ASSERT_TRUE(
          testing::WriteTokens(a, "src", 1, where, testing::RandomRows(where.size(), 3)).ok());
      const std::string src_before = ReadAll(a, "src", {src.begin(), src.begin() + 64});

      Daemon& survivor = kill_destination ? a : b;
      Daemon& victim = kill_destination ? b : a;
      // The survivor's call: a push from a when b dies, a pull into b when a dies.
      auto call = std::async(std::launch::async, [&] {
        return kill_destination ? Push(a, "src", src, Address(b), "dst", dst)
                                : Pull(b, "dst", dst, Address(a), "src", src);
      });
      std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
      kill(victim.pid(), SIGKILL);
      const Outcome r = call.get();
      if (r.status.ok()) {
        if (delay_ms == kInterruptDelaysMs.back()) {
          GTEST_SKIP() << "the transfer finished before the kill (" << r.seconds << " s)";
        }
        continue;
      }
      EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE) << r.status.error_message();
      EXPECT_EQ(r.reason, "PEER_UNAVAILABLE");
      EXPECT_LT(r.seconds, 10.0);
      // The survivor is unharmed and serves: its pages read as before, its staging is back.
      if (kill_destination) {
        EXPECT_EQ(ReadAll(a, "src", {src.begin(), src.begin() + 64}), src_before);
      } else {
        // Nothing was committed: every destination page still reads zero.
        EXPECT_EQ(ReadAll(b, "dst", {dst.begin(), dst.begin() + 8}),
                  std::string(8 * 3 * 64 * 528, '\0'));
      }
      EXPECT_EQ(testing::StagedBytesSettled(survivor), 0);
      EXPECT_TRUE(survivor.Alive());
      break;
    }
  }
}

// The sender of a Push killed mid-transfer: the destination, which receives fresh pages in
// place, zeroes what landed once its receives end (within the bound) and releases the
// pages: they read zero again and take a write at once. With "cuda" the pools have one
// layer (three times the pages), so that the pages, in order, are one run of the pool and
// land in place in device memory.
TEST_P(TransferTest, ADestinationWhoseSenderIsKilledZeroesWhatLandedAndReleasesThePages) {
  const int layers = GetParam() == "cuda" ? 1 : 3;
  const int kPages = kInterruptedPages * Scale() * 3 / layers;  // x 64 tokens x 528 B x layers
  std::vector<std::string> debug = Flags();
  debug.push_back("--log_level=debug");
  // As above: 60 ms in, then earlier with new daemons where the push finished first.
  for (const int delay_ms : {60, 15, 3}) {
    Daemon a(Flags()), b(debug, /*capture_log=*/true);
    const PoolPair pools = CreatePools(a, b, 64, kPages, layers, kPages);
    const std::vector<v1::PageHandle>& src = pools.src;
    const std::vector<v1::PageHandle>& dst = pools.dst;
    std::vector<v1::TokenLocation> where;
    for (int i = 0; i < 256; ++i) where.push_back(Location(src[i / 64], i % 64));
    ASSERT_TRUE(
        testing::WriteTokens(a, "src", 0, where, testing::RandomRows(where.size(), 4)).ok());
    auto call = std::async(std::launch::async,
                           [&] { return Push(a, "src", src, Address(b), "dst", dst); });
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    kill(a.pid(), SIGKILL);
    if (call.get().status.ok()) {
      if (delay_ms == 3) GTEST_SKIP() << "the transfer finished before the kill";
      continue;
    }
    // Received in place: a cpu pool in host memory; a GPU pool in device memory where UCX
    // moves it (else through host staging, nothing in the pool before the commit).
    // (Unless the kill came before the offer did.)
    if (LogCount(b, ": receiving ") == 1) {
      if (GetParam().rfind("cuda", 0) != 0) {
        EXPECT_EQ(LogCount(b, " in place on "), 1) << b.Log();
      }
      if (GetParam() == "cuda" &&
          b.Log().find("device_memory=" + testing::TestDevice()) != std::string::npos) {
        EXPECT_EQ(LogCount(b, " in place in device memory on "), 1) << b.Log();
      }
    }
    const std::vector<v1::PageHandle> first(dst.begin(), dst.begin() + 8);
    EXPECT_TRUE(ReadUntilZero(b, "dst", first, 12) ==
                std::string(static_cast<size_t>(8 * layers * 64 * 528), '\0'));
    // Not held any more: a write of one of them commits without waiting for anything.
    EXPECT_TRUE(WriteCommitsAtOnce(b, "dst", dst[0], 10, 5));
    EXPECT_TRUE(b.Alive());
    break;
  }
}

std::string TransportName(const ::testing::TestParamInfo<std::string>& info) { return info.param; }

// "lanes": tcp with every transfer spread over three UCX workers and connections per daemon,
// one page per message.
INSTANTIATE_TEST_SUITE_P(Transports, TransferTest, ::testing::Values("tcp", "cma", "lanes"),
                         TransportName);
// "cuda_lanes" (label gpu): GPU pools through host staging over three lanes.
INSTANTIATE_TEST_SUITE_P(GpuTransports, TransferTest, ::testing::Values("cuda", "cuda_lanes"),
                         TransportName);

// ---- without UCX, and through the command line -----------------------------------------------

// One call of a daemon's Peer.Exchange by a caller that is not a daemon: writes `messages`,
// ends its side and reads every reply.
struct PeerReplies {
  grpc::Status status;
  std::string reason;
  bool ready = false;  // a PeerReady came
  bool offer = false;  // a PeerOffer came
};
PeerReplies ExchangeWith(Daemon& d, const std::vector<v1::PeerMessage>& messages) {
  auto stub = v1::Peer::NewStub(d.channel());
  grpc::ClientContext ctx;
  auto stream = stub->Exchange(&ctx);
  for (const auto& m : messages) stream->Write(m);
  stream->WritesDone();
  PeerReplies out;
  v1::PeerMessage reply;
  while (stream->Read(&reply)) {
    out.ready = out.ready || reply.has_ready();
    out.offer = out.offer || reply.has_offer();
  }
  out.status = stream->Finish();
  out.reason = testing::ReasonOf(ctx);
  return out;
}

// A caller of the daemons' own Peer service that is not a daemon: malformed offers are
// refused with a reason, an offer it never sends bytes for ends within the idle time with
// its staging released, and the daemon serves on with the pages unchanged.
// An offer, as a sending daemon makes one, of `units` V41 units (layer 0) into `pages` of
// pool "dst", with pages of `page` bytes in messages of `message` bytes.
v1::PeerMessage OfferInto(const std::vector<v1::PageHandle>& pages, uint64_t units, uint64_t page,
                          uint64_t message) {
  v1::PeerMessage m;
  v1::PeerOffer& o = *m.mutable_offer();
  o.set_pool("dst");
  for (const auto& p : pages) *o.add_pages() = p;
  o.add_layers(0);
  o.set_layout(v1::LAYOUT_V41);
  o.set_page_bytes(page);
  o.set_message_bytes(message);
  o.set_units(units);
  return m;
}

TEST(PeerHostileTest, MalformedOrAbandonedOffersAreRefusedAndLeaveNothingBehind) {
  Daemon d({"--peer_timeout_seconds=1", "--stream_idle_timeout_seconds=2"});
  testing::CreatePool(d, "dst", Layout::kV41, 16, 8);
  const auto dst = AllPages(d, "dst", 2);
  const uint64_t page_bytes = PageBytes(Layout::kV41, 16);
  auto exchange = [&](const std::vector<v1::PeerMessage>& messages, std::string* reason) {
    const PeerReplies r = ExchangeWith(d, messages);
    *reason = r.reason;
    return r.status;
  };
  auto offer = [&](uint64_t units, uint64_t page, uint64_t message) {
    return OfferInto(dst, units, page, message);
  };
  std::string reason;
  // Nothing at all, a reply where an opening belongs, and offers that do not add up.
  EXPECT_EQ(exchange({}, &reason).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  v1::PeerMessage done;
  done.mutable_done()->set_pages(1);
  EXPECT_EQ(exchange({done}, &reason).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  for (const v1::PeerMessage& bad :
       {offer(1u << 30, page_bytes, page_bytes), offer(2, 0, page_bytes), offer(2, page_bytes, 0),
        offer(2, page_bytes, page_bytes + 1), offer(2, page_bytes, uint64_t{1} << 40)}) {
    EXPECT_EQ(exchange({bad}, &reason).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(reason, "INVALID_REQUEST");
  }
  // Destination pages given twice (as handles and packed), or packed with a generation
  // missing.
  v1::PeerMessage both = offer(2, page_bytes, page_bytes);
  *both.mutable_offer()->mutable_page_list() = testing::PackPages(dst);
  v1::PeerMessage short_list = both;
  short_list.mutable_offer()->clear_pages();
  *short_list.mutable_offer()->mutable_page_list() = testing::PackPages(dst, 1);
  for (const v1::PeerMessage& bad : {both, short_list}) {
    EXPECT_EQ(exchange({bad}, &reason).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(reason, "INVALID_REQUEST");
  }
  // The right page count but another page size.
  EXPECT_EQ(exchange({offer(2, page_bytes * 2, page_bytes * 2)}, &reason).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(reason, "LAYOUT_MISMATCH");
  // A well-formed offer whose bytes never come: the daemon posts its receives, says ready,
  // and gives up after its idle time; nothing is committed and the staging comes back.
  const auto start = std::chrono::steady_clock::now();
  const PeerReplies abandoned = ExchangeWith(d, {offer(2, page_bytes, page_bytes)});
  EXPECT_TRUE(abandoned.ready);
  EXPECT_EQ(abandoned.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(abandoned.reason, "PEER_UNAVAILABLE");
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 10);
  EXPECT_EQ(testing::StagedBytesSettled(d), 0);
  EXPECT_EQ(ReadAll(d, "dst", dst), std::string(2 * page_bytes, '\0'));
  // A caller that opens the peer stream and says nothing holds one stream until the idle
  // timeout ends it.
  auto streams_reach = [&](double n) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (testing::Sample(testing::Metrics(d), "kvferry_budget_used{resource=\"streams\"}") != n) {
      if (std::chrono::steady_clock::now() > until) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return true;
  };
  auto stub = v1::Peer::NewStub(d.channel());
  grpc::ClientContext mute_ctx;
  const auto opened = std::chrono::steady_clock::now();
  auto mute = stub->Exchange(&mute_ctx);
  EXPECT_TRUE(streams_reach(1));
  v1::PeerMessage reply;
  EXPECT_FALSE(mute->Read(&reply));
  EXPECT_EQ(mute->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - opened).count(), 20);
  EXPECT_TRUE(streams_reach(0));
}

// An offer that cuts its bytes into more messages than one transfer may take (65536) is
// refused before the daemon posts a receive for any: a receive each, posted on a UCX
// progress thread before the answer, would let one offer of tiny messages hold that thread
// (and every transfer on its lane) while it posts a million. The same bytes in half as
// many messages are taken.
TEST(PeerHostileTest, AnOfferOfTooManyMessagesIsRefusedBeforeAnyReceive) {
  Daemon d({"--peer_timeout_seconds=1", "--stream_idle_timeout_seconds=2"});
  constexpr int kPages = 32769;  // x 2 layers: 65538 units (a page of one token each)
  testing::CreatePool(d, "dst", Layout::kV41, 1, kPages, 2, "cpu");
  const auto dst = AllPages(d, "dst", kPages);
  ASSERT_EQ(dst.size(), static_cast<size_t>(kPages));
  const uint64_t page_bytes = PageBytes(Layout::kV41, 1);
  auto offer = [&](uint64_t message_bytes) {
    v1::PeerMessage m = OfferInto({}, 2 * kPages, page_bytes, message_bytes);
    *m.mutable_offer()->mutable_page_list() = testing::PackPages(dst);
    m.mutable_offer()->add_layers(1);
    return m;
  };
  const PeerReplies tiny = ExchangeWith(d, {offer(page_bytes)});
  EXPECT_FALSE(tiny.ready);
  EXPECT_EQ(tiny.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << tiny.status.error_message();
  EXPECT_EQ(tiny.reason, "INVALID_REQUEST");
  EXPECT_NE(tiny.status.error_message().find("65538 messages"), std::string::npos)
      << tiny.status.error_message();
  EXPECT_EQ(testing::StagedBytesSettled(d), 0);
  // Two pages a message: 32769 messages, taken (and then abandoned: no bytes come).
  const PeerReplies taken = ExchangeWith(d, {offer(2 * page_bytes)});
  EXPECT_TRUE(taken.ready);
  EXPECT_EQ(taken.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(testing::StagedBytesSettled(d), 0);
  // A daemon asked for a message a page makes its messages large enough to fit: its push of
  // the same pages lands whole.
  Daemon a({"--ucx_lanes=1", "--peer_message_bytes=1"});
  testing::CreatePool(a, "src", Layout::kV41, 1, kPages, 2, "cpu");
  const auto src = AllPages(a, "src", kPages);
  ASSERT_EQ(src.size(), static_cast<size_t>(kPages));
  for (uint32_t layer : {0u, 1u}) {
    const std::vector<v1::TokenLocation> at = {Location(src[7], 0), Location(src[kPages - 1], 0)};
    ASSERT_TRUE(testing::WriteTokens(a, "src", layer, at, testing::RandomRows(2, 40 + layer)).ok());
  }
  const Outcome pushed = Push(a, "src", src, Address(d), "dst", dst);
  ASSERT_TRUE(pushed.status.ok()) << pushed.status.error_message();
  EXPECT_EQ(ReadAll(d, "dst", dst), ReadAll(a, "src", src));
  EXPECT_TRUE(d.Alive());
}

// A caller of the Peer service that opens with requests (a Pull's opening, which the source
// answers with an offer) naming their source pages badly: each is refused with its reason
// before any offer, and a well-formed request after them is offered as usual.
TEST(PeerHostileTest, MalformedRequestsAreRefusedBeforeAnyOffer) {
  Daemon d({"--peer_timeout_seconds=1", "--stream_idle_timeout_seconds=2"});
  testing::CreatePool(d, "src", Layout::kV41, 16, 8);
  const auto src = AllPages(d, "src", 3);
  auto request = [&](std::vector<v1::PageHandle> pages, uint64_t destination_pages) {
    v1::PeerMessage m;
    v1::PeerRequest& r = *m.mutable_request();
    r.set_pool("src");
    *r.mutable_page_list() = testing::PackPages(pages);
    r.add_layers(0);
    r.set_num_destination_pages(destination_pages);
    return m;
  };
  struct Case {
    const char* what;
    v1::PeerMessage opening;
    grpc::StatusCode code;
    const char* reason;
  };
  std::vector<Case> cases;
  v1::PeerMessage both = request(src, 3);
  for (const auto& p : src) *both.mutable_request()->add_pages() = p;
  cases.push_back({"pages as handles and packed", both, grpc::StatusCode::INVALID_ARGUMENT,
                   "INVALID_REQUEST"});
  v1::PeerMessage short_list = request(src, 3);
  *short_list.mutable_request()->mutable_page_list() = testing::PackPages(src, 1);
  cases.push_back({"a generation missing", short_list, grpc::StatusCode::INVALID_ARGUMENT,
                   "INVALID_REQUEST"});
  cases.push_back({"other destination count", request(src, 2), grpc::StatusCode::INVALID_ARGUMENT,
                   "INVALID_REQUEST"});
  std::vector<v1::PageHandle> stale = src;
  stale[1].set_generation(stale[1].generation() + 1);
  cases.push_back({"a stale page", request(stale, 3), grpc::StatusCode::FAILED_PRECONDITION,
                   "STALE_PAGE_HANDLE"});
  v1::PeerMessage elsewhere = request(src, 3);
  elsewhere.mutable_request()->set_pool("nowhere");
  cases.push_back({"an unknown pool", elsewhere, grpc::StatusCode::NOT_FOUND, "POOL_NOT_FOUND"});
  v1::PeerMessage layer = request(src, 3);
  layer.mutable_request()->set_layers(0, 1);  // the pool has one layer
  cases.push_back({"a layer out of range", layer, grpc::StatusCode::INVALID_ARGUMENT,
                   "LAYER_OUT_OF_RANGE"});
  v1::PeerMessage transcode = request(src, 3);
  transcode.mutable_request()->set_transcode_to(static_cast<v1::Layout>(77));
  cases.push_back({"an unknown layout", transcode, grpc::StatusCode::INVALID_ARGUMENT,
                   "INVALID_LAYOUT"});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const PeerReplies r = ExchangeWith(d, {c.opening});
    EXPECT_EQ(r.status.error_code(), c.code);
    EXPECT_EQ(r.reason, c.reason);
    EXPECT_FALSE(r.offer);
  }
  // A well-formed request is offered (and then abandoned: no ready comes), whatever host it
  // names (only a guess of where the receiver wants the bytes).
  v1::PeerMessage odd_host = request(src, 3);
  odd_host.mutable_request()->set_host(std::string(4096, 'x'));
  const PeerReplies r = ExchangeWith(d, {odd_host});
  EXPECT_FALSE(r.status.ok());
  EXPECT_TRUE(r.offer);
  EXPECT_TRUE(d.Alive());
}

// A stand-in peer: `service` served on a loopback port (into *port).
std::unique_ptr<grpc::Server> ServeOnLoopback(grpc::Service& service, int* port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), port);
  builder.RegisterService(&service);
  return builder.BuildAndStart();
}

// A Pull's sender that gives up once the receiver is ready (as a daemon does whose source
// pages vanish mid-transfer): the receiving daemon, waiting on UCX for bytes that will not
// come, reports the sender's own status and reason at once, not its idle timeout.
class SenderThatGivesUp final : public v1::Peer::Service {
 public:
  // `layer`: the layer it offers (a daemon offers those asked for).
  explicit SenderThatGivesUp(uint64_t page_bytes, uint32_t layer = 0)
      : page_bytes_(page_bytes), layer_(layer) {}
  grpc::Status Exchange(grpc::ServerContext* context,
                        grpc::ServerReaderWriter<v1::PeerMessage, v1::PeerMessage>* stream) override {
    v1::PeerMessage request;
    if (!stream->Read(&request) || !request.has_request()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "expected a request");
    }
    v1::PeerMessage offer;
    v1::PeerOffer& o = *offer.mutable_offer();
    o.add_layers(layer_);
    o.set_layout(v1::LAYOUT_V41);
    o.set_page_bytes(page_bytes_);
    o.set_message_bytes(page_bytes_);
    o.set_units(request.request().page_list().page_ids_size());  // daemons send them packed
    stream->Write(offer);
    v1::PeerMessage ready;
    if (!stream->Read(&ready) || !ready.has_ready()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "expected ready");
    }
    receiver_ready = true;
    context->AddTrailingMetadata("kvferry-error-reason", "STALE_PAGE_HANDLE");
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "source page 7 was freed mid-transfer");
  }
  std::atomic<bool> receiver_ready{false};

 private:
  const uint64_t page_bytes_;
  const uint32_t layer_;
};

// A caller of the Peer service that offers bytes into fresh cpu pages and never sends them:
// the daemon receives those pages in place, so it holds them for writing while it waits.
// A client's write of one of them meanwhile waits (it does not interleave with the
// transfer), and lands once the daemon gives the offer up: the page then holds exactly
// that write (what a fresh page of another pool holds after the same write), the transfer
// nothing.
TEST(PeerHostileTest, AWriteOfPagesAnAbandonedOfferHoldsWaitsAndThenLandsAlone) {
  Daemon d({"--peer_timeout_seconds=3"});
  // Pages held for a transfer in place: a host memory pool, whatever the test device.
  testing::CreatePool(d, "dst", Layout::kV41, 16, 8, 1, "cpu");
  testing::CreatePool(d, "ref", Layout::kV41, 16, 8, 1, "cpu");
  const auto dst = AllPages(d, "dst", 2);
  const auto ref = AllPages(d, "ref", 2);
  const uint64_t page_bytes = PageBytes(Layout::kV41, 16);
  auto stub = v1::Peer::NewStub(d.channel());
  grpc::ClientContext ctx;
  auto stream = stub->Exchange(&ctx);
  const v1::PeerMessage m = OfferInto(dst, 2, page_bytes, page_bytes);
  ASSERT_TRUE(stream->Write(m));
  v1::PeerMessage reply;
  ASSERT_TRUE(stream->Read(&reply));
  ASSERT_TRUE(reply.has_ready());  // receives posted into the pages themselves
  const auto rows = testing::RandomRows(1, 11);
  const auto started = std::chrono::steady_clock::now();
  auto write = std::async(std::launch::async, [&] {
    return testing::WriteTokens(d, "dst", 0, {Location(dst[1], 3)}, rows);
  });
  EXPECT_EQ(write.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout)
      << "a write of pages a transfer holds went ahead of it";
  ASSERT_EQ(write.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  const grpc::Status written = write.get();
  EXPECT_TRUE(written.ok()) << written.error_message();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(), 10);
  stream->WritesDone();
  while (stream->Read(&reply)) {
  }
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  ASSERT_TRUE(testing::WriteTokens(d, "ref", 0, {Location(ref[1], 3)}, rows).ok());
  EXPECT_EQ(ReadAll(d, "dst", dst), ReadAll(d, "ref", ref));
  EXPECT_TRUE(d.Alive());
}

TEST(PeerHostileTest, APullsSenderThatGivesUpIsHeardWithItsReasonAtOnce) {
  // An idle time far above what the call may take: only the sender's end can finish it.
  Daemon d({"--ucx_transports=tcp", "--peer_timeout_seconds=60"});
  testing::CreatePool(d, "dst", Layout::kV41, 16, 8);
  const auto dst = AllPages(d, "dst", 4);
  SenderThatGivesUp sender(PageBytes(Layout::kV41, 16));
  int port = 0;
  std::unique_ptr<grpc::Server> server = ServeOnLoopback(sender, &port);
  ASSERT_NE(port, 0);
  const Outcome r = Pull(d, "dst", dst, "127.0.0.1:" + std::to_string(port), "src", dst);
  server->Shutdown();
  EXPECT_TRUE(sender.receiver_ready);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << r.status.error_message();
  EXPECT_EQ(r.reason, "STALE_PAGE_HANDLE");
  EXPECT_NE(r.status.error_message().find("freed mid-transfer"), std::string::npos)
      << r.status.error_message();
  EXPECT_LT(r.seconds, 10.0);  // not the 60 s idle time
  // Nothing committed, the staging released, the daemon serving.
  EXPECT_EQ(testing::StagedBytesSettled(d), 0);
  EXPECT_EQ(ReadAll(d, "dst", dst), std::string(4 * PageBytes(Layout::kV41, 16), '\0'));
  EXPECT_TRUE(d.Alive());
}

// A Pull's source that offers another layer than the one asked for: refused before the
// pulling daemon reserves or posts anything, so no byte can land in a layer the client did
// not name.
TEST(PeerHostileTest, APullsSourceOfferingOtherLayersIsRefused) {
  Daemon d({"--ucx_transports=tcp"});
  testing::CreatePool(d, "dst", Layout::kV41, 16, 8, 2);
  const auto dst = AllPages(d, "dst", 4);
  SenderThatGivesUp sender(PageBytes(Layout::kV41, 16), /*layer=*/1);
  int port = 0;
  std::unique_ptr<grpc::Server> server = ServeOnLoopback(sender, &port);
  ASSERT_NE(port, 0);
  auto stub = v1::Transfer::NewStub(d.channel());
  grpc::ClientContext ctx;
  v1::PullRequest req;
  req.set_from_address("127.0.0.1:" + std::to_string(port));
  req.set_from_pool("src");
  for (const auto& p : dst) *req.add_from_pages() = p;
  req.add_layers(0);
  req.set_pool("dst");
  for (const auto& p : dst) *req.add_pages() = p;
  v1::TransferPagesResponse resp;
  const grpc::Status status = stub->Pull(&ctx, req, &resp);
  server->Shutdown();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INTERNAL) << status.error_message();
  EXPECT_NE(status.error_message().find("offered layers [1]"), std::string::npos)
      << status.error_message();
  EXPECT_FALSE(sender.receiver_ready);
  EXPECT_EQ(testing::StagedBytesSettled(d), 0);
  EXPECT_EQ(ReadAll(d, "dst", dst), std::string(4 * 2 * PageBytes(Layout::kV41, 16), '\0'));
  EXPECT_TRUE(d.Alive());
}

// ---- the peer secret --------------------------------------------------------------------------

// A file holding `secret`, removed with the object.
struct SecretFile {
  explicit SecretFile(const std::string& secret) {
    char dir[] = "/tmp/kvferry-secret-XXXXXX";
    if (mkdtemp(dir) == nullptr) throw std::runtime_error("mkdtemp");
    path = std::string(dir) + "/peer-secret";
    std::ofstream(path) << secret << "\n";
  }
  ~SecretFile() { std::system(("rm -rf '" + path.substr(0, path.rfind('/')) + "'").c_str()); }
  std::string flag() const { return "--peer_secret_file=" + path; }
  std::string path;
};

// A Push's receiver that is no daemon: it answers each offer with a ready that names
// `address` as its UCX worker, with no mac or one made with `secret` (not the daemons').
class ForgedReceiver final : public v1::Peer::Service {
 public:
  // `lanes`: the addresses its ready names for lanes 1, 2, ... (the mac covers them).
  ForgedReceiver(std::string address, std::string secret, std::vector<std::string> lanes = {})
      : address_(std::move(address)), secret_(std::move(secret)), lanes_(std::move(lanes)) {}
  grpc::Status Exchange(grpc::ServerContext*,
                        grpc::ServerReaderWriter<v1::PeerMessage, v1::PeerMessage>* stream) override {
    v1::PeerMessage offer;
    if (!stream->Read(&offer) || !offer.has_offer()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "expected an offer");
    }
    nonce = offer.offer().nonce();
    v1::PeerMessage ready;
    v1::PeerReady& r = *ready.mutable_ready();
    r.set_worker_address(address_);
    r.set_transfer_id(1);
    r.set_host("forged");
    r.set_transport("tcp");
    for (const std::string& lane : lanes_) r.add_lane_addresses(lane);
    if (!secret_.empty()) {
      r.set_mac(server::PeerReadyMac(secret_, nonce, 1, address_, "forged", "tcp", lanes_));
    }
    stream->Write(ready);
    for (v1::PeerMessage next; stream->Read(&next);) {
    }
    return grpc::Status::OK;
  }
  std::string nonce;  // of the offer answered

 private:
  const std::string address_, secret_;
  const std::vector<std::string> lanes_;
};

// A push of d's `pages` of pool "src" to `receiver`, served on loopback for the call; its
// outcome in `r` (call it under ASSERT_NO_FATAL_FAILURE).
void PushTo(ForgedReceiver& receiver, Daemon& d, const std::vector<v1::PageHandle>& pages,
            Outcome* r) {
  int port = 0;
  std::unique_ptr<grpc::Server> server = ServeOnLoopback(receiver, &port);
  ASSERT_NE(port, 0);
  *r = Push(d, "src", pages, "127.0.0.1:" + std::to_string(port), "dst", pages);
  server->Shutdown();
}

// Random bytes where a UCX worker address belongs: UCX 1.13 crashes unpacking most such
// blobs, so a daemon that connected to one would not survive the test.
std::string JunkAddress(std::mt19937_64& random) {
  std::string junk(64 + random() % 256, '\0');
  for (char& c : junk) c = static_cast<char>(random());
  return junk;
}

// Whoever can open a peer stream (any tenant, or a server at the address a client names
// for a Push) could answer with a forged UCX worker address. A daemon with a peer secret
// sends to none that its ready does not prove with the secret: a Push to a stand-in
// receiver whose ready carries no mac, or a mac made with another secret, fails
// UNAUTHENTICATED (PEER_NOT_AUTHENTICATED) with nothing connected, and so does the sending
// side of a Pull whose caller answers the offer so; the daemon serves on. Every offer
// carries a fresh 16-byte nonce.
TEST(PeerHostileTest, AReadyNotProvenWithTheSecretIsNeverConnectedTo) {
  const SecretFile secret("0123456789abcdef0123456789abcdef");
  Daemon d({"--ucx_transports=tcp", secret.flag()});
  testing::CreatePool(d, "src", Layout::kV41, 16, 8);
  const auto src = AllPages(d, "src", 2);
  const auto rows = testing::RandomRows(2, 31);
  ASSERT_TRUE(testing::WriteTokens(d, "src", 0, {Location(src[0], 1), Location(src[1], 5)}, rows).ok());
  const std::string before = ReadAll(d, "src", src);
  std::mt19937_64 random(5);
  std::set<std::string> nonces;
  for (const std::string other_secret : {"", "fedcba9876543210fedcba9876543210"}) {
    for (int i = 0; i < 3; ++i) {
      SCOPED_TRACE(other_secret.empty() ? "no mac" : "a mac of another secret");
      ForgedReceiver receiver(JunkAddress(random), other_secret);
      Outcome r;
      ASSERT_NO_FATAL_FAILURE(PushTo(receiver, d, src, &r));
      EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << r.status.error_message();
      EXPECT_EQ(r.reason, "PEER_NOT_AUTHENTICATED");
      EXPECT_NE(r.status.error_message().find(other_secret.empty() ? "no mac" : "wrong mac"),
                std::string::npos)
          << r.status.error_message();
      ASSERT_TRUE(d.Alive());
      EXPECT_EQ(receiver.nonce.size(), 16u);
      nonces.insert(receiver.nonce);
    }
  }
  EXPECT_EQ(nonces.size(), 6u);
  // The sending side of a Pull: the caller asks for the pages, takes the offer and answers
  // with a forged ready.
  auto stub = v1::Peer::NewStub(d.channel());
  grpc::ClientContext ctx;
  auto stream = stub->Exchange(&ctx);
  v1::PeerMessage request;
  v1::PeerRequest& req = *request.mutable_request();
  req.set_pool("src");
  *req.mutable_page_list() = testing::PackPages(src);
  req.set_num_destination_pages(src.size());
  ASSERT_TRUE(stream->Write(request));
  v1::PeerMessage offer;
  ASSERT_TRUE(stream->Read(&offer));
  ASSERT_TRUE(offer.has_offer());
  v1::PeerMessage ready;
  ready.mutable_ready()->set_worker_address(JunkAddress(random));
  ready.mutable_ready()->set_transfer_id(1);
  ASSERT_TRUE(stream->Write(ready));
  stream->WritesDone();
  for (v1::PeerMessage reply; stream->Read(&reply);) {
  }
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(testing::ReasonOf(ctx), "PEER_NOT_AUTHENTICATED");
  ASSERT_TRUE(d.Alive());
  EXPECT_EQ(ReadAll(d, "src", src), before);
  EXPECT_EQ(testing::StagedBytesSettled(d), 0);
}

// Daemons sharing the secret move pages both ways, byte for byte (the receiver's mac
// checked, over the addresses of all its lanes: a has three, b two, so their transfers run
// on two, a page per message). A daemon with another secret, or none, cannot prove its ready to one with the
// secret: pushes to it are refused (PEER_NOT_AUTHENTICATED) and nothing lands. A daemon
// without a secret (and without client authentication) trusts its network: its push to a
// daemon with the secret lands.
TEST(PeerSecretTransferTest, OnlyDaemonsSharingTheSecretReceiveFromOneThatHasIt) {
  const SecretFile shared("0123456789abcdef0123456789abcdef"), other("a-secret-that-the-others-do-not-have");
  Daemon a({"--ucx_transports=tcp", "--ucx_lanes=3", "--peer_message_bytes=1", shared.flag()});
  Daemon b({"--ucx_transports=tcp", "--ucx_lanes=2", "--peer_message_bytes=1",
            "--log_level=debug", shared.flag()},
           /*capture_log=*/true);
  Daemon c({"--ucx_transports=tcp", other.flag()}), open({"--ucx_transports=tcp"});
  const uint64_t page_bytes = PageBytes(Layout::kV41, 16);
  const std::string zero(2 * page_bytes, '\0');
  testing::CreatePool(a, "src", Layout::kV41, 16, 4);
  const auto src = AllPages(a, "src", 2);
  ASSERT_TRUE(testing::WriteTokens(a, "src", 0, EveryStep(src, 16, 3),
                                   testing::RandomRows(12, 41)).ok());
  const std::string sent = ReadAll(a, "src", src);
  ASSERT_NE(sent, zero);
  std::map<Daemon*, std::vector<v1::PageHandle>> dst;
  for (Daemon* d : {&b, &c, &open}) {
    testing::CreatePool(*d, "dst", Layout::kV41, 16, 4);
    dst[d] = AllPages(*d, "dst", 2);
  }
  const Outcome pushed = Push(a, "src", src, Address(b), "dst", dst[&b]);
  ASSERT_TRUE(pushed.status.ok()) << pushed.status.error_message() << " " << pushed.reason;
  EXPECT_EQ(ReadAll(b, "dst", dst[&b]), sent);
  EXPECT_EQ(LogCount(b, "; 2 lane(s))"), 1);  // as many lanes as both have
  testing::CreatePool(a, "back", Layout::kV41, 16, 4);
  const auto back = AllPages(a, "back", 2);
  const Outcome pulled = Pull(a, "back", back, Address(b), "dst", dst[&b]);
  ASSERT_TRUE(pulled.status.ok()) << pulled.status.error_message() << " " << pulled.reason;
  EXPECT_EQ(ReadAll(a, "back", back), sent);
  for (Daemon* d : {&c, &open}) {
    const Outcome r = Push(a, "src", src, Address(*d), "dst", dst[d]);
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << r.status.error_message();
    EXPECT_EQ(r.reason, "PEER_NOT_AUTHENTICATED");
    EXPECT_EQ(ReadUntilZero(*d, "dst", dst[d], 10), zero);
  }
  testing::CreatePool(open, "src", Layout::kV41, 16, 4);
  const auto open_src = AllPages(open, "src", 2);
  ASSERT_TRUE(testing::WriteTokens(open, "src", 0, EveryStep(open_src, 16, 5),
                                   testing::RandomRows(8, 43)).ok());
  testing::CreatePool(a, "from_open", Layout::kV41, 16, 4);
  const auto from_open = AllPages(a, "from_open", 2);
  const Outcome trusted = Push(open, "src", open_src, Address(a), "from_open", from_open);
  ASSERT_TRUE(trusted.status.ok()) << trusted.status.error_message() << " " << trusted.reason;
  EXPECT_EQ(ReadAll(a, "from_open", from_open), ReadAll(open, "src", open_src));
}

// UCX lanes from a peer that does not follow the protocol. A receiver (holding the
// deployment's secret, so its mac is right) that answers with more lanes than the sender
// offered is refused before anything is connected: its addresses are junk that would crash
// the daemon unpacking them. A sender offering more lanes than any daemon has (2^32 - 1) gets
// a ready for the receiver's own lanes only.
TEST(PeerHostileTest, LanesBeyondTheOfferOrTheDaemonAreNeverUsed) {
  const std::string shared = "0123456789abcdef0123456789abcdef";
  const SecretFile secret(shared);
  Daemon d({"--ucx_transports=tcp", "--ucx_lanes=2", secret.flag()});
  testing::CreatePool(d, "src", Layout::kV41, 16, 8);
  const auto src = AllPages(d, "src", 2);
  std::mt19937_64 random(9);
  ForgedReceiver receiver(JunkAddress(random), shared, {JunkAddress(random), JunkAddress(random)});
  Outcome r;
  ASSERT_NO_FATAL_FAILURE(PushTo(receiver, d, src, &r));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INTERNAL) << r.status.error_message();
  EXPECT_NE(r.status.error_message().find("3 UCX lanes, more than the 2 offered"),
            std::string::npos)
      << r.status.error_message();
  ASSERT_TRUE(d.Alive());

  // The receiving side: an offer of 2^32 - 1 lanes for two pages of d's pool.
  testing::CreatePool(d, "dst", Layout::kV41, 16, 8);
  const auto dst = AllPages(d, "dst", 2);
  auto stub = v1::Peer::NewStub(d.channel());
  grpc::ClientContext ctx;
  auto stream = stub->Exchange(&ctx);
  v1::PeerMessage offer =
      OfferInto(dst, 2, PageBytes(Layout::kV41, 16), PageBytes(Layout::kV41, 16));
  offer.mutable_offer()->set_lanes(0xFFFFFFFFu);
  offer.mutable_offer()->set_nonce(std::string(16, 'n'));
  ASSERT_TRUE(stream->Write(offer));
  v1::PeerMessage ready;
  ASSERT_TRUE(stream->Read(&ready));
  ASSERT_TRUE(ready.has_ready()) << ready.DebugString();
  EXPECT_EQ(ready.ready().lane_addresses_size(), 1);  // d's second lane: two in all
  EXPECT_NE(ready.ready().lane_addresses(0), ready.ready().worker_address());
  ctx.TryCancel();
  stream->Finish().IgnoreError();
  ASSERT_TRUE(d.Alive());
  EXPECT_EQ(ReadUntilZero(d, "dst", dst, 10), std::string(2 * PageBytes(Layout::kV41, 16), '\0'));
}

// ---- GPU pools in device memory (label gpu) -------------------------------------------------

// Where the UCX library moves CUDA memory (a build with its cuda_copy / cuda_ipc transports),
// the pools are on the daemons' GPU and a transport reaches the peer without the host
// (cuda_ipc: the two daemons share a host), pages leave from the device (the gathered batch
// is handed to UCX where the GPU put it) and land in device staging that the commit scatters
// from: no copy through host memory on either side. With cuda_copy alone UCX would pipeline
// device memory through host fragments of its own, slower than the daemons' staging, so the
// bytes are staged through the host as without CUDA (on the receiver, each message copied on
// to the device as it arrives). Both against the golden pools,
// transcoded too, and a push to a stale page changes nothing. Skips without a GPU
// (KVFERRY_TEST_DEVICE=cuda:N) or without such a UCX.
TEST(TransferDeviceMemoryTest, GpuPoolsLeaveAndLandInDeviceMemoryByteForByte) {
  const std::string device = testing::TestDevice();
  if (device.rfind("cuda:", 0) != 0) GTEST_SKIP() << "needs KVFERRY_TEST_DEVICE=cuda:N";
  const testing::GoldenCase c = testing::GoldenCases()[1];
  for (const std::string transports : {"tcp,cuda_copy", "tcp,cuda_copy,cuda_ipc"}) {
    SCOPED_TRACE(transports);
    const std::vector<std::string> flags = {"--ucx_transports=" + transports,
                                            "--default_device=" + device, "--log_level=debug"};
    Daemon a(flags, /*capture_log=*/true), b(flags, /*capture_log=*/true);
    if (a.Log().find("device_memory=" + device) == std::string::npos) {
      GTEST_SKIP() << "this UCX moves no CUDA memory (no cuda_copy transport)";
    }
    auto count = [](Daemon& d, const std::string& what) { return LogCount(d, what); };
    for (Layout layout : testing::AllLayouts()) {
      const std::string l = LayoutName(layout);
      SCOPED_TRACE(l);
      const auto src = GoldenPool(a, l, c, layout);
      const std::string golden = AsBytes(testing::ReadBytes(c.file("pool." + l + ".bin")));
      testing::CreatePool(b, l, layout, c.page_size, c.num_pages);
      auto dst = AllPages(b, l, static_cast<int>(c.num_pages));
      std::reverse(dst.begin(), dst.end());
      Outcome pushed = Push(a, l, src, Address(b), l, dst);
      ASSERT_TRUE(pushed.status.ok()) << pushed.status.error_message();
      EXPECT_EQ(ReadAll(b, l, dst), golden);
      // Pulled back into a fresh pool, and transcoded to V4 on the way.
      testing::CreatePool(a, l + ".back", layout, c.page_size, c.num_pages);
      const auto back = AllPages(a, l + ".back", static_cast<int>(c.num_pages));
      Outcome pulled = Pull(a, l + ".back", back, Address(b), l, dst);
      ASSERT_TRUE(pulled.status.ok()) << pulled.status.error_message();
      EXPECT_EQ(ReadAll(a, l + ".back", back), golden);
      testing::CreatePool(b, l + ".v4", Layout::kV4, c.page_size, c.num_pages);
      const auto v4 = AllPages(b, l + ".v4", static_cast<int>(c.num_pages));
      Outcome transcoded = Push(a, l, src, Address(b), l + ".v4", v4, v1::LAYOUT_V4);
      ASSERT_TRUE(transcoded.status.ok()) << transcoded.status.error_message();
      EXPECT_EQ(ReadAll(b, l + ".v4", v4),
                AsBytes(testing::ReadBytes(c.file("transcode." + l + "_to_v4.bin"))));
      // A stale destination page: refused, the destination as it was.
      const std::string before = ReadAll(b, l, dst);
      v1::PageHandle stale = dst[0];
      stale.set_generation(stale.generation() + 1);
      std::vector<v1::PageHandle> bad = dst;
      bad[0] = stale;
      Outcome refused = Push(a, l, src, Address(b), l, bad);
      EXPECT_FALSE(refused.status.ok());
      EXPECT_EQ(ReadAll(b, l, dst), before);
    }
    // A pool in host memory on either side: a cpu pool pushed into a GPU pool lands through
    // host staging, copied to the device as it arrives (UCX would take host bytes into
    // device memory through its slow pipeline, on one lane), and a GPU pool pushed into a
    // fresh cpu pool leaves from host memory and lands in place; both byte for byte.
    {
      const std::string l = LayoutName(Layout::kV41);
      const std::string golden = AsBytes(testing::ReadBytes(c.file("pool." + l + ".bin")));
      const auto host_src = GoldenPool(a, "host", c, Layout::kV41, "cpu");
      testing::CreatePool(b, "from.host", Layout::kV41, c.page_size, c.num_pages);
      const auto gpu_dst = AllPages(b, "from.host", static_cast<int>(c.num_pages));
      Outcome up = Push(a, "host", host_src, Address(b), "from.host", gpu_dst);
      ASSERT_TRUE(up.status.ok()) << up.status.error_message();
      EXPECT_EQ(ReadAll(b, "from.host", gpu_dst), golden);
      const auto gpu_src = GoldenPool(a, "gpu", c, Layout::kV41);
      testing::CreatePool(b, "to.host", Layout::kV41, c.page_size, c.num_pages, 1, "cpu");
      const auto host_dst = AllPages(b, "to.host", static_cast<int>(c.num_pages));
      Outcome down = Push(a, "gpu", gpu_src, Address(b), "to.host", host_dst);
      ASSERT_TRUE(down.status.ok()) << down.status.error_message();
      EXPECT_EQ(ReadAll(b, "to.host", host_dst), golden);
    }
    // With cuda_ipc every push between GPU pools that sent bytes left from device memory
    // (per layout: the push and the transcoded push; the refused one ended before). The
    // push into the reversed pages went through device staging (its message spans pages
    // that are not one run of the pool); the transcoded push and the pull, into a fresh
    // pool's pages in order, landed in place in device memory. The two pushes to or from a
    // cpu pool did neither.
    const bool direct = transports.find("cuda_ipc") != std::string::npos;
    EXPECT_EQ(count(a, " from device memory:"), direct ? 2 * 3 : 0) << a.Log();
    EXPECT_EQ(count(b, "push received: "), 2 * 3 + 2) << b.Log();
    EXPECT_EQ(count(b, " through device staging, "), direct ? 3 : 0) << b.Log();
    EXPECT_EQ(count(b, " in place in device memory, "), direct ? 3 : 0) << b.Log();
    EXPECT_EQ(count(a, "pull received: "), 3) << a.Log();
    EXPECT_EQ(count(a, " in place in device memory; "), direct ? 3 : 0) << a.Log();
    EXPECT_EQ(count(b, " bytes in place, "), 1) << b.Log();
    // On one lane, though each daemon has as many as its cores give (the first push was
    // offered on all of them, the source not knowing yet that the peer shares its host).
    if (direct) {
      int in_device_memory = 0, on_one_lane = 0;
      std::istringstream lines(b.Log());
      for (std::string line; std::getline(lines, line);) {
        if (line.find("push received: ") == std::string::npos ||
            (line.find(" through device staging, ") == std::string::npos &&
             line.find(" in place in device memory, ") == std::string::npos)) {
          continue;
        }
        ++in_device_memory;
        if (line.find("; 1 lane(s))") != std::string::npos) ++on_one_lane;
      }
      EXPECT_EQ(in_device_memory, 2 * 3) << b.Log();
      EXPECT_EQ(on_one_lane, in_device_memory) << b.Log();
    }
    // Without cuda_ipc the bytes land in host staging, each message copied on to the device
    // as it arrived (with it too, those from the cpu pool).
    EXPECT_EQ(count(b, "copied to the device as it arrived, "), direct ? 1 : 2 * 3 + 1) << b.Log();
  }
}

// The frozen-peer tests: two daemons over tcp with a 2 s peer timeout, a pool of ~300 MB on
// each (3000 pages x 3 layers x 64 tokens x 528 B; a third under a sanitizer), every page
// allocated, the first 64 source pages holding a token each.
std::vector<std::string> FrozenPeerFlags() {
  return {"--ucx_transports=tcp", "--peer_timeout_seconds=2"};
}
// b's "dst" pool deleted and made again, fresh: the pages a finished transfer filled would
// no longer take bytes in place. Its pages.
std::vector<v1::PageHandle> FreshDestination(Daemon& b) {
  grpc::ClientContext ctx;
  v1::DeletePoolRequest req;
  req.set_name("dst");
  v1::DeletePoolResponse resp;
  const grpc::Status s = b.stub().DeletePool(&ctx, req, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  testing::CreatePool(b, "dst", Layout::kV41, 64, kInterruptedPages, 3);
  return AllPages(b, "dst", kInterruptedPages);
}
// Freezes `peer` (SIGSTOP) while `transfer` runs, kInterruptDelaysMs[0] after it starts, and
// wakes it when the call has ended. Where the machine finished the transfer before the
// freeze, it tries again with the next, earlier freeze (`fresh` first gives the transfer new
// destination pages), so that fast machines test the freeze too; the last call's outcome.
template <typename Transfer, typename Fresh>
Outcome FreezeDuring(Daemon& peer, const Transfer& transfer, const Fresh& fresh) {
  Outcome r;
  for (const int delay_ms : kInterruptDelaysMs) {
    auto call = std::async(std::launch::async, transfer);
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    kill(peer.pid(), SIGSTOP);
    r = call.get();
    kill(peer.pid(), SIGCONT);
    if (!r.status.ok()) break;
    fresh();
  }
  return r;
}
PoolPair FrozenPeerPools(Daemon& a, Daemon& b, uint64_t seed) {
  PoolPair pools = CreatePools(a, b, 64, kInterruptedPages, 3, kInterruptedPages);
  std::vector<v1::TokenLocation> where;
  for (int i = 0; i < 64; ++i) where.push_back(Location(pools.src[i], i));
  EXPECT_TRUE(testing::WriteTokens(a, "src", 0, where, testing::RandomRows(where.size(), seed)).ok());
  return pools;
}

// A destination that stops answering (SIGSTOP: its connections stay open, nothing comes
// back). Frozen before the push, the call ends when the answer to the offer is overdue;
// frozen while bytes move, when UCX has made no progress for the peer timeout. Either way:
// UNAVAILABLE within the bound, the source unharmed; the destination, woken, has committed
// nothing, gives its staging back and serves again.
TEST(TransferFrozenPeerTest, ADestinationThatStopsAnsweringFailsTheCallWithinTheBound) {
  for (const bool mid_transfer : {false, true}) {
    SCOPED_TRACE(mid_transfer ? "frozen while bytes move" : "frozen before the push");
    Daemon a(FrozenPeerFlags()), b(FrozenPeerFlags());
    PoolPair pools = FrozenPeerPools(a, b, 6);
    const std::vector<v1::PageHandle> first(pools.src.begin(), pools.src.begin() + 64);
    const std::string src_before = ReadAll(a, "src", first);
    auto push = [&] { return Push(a, "src", pools.src, Address(b), "dst", pools.dst); };
    Outcome r;
    if (mid_transfer) {
      r = FreezeDuring(b, push, [&] { pools.dst = FreshDestination(b); });
      if (r.status.ok()) {
        GTEST_SKIP() << "the transfer finished before the peer froze, 3 ms in (" << r.seconds
                     << " s)";
      }
    } else {
      kill(b.pid(), SIGSTOP);
      r = push();
      kill(b.pid(), SIGCONT);
    }
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE) << r.status.error_message();
    EXPECT_EQ(r.reason, "PEER_UNAVAILABLE");
    EXPECT_LT(r.seconds, 10.0);
    EXPECT_EQ(ReadAll(a, "src", first), src_before);
    EXPECT_EQ(testing::StagedBytesSettled(a), 0);
    // Woken, the destination finds the transfer ended: nothing committed, staging back.
    EXPECT_EQ(testing::StagedBytesSettled(b), 0);
    // Its receives that matched end once the woken peer's sends do, or UCX's keepalive
    // (twice per peer timeout) gives the sender up; then what landed is zeroed and the pages
    // released.
    const std::vector<v1::PageHandle> dst_first(pools.dst.begin(), pools.dst.begin() + 8);
    EXPECT_TRUE(ReadUntilZero(b, "dst", dst_first, 8) == std::string(8 * 3 * 64 * 528, '\0'));
    EXPECT_TRUE(WriteCommitsAtOnce(b, "dst", pools.dst[0], 3, 7));
    EXPECT_TRUE(a.Alive());
    EXPECT_TRUE(b.Alive());
  }
}

// A peer address where the connection is taken (the kernel's backlog) but nothing ever
// answers: the push ends UNAVAILABLE within the peer timeout, not gRPC's connect timeout.
TEST(TransferFrozenPeerTest, APeerThatNeverAnswersTheConnectionFailsWithinTheBound) {
  Daemon a(FrozenPeerFlags());
  testing::CreatePool(a, "src", Layout::kV41, 16, 4);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 16), 0);  // never accepted
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string silent = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
  const auto pages = AllPages(a, "src", 2);
  const Outcome r = Push(a, "src", pages, silent, "dst", pages);
  close(fd);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE) << r.status.error_message();
  EXPECT_EQ(r.reason, "PEER_UNAVAILABLE");
  EXPECT_LT(r.seconds, 5.0);  // the peer timeout is 2 s
  EXPECT_TRUE(a.Alive());
}

// The other side of it: the source of a Pull frozen while bytes move. The pulling daemon's
// call ends UNAVAILABLE within the bound with what landed in place zeroed; the source, woken,
// finds its transfer ended (its endpoint retired, not closed under the peer's feet), gives
// its read memory back and serves a pull of the same pages again.
TEST(TransferFrozenPeerTest, ASourceThatStopsAnsweringFailsThePullWithinTheBound) {
  Daemon a(FrozenPeerFlags()), b(FrozenPeerFlags());
  PoolPair pools = FrozenPeerPools(a, b, 8);
  const Outcome r =
      FreezeDuring(a, [&] { return Pull(b, "dst", pools.dst, Address(a), "src", pools.src); },
                   [&] { pools.dst = FreshDestination(b); });
  if (r.status.ok()) GTEST_SKIP() << "the pull finished before the source froze, 3 ms in";
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE) << r.status.error_message();
  EXPECT_EQ(r.reason, "PEER_UNAVAILABLE");
  EXPECT_LT(r.seconds, 10.0);
  // What landed in place is zeroed once the receives that matched end (the source answers
  // again, or UCX's keepalive gives it up).
  const std::vector<v1::PageHandle> dst_first(pools.dst.begin(), pools.dst.begin() + 8);
  EXPECT_TRUE(ReadUntilZero(b, "dst", dst_first, 8) == std::string(8 * 3 * 64 * 528, '\0'));
  EXPECT_EQ(testing::StagedBytesSettled(b), 0);
  // Woken, the source serves the same pages whole.
  testing::CreatePool(b, "again", Layout::kV41, 64, kInterruptedPages, 3);
  const auto again = AllPages(b, "again", kInterruptedPages);
  const Outcome second = Pull(b, "again", again, Address(a), "src", pools.src);
  ASSERT_TRUE(second.status.ok()) << second.status.error_message();
  EXPECT_TRUE(ReadAll(b, "again", again) == ReadAll(a, "src", pools.src));
  EXPECT_TRUE(a.Alive());
  EXPECT_TRUE(b.Alive());
}

TEST(TransferOffTest, ADaemonWithoutUcxSaysSo) {
  Daemon a({"--ucx=false"}), b;
  testing::CreatePool(a, "src", Layout::kV41, 16, 4);
  testing::CreatePool(b, "dst", Layout::kV41, 16, 4);
  Outcome r = Push(a, "src", AllPages(a, "src", 1), Address(b), "dst", AllPages(b, "dst", 1));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(r.reason, "TRANSPORT_UNAVAILABLE");
  // The peer without UCX refuses too, and says why.
  r = Pull(b, "dst", AllPages(b, "dst", 1), Address(a), "src", AllPages(a, "src", 1));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(r.reason, "TRANSPORT_UNAVAILABLE");
}

TEST(TransferOffTest, TransportsThatCannotReportADeadPeerAreRefusedWithAReason) {
  Daemon a({"--ucx_transports=posix,sysv"}), b({"--ucx_transports=posix,sysv"});
  testing::CreatePool(a, "src", Layout::kV41, 16, 4);
  testing::CreatePool(b, "dst", Layout::kV41, 16, 4);
  const auto dst = AllPages(b, "dst", 1);
  Outcome r = Push(a, "src", AllPages(a, "src", 1), Address(b), "dst", dst);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(r.reason, "TRANSPORT_UNAVAILABLE");
  EXPECT_NE(r.status.error_message().find("cma or tcp"), std::string::npos)
      << r.status.error_message();
  // b dropped what it staged for the refused transfer, and both serve on.
  EXPECT_EQ(testing::StagedBytesSettled(b), 0);
  EXPECT_EQ(ReadAll(b, "dst", dst), std::string(PageBytes(Layout::kV41, 16), '\0'));
}

// A daemon keeps its gRPC channel to a peer between transfers, and a transfer's stream is
// quiet while its bytes move over UCX. The channel's keepalive pings must stay within what
// the peer's server accepts (one per 5 s without data; more and the server closes the
// connection with GOAWAY "too_many_pings", failing the call under way): a peer stream that
// stays quiet for longer than the server takes strikes is not closed (it was, when a peer
// timeout of 2 s pinged every second: "keepalive watchdog timeout" or "Too many pings",
// UNAVAILABLE, about 4 s in); the daemon answers the stream's first message itself.
TEST(TransferChannelTest, AQuietPeerStreamIsNotClosedForTooManyPings) {
  Daemon b({"--ucx_transports=tcp", "--peer_timeout_seconds=2",
            "--stream_idle_timeout_seconds=60"});
  const std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(
      Address(b), grpc::InsecureChannelCredentials(), server::PeerChannelArguments(2));
  v1::Peer::Stub stub(channel);
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReaderWriter<v1::PeerMessage, v1::PeerMessage>> stream =
      stub.Exchange(&context);
  absl::SleepFor(absl::Seconds(7));
  v1::PeerMessage out_of_turn;
  out_of_turn.mutable_done()->set_pages(1);
  stream->Write(out_of_turn);
  stream->WritesDone();
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_message().find("pings"), std::string::npos) << status.error_message();
  EXPECT_NE(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  EXPECT_TRUE(b.Alive());
}

TEST(TransferDevicesTest, PeersOnTheLoopbackDeviceOnlyMoveTheirPages) {
  const std::vector<std::string> flags = {"--ucx_transports=tcp", "--ucx_net_devices=lo"};
  Daemon a(flags), b(flags);
  const testing::GoldenCase c = testing::GoldenCases().front();
  const auto src = GoldenPool(a, "gold", c, Layout::kV41);
  testing::CreatePool(b, "dst", Layout::kV41, c.page_size, c.num_pages);
  const auto dst = AllPages(b, "dst", static_cast<int>(c.num_pages));
  Outcome r = Push(a, "gold", src, Address(b), "dst", dst);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(ReadAll(b, "dst", dst), AsBytes(testing::ReadBytes(c.file("pool.v41.bin"))));
  // A device that is not there: the daemon asked for it does not start.
  EXPECT_THROW(Daemon({"--ucx_transports=tcp", "--ucx_net_devices=nosuchdevice0"}),
               std::runtime_error);
}

// The pipeline flags: out-of-range values stop the start-up; a shallow pipeline of
// one-page-sized messages and a deep one of small messages move the same bytes.
TEST(TransferFlagsTest, PipelineBoundsAreCheckedAndEveryDepthMovesTheSameBytes) {
  for (const std::string bad :
       {"--peer_send_depth=1", "--peer_send_depth=65", "--peer_device_send_depth=1",
        "--peer_device_message_bytes=0", "--peer_device_message_bytes=67108865",
        "--peer_message_bytes=0", "--ucx_lanes=-1", "--ucx_lanes=17"}) {
    EXPECT_THROW(Daemon({"--ucx_transports=tcp", bad}), std::runtime_error) << bad;
  }
  const uint64_t page_bytes = PageBytes(Layout::kV41, 16);
  for (const auto& [depth, pages_per_message] : {std::pair{2, 1}, std::pair{16, 3}}) {
    SCOPED_TRACE(depth);
    const std::vector<std::string> flags = {
        "--ucx_transports=tcp", "--peer_send_depth=" + std::to_string(depth),
        "--peer_message_bytes=" + std::to_string(pages_per_message * page_bytes)};
    Daemon a(flags), b(flags);
    const PoolPair pools = CreatePools(a, b, 16, 40, 2, 40);
    for (int layer = 0; layer < 2; ++layer) {
      const std::vector<v1::TokenLocation> where = EveryStep(pools.src, 16, 2 + layer);
      ASSERT_TRUE(testing::WriteTokens(a, "src", layer, where,
                                       testing::RandomRows(where.size(), 40 + layer)).ok());
    }
    std::vector<v1::PageHandle> dst = pools.dst;
    std::reverse(dst.begin(), dst.end());
    Outcome pushed = Push(a, "src", pools.src, Address(b), "dst", dst);
    ASSERT_TRUE(pushed.status.ok()) << pushed.status.error_message();
    EXPECT_EQ(ReadAll(b, "dst", dst), ReadAll(a, "src", pools.src));
  }
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(TransferCliTest, PushAndPullThroughTheCommand) {
  Daemon a, b;
  const testing::GoldenCase c = testing::GoldenCases().front();
  const auto src = GoldenPool(a, "gold", c, Layout::kV41Fp4);
  testing::CreatePool(b, "dst", Layout::kV4, c.page_size, c.num_pages);
  testing::CreatePool(a, "back", Layout::kV41Fp4, c.page_size, c.num_pages);
  const auto dst = AllPages(b, "dst", static_cast<int>(c.num_pages));
  const auto back = AllPages(a, "back", static_cast<int>(c.num_pages));
  auto write_pages = [&](const std::string& path, const std::vector<v1::PageHandle>& pages) {
    std::ofstream out(path);
    out << "[";
    for (size_t i = 0; i < pages.size(); ++i) {
      out << (i ? "," : "") << "{\"page_id\": " << pages[i].page_id()
          << ", \"generation\": " << pages[i].generation() << "}";
    }
    out << "]\n";
  };
  const std::string dir = a.dir();
  write_pages(dir + "/src.json", src);
  write_pages(dir + "/dst.json", dst);
  write_pages(dir + "/back.json", back);
  auto kvferry = [&](Daemon& d, const std::string& args) {
    const std::string command = testing::CliPath() + " --json --target " + Address(d) + " " +
                                args + " > " + dir + "/out.txt 2> " + dir + "/err.txt";
    const int status = std::system(command.c_str());
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  ASSERT_EQ(kvferry(a, "push gold --pages " + dir + "/src.json --to " + Address(b) +
                           " --to-pool dst --to-pages " + dir + "/dst.json --transcode-to v4"),
            0)
      << Slurp(dir + "/err.txt");
  EXPECT_NE(Slurp(dir + "/out.txt").find("\"pages\":" + std::to_string(c.num_pages)),
            std::string::npos);
  EXPECT_EQ(ReadAll(b, "dst", dst),
            AsBytes(testing::ReadBytes(c.file("transcode.v41_fp4_to_v4.bin"))));
  ASSERT_EQ(kvferry(a, "pull back --pages " + dir + "/back.json --from " + Address(a) +
                           " --from-pool gold --from-pages " + dir + "/src.json"),
            0)
      << Slurp(dir + "/err.txt");
  EXPECT_EQ(ReadAll(a, "back", back), AsBytes(testing::ReadBytes(c.file("pool.v41_fp4.bin"))));
  // A refused push exits non-zero and names the reason.
  EXPECT_NE(kvferry(a, "push gold --pages " + dir + "/src.json --to " + Address(b) +
                           " --to-pool dst --to-pages " + dir + "/dst.json"),
            0);
  EXPECT_NE(Slurp(dir + "/err.txt").find("LAYOUT_MISMATCH"), std::string::npos)
      << Slurp(dir + "/err.txt");
}

}  // namespace
}  // namespace kvferry
