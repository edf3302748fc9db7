// kvferryd end to end: the real binary on loopback, driven through generated gRPC stubs.
#include <httplib.h>

#include <atomic>
#include <cmath>
#include <map>
#include <thread>

#include "common/golden.h"
#include "common/random_rows.h"
#include "daemon_harness.h"
#include "kvferry/kernels/ops.h"
#include "metrics_scrape.h"

namespace kvferry {
namespace {

using testing::Daemon;
using testing::Location;

// Handles of every page of a fresh pool, indexed by page id.
std::map<uint64_t, v1::PageHandle> AllPages(Daemon& d, const std::string& pool, int count) {
  std::map<uint64_t, v1::PageHandle> by_id;
  for (const auto& h : testing::Allocate(d, pool, count)) by_id[h.page_id()] = h;
  return by_id;
}

std::vector<v1::PageHandle> InOrder(const std::map<uint64_t, v1::PageHandle>& by_id) {
  std::vector<v1::PageHandle> pages;
  for (const auto& [id, h] : by_id) pages.push_back(h);
  return pages;
}

std::string AsBytes(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

// ---- golden round trip ---------------------------------------------------------------------

TEST(DaemonGoldenTest, EveryGoldenCaseRoundTripsByteForByte) {
  Daemon d;
  for (const testing::GoldenCase& c : testing::GoldenCases()) {
    const auto rows = testing::ReadArray<uint16_t>(c.file("input.bf16"));
    const auto locs = testing::ReadArray<int64_t>(c.file("locs.i64"));
    for (Layout layout : testing::AllLayouts()) {
      const std::string l = LayoutName(layout);
      const std::string name = c.name + "." + l;
      SCOPED_TRACE(name);
      const v1::Pool pool = testing::CreatePool(d, name, layout, c.page_size, c.num_pages);
      EXPECT_EQ(static_cast<int64_t>(pool.page_bytes()), c.layout(layout).page_bytes);
      const auto pages = AllPages(d, name, static_cast<int>(c.num_pages));
      std::vector<v1::TokenLocation> where;
      for (int64_t loc : locs) where.push_back(Location(pages.at(loc / c.page_size), loc % c.page_size));
      v1::WriteResponse written;
      ASSERT_TRUE(testing::WriteTokens(d, name, 0, where, rows, 100, &written).ok());
      EXPECT_EQ(written.tokens_written(), locs.size());

      std::string bytes;
      ASSERT_TRUE(testing::ReadPages(d, name, InOrder(pages), &bytes).ok());
      EXPECT_TRUE(bytes == AsBytes(testing::ReadBytes(c.file("pool." + l + ".bin"))));

      std::vector<uint16_t> workspace;
      ASSERT_TRUE(testing::ReadWorkspace(d, name, 0, where, &workspace).ok());
      EXPECT_TRUE(workspace == testing::ReadArray<uint16_t>(c.file("dequant." + l + ".bf16")));

      ASSERT_TRUE(testing::ReadPages(d, name, InOrder(pages), &bytes, v1::LAYOUT_V4).ok());
      EXPECT_TRUE(bytes == AsBytes(testing::ReadBytes(c.file("transcode." + l + "_to_v4.bin"))));

      // Stats: the spec's bytes/token and savings, for exactly the tokens written.
      const v1::Stats stats = testing::GetStats(d);
      for (const v1::PoolStats& s : stats.pools()) {
        if (s.name() != name) continue;
        const double effective = static_cast<double>(c.layout(layout).page_bytes) / c.page_size;
        const double v4_effective = static_cast<double>(PageBytes(Layout::kV4, c.page_size)) / c.page_size;
        EXPECT_EQ(s.tokens_held(), locs.size());
        EXPECT_EQ(s.records_held(), locs.size());
        EXPECT_EQ(s.nominal_bytes_per_token(), c.layout(layout).bytes_per_token);
        EXPECT_EQ(s.effective_bytes_per_token(), effective);
        EXPECT_EQ(s.bytes_saved_vs_bf16(), locs.size() * (1024.0 - effective));
        EXPECT_EQ(s.bytes_saved_vs_v4(), locs.size() * (v4_effective - effective));
        EXPECT_EQ(s.pages_used(), static_cast<uint64_t>(c.num_pages));
      }
    }
  }
}

// ---- one test per bad input ---------------------------------------------------------------

class DaemonInvalidTest : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::CreatePool(d_, "p", Layout::kV41, 16, 8, 2);
    pages_ = testing::Allocate(d_, "p", 4);
    // Known content to prove unchanged: rows in pages 0 and 1 of layer 1.
    std::vector<v1::TokenLocation> where;
    for (int i = 0; i < 20; ++i) where.push_back(Location(pages_[i / 16], i % 16));
    ASSERT_TRUE(testing::WriteTokens(d_, "p", 1, where, testing::RandomRows(20, 1)).ok());
    before_ = Snapshot();
  }
  std::string Snapshot() {
    std::string bytes;
    EXPECT_TRUE(testing::ReadPages(d_, "p", pages_, &bytes).ok());
    return bytes;
  }
  void ExpectUnchanged() {
    EXPECT_TRUE(Snapshot() == before_) << "pool bytes changed";
    EXPECT_EQ(testing::GetStats(d_).tokens_held(), 20u);
  }
  grpc::Status Write(const std::vector<v1::TokenLocation>& where, std::vector<uint16_t> rows,
                     size_t per = 256) {
    return testing::WriteTokens(d_, "p", 1, where, rows, per);
  }

