// Issue #17 through the real kvferryd: each way a client could make the daemon hold
// without bound — staged bytes, open streams, idle and endless streams, empty messages,
// pools, host memory, dead peers, slow HTTP clients, huge listings — is now answered with
// RESOURCE_EXHAUSTED or a timely end, with a reason, while a well-behaved client is served.
#include <arpa/inet.h>
#include <httplib.h>
#include <netinet/in.h>
#include <openssl/evp.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include <atomic>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <thread>

#include "common/random_rows.h"
#include "daemon_harness.h"
#include "metrics_scrape.h"
#include "kvferry/v1/cache.grpc.pb.h"
#include "kvferry/v1/session.grpc.pb.h"
#include "test_certs.h"

namespace kvferry {
namespace {

using testing::Daemon;
using testing::Location;
using testing::Metrics;
using testing::Sample;
using testing::RandomRows;
using testing::ReasonOf;
using Clock = std::chrono::steady_clock;

// Polls `done` every 50 ms for up to `seconds`.
bool Eventually(const std::function<bool()>& done, int seconds = 30) {
  const auto deadline = Clock::now() + std::chrono::seconds(seconds);
  while (Clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::string Sha256(const std::string& text) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  EVP_Digest(text.data(), text.size(), digest, &n, EVP_sha256(), nullptr);
  std::string hex;
  char byte[3];
  for (unsigned int i = 0; i < n; ++i) {
    std::snprintf(byte, sizeof(byte), "%02x", digest[i]);
    hex += byte;
  }
  return hex;
}

// A daemon with a token file: alice (token "tok-a") and bob ("tok-b"), no quotas of their
// own, so the --tenant_* defaults apply.
struct TwoTenants {
  std::string dir;
  std::unique_ptr<Daemon> d;
  explicit TwoTenants(std::vector<std::string> flags) {
    char tmp[] = "/tmp/kvferry-gov-XXXXXX";
    if (mkdtemp(tmp) == nullptr) throw std::runtime_error("mkdtemp");
    dir = tmp;
    testing::WriteFile(dir + "/tokens",
                       "alice " + Sha256("tok-a") + "\nbob " + Sha256("tok-b") + "\n");
    flags.push_back("--auth_tokens=" + dir + "/tokens");
    d = std::make_unique<Daemon>(flags);
  }
  ~TwoTenants() { std::system(("rm -rf '" + dir + "'").c_str()); }
};

// What all clients together use of a daemon-wide budget ("streams").
double Used(Daemon& d, const std::string& resource) {
  return Sample(Metrics(d), "kvferry_budget_used{resource=\"" + resource + "\"}");
}

// 64 locations in `page` (page_size 64) and rows for them.
std::vector<v1::TokenLocation> Slots(const v1::PageHandle& page, int n = 64) {
  std::vector<v1::TokenLocation> locs;
  for (int i = 0; i < n; ++i) locs.push_back(Location(page, i));
  return locs;
}

v1::WriteTokensRequest RowsMessage(const std::string& pool, const std::vector<v1::TokenLocation>& locs,
                                   const std::vector<uint16_t>& rows) {
  v1::WriteTokensRequest msg;
  msg.set_pool(pool);
  msg.set_layer(0);
  for (const auto& l : locs) *msg.add_locations() = l;
  msg.set_rows(reinterpret_cast<const char*>(rows.data()), locs.size() * kBf16RowBytes);
  return msg;
}

// A write stream held open by a client that stops sending.
struct OpenWrite {
  grpc::ClientContext ctx;
  v1::WriteResponse resp;
  std::unique_ptr<grpc::ClientWriter<v1::WriteTokensRequest>> writer;
  OpenWrite(Daemon& d, const v1::WriteTokensRequest& first) {
    writer = d.stub().WriteTokens(&ctx, &resp);
    writer->Write(first);
  }
  ~OpenWrite() {
    ctx.TryCancel();
    writer->Finish();
  }
};

grpc::Status ReadAll(Daemon& d, const std::string& pool, const std::vector<v1::PageHandle>& pages,
                     std::string* reason = nullptr) {
  std::string bytes;
  return testing::ReadPages(d, pool, pages, &bytes, v1::LAYOUT_UNSPECIFIED, {}, reason);
}

grpc::Status List(Daemon& d, v1::ListPoolsResponse* out, uint32_t page_size = 0,
                  const std::string& token = "", std::string* reason = nullptr) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::ListPoolsRequest req;
  req.set_page_size(page_size);
  req.set_page_token(token);
  const grpc::Status s = d.stub().ListPools(&ctx, req, out);
  if (reason != nullptr) *reason = ReasonOf(ctx);
  return s;
}

// ---- staged write bytes --------------------------------------------------------------------

TEST(StagedBudgetTest, WritesBeyondTheDaemonBudgetAreRefusedWhileReadsGoOn) {
  // 128 rows staged at once by all writes together.
  const int64_t budget = 128 * testing::StagedBytesPerRow(Layout::kV41);
  Daemon d({"--max_staged_write_bytes=" + std::to_string(budget)});
  testing::CreatePool(d, "p", Layout::kV41, 64, 8);
  const auto pages = testing::Allocate(d, "p", 4);
  const auto rows = RandomRows(64, 1);
  {
    // Two hostile writers stage 64 rows each and stop sending: the budget is used up.
    OpenWrite a(d, RowsMessage("p", Slots(pages[0]), rows));
    OpenWrite b(d, RowsMessage("p", Slots(pages[1]), rows));
    ASSERT_TRUE(Eventually([&] { return Used(d, "staged_write_bytes") == budget; }));
    std::string reason;
    grpc::Status refused;
    ASSERT_TRUE(Eventually([&] {
      refused = testing::WriteTokens(d, "p", 0, Slots(pages[2], 1), rows, 256, nullptr, &reason);
      return !refused.ok();
    }));
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_EQ(reason, "DAEMON_BUDGET_EXHAUSTED");
    EXPECT_NE(refused.error_message().find("staged_write_bytes"), std::string::npos)
        << refused.error_message();
    // Reads, listings and allocations go on; the refused write stored nothing.
    EXPECT_TRUE(ReadAll(d, "p", pages).ok());
    v1::ListPoolsResponse listed;
    EXPECT_TRUE(List(d, &listed).ok());
    EXPECT_EQ(testing::Allocate(d, "p", 1).size(), 1u);
    EXPECT_EQ(testing::GetStats(d).tokens_held(), 0u);
    EXPECT_GE(Sample(Metrics(d),
                     "kvferry_refusals_total{reason=\"daemon_budget_exhausted\",resource=\"staged_write_bytes\"}"),
              1);
  }
  // The hostile streams are gone: the same write goes through.
  EXPECT_TRUE(Eventually(
      [&] { return testing::WriteTokens(d, "p", 0, Slots(pages[2]), rows).ok(); }));
  EXPECT_EQ(testing::GetStats(d).tokens_held(), 64u);
}

TEST(StagedBudgetTest, ATenantAtItsShareIsRefusedWhileAnotherTenantWrites) {
  // Daemon budget of 512 rows, so each tenant may stage a quarter: 128 rows.
  const int64_t share = 128 * testing::StagedBytesPerRow(Layout::kV41);
  TwoTenants t({"--max_staged_write_bytes=" + std::to_string(4 * share)});
  Daemon& d = *t.d;
  d.Connect(grpc::InsecureChannelCredentials(), "tok-a");
  testing::CreatePool(d, "p", Layout::kV41, 64, 8);
  const auto alice_pages = testing::Allocate(d, "p", 4);
  d.Connect(grpc::InsecureChannelCredentials(), "tok-b");
  testing::CreatePool(d, "p", Layout::kV41, 64, 8);
  const auto bob_pages = testing::Allocate(d, "p", 4);
  const auto rows = RandomRows(64, 2);

  d.Connect(grpc::InsecureChannelCredentials(), "tok-a");
  OpenWrite a(d, RowsMessage("p", Slots(alice_pages[0]), rows));
  OpenWrite b(d, RowsMessage("p", Slots(alice_pages[1]), rows));
  ASSERT_TRUE(Eventually([&] { return Used(d, "staged_write_bytes") == share; }));
  std::string reason;
  grpc::Status refused;
  ASSERT_TRUE(Eventually([&] {
    refused = testing::WriteTokens(d, "p", 0, Slots(alice_pages[2], 1), rows, 256, nullptr, &reason);
    return !refused.ok();
  }));
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(reason, "QUOTA_EXCEEDED");

  // Bob writes twice as much as alice may stage, in two writes, and reads it back.
  d.Connect(grpc::InsecureChannelCredentials(), "tok-b");
  EXPECT_TRUE(testing::WriteTokens(d, "p", 0, Slots(bob_pages[0]), rows).ok());
  EXPECT_TRUE(testing::WriteTokens(d, "p", 0, Slots(bob_pages[1]), rows).ok());
  EXPECT_TRUE(ReadAll(d, "p", bob_pages).ok());
  EXPECT_EQ(testing::GetStats(d).tokens_held(), 128u);
}

// ---- streams -------------------------------------------------------------------------------

TEST(StreamBudgetTest, StreamsBeyondTheBudgetAreRefusedAndUnaryCallsAreServed) {
  Daemon d({"--max_streams=4", "--stream_idle_timeout_seconds=0"});
  testing::CreatePool(d, "p", Layout::kV4, 64, 8);
  const auto pages = testing::Allocate(d, "p", 2);
  const auto rows = RandomRows(1, 3);
  std::vector<std::unique_ptr<OpenWrite>> held;
  for (int i = 0; i < 4; ++i) {
    held.push_back(std::make_unique<OpenWrite>(d, RowsMessage("p", {Location(pages[0], i)}, rows)));
  }
  ASSERT_TRUE(Eventually([&] { return Used(d, "streams") == 4; }));
  EXPECT_EQ(Sample(Metrics(d), "kvferry_budget_limit{resource=\"streams\"}"), 4);
  std::string reason;
  grpc::Status refused;
  ASSERT_TRUE(Eventually([&] {
    refused = ReadAll(d, "p", pages, &reason);
    return !refused.ok();
  }));
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(reason, "DAEMON_BUDGET_EXHAUSTED");
  EXPECT_NE(refused.error_message().find("streams"), std::string::npos);
  v1::ListPoolsResponse listed;
  EXPECT_TRUE(List(d, &listed).ok());
  EXPECT_EQ(listed.pools_size(), 1);
  EXPECT_EQ(testing::Allocate(d, "p", 1).size(), 1u);
  held.pop_back();
  EXPECT_TRUE(Eventually([&] { return ReadAll(d, "p", pages).ok(); }));
}

TEST(StreamBudgetTest, ATenantAtItsStreamsIsRefusedWhileAnotherTenantStreams) {
  TwoTenants t({"--tenant_max_streams=2", "--stream_idle_timeout_seconds=0"});
  Daemon& d = *t.d;
  const auto rows = RandomRows(1, 4);
  d.Connect(grpc::InsecureChannelCredentials(), "tok-b");
  testing::CreatePool(d, "p", Layout::kV4, 64, 8);
  const auto bob_pages = testing::Allocate(d, "p", 2);
  d.Connect(grpc::InsecureChannelCredentials(), "tok-a");
  testing::CreatePool(d, "p", Layout::kV4, 64, 8);
  const auto pages = testing::Allocate(d, "p", 2);
  OpenWrite a(d, RowsMessage("p", {Location(pages[0], 0)}, rows));
  OpenWrite b(d, RowsMessage("p", {Location(pages[0], 1)}, rows));
  ASSERT_TRUE(Eventually([&] { return Used(d, "streams") == 2; }));
  std::string reason;
  grpc::Status refused;
  ASSERT_TRUE(Eventually([&] {
    refused = ReadAll(d, "p", pages, &reason);
    return !refused.ok();
  }));
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(reason, "QUOTA_EXCEEDED");
  d.Connect(grpc::InsecureChannelCredentials(), "tok-b");
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(ReadAll(d, "p", bob_pages).ok());
  EXPECT_TRUE(testing::WriteTokens(d, "p", 0, {Location(bob_pages[0], 0)}, rows).ok());
}

// ---- time bounds ---------------------------------------------------------------------------

TEST(StreamTimeTest, IdleWriteAndUnreadReadAreCancelledAndTheirSlotsComeBack) {
  Daemon d({"--max_streams=2", "--stream_idle_timeout_seconds=1"});
  // 38 MB of pages: far more than gRPC buffers for a client that does not read.
  testing::CreatePool(d, "p", Layout::kV4, 64, 1024);
  const auto pages = testing::Allocate(d, "p", 1024);
  const auto rows = RandomRows(64, 5);
  const auto start = Clock::now();
  grpc::ClientContext write_ctx;
  v1::WriteResponse write_resp;
  auto writer = d.stub().WriteTokens(&write_ctx, &write_resp);
  ASSERT_TRUE(writer->Write(RowsMessage("p", Slots(pages[0]), rows)));
  grpc::ClientContext read_ctx;
  v1::ReadPagesRequest req;
  req.set_pool("p");
  for (const auto& p : pages) *req.add_pages() = p;
  auto reader = d.stub().ReadPages(&read_ctx, req);
  v1::PageChunk chunk;
  ASSERT_TRUE(reader->Read(&chunk));  // one chunk, then the client stops reading

  // Both end within a few seconds of the 1 s timeout (bounds generous for a loaded machine).
  const grpc::Status w = writer->Finish();
  EXPECT_EQ(w.error_code(), grpc::StatusCode::CANCELLED) << w.error_message();
  // The reader keeps not reading until the daemon has ended its stream too.
  const std::string expired =
      "kvferry_refusals_total{reason=\"stream_idle_timeout\",resource=\"streams\"}";
  EXPECT_TRUE(Eventually([&] { return Sample(Metrics(d), expired) >= 2; }));
  while (reader->Read(&chunk)) {
  }
  const grpc::Status r = reader->Finish();
  EXPECT_EQ(r.error_code(), grpc::StatusCode::CANCELLED) << r.error_message();
  EXPECT_LT(SecondsSince(start), 30);
  // Nothing of the write was stored; both slots are free again.
  EXPECT_EQ(testing::GetStats(d).tokens_held(), 0u);
  EXPECT_TRUE(Eventually([&] { return testing::WriteTokens(d, "p", 0, Slots(pages[1]), rows).ok(); }));
  EXPECT_TRUE(ReadAll(d, "p", {pages[1]}).ok());
}

TEST(StreamTimeTest, AStreamThatKeepsSendingIsCancelledAtTheLongestDuration) {
  Daemon d({"--max_stream_seconds=2", "--stream_idle_timeout_seconds=0"});
  testing::CreatePool(d, "p", Layout::kV4, 64, 8);
  const auto pages = testing::Allocate(d, "p", 4);
  const auto rows = RandomRows(1, 6);
  grpc::ClientContext ctx;
  v1::WriteResponse resp;
  auto writer = d.stub().WriteTokens(&ctx, &resp);
  const auto start = Clock::now();
  int sent = 0;
  // One row every 100 ms: never idle. The daemon ends the stream; Write then fails.
  while (SecondsSince(start) < 60 && sent < 256 &&
         writer->Write(RowsMessage("p", {Location(pages[sent / 64], sent % 64)}, rows))) {
    ++sent;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const grpc::Status s = writer->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << s.error_message();
  EXPECT_GE(SecondsSince(start), 1.5);
  EXPECT_LT(sent, 256) << "the stream was never ended";
  EXPECT_EQ(testing::GetStats(d).tokens_held(), 0u);
  EXPECT_GE(Sample(Metrics(d), "kvferry_refusals_total{reason=\"stream_too_long\",resource=\"streams\"}"), 1);
  EXPECT_TRUE(testing::WriteTokens(d, "p", 0, {Location(pages[0], 0)}, rows).ok());
}

TEST(StreamTimeTest, MessagesWithoutRowsAfterTheFirstAreInvalidArgument) {
  Daemon d;
  testing::CreatePool(d, "p", Layout::kV4, 64, 8);
  const auto pages = testing::Allocate(d, "p", 1);
  const auto rows = RandomRows(1, 7);
  grpc::ClientContext ctx;
  v1::WriteResponse resp;
  auto writer = d.stub().WriteTokens(&ctx, &resp);
  v1::WriteTokensRequest first;  // names pool and layer only: allowed
  first.set_pool("p");
  first.set_layer(0);
  ASSERT_TRUE(writer->Write(first));
  ASSERT_TRUE(writer->Write(RowsMessage("p", {Location(pages[0], 0)}, rows)));
  // Before: 2 000 000 of these were taken (+138 MiB) and the write answered OK.
  for (int i = 0; i < 10000 && writer->Write(v1::WriteTokensRequest()); ++i) {
  }
  writer->WritesDone();
  const grpc::Status s = writer->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_EQ(ReasonOf(ctx), "INVALID_REQUEST");
  EXPECT_NE(s.error_message().find("carries no data"), std::string::npos) << s.error_message();
  EXPECT_EQ(testing::GetStats(d).tokens_held(), 0u);
  // Pool and layer alone, then rows: a normal write.
  grpc::ClientContext ok_ctx;
  auto ok = d.stub().WriteTokens(&ok_ctx, &resp);
  ASSERT_TRUE(ok->Write(first));
  v1::WriteTokensRequest last = RowsMessage("", {Location(pages[0], 0)}, rows);
  last.set_finish_write(true);
  ASSERT_TRUE(ok->Write(last));
  ok->WritesDone();
  EXPECT_TRUE(ok->Finish().ok());
  EXPECT_EQ(resp.tokens_written(), 1u);
}

// A client process that opens a write stream, says so on `ready`, and then hangs; the
// daemon's port comes through `port`. Forked before this process starts any gRPC thread.
pid_t StartStreamHolder(int port_fd, int ready_fd) {
  const pid_t pid = fork();
  if (pid != 0) return pid;
  int port = 0;
  if (read(port_fd, &port, sizeof(port)) != sizeof(port)) _exit(1);
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                     grpc::InsecureChannelCredentials());
  auto stub = v1::KvFerry::NewStub(channel);
  grpc::ClientContext ctx;
  v1::WriteResponse resp;
  auto writer = stub->WriteTokens(&ctx, &resp);
  v1::WriteTokensRequest first;
  first.set_pool("p");
  first.set_layer(0);
  writer->Write(first);
  const char ok = 1;
  if (write(ready_fd, &ok, 1) != 1) _exit(1);
  while (true) pause();
}

TEST(KeepaliveTest, AFrozenClientsStreamIsReleasedWithinSeconds) {
  int to_child[2], from_child[2];
  ASSERT_EQ(pipe(to_child), 0);
  ASSERT_EQ(pipe(from_child), 0);
  const pid_t child = StartStreamHolder(to_child[0], from_child[1]);
  ASSERT_GT(child, 0);
  // No idle timeout: only keepalive can find the frozen client.
  Daemon d({"--max_streams=1", "--stream_idle_timeout_seconds=0", "--keepalive_seconds=1",
            "--keepalive_timeout_seconds=1"});
  testing::CreatePool(d, "p", Layout::kV4, 64, 8);
  const auto pages = testing::Allocate(d, "p", 1);
  const int port = d.grpc_port();
  ASSERT_EQ(write(to_child[1], &port, sizeof(port)), static_cast<ssize_t>(sizeof(port)));
  char ok = 0;
  ASSERT_EQ(read(from_child[0], &ok, 1), 1);
  ASSERT_TRUE(Eventually([&] { return Used(d, "streams") == 1; }));
  std::string reason;
  ASSERT_TRUE(Eventually([&] { return !ReadAll(d, "p", pages, &reason).ok(); }));
  EXPECT_EQ(reason, "DAEMON_BUDGET_EXHAUSTED") << "the client holds the one stream";
  // Frozen: the kernel still acknowledges its TCP segments, but nobody answers a ping.
  kill(child, SIGSTOP);
  const auto start = Clock::now();
  EXPECT_TRUE(Eventually([&] { return ReadAll(d, "p", pages).ok(); }, 60));
  const double seconds = SecondsSince(start);
  std::printf("frozen client's stream released after %.1f s\n", seconds);
  EXPECT_LT(seconds, 30);
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
}

// A synchronous gRPC client answers pings only from a thread inside one of its calls, or
// from its backup poller (every 5 s by default; off here, so that only the client's calls
// poll). This one writes half a page, is busy elsewhere for 8 s, then writes the rest; its
// exit status is 0 when the write committed whole, 2 when it failed. The daemon's port, then
// the page's id and generation, come through `from_parent`. Forked before this process
// starts any gRPC thread.
pid_t StartBusyWriter(int from_parent, const std::vector<uint16_t>& rows) {
  const pid_t pid = fork();
  if (pid != 0) return pid;
  setenv("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "0", 1);
  int port = 0;
  uint64_t handle[2] = {};
  if (read(from_parent, &port, sizeof(port)) != sizeof(port) ||
      read(from_parent, handle, sizeof(handle)) != sizeof(handle)) {
    _exit(1);
  }
  v1::PageHandle page;
  page.set_page_id(handle[0]);
  page.set_generation(handle[1]);
  const std::vector<v1::TokenLocation> slots = Slots(page);
  auto stub = v1::KvFerry::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                                       grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::WriteResponse resp;
  auto writer = stub->WriteTokens(&ctx, &resp);
  const std::vector<uint16_t> second_half(rows.begin() + rows.size() / 2, rows.end());
  const bool first = writer->Write(
      RowsMessage("p", {slots.begin(), slots.begin() + slots.size() / 2}, rows));
  std::this_thread::sleep_for(std::chrono::seconds(8));
  v1::WriteTokensRequest last =
      RowsMessage("", {slots.begin() + slots.size() / 2, slots.end()}, second_half);
  last.set_finish_write(true);
  const bool second = writer->Write(last);
  writer->WritesDone();
  const grpc::Status s = writer->Finish();
  std::printf("busy writer: writes %d %d, status %d %s\n", first, second, s.error_code(),
              s.error_message().c_str());
  std::fflush(stdout);
  _exit(s.ok() && resp.tokens_written() == slots.size() ? 0 : 2);
}

// Under the default keepalive timeout, a client busy between its calls for longer than the
// old 5 s default keeps its connection and its write. (The daemon cut such a connection at
// ping + 5 s: the TSan run of the transfer tests lost a 300 MB read to it.)
TEST(KeepaliveTest, AClientBusyBetweenItsCallsKeepsItsConnectionUnderTheDefaultTimeout) {
  int to_child[2];
  ASSERT_EQ(pipe(to_child), 0);
  const auto rows = RandomRows(64, 21);
  const pid_t child = StartBusyWriter(to_child[0], rows);
  ASSERT_GT(child, 0);
  Daemon d({"--keepalive_seconds=1"});  // pinged after 1 s of silence
  testing::CreatePool(d, "p", Layout::kV4, 64, 8);
  testing::CreatePool(d, "reference", Layout::kV4, 64, 8);
  const auto pages = testing::Allocate(d, "p", 1);
  const auto reference = testing::Allocate(d, "reference", 1);
  ASSERT_TRUE(testing::WriteTokens(d, "reference", 0, Slots(reference.at(0)), rows, 64).ok());
  const int port = d.grpc_port();
  const uint64_t handle[2] = {pages.at(0).page_id(), pages.at(0).generation()};
  ASSERT_EQ(write(to_child[1], &port, sizeof(port)), static_cast<ssize_t>(sizeof(port)));
  ASSERT_EQ(write(to_child[1], handle, sizeof(handle)), static_cast<ssize_t>(sizeof(handle)));
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the busy client's write failed (its output above)";
  std::string written, expected;
  ASSERT_TRUE(testing::ReadPages(d, "p", pages, &written).ok());
  ASSERT_TRUE(testing::ReadPages(d, "reference", reference, &expected).ok());
  EXPECT_TRUE(written == expected);
}

// ---- streams per connection, sessions and subscriptions ----------------------------------

// A channel of its own connection (gRPC would otherwise share one between equal channels).
std::shared_ptr<grpc::Channel> OwnConnection(const Daemon& d) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(d.grpc_port()),
                                   grpc::InsecureChannelCredentials(), args);
}

TEST(StreamBudgetTest, OneConnectionHoldsAtMostItsStreamsWhileAnotherConnectionIsServed) {
  Daemon d({"--max_streams_per_connection=3", "--max_streams=100",
            "--stream_idle_timeout_seconds=0"});
  testing::CreatePool(d, "p", Layout::kV4, 64, 8);
  const auto pages = testing::Allocate(d, "p", 2);
  const auto rows = RandomRows(1, 8);
  // Six write streams that stop sending, all on one connection; each opened on its own
  // thread, since a call beyond the connection's streams waits in the client.
  auto hostile = OwnConnection(d);
  auto hostile_stub = v1::KvFerry::NewStub(hostile);
  struct Held {
    grpc::ClientContext ctx;
    v1::WriteResponse resp;
    std::unique_ptr<grpc::ClientWriter<v1::WriteTokensRequest>> writer;
  };
  std::vector<std::unique_ptr<Held>> held;
  for (int i = 0; i < 6; ++i) held.push_back(std::make_unique<Held>());
  std::vector<std::thread> openers;
  for (int i = 0; i < 6; ++i) {
    openers.emplace_back([&, i] {
      held[i]->writer = hostile_stub->WriteTokens(&held[i]->ctx, &held[i]->resp);
      held[i]->writer->Write(RowsMessage("p", {Location(pages[0], i)}, rows));
    });
  }
  ASSERT_TRUE(Eventually([&] { return Used(d, "streams") == 3; }));
  std::this_thread::sleep_for(std::chrono::seconds(1));
  EXPECT_EQ(Used(d, "streams"), 3) << "the connection opened more streams than it may";
  // Another connection (the harness's channel) reads and writes as usual.
  EXPECT_TRUE(ReadAll(d, "p", pages).ok());
  EXPECT_TRUE(testing::WriteTokens(d, "p", 0, {Location(pages[1], 0)}, rows).ok());
  for (auto& h : held) h->ctx.TryCancel();
  for (auto& t : openers) t.join();
  for (auto& h : held) {
    if (h->writer) h->writer->Finish();
  }
  EXPECT_TRUE(Eventually([&] { return Used(d, "streams") == 0; }));
  // Nothing of the cancelled writes was stored: page 0 holds no token.
  EXPECT_EQ(testing::GetStats(d).tokens_held(), 1u);
}

// A session stream that said `open` and got its `opened` event.
struct OpenedSession {
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionEvent>> stream;
  bool opened = false;
};
std::unique_ptr<OpenedSession> OpenSession(Daemon& d, const std::string& worker) {
  auto s = std::make_unique<OpenedSession>();
  s->stream = v1::KvSession::NewStub(d.channel())->OpenSession(&s->ctx);
  v1::SessionRequest open;
  open.mutable_open()->set_worker(worker);
  v1::SessionEvent event;
  s->opened = s->stream->Write(open) && s->stream->Read(&event) && event.has_opened();
  return s;
}

TEST(SessionStreamTest, ASessionHoldsAStreamIsIdleBoundUntilOpenAndLongLivedOnceOpen) {
  Daemon d({"--max_streams=2", "--stream_idle_timeout_seconds=1", "--max_stream_seconds=2"});
  testing::CreatePool(d, "p", Layout::kV4, 64, 8);
  const auto pages = testing::Allocate(d, "p", 1);
  // An opened session, then a stream that never says `open`.
  const auto session = OpenSession(d, "governance");
  ASSERT_TRUE(session->opened);
  grpc::ClientContext mute_ctx;
  const auto start = Clock::now();
  auto mute = v1::KvSession::NewStub(d.channel())->OpenSession(&mute_ctx);
  ASSERT_TRUE(Eventually([&] { return Used(d, "streams") == 2; }));
  // Both count against the streams budget.
  std::string reason;
  const grpc::Status refused = ReadAll(d, "p", pages, &reason);
  if (Used(d, "streams") == 2) {
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_EQ(reason, "DAEMON_BUDGET_EXHAUSTED");
  }
  // The mute one is cancelled by the idle timeout; its slot comes back.
  v1::SessionEvent e;
  EXPECT_FALSE(mute->Read(&e));
  EXPECT_EQ(mute->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_LT(SecondsSince(start), 30);
  EXPECT_TRUE(Eventually([&] { return Used(d, "streams") == 1; }));
  EXPECT_GE(Sample(Metrics(d), "kvferry_refusals_total{reason=\"stream_idle_timeout\",resource=\"streams\"}"), 1);
  // The open session outlives the idle timeout and the longest duration.
  std::this_thread::sleep_for(std::chrono::seconds(4));
  EXPECT_EQ(Sample(Metrics(d), "kvferry_sessions"), 1);
  EXPECT_EQ(Used(d, "streams"), 1);
  session->stream->WritesDone();
  EXPECT_TRUE(session->stream->Finish().ok());
  EXPECT_TRUE(Eventually([&] { return Used(d, "streams") == 0; }));
}

TEST(SubscriptionStreamTest, ASubscriptionOutlivesTheLongestDurationAndShutdownEndsItAtOnce) {
  // A grace period far longer than the test allows: only cancelling the long-lived streams
  // lets the daemon exit in time.
  Daemon d({"--max_stream_seconds=2", "--stream_idle_timeout_seconds=5",
            "--shutdown_grace_seconds=60"});
  auto cache = v1::KvCache::NewStub(d.channel());
  grpc::ClientContext sub_ctx;
  v1::SubscribeEventsRequest req;
  auto events = cache->SubscribeEvents(&sub_ctx, req);
  v1::EventBatch batch;
  ASSERT_TRUE(events->Read(&batch));
  const uint64_t publisher = batch.publisher_id();
  EXPECT_NE(publisher, 0u);
  // Heartbeats keep coming past --max_stream_seconds.
  const auto start = Clock::now();
  while (SecondsSince(start) < 4) ASSERT_TRUE(events->Read(&batch)) << SecondsSince(start);
  // A session is open too, and neither reads nor writes.
  const auto session = OpenSession(d, "quiet");
  ASSERT_TRUE(session->opened);
  const auto stop = Clock::now();
  EXPECT_EQ(d.Terminate(), 0);
  const double seconds = SecondsSince(stop);
  std::printf("daemon with a subscription and a session exited in %.2f s\n", seconds);
  EXPECT_LT(seconds, 10);
  while (events->Read(&batch)) {
  }
  // UNAVAILABLE (SHUTTING_DOWN) when the event log's close reached the handler first,
  // CANCELLED when the cancel did.
  const grpc::StatusCode code = events->Finish().error_code();
  EXPECT_TRUE(code == grpc::StatusCode::UNAVAILABLE || code == grpc::StatusCode::CANCELLED) << code;
}

// ---- pools and memory ----------------------------------------------------------------------

TEST(PoolBudgetTest, PoolsBeyondTheDaemonBudgetAreRefusedUntilOneIsDeleted) {
  Daemon d({"--max_pools=8"});
  for (int i = 0; i < 8; ++i) testing::CreatePool(d, "p" + std::to_string(i), Layout::kV41Fp4, 1, 1);
  grpc::ClientContext ctx;
  v1::CreatePoolRequest req;
  req.set_name("one-too-many");
  req.set_layout(v1::LAYOUT_V41_FP4);
  req.set_page_size(1);
  req.set_num_pages(1);
  req.set_num_layers(1);
  v1::Pool pool;
  const grpc::Status s = d.stub().CreatePool(&ctx, req, &pool);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(ReasonOf(ctx), "DAEMON_BUDGET_EXHAUSTED");
  v1::ListPoolsResponse listed;
  ASSERT_TRUE(List(d, &listed).ok());
  EXPECT_EQ(listed.pools_size(), 8);
  ASSERT_TRUE(testing::DeletePool(d, "p0").ok());
  EXPECT_TRUE(Eventually([&] {
    grpc::ClientContext again;
    return d.stub().CreatePool(&again, req, &pool).ok();
  }));
}

TEST(MemoryCapTest, PoolsCountAgainstTheCapNotAgainstFreeMemoryAndReadsGoOn) {
  // 64 MiB cap: pools may take 56 MiB of it.
  Daemon d({"--cpu_memory_limit_bytes=67108864"});
  // V4, 64 tokens a page: 37376 bytes a page; 800 pages = 29.9 MB, in host memory whatever
  // the test device (the cap is the cpu backend's).
  testing::CreatePool(d, "a", Layout::kV4, 64, 800, 1, "cpu");
  const auto pages = testing::Allocate(d, "a", 4);
  const auto rows = RandomRows(64, 8);
  ASSERT_TRUE(testing::WriteTokens(d, "a", 0, Slots(pages[0]), rows).ok());
  grpc::ClientContext ctx;
  v1::CreatePoolRequest req;
  req.set_name("b");
  req.set_layout(v1::LAYOUT_V4);
  req.set_page_size(64);
  req.set_num_pages(800);
  req.set_num_layers(1);
  req.set_device("cpu");
  v1::Pool pool;
  const grpc::Status s = d.stub().CreatePool(&ctx, req, &pool);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << "free memory is far larger";
  EXPECT_EQ(ReasonOf(ctx), "DEVICE_OUT_OF_MEMORY");
  EXPECT_NE(s.error_message().find("cpu_memory_limit_bytes"), std::string::npos) << s.error_message();
  v1::ListPoolsResponse listed;
  ASSERT_TRUE(List(d, &listed).ok());
  EXPECT_EQ(listed.pools_size(), 1) << "nothing allocated";
  // The eighth kept back serves reads and writes of the pool that exists.
  std::string bytes;
  EXPECT_TRUE(testing::ReadPages(d, "a", pages, &bytes).ok());
  EXPECT_TRUE(testing::WriteTokens(d, "a", 0, Slots(pages[1]), rows).ok());
  ASSERT_TRUE(testing::DeletePool(d, "a").ok());
  EXPECT_TRUE(Eventually([&] {
    grpc::ClientContext again;
    return d.stub().CreatePool(&again, req, &pool).ok();
  }));
}

// ---- page leases --------------------------------------------------------------------------

std::vector<v1::PageHandle> AllocateLeased(Daemon& d, const std::string& pool, int count,
                                           uint32_t lease_seconds) {
  grpc::ClientContext ctx;
  v1::AllocatePagesRequest req;
  req.set_pool(pool);
  req.set_count(count);
  req.set_lease_seconds(lease_seconds);
  v1::AllocatePagesResponse resp;
  const grpc::Status s = d.stub().AllocatePages(&ctx, req, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return {resp.pages().begin(), resp.pages().end()};
}

grpc::Status Renew(Daemon& d, const std::string& pool, const std::vector<v1::PageHandle>& pages,
                   std::string* reason = nullptr) {
  grpc::ClientContext ctx;
  v1::RenewPagesRequest req;
  req.set_pool(pool);
  for (const auto& p : pages) *req.add_pages() = p;
  v1::RenewPagesResponse resp;
  const grpc::Status s = d.stub().RenewPages(&ctx, req, &resp);
  if (reason != nullptr) *reason = ReasonOf(ctx);
  return s;
}

TEST(LeaseTest, UnrenewedLeasedPagesAreFreedZeroedAndStaleWhileRenewedAndPlainOnesStay) {
  Daemon d;
  testing::CreatePool(d, "p", Layout::kV41, 64, 16);
  const auto rows = RandomRows(64, 11);
  // A client that dies right after writing: its leased page must come back.
  const auto forgotten = AllocateLeased(d, "p", 2, 2);
  const auto renewed = AllocateLeased(d, "p", 1, 2);  // RenewPages keeps it
  const auto used = AllocateLeased(d, "p", 1, 2);     // reads and writes keep it
  const auto plain = testing::Allocate(d, "p", 1);    // today's semantics: kept until freed
  ASSERT_TRUE(testing::WriteTokens(d, "p", 0, Slots(forgotten[0]), rows).ok());
  ASSERT_TRUE(testing::WriteTokens(d, "p", 0, Slots(plain[0]), rows).ok());
  const auto start = Clock::now();
  // Renew and use for 6 s (three lease lengths), every 0.5 s.
  while (SecondsSince(start) < 6) {
    EXPECT_TRUE(Renew(d, "p", renewed).ok());
    EXPECT_TRUE(testing::WriteTokens(d, "p", 0, Slots(used[0], 1), rows).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  // The forgotten pages were freed: stale everywhere, back in the free list, counted out.
  std::string reason;
  const grpc::Status s = Renew(d, "p", forgotten, &reason);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_EQ(reason, "STALE_PAGE_HANDLE");
  EXPECT_EQ(ReadAll(d, "p", {forgotten[0]}, &reason).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  const v1::Stats stats = testing::GetStats(d);
  EXPECT_EQ(stats.pools(0).pages_used(), 3u);
  EXPECT_EQ(stats.tokens_held(), 64u + 1u) << "the freed page's tokens are gone";
  EXPECT_TRUE(ReadAll(d, "p", renewed).ok());
  EXPECT_TRUE(ReadAll(d, "p", used).ok());
  EXPECT_TRUE(ReadAll(d, "p", plain).ok());
  // Reallocated, the page reads as zeros.
  const auto again = testing::Allocate(d, "p", 13);
  std::string bytes;
  ASSERT_TRUE(testing::ReadPages(d, "p", again, &bytes).ok());
  EXPECT_EQ(bytes, std::string(bytes.size(), '\0'));
  // A lease and a session at once is refused.
  grpc::ClientContext ctx;
  v1::AllocatePagesRequest both;
  both.set_pool("p");
  both.set_count(1);
  both.set_lease_seconds(5);
  both.set_session_id(7);
  v1::AllocatePagesResponse resp;
  EXPECT_EQ(d.stub().AllocatePages(&ctx, both, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

// ---- listings ------------------------------------------------------------------------------

TEST(PaginationTest, ManyPoolsAreListedPageByPageAndStatsTotalThemAll) {
  Daemon d;
  const int n = 2500;
  std::set<std::string> names;
  for (int i = 0; i < n; ++i) {
    char name[16];
    std::snprintf(name, sizeof(name), "pool-%05d", i);
    names.insert(name);
    testing::CreatePool(d, name, Layout::kV41Fp4, 1, 1);
  }
  std::vector<std::string> listed;
  std::string token;
  int pages = 0;
  do {
    v1::ListPoolsResponse resp;
    ASSERT_TRUE(List(d, &resp, 0, token).ok());
    EXPECT_LE(resp.pools_size(), 1000);
    for (const auto& p : resp.pools()) listed.push_back(p.name());
    token = resp.next_page_token();
    ++pages;
  } while (!token.empty() && pages < 100);
  EXPECT_EQ(pages, 3);
  EXPECT_EQ(listed, std::vector<std::string>(names.begin(), names.end()));

  // A small page size, and a token kvferryd did not make.
  v1::ListPoolsResponse small;
  ASSERT_TRUE(List(d, &small, 7).ok());
  EXPECT_EQ(small.pools_size(), 7);
  EXPECT_EQ(small.pools(6).name(), "pool-00006");
  v1::ListPoolsResponse next;
  ASSERT_TRUE(List(d, &next, 7, small.next_page_token()).ok());
  EXPECT_EQ(next.pools(0).name(), "pool-00007");
  std::string reason;
  v1::ListPoolsResponse bad;
  EXPECT_EQ(List(d, &bad, 0, "not a token!", &reason).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(reason, "INVALID_REQUEST");

  // GetStats: pages of pools, totals over all of them.
  int stat_pools = 0;
  token.clear();
  pages = 0;
  do {
    grpc::ClientContext ctx;
    v1::GetStatsRequest req;
    req.set_page_token(token);
    v1::Stats stats;
    ASSERT_TRUE(d.stub().GetStats(&ctx, req, &stats).ok());
    EXPECT_EQ(stats.pool_bytes(), static_cast<uint64_t>(n) * PageBytes(Layout::kV41Fp4, 1));
    stat_pools += stats.pools_size();
    token = stats.next_page_token();
    ++pages;
  } while (!token.empty() && pages < 100);
  EXPECT_EQ(stat_pools, n);
}

// ---- the metrics endpoint ------------------------------------------------------------------

// A connection to the metrics port that sends a request's first line and then one header
// byte every 500 ms, until `stop`.
void Drip(int port, const std::atomic<bool>& stop) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string start = "GET /healthz HTTP/1.1\r\nX-Slow: ";
    send(fd, start.data(), start.size(), MSG_NOSIGNAL);
    while (!stop && send(fd, "a", 1, MSG_NOSIGNAL) == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    }
  }
  close(fd);
}

TEST(HttpTest, SixteenSlowDripConnectionsDoNotHoldUpHealthz) {
  Daemon d;
  std::atomic<bool> stop{false};
  std::vector<std::thread> drips;
  for (int i = 0; i < 16; ++i) drips.emplace_back([&] { Drip(d.metrics_port(), stop); });
  std::this_thread::sleep_for(std::chrono::seconds(2));  // all 16 connected and dripping
  double slowest = 0;
  for (int i = 0; i < 10; ++i) {
    httplib::Client client("127.0.0.1", d.metrics_port());
    client.set_connection_timeout(10);
    client.set_read_timeout(10);
    const auto start = Clock::now();
    auto res = client.Get("/healthz");
    slowest = std::max(slowest, SecondsSince(start));
    EXPECT_TRUE(res && res->status == 200) << "no answer to /healthz";
    if (!res) break;
  }
  stop = true;
  for (auto& t : drips) t.join();
  std::printf("slowest /healthz of 10 beside 16 slow-drip connections: %.3f s\n", slowest);
  // With httplib's default 8 workers, every call waited until a drip connection ended
  // (20 s in the issue; here the 10 s client timeout).
  EXPECT_LT(slowest, 5);
}

TEST(HttpTest, AConnectionThatSendsNothingIsClosedByTheDaemon) {
  Daemon d({"--http_read_timeout_seconds=1"});
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(d.metrics_port()));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  timeval tv{30, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  const auto start = Clock::now();
  char byte;
  EXPECT_EQ(recv(fd, &byte, 1, 0), 0) << "the daemon did not close the idle connection";
  EXPECT_LT(SecondsSince(start), 20);
  close(fd);
}

// ---- memory after bursts -------------------------------------------------------------------

// 1000 reads of a 38 MB pool in host memory (a cuda pool would start a CUDA context, whose
// own RSS is not this test's business), opened in rounds of 200 that the client never reads
// and then cancels; the daemon's RSS at the peak and 3 s after the last handler ended.
std::pair<int64_t, int64_t> RssAroundCancelledReads(Daemon& d) {
  testing::CreatePool(d, "p", Layout::kV4, 64, 1024, 1, "cpu");
  const auto pages = testing::Allocate(d, "p", 1024);
  v1::ReadPagesRequest req;
  req.set_pool("p");
  for (const auto& p : pages) *req.add_pages() = p;
  int64_t peak = 0;
  for (int round = 0; round < 5; ++round) {
    std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
    std::vector<std::unique_ptr<grpc::ClientReader<v1::PageChunk>>> readers;
    for (int i = 0; i < 200; ++i) {
      contexts.push_back(std::make_unique<grpc::ClientContext>());
      readers.push_back(d.stub().ReadPages(contexts.back().get(), req));
    }
    std::this_thread::sleep_for(std::chrono::seconds(2));
    peak = std::max(peak, testing::ProcStatus(d.pid(), "VmRSS"));
    for (auto& c : contexts) c->TryCancel();
    for (auto& r : readers) r->Finish();
  }
  // Every handler has ended (its reader freed); then the trim has had its period.
  // (On two busy cores, with glibc held to two arenas, the last handlers have taken over
  // two minutes to end.)
  EXPECT_TRUE(Eventually([&] {
    return Sample(Metrics(d), "kvferry_rpc_requests_total{method=\"ReadPages\",code=\"CANCELLED\"}") >= 1000;
  }, 240));
  std::this_thread::sleep_for(std::chrono::seconds(3));
  return {peak, testing::ProcStatus(d.pid(), "VmRSS")};
}

TEST(MemoryTest, AfterAThousandCancelledReadsThePeriodicTrimReturnsTheMemory) {
#if defined(KVFERRY_TEST_ASAN) || defined(KVFERRY_TEST_TSAN)
  GTEST_SKIP() << "RSS says nothing under a sanitizer's allocator";
#endif
  // What the daemon keeps over its idle RSS: without trimming, with glibc held to two
  // arenas, with the periodic trim (the default, here every second).
  auto kept = [](const char* what, std::vector<std::string> flags, const char* tunables) {
    if (tunables != nullptr) setenv("GLIBC_TUNABLES", tunables, 1);
    flags.push_back("--max_streams=1000");
    flags.push_back("--max_streams_per_connection=1000");  // the burst comes on one connection
    // glibc's heap alone: UCX, when on, interposes on the memory calls (its memory-event
    // hooks), which this test is not about.
    flags.push_back("--ucx=false");
    Daemon d(flags);
    unsetenv("GLIBC_TUNABLES");
    const int64_t before = testing::ProcStatus(d.pid(), "VmRSS");
    const auto [peak, after] = RssAroundCancelledReads(d);
    std::printf("%s: VmRSS idle %lld KiB, peak %lld KiB, after %lld KiB\n", what,
                static_cast<long long>(before), static_cast<long long>(peak),
                static_cast<long long>(after));
    return after - before;
  };
  const int64_t plain = kept("no trim", {"--malloc_trim_seconds=0"}, nullptr);
  const int64_t arenas = kept("arena_max=2", {"--malloc_trim_seconds=0"}, "glibc.malloc.arena_max=2");
  const int64_t trimmed = kept("trim every 1 s", {"--malloc_trim_seconds=1"}, nullptr);
  (void)arenas;
  EXPECT_LT(trimmed, plain);
  // The pool (38 MB) and little else stays.
  EXPECT_LT(trimmed, 256 * 1024);
}

}  // namespace
}  // namespace kvferry
