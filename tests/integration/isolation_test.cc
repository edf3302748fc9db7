// The round-2 core defects, each reproduced against the real kvferryd the way a client or a
// probe would hit it: health probes, freed pages, handles across frees and pool
// incarnations, stream targets, label cardinality, read memory, reply size, deletes during
// writes, and port reuse.
#include <grpcpp/generic/generic_stub.h>
#include <httplib.h>

#include <atomic>
#include <fstream>
#include <thread>

#include "common/random_rows.h"
#include "daemon_harness.h"
#include "kvferry/kernels/ops.h"

namespace kvferry {
namespace {

using testing::Daemon;
using testing::Location;
using testing::RawUnary;

std::string Fetch(int port, const std::string& path) {
  httplib::Client client("127.0.0.1", port);
  auto res = client.Get(path);
  return res && res->status == 200 ? res->body : "";
}

// Health/Watch: sends the request and reads the first response into `first`; with `first`
// null, drops the stream unread right after the request (an abandoned watch).
grpc::Status WatchFirst(const std::shared_ptr<grpc::Channel>& channel, std::string* first) {
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto call = stub.PrepareCall(&ctx, "/grpc.health.v1.Health/Watch", &cq);
  void* tag;
  bool ok;
  call->StartCall(reinterpret_cast<void*>(1));
  cq.Next(&tag, &ok);
  grpc::ByteBuffer req;  // empty HealthCheckRequest
  grpc::Slice empty("");
  req = grpc::ByteBuffer(&empty, 1);
  call->Write(req, reinterpret_cast<void*>(2));
  cq.Next(&tag, &ok);
  grpc::Status status;
  if (first != nullptr) {
    call->WritesDone(reinterpret_cast<void*>(3));
    cq.Next(&tag, &ok);
    grpc::ByteBuffer resp;
    call->Read(&resp, reinterpret_cast<void*>(4));
    cq.Next(&tag, &ok);
    if (ok) {
      std::vector<grpc::Slice> slices;
      resp.Dump(&slices);
      first->clear();
      for (const auto& s : slices) first->append(reinterpret_cast<const char*>(s.begin()), s.size());
    } else {
      status = grpc::Status(grpc::StatusCode::UNKNOWN, "no response");
    }
  }
  ctx.TryCancel();
  grpc::Status finish;
  call->Finish(&finish, reinterpret_cast<void*>(5));
  cq.Next(&tag, &ok);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return status;
}

// HealthCheckResponse{status: SERVING} on the wire: field 1, varint 1.
const std::string kServing("\x08\x01", 2);

// 1 ---------------------------------------------------------------------------------------------
TEST(HealthTest, CheckAndWatchAnswerServingRepeatedlyAndConcurrentlyWithTraffic) {
  Daemon d;
  testing::CreatePool(d, "h", Layout::kV41, 16, 64);
  std::atomic<bool> stop{false};
  std::atomic<int> write_failures{0}, writes{0};
  std::thread traffic([&] {
    const auto pages = testing::Allocate(d, "h", 1);
    std::vector<v1::TokenLocation> where;
    for (int i = 0; i < 16; ++i) where.push_back(Location(pages[0], i));
    const auto rows = testing::RandomRows(16, 1);
    while (!stop) {
      if (!testing::WriteTokens(d, "h", 0, where, rows, 4).ok()) ++write_failures;
      ++writes;
    }
  });
  std::atomic<int> bad{0};
  std::vector<std::thread> probes;
  for (int t = 0; t < 8; ++t) {
    probes.emplace_back([&, t] {
      // Each probe its own channel, as separate kubelet probes would be.
      auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(d.grpc_port()),
                                         grpc::InsecureChannelCredentials());
      for (int i = 0; i < 50; ++i) {
        std::string response;
        if (t % 2 == 0) {
          if (!RawUnary(channel, "/grpc.health.v1.Health/Check", "", &response).ok() ||
              response != kServing) {
            ++bad;
          }
        } else if (!WatchFirst(channel, &response).ok() || response != kServing) {
          ++bad;
        }
      }
    });
  }
  for (auto& p : probes) p.join();
  stop = true;
  traffic.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(write_failures.load(), 0);
  EXPECT_GT(writes.load(), 0);
  EXPECT_TRUE(d.Alive());
  // Health of a named service that does not exist: NOT_FOUND, and still alive.
  std::string response;
  const std::string named("\x0a\x03nop", 5);  // HealthCheckRequest{service: "nop"}
  EXPECT_EQ(RawUnary(d.channel(), "/grpc.health.v1.Health/Check", named, &response).error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(d.Alive());
  EXPECT_NE(Fetch(d.metrics_port(), "/metrics").find("kvferry_rpc_requests_total{method=\"Check\",code=\"OK\"} 200"),
            std::string::npos);
}

// The health service against a hostile caller: bytes that are no HealthCheckRequest, a
// huge service name, and Watch streams opened and dropped without reading. Each gets an
// answer (or is let go), and a plain probe is still answered SERVING after.
TEST(HealthTest, MalformedChecksAndAbandonedWatchesLeaveTheProbeServing) {
  Daemon d;
  std::string response;
  const std::string check = "/grpc.health.v1.Health/Check";
  for (const std::string& garbage :
       {std::string("\xff\xff\xff\xff", 4), std::string("\x0a\x10" "ab", 4) /* says 16 bytes, holds 2 */,
        std::string("\x0a\x03\xc3\x28x", 5) /* service name not UTF-8 */}) {
    const grpc::Status s = RawUnary(d.channel(), check, garbage, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_TRUE(d.Alive());
  }
  // A 64 KiB service name: refused (gRPC's health service bounds the name).
  const std::string huge = std::string("\x0a\x80\x80\x04", 4) + std::string(65536, 's');  // field 1, length 65536
  EXPECT_EQ(RawUnary(d.channel(), check, huge, &response).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  // 50 Watch streams opened, sent one request and dropped unread.
  for (int i = 0; i < 50; ++i) WatchFirst(d.channel(), nullptr);
  EXPECT_TRUE(d.Alive());
  ASSERT_TRUE(RawUnary(d.channel(), check, "", &response).ok());
  EXPECT_EQ(response, kServing);
  ASSERT_TRUE(WatchFirst(d.channel(), &response).ok());
  EXPECT_EQ(response, kServing);
}

// 2 ---------------------------------------------------------------------------------------------
TEST(FreedPageTest, ReallocatedPageReadsZeroInEveryLayerAndInEveryRead) {
  Daemon d;
  testing::CreatePool(d, "z", Layout::kV4, 8, 1, 3);
  auto pages = testing::Allocate(d, "z", 1);
  std::vector<v1::TokenLocation> where;
  for (int i = 0; i < 8; ++i) where.push_back(Location(pages[0], i));
  for (int layer = 0; layer < 3; ++layer) {
    ASSERT_TRUE(testing::WriteTokens(d, "z", layer, where, testing::RandomRows(8, 10 + layer)).ok());
  }
  std::string before;
  ASSERT_TRUE(testing::ReadPages(d, "z", pages, &before).ok());
  ASSERT_NE(before, std::string(before.size(), '\0'));
  ASSERT_TRUE(testing::FreePages(d, "z", {pages[0]}).ok());
  const auto again = testing::Allocate(d, "z", 1);
  ASSERT_EQ(again.size(), 1u);
  ASSERT_EQ(again[0].page_id(), pages[0].page_id());
  ASSERT_NE(again[0].generation(), pages[0].generation());
  std::string raw;
  ASSERT_TRUE(testing::ReadPages(d, "z", again, &raw).ok());
  EXPECT_EQ(raw.size(), 3u * PageBytes(Layout::kV4, 8));
  EXPECT_EQ(raw, std::string(raw.size(), '\0')) << "the previous owner's records are visible";
  std::vector<v1::TokenLocation> fresh;
  for (int i = 0; i < 8; ++i) fresh.push_back(Location(again[0], i));
  for (int layer = 0; layer < 3; ++layer) {
    grpc::ClientContext ctx;
    std::vector<uint16_t> rows;
    v1::ReadWorkspaceRequest req;
    ASSERT_TRUE(testing::ReadWorkspace(d, "z", layer, fresh, &rows).ok());
    EXPECT_EQ(rows, std::vector<uint16_t>(8 * 512, 0)) << "layer " << layer;
  }
  ASSERT_TRUE(testing::ReadPages(d, "z", again, &raw, v1::LAYOUT_V41).ok());
  EXPECT_EQ(raw, std::string(raw.size(), '\0'));
  EXPECT_EQ(testing::GetStats(d).tokens_held(), 0u);
}

// 3 ---------------------------------------------------------------------------------------------
TEST(StaleWriteTest, WriteNamingAPageAtTwoGenerationsFailsWholeAndChangesNothing) {
  Daemon d;
  testing::CreatePool(d, "g", Layout::kV41, 16, 2);
  const auto first = testing::Allocate(d, "g", 1);
  const auto rows = testing::RandomRows(2, 3);
  grpc::ClientContext ctx;
  v1::WriteResponse resp;
  auto writer = d.stub().WriteTokens(&ctx, &resp);
  v1::WriteTokensRequest msg;
  msg.set_pool("g");
  msg.set_layer(0);
  *msg.add_locations() = Location(first[0], 0);
  msg.set_rows(reinterpret_cast<const char*>(rows.data()), 1024);
  ASSERT_TRUE(writer->Write(msg));
  // Meanwhile the page is freed and handed to someone else.
  ASSERT_TRUE(testing::FreePages(d, "g", {first[0]}).ok());
  const auto second = testing::Allocate(d, "g", 1);
  ASSERT_EQ(second[0].page_id(), first[0].page_id());
  v1::WriteTokensRequest msg2;
  *msg2.add_locations() = Location(second[0], 1);
  msg2.set_rows(reinterpret_cast<const char*>(rows.data() + 512), 1024);
  msg2.set_finish_write(true);
  // May report false: the daemon can refuse the write (and end the call) before the client
  // learns that this message went out.
  writer->Write(msg2);
  writer->WritesDone();
  const grpc::Status s = writer->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  const std::string reason = testing::ReasonOf(ctx);
  EXPECT_TRUE(reason == "HANDLE_GENERATION_CHANGED" || reason == "STALE_PAGE_HANDLE") << reason;
  std::string raw;
  ASSERT_TRUE(testing::ReadPages(d, "g", second, &raw).ok());
  EXPECT_EQ(raw, std::string(raw.size(), '\0'));
  EXPECT_EQ(testing::GetStats(d).tokens_held(), 0u);
}

// 4 ---------------------------------------------------------------------------------------------
TEST(PoolIncarnationTest, HandlesOfADeletedPoolAreRefusedByItsSuccessor) {
  Daemon d;
  const v1::Pool p1 = testing::CreatePool(d, "r", Layout::kV4, 16, 4);
  const auto old_pages = testing::Allocate(d, "r", 1);
  ASSERT_TRUE(testing::DeletePool(d, "r").ok());
  const v1::Pool p2 = testing::CreatePool(d, "r", Layout::kV4, 16, 4);
  EXPECT_NE(p1.pool_id(), p2.pool_id());
  const auto new_pages = testing::Allocate(d, "r", 1);
  ASSERT_EQ(new_pages[0].page_id(), old_pages[0].page_id());
  std::vector<v1::TokenLocation> where = {Location(new_pages[0], 0)};
  ASSERT_TRUE(testing::WriteTokens(d, "r", 0, where, testing::RandomRows(1, 4)).ok());
  std::string before;
  ASSERT_TRUE(testing::ReadPages(d, "r", new_pages, &before).ok());

  std::string reason, bytes;
  EXPECT_EQ(testing::ReadPages(d, "r", old_pages, &bytes, v1::LAYOUT_UNSPECIFIED, {}, &reason).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(reason, "STALE_PAGE_HANDLE");
  EXPECT_EQ(testing::WriteTokens(d, "r", 0, {Location(old_pages[0], 1)}, testing::RandomRows(1, 5),
                                 256, nullptr, &reason).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(reason, "STALE_PAGE_HANDLE");
  std::string after;
  ASSERT_TRUE(testing::ReadPages(d, "r", new_pages, &after).ok());
  EXPECT_EQ(after, before);
}

// 5 ---------------------------------------------------------------------------------------------
TEST(StreamTargetTest, LaterMessageNamingAnotherLayerOrPoolFailsAndChangesNothing) {
  Daemon d;
  testing::CreatePool(d, "l", Layout::kV41, 16, 2, 2);
  testing::CreatePool(d, "other", Layout::kV41, 16, 2, 2);
  const auto pages = testing::Allocate(d, "l", 1);
  const auto rows = testing::RandomRows(2, 6);
  for (int variant = 0; variant < 2; ++variant) {
    grpc::ClientContext ctx;
    v1::WriteResponse resp;
    auto writer = d.stub().WriteTokens(&ctx, &resp);
    v1::WriteTokensRequest m1, m2;
    m1.set_pool("l");
    m1.set_layer(0);
    *m1.add_locations() = Location(pages[0], 0);
    m1.set_rows(reinterpret_cast<const char*>(rows.data()), 1024);
    if (variant == 0) {
      m2.set_layer(1);
    } else {
      m2.set_pool("other");
    }
    *m2.add_locations() = Location(pages[0], 1);
    m2.set_rows(reinterpret_cast<const char*>(rows.data() + 512), 1024);
    m2.set_finish_write(true);
    writer->Write(m1);
    writer->Write(m2);
    writer->WritesDone();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(testing::ReasonOf(ctx), "STREAM_TARGET_CHANGED");
  }
  EXPECT_EQ(testing::GetStats(d).tokens_held(), 0u);
  // Layer set explicitly to the same value in every message is fine.
  grpc::ClientContext ctx;
  v1::WriteResponse resp;
  auto writer = d.stub().WriteTokens(&ctx, &resp);
  for (int i = 0; i < 2; ++i) {
    v1::WriteTokensRequest m;
    m.set_pool("l");
    m.set_layer(1);
    *m.add_locations() = Location(pages[0], i);
    m.set_rows(reinterpret_cast<const char*>(rows.data() + 512 * i), 1024);
    m.set_finish_write(i == 1);
    writer->Write(m);
  }
  writer->WritesDone();
  ASSERT_TRUE(writer->Finish().ok());
  EXPECT_EQ(resp.tokens_written(), 2u);
}

// 6 ---------------------------------------------------------------------------------------------
TEST(MetricsLabelTest, MadeUpMethodNamesShareOneLabel) {
  Daemon d;
  for (int i = 0; i < 300; ++i) {
    const grpc::Status s = RawUnary(d.channel(), "/made.up.Service/Method" + std::to_string(i), "", nullptr);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  }
  const std::string text = Fetch(d.metrics_port(), "/metrics");
  EXPECT_EQ(text.find("Method1"), std::string::npos);
  EXPECT_NE(text.find("kvferry_rpc_requests_total{method=\"unknown\",code=\"UNIMPLEMENTED\"} 300"),
            std::string::npos)
      << text.substr(0, 2000);
  EXPECT_LT(text.size(), 64u << 10);
}

// 7 ---------------------------------------------------------------------------------------------
TEST(ReadMemoryTest, RepeatedLayersAreRefusedAndAWideReadStaysWithinItsChunks) {
  Daemon d;
  constexpr int kLayers = 64;
  testing::CreatePool(d, "big", Layout::kV4, 4096, 1, kLayers);  // 64 x 2.4 MB
  const auto pages = testing::Allocate(d, "big", 1);
  {
    grpc::ClientContext ctx;
    v1::ReadPagesRequest req;
    req.set_pool("big");
    *req.add_pages() = pages[0];
    for (int i = 0; i < 1000; ++i) req.add_layers(0);
    auto reader = d.stub().ReadPages(&ctx, req);
    v1::PageChunk chunk;
    EXPECT_FALSE(reader->Read(&chunk));
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(testing::ReasonOf(ctx), "DUPLICATE_LAYER");
  }
#if defined(KVFERRY_TEST_ASAN)
  GTEST_SKIP() << "AddressSanitizer's quarantine keeps freed memory resident: peak RSS says nothing";
#endif
  const int64_t hwm_before = testing::ProcStatus(d.pid(), "VmHWM");
  std::string bytes;
  ASSERT_TRUE(testing::ReadPages(d, "big", pages, &bytes).ok());
  EXPECT_EQ(bytes.size(), static_cast<size_t>(kLayers) * PageBytes(Layout::kV4, 4096));
  const int64_t growth_kib = testing::ProcStatus(d.pid(), "VmHWM") - hwm_before;
  // The old daemon staged the whole 153 MB request; batches of one page keep it to a few MB.
  EXPECT_LT(growth_kib, 64 * 1024) << "peak RSS grew by " << growth_kib << " KiB";
}

// 8 ---------------------------------------------------------------------------------------------
TEST(AllocateReplyTest, CountAboveWhatOneReplyCarriesIsRefusedAndAllocatesNothing) {
  Daemon d;
  testing::CreatePool(d, "a", Layout::kV41Fp4, 1, 700000);
  grpc::ClientContext ctx;
  v1::AllocatePagesRequest req;
  req.set_pool("a");
  req.set_count(600000);
  v1::AllocatePagesResponse resp;
  EXPECT_EQ(d.stub().AllocatePages(&ctx, req, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(testing::ReasonOf(ctx), "TOO_MANY_PAGES");
  EXPECT_EQ(testing::GetStats(d).pools(0).pages_used(), 0u);
  // The largest count allowed fits its reply.
  grpc::ClientContext ctx2;
  req.set_count(65536);
  EXPECT_TRUE(d.stub().AllocatePages(&ctx2, req, &resp).ok());
  EXPECT_EQ(resp.pages_size(), 65536);
  EXPECT_EQ(testing::GetStats(d).pools(0).pages_used(), 65536u);
}

// 9 ---------------------------------------------------------------------------------------------
TEST(DeleteDuringWriteTest, WriteInFlightWhenItsPoolIsDeletedFailsAndStoresNothing) {
  Daemon d;
  for (bool recreate : {false, true}) {
    SCOPED_TRACE(recreate ? "re-created" : "deleted");
    testing::CreatePool(d, "w", Layout::kV41, 16, 2);
    const auto pages = testing::Allocate(d, "w", 1);
    const auto rows = testing::RandomRows(2, 8);
    grpc::ClientContext ctx;
    v1::WriteResponse resp;
    auto writer = d.stub().WriteTokens(&ctx, &resp);
    v1::WriteTokensRequest m;
    m.set_pool("w");
    *m.add_locations() = Location(pages[0], 0);
    m.set_rows(reinterpret_cast<const char*>(rows.data()), 1024);
    ASSERT_TRUE(writer->Write(m));
    ASSERT_TRUE(testing::DeletePool(d, "w").ok());
    if (recreate) testing::CreatePool(d, "w", Layout::kV41, 16, 2);
    v1::WriteTokensRequest m2;
    *m2.add_locations() = Location(pages[0], 1);
    m2.set_rows(reinterpret_cast<const char*>(rows.data() + 512), 1024);
    m2.set_finish_write(true);
    writer->Write(m2);
    writer->WritesDone();
    const grpc::Status s = writer->Finish();
    EXPECT_FALSE(s.ok());
    EXPECT_TRUE(s.error_code() == grpc::StatusCode::ABORTED ||
                s.error_code() == grpc::StatusCode::NOT_FOUND ||
                s.error_code() == grpc::StatusCode::FAILED_PRECONDITION)
        << s.error_code() << " " << s.error_message();
    EXPECT_EQ(resp.tokens_written(), 0u);
    if (recreate) {
      EXPECT_EQ(testing::GetStats(d).tokens_held(), 0u);
      ASSERT_TRUE(testing::DeletePool(d, "w").ok());
    }
  }
}

// 10 --------------------------------------------------------------------------------------------
// Runs kvferryd with `flags` until it exits (or 20 s); returns its exit code and stderr.
int RunDaemonToExit(const std::vector<std::string>& flags, std::string* err) {
  char path[] = "/tmp/kvferryd-port-XXXXXX";
  const int fd = mkstemp(path);
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(fd, 2);
    std::vector<std::string> args = {testing::DaemonPath()};
    args.insert(args.end(), flags.begin(), flags.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  close(fd);
  std::ifstream in(path);
  err->assign(std::istreambuf_iterator<char>(in), {});
  unlink(path);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(PortTest, SecondDaemonOnATakenPortFailsToStart) {
  Daemon d;
  std::string err;
  EXPECT_EQ(RunDaemonToExit({"--listen=127.0.0.1:" + std::to_string(d.grpc_port()),
                             "--metrics_listen=127.0.0.1:0", "--default_device=cpu"},
                            &err),
            1);
  EXPECT_NE(err.find("address in use"), std::string::npos) << err;
  EXPECT_EQ(RunDaemonToExit({"--listen=127.0.0.1:0",
                             "--metrics_listen=127.0.0.1:" + std::to_string(d.metrics_port()),
                             "--default_device=cpu"},
                            &err),
            1);
  EXPECT_NE(err.find("address in use"), std::string::npos) << err;
  EXPECT_TRUE(d.Alive());
}

}  // namespace
}  // namespace kvferry