  Daemon d_;
  std::vector<v1::PageHandle> pages_;
  std::string before_;
};

TEST_F(DaemonInvalidTest, NanRowIsInvalidArgument) {
  auto rows = testing::RandomRows(2, 2);
  rows[512 + 7] = 0x7FC0;
  const grpc::Status s = Write({Location(pages_[2], 0), Location(pages_[2], 1)}, rows);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("row 1 dim 7 is NaN"), std::string::npos) << s.error_message();
  ExpectUnchanged();
}

TEST_F(DaemonInvalidTest, InfInALaterMessageLeavesEarlierMessagesUnwritten) {
  auto rows = testing::RandomRows(4, 3);
  rows[3 * 512] = 0xFF80;  // -Inf in the second message
  std::vector<v1::TokenLocation> where;
  for (int i = 0; i < 4; ++i) where.push_back(Location(pages_[0], i));  // overwrite known rows
  const grpc::Status s = Write(where, rows, /*per=*/2);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // Rows are numbered across the write: the second message's second row is row 3.
  EXPECT_NE(s.error_message().find("row 3 dim 0 is -Inf"), std::string::npos) << s.error_message();
  ExpectUnchanged();
  EXPECT_EQ(testing::StagedBytesSettled(d_), 0) << "the refused write's staging is released";
}

// gRPC ends a read both when the client half-closes and when a message does not decode; the
// second must not commit the messages before it. Both WriteTokens and WritePages.
TEST_F(DaemonInvalidTest, UndecodableLaterMessageFailsTheWriteAndLeavesEarlierMessagesUnwritten) {
  const std::string not_utf8("\xbf\xe7\x6c", 3);  // a proto3 string must be UTF-8
  {
    grpc::ClientContext ctx;
    v1::WriteResponse resp;
    auto writer = d_.stub().WriteTokens(&ctx, &resp);
    const auto rows = testing::RandomRows(2, 4);
    for (int m = 0; m < 2; ++m) {
      v1::WriteTokensRequest msg;
      msg.set_pool(m == 0 ? "p" : not_utf8);
      msg.set_layer(1);
      *msg.add_locations() = Location(pages_[0], m);  // overwrites known rows
      msg.set_rows(reinterpret_cast<const char*>(rows.data() + m * kHeadDim), kBf16RowBytes);
      ASSERT_TRUE(writer->Write(msg));
    }
    writer->WritesDone();
    const grpc::Status s = writer->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_EQ(testing::ReasonOf(ctx), "INVALID_REQUEST");
    EXPECT_NE(s.error_message().find("could not be decoded"), std::string::npos) << s.error_message();
  }
  {
    grpc::ClientContext ctx;
    v1::WriteResponse resp;
    auto writer = d_.stub().WritePages(&ctx, &resp);
    const std::string page(PageBytes(Layout::kV41, 16), '\0');
    for (int m = 0; m < 2; ++m) {
      v1::WritePagesRequest msg;
      msg.set_pool(m == 0 ? "p" : not_utf8);
      msg.set_layout(v1::LAYOUT_V41);
      *msg.mutable_page() = pages_[m];  // zeros over the known rows of pages 0 and 1
      msg.set_layer(1);
      msg.set_data(page);
      ASSERT_TRUE(writer->Write(msg));
    }
    writer->WritesDone();
    const grpc::Status s = writer->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_EQ(testing::ReasonOf(ctx), "INVALID_REQUEST");
  }
  ExpectUnchanged();
}

// gRPC's Read also ends a stream that the client cancelled or lost, and IsCancelled() may
// learn of that a moment later. So a write is stored only when its last message sets
// finish_write: half-closing without it is how a cut-off stream can look to the daemon.
// A message after the finishing one is refused too. Both WriteTokens and WritePages.
TEST_F(DaemonInvalidTest, AWriteItsClientDidNotFinishStoresNothing) {
  const auto rows = testing::RandomRows(2, 4);
  const std::string page(PageBytes(Layout::kV41, 16), '\x5a');
  // Two messages of one write, `fill` making each; finish_write on message `finish_at`.
  auto refused = [&]<typename Request>(grpc::ClientContext& ctx,
                                       std::unique_ptr<grpc::ClientWriter<Request>> writer,
                                       auto fill, int finish_at, const std::string& expected) {
    for (int m = 0; m < 2; ++m) {
      Request msg;
      fill(m, msg);
      msg.set_finish_write(m == finish_at);
      ASSERT_TRUE(writer->Write(msg));
    }
    writer->WritesDone();
    const grpc::Status s = writer->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_EQ(testing::ReasonOf(ctx), expected) << s.error_message();
  };
  for (const int finish_at : {2, 0}) {  // none of the two messages; the first
    const std::string expected = finish_at == 2 ? "WRITE_NOT_FINISHED" : "INVALID_REQUEST";
    v1::WriteResponse resp;
    {
      grpc::ClientContext ctx;
      refused(ctx, d_.stub().WriteTokens(&ctx, &resp), [&](int m, v1::WriteTokensRequest& msg) {
        if (m == 0) {
          msg.set_pool("p");
          msg.set_layer(1);
        }
        *msg.add_locations() = Location(pages_[0], m);  // overwrites known rows
        msg.set_rows(reinterpret_cast<const char*>(rows.data() + m * kHeadDim), kBf16RowBytes);
      }, finish_at, expected);
    }
    {
      grpc::ClientContext ctx;
      refused(ctx, d_.stub().WritePages(&ctx, &resp), [&](int m, v1::WritePagesRequest& msg) {
        if (m == 0) {
          msg.set_pool("p");
          msg.set_layout(v1::LAYOUT_V41);
        }
        *msg.mutable_page() = pages_[m];  // over the known rows of pages 0 and 1
        msg.set_layer(1);
        msg.set_data(page);
      }, finish_at, expected);
    }
  }
  ExpectUnchanged();
}

TEST_F(DaemonInvalidTest, WrongRowLengthIsInvalidArgument) {
  grpc::ClientContext ctx;
  v1::WriteResponse resp;
  auto writer = d_.stub().WriteTokens(&ctx, &resp);
  v1::WriteTokensRequest msg;
  msg.set_pool("p");
  msg.set_layer(1);
  *msg.add_locations() = Location(pages_[2], 0);
  msg.set_rows(std::string(1000, '\0'));
  writer->Write(msg);
  writer->WritesDone();
  const grpc::Status s = writer->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("expected 1024"), std::string::npos) << s.error_message();
  ExpectUnchanged();
}

TEST_F(DaemonInvalidTest, SlotOutOfRangeIsInvalidArgument) {
  const grpc::Status s = Write({Location(pages_[2], 16)}, testing::RandomRows(1, 4));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ExpectUnchanged();
}

TEST_F(DaemonInvalidTest, PageOutOfRangeIsInvalidArgument) {
  v1::PageHandle bogus;
  bogus.set_page_id(1000);
  bogus.set_generation(1);
  const grpc::Status s = Write({Location(bogus, 0)}, testing::RandomRows(1, 4));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ExpectUnchanged();
}

TEST_F(DaemonInvalidTest, RepeatedLocationIsInvalidArgument) {
  const grpc::Status s = Write({Location(pages_[2], 3), Location(pages_[3], 1), Location(pages_[2], 3)},
                               testing::RandomRows(3, 5), /*per=*/1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("written twice"), std::string::npos) << s.error_message();
  ExpectUnchanged();
}

TEST_F(DaemonInvalidTest, UnknownPoolIsNotFound) {
  const grpc::Status s = testing::WriteTokens(d_, "nope", 0, {Location(pages_[2], 0)},
                                              testing::RandomRows(1, 6));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  grpc::ClientContext ctx;
  v1::Pool pool;
  v1::DescribePoolRequest req;
  req.set_name("nope");
  EXPECT_EQ(d_.stub().DescribePool(&ctx, req, &pool).error_code(), grpc::StatusCode::NOT_FOUND);
  ExpectUnchanged();
}

TEST_F(DaemonInvalidTest, StaleHandleIsFailedPrecondition) {
  // Free page 3 (unwritten) and use its old handle for a write and a read.
  ASSERT_TRUE(testing::FreePages(d_, "p", {pages_[3]}).ok());
  const grpc::Status s = Write({Location(pages_[3], 0)}, testing::RandomRows(1, 7));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(s.error_message().find("stale page handle"), std::string::npos) << s.error_message();
  std::string bytes;
  EXPECT_EQ(testing::ReadPages(d_, "p", {pages_[3]}, &bytes).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  // A new allocation gets the page back with a new generation.
  const auto again = testing::Allocate(d_, "p", 1);
  ASSERT_EQ(again.size(), 1u);
  EXPECT_EQ(again[0].page_id(), pages_[3].page_id());
  EXPECT_NE(again[0].generation(), pages_[3].generation());
  pages_[3] = again[0];
  ExpectUnchanged();
}

TEST_F(DaemonInvalidTest, WritePagesInTheWrongLayoutIsFailedPrecondition) {
  grpc::ClientContext ctx;
  v1::WriteResponse resp;
  auto writer = d_.stub().WritePages(&ctx, &resp);
  v1::WritePagesRequest msg;
  msg.set_pool("p");
  msg.set_layout(v1::LAYOUT_V4);
  *msg.mutable_page() = pages_[0];
  msg.set_layer(1);
  msg.set_data(std::string(PageBytes(Layout::kV4, 16), '\x11'));
  writer->Write(msg);
  writer->WritesDone();
  EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  ExpectUnchanged();
}

TEST_F(DaemonInvalidTest, OversizedMessageIsResourceExhausted) {
  // 5000 rows = 5 MB in one message; the daemon takes at most 4 MiB.
  std::vector<v1::TokenLocation> where(5000, Location(pages_[2], 0));
  const grpc::Status s = Write(where, std::vector<uint16_t>(5000 * 512, 0), /*per=*/5000);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  ExpectUnchanged();
}

TEST_F(DaemonInvalidTest, PoolFullIsResourceExhausted) {
  grpc::ClientContext ctx;
  v1::AllocatePagesRequest req;
  req.set_pool("p");
  req.set_count(5);  // 4 of 8 are free
  v1::AllocatePagesResponse resp;
  const grpc::Status s = d_.stub().AllocatePages(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(s.error_message().find("is full"), std::string::npos) << s.error_message();
  EXPECT_EQ(resp.pages_size(), 0);
  ExpectUnchanged();
  EXPECT_EQ(testing::GetStats(d_).pools(0).pages_used(), 4u);
}

TEST_F(DaemonInvalidTest, PoolLargerThanDeviceMemoryIsResourceExhaustedAndAllocatesNothing) {
  grpc::ClientContext ctx;
  v1::CreatePoolRequest req;
  req.set_name("huge");
  req.set_layout(v1::LAYOUT_V4);
  req.set_page_size(4096);
  req.set_num_pages(uint64_t{1} << 28);  // ~640 TB
  req.set_num_layers(1);
  req.set_device(testing::TestDevice());
  v1::Pool pool;
  EXPECT_EQ(d_.stub().CreatePool(&ctx, req, &pool).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(testing::GetStats(d_).pools_size(), 1);
  ExpectUnchanged();
}

TEST_F(DaemonInvalidTest, UnknownLayoutAndBadPageSizeAreInvalidArgument) {
  for (auto [layout, page_size] : {std::pair{v1::LAYOUT_UNSPECIFIED, 16}, {v1::LAYOUT_V4, 48}}) {
    grpc::ClientContext ctx;
    v1::CreatePoolRequest req;
    req.set_name("bad");
    req.set_layout(layout);
    req.set_page_size(page_size);
    req.set_num_pages(4);
    req.set_num_layers(1);
    v1::Pool pool;
    EXPECT_EQ(d_.stub().CreatePool(&ctx, req, &pool).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  ExpectUnchanged();
}

// ---- clients that go away -----------------------------------------------------------------

TEST(DaemonClientGoneTest, CancelledAndExpiredWritesLeaveNothingAndDaemonServes) {
  Daemon d;
  testing::CreatePool(d, "c", Layout::kV41Fp4, 64, 16);
  const auto pages = testing::Allocate(d, "c", 2);
  const auto rows = testing::RandomRows(64, 9);
  v1::WriteTokensRequest msg;
  msg.set_pool("c");
  for (int i = 0; i < 64; ++i) *msg.add_locations() = Location(pages[0], i);
  msg.set_rows(reinterpret_cast<const char*>(rows.data()), rows.size() * 2);
  {  // cancelled after one message
    grpc::ClientContext ctx;
    v1::WriteResponse resp;
    auto writer = d.stub().WriteTokens(&ctx, &resp);
    ASSERT_TRUE(writer->Write(msg));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ctx.TryCancel();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  {  // deadline passes mid-stream
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
    v1::WriteResponse resp;
    auto writer = d.stub().WriteTokens(&ctx, &resp);
    writer->Write(msg);
    std::this_thread::sleep_for(std::chrono::milliseconds(600));
    writer->WritesDone();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  {  // a read cancelled after its first chunk
    grpc::ClientContext ctx;
    v1::ReadPagesRequest req;
    req.set_pool("c");
    *req.add_pages() = pages[0];
    *req.add_pages() = pages[1];
    req.set_chunk_bytes(4096);
    auto reader = d.stub().ReadPages(&ctx, req);
    v1::PageChunk chunk;
    ASSERT_TRUE(reader->Read(&chunk));
    ctx.TryCancel();
    while (reader->Read(&chunk)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  // Nothing was written, nothing leaked, and the daemon still serves.
  v1::Stats stats = testing::GetStats(d);
  EXPECT_EQ(stats.tokens_held(), 0u);
  EXPECT_EQ(stats.pools(0).pages_used(), 2u);
  std::string bytes;
  ASSERT_TRUE(testing::ReadPages(d, "c", pages, &bytes).ok());
  EXPECT_EQ(bytes, std::string(2 * PageBytes(Layout::kV41Fp4, 64), '\0'));
  std::vector<v1::TokenLocation> where;
  for (int i = 0; i < 64; ++i) where.push_back(Location(pages[0], i));
  ASSERT_TRUE(testing::WriteTokens(d, "c", 0, where, rows).ok());
  EXPECT_EQ(testing::GetStats(d).tokens_held(), 64u);
}

// ---- concurrency ---------------------------------------------------------------------------

TEST(DaemonConcurrencyTest, SixteenClientsWriteAndReadDisjointPages) {
  Daemon d;
  testing::CreatePool(d, "shared", Layout::kV4, 64, 16 * 4, 2);
  std::atomic<int> failures{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < 16; ++c) {
    clients.emplace_back([&d, &failures, c] {
      const auto pages = testing::Allocate(d, "shared", 4);
      const int n = 200;
      const auto rows = testing::RandomRows(n, 100 + c);
      std::vector<v1::TokenLocation> where;
      std::vector<int64_t> local;  // token index within a 4-page reference pool
      for (int i = 0; i < n; ++i) {  // page i % 4, slot i / 4: all distinct
        where.push_back(Location(pages[i % 4], i / 4));
        local.push_back((i % 4) * 64 + i / 4);
      }
      for (int round = 0; round < 3; ++round) {
        if (!testing::WriteTokens(d, "shared", round % 2, where, rows, 64).ok()) ++failures;
        std::vector<uint16_t> back;
        if (!testing::ReadWorkspace(d, "shared", round % 2, where, &back).ok()) ++failures;
        // Expected: the CPU reference's quantize → dequantize of the same rows.
        const PoolGeometry g{Layout::kV4, 64, 4};
        std::vector<uint8_t> pool(g.pool_bytes(), 0);
        std::vector<uint16_t> expected(rows.size());
        if (!reference::QuantizeStore(g, rows, local, pool).ok() ||
            !reference::DequantizeGather(g, pool, local, expected).ok() || back != expected) {
          ++failures;
        }
      }
    });
  }
  for (auto& t : clients) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(testing::GetStats(d).pools(0).pages_used(), 64u);
  EXPECT_EQ(testing::GetStats(d).tokens_held(), 16u * 200u);
}

// ---- threads -------------------------------------------------------------------------------

TEST(DaemonThreadsTest, EveryThreadButTheMainOneIsNamed) {
  // An operator's `top -H` or `ps -L` tells kvferry's threads ("kvf-...") from gRPC's and
  // UCX's: after a write and a read, none but the main thread carries the process's name, and
  // the metrics server's threads (cpp-httplib's pool with them) are kvferry's.
  Daemon d;
  testing::CreatePool(d, "named", Layout::kV4, 64, 4);
  const auto pages = testing::Allocate(d, "named", 1);
  ASSERT_EQ(pages.size(), 1u);
  const std::vector<v1::TokenLocation> where = {Location(pages[0], 0), Location(pages[0], 1)};
  ASSERT_TRUE(testing::WriteTokens(d, "named", 0, where, testing::RandomRows(2, 5), 2).ok());
  std::vector<uint16_t> back;
  ASSERT_TRUE(testing::ReadWorkspace(d, "named", 0, where, &back).ok());
  ASSERT_NE(testing::Metrics(d).find("kvferry_"), std::string::npos);
  std::map<std::string, int> threads = testing::ThreadCounts(d.pid());
#if defined(KVFERRY_TEST_TSAN)
  const int unnamed = 2;  // and ThreadSanitizer's own background thread
#else
  const int unnamed = 1;
#endif
  EXPECT_EQ(threads["kvferryd"], unnamed) << testing::ThreadNames(threads);
  EXPECT_GE(threads["kvf-http"], 2) << testing::ThreadNames(threads);
}

TEST(DaemonLargeWriteTest, AWriteOverSeveralStagingChunksStoresTheReferenceBytes) {
  // 10000 rows (9.8 MiB): more than two 4 MiB staging chunks, scattered over 200 pages, so
  // the commit stores chunk by chunk (from the staging itself on the cpu backend).
  Daemon d;
  const int ps = 64, num_pages = 200, n = 10000;
  testing::CreatePool(d, "big", Layout::kV41Fp4, ps, num_pages);
  const auto pages = testing::Allocate(d, "big", num_pages);
  const auto rows = testing::RandomRows(n, 77);
  const auto locs = testing::ScatteredLocations(n, int64_t{num_pages} * ps, 78);
  std::vector<v1::TokenLocation> where;
  for (int64_t loc : locs) where.push_back(Location(pages[loc / ps], loc % ps));
  ASSERT_TRUE(testing::WriteTokens(d, "big", 0, where, rows, 1000).ok());
  // Expected: the CPU reference on a pool whose page i is the daemon's pages[i].
  const PoolGeometry g{Layout::kV41Fp4, ps, num_pages};
  std::vector<uint8_t> expected(g.pool_bytes(), 0);
  ASSERT_TRUE(reference::QuantizeStore(g, rows, locs, expected).ok());
  std::string bytes;
  ASSERT_TRUE(testing::ReadPages(d, "big", pages, &bytes).ok());
  ASSERT_EQ(bytes.size(), expected.size());
  EXPECT_TRUE(std::equal(expected.begin(), expected.end(),
                         reinterpret_cast<const uint8_t*>(bytes.data())));
}

// ---- metrics -----------------------------------------------------------------------------

std::string Fetch(int port, const std::string& path) {
  httplib::Client client("127.0.0.1", port);
  auto res = client.Get(path);
  return res && res->status == 200 ? res->body : "";
}

TEST(DaemonMetricsTest, PromtoolAcceptsTheExpositionAndPrometheusScrapesSavings) {
  // deploy/install-deps.sh installs Prometheus; only a machine that cannot have it (a
  // lent GPU machine without a package registry) may say so explicitly and skip.
  if (std::getenv("KVFERRY_NO_PROMETHEUS") != nullptr) GTEST_SKIP() << "KVFERRY_NO_PROMETHEUS set";
  Daemon d;
  testing::CreatePool(d, "m", Layout::kV41, 64, 8);
  const auto pages = testing::Allocate(d, "m", 2);
  std::vector<v1::TokenLocation> where;
  for (int i = 0; i < 100; ++i) where.push_back(Location(pages[i / 64], i % 64));
  ASSERT_TRUE(testing::WriteTokens(d, "m", 0, where, testing::RandomRows(100, 11)).ok());
  testing::WriteTokens(d, "m", 0, {Location(pages[0], 0)}, std::vector<uint16_t>(512, 0x7FC0));

  const std::string text = Fetch(d.metrics_port(), "/metrics");
  ASSERT_FALSE(text.empty());
  EXPECT_NE(text.find("kvferry_pool_bytes_saved{pool=\"m\",layout=\"v41\",device=\"" +
                      testing::TestDevice() + "\",baseline=\"bf16\"} 49600"),
            std::string::npos)
      << text.substr(0, 3000);  // 100 tokens × (1024 − 528)
  EXPECT_NE(text.find("kvferry_rpc_requests_total{method=\"WriteTokens\",code=\"INVALID_ARGUMENT\"} 1"),
            std::string::npos);
  if (testing::TestDevice() == "cpu") {
    // On host memory each message's rows are quantized as they arrive (the NaN's message
    // too: the check is part of that pass), and the commit moves the records.
    EXPECT_NE(text.find("kvferry_kernel_seconds_count{op=\"quantize_store\",layout=\"v41\"} 2"),
              std::string::npos);
    EXPECT_NE(text.find("kvferry_kernel_seconds_count{op=\"copy_records\",layout=\"v41\"} 1"),
              std::string::npos);
  } else {
    EXPECT_NE(text.find("kvferry_kernel_seconds_count{op=\"quantize_store\",layout=\"v41\"} 1"),
              std::string::npos);
  }
  EXPECT_NE(text.find("kvferry_rpc_latency_seconds_count{method=\"WriteTokens\",code=\"OK\"} 1"),
            std::string::npos);
  EXPECT_NE(text.find("kvferry_errors_total{method=\"WriteTokens\",reason=\"non_finite_value\"} 1"),
            std::string::npos);

  // promtool's linter.
  const std::string file = d.dir() + "/metrics.txt";
  std::ofstream(file) << text;
  const std::string log = d.dir() + "/promtool.log";
  const int promtool = std::system(("promtool check metrics < " + file + " > " + log + " 2>&1").c_str());
  const auto promtool_output = testing::ReadBytes(log);
  EXPECT_EQ(promtool, 0) << std::string(promtool_output.begin(), promtool_output.end());

  // A real Prometheus scrapes the endpoint; its HTTP API must return the savings figure.
  const int prom_port = 20000 + (getpid() % 20000);
  std::ofstream(d.dir() + "/prometheus.yml")
      << "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: kvferryd\n"
      << "    static_configs:\n      - targets: ['127.0.0.1:" << d.metrics_port() << "']\n";
  const pid_t prom = fork();
  if (prom == 0) {
    const std::string config = "--config.file=" + d.dir() + "/prometheus.yml";
    const std::string storage = "--storage.tsdb.path=" + d.dir() + "/tsdb";
    const std::string listen = "--web.listen-address=127.0.0.1:" + std::to_string(prom_port);
    freopen((d.dir() + "/prometheus.log").c_str(), "w", stderr);
    execlp("prometheus", "prometheus", config.c_str(), storage.c_str(), listen.c_str(), nullptr);
    _exit(127);
  }
  std::string answer;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < deadline) {
    answer = Fetch(prom_port, "/api/v1/query?query=kvferry_pool_bytes_saved%7Bbaseline%3D%22bf16%22%7D");
    if (answer.find("\"49600\"") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  kill(prom, SIGTERM);
  waitpid(prom, nullptr, 0);
  EXPECT_NE(answer.find("\"49600\""), std::string::npos) << answer;
  EXPECT_NE(answer.find("\"pool\":\"m\""), std::string::npos) << answer;
}

// ---- shutdown -----------------------------------------------------------------------------

TEST(DaemonShutdownTest, SigtermDuringTrafficExitsZero) {
  Daemon d;
  testing::CreatePool(d, "s", Layout::kV41, 16, 64);
  const auto pages = testing::Allocate(d, "s", 8);
  std::atomic<bool> stop{false};
  std::atomic<int> ok_calls{0};
  std::vector<std::thread> traffic;
  for (int t = 0; t < 4; ++t) {
    traffic.emplace_back([&, t] {
      const auto rows = testing::RandomRows(16, t);
      std::vector<v1::TokenLocation> where;
      for (int i = 0; i < 16; ++i) where.push_back(Location(pages[2 * t], i));
      while (!stop) {
        if (testing::WriteTokens(d, "s", 0, where, rows, 4).ok()) ++ok_calls;
        std::vector<uint16_t> back;
        testing::ReadWorkspace(d, "s", 0, where, &back);
      }
    });
  }
  while (ok_calls < 20) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(d.Terminate(), 0);
  stop = true;
  for (auto& t : traffic) t.join();
}

}  // namespace
}  // namespace kvferry
