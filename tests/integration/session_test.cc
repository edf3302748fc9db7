// Sessions through the real daemon without a GPU: the argument checks, session-owned pages
// freed when the session ends — cleanly or by kill -9 of the worker — and the daemon
// healthy after.
#include <signal.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "daemon_harness.h"
#include "metrics_scrape.h"
#include "kvferry/client/client.h"
#include "kvferry/client/session.h"
#include "kvferry/v1/session.grpc.pb.h"

namespace kvferry {
namespace {

using client::Session;

client::ClientOptions Options(const testing::Daemon& d) {
  client::ClientOptions o;
  o.target = "127.0.0.1:" + std::to_string(d.grpc_port());
  return o;
}

// A session opened over the raw API (the stream and what the daemon answered).
struct RawSession {
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionEvent>> stream;
  v1::SessionOpened opened;
};

void OpenRaw(v1::KvSession::Stub& stub, const std::string& worker, RawSession& s) {
  s.stream = stub.OpenSession(&s.ctx);
  v1::SessionRequest req;
  req.mutable_open()->set_worker(worker);
  ASSERT_TRUE(s.stream->Write(req));
  v1::SessionEvent e;
  ASSERT_TRUE(s.stream->Read(&e));
  s.opened = e.opened();
}

uint64_t PagesUsed(testing::Daemon& d) { return testing::GetStats(d).pools(0).pages_used(); }


// VMM memory is taken from the process a request names only when that process proves it is
// the session's: a descriptor of it that reads the session's secret. Without a GPU the
// daemon stops right after the proof (the cpu backend maps no VMM memory), which tells a
// proof that passed (UNKNOWN_DEVICE) from one refused (WORKER_NOT_ACCESSIBLE).
TEST(SessionVmmTest, NoCallerTakesAProcessesMemoryWithoutItsSessionsSecret) {
  testing::Daemon d;
  auto stub = v1::KvSession::NewStub(
      grpc::CreateChannel(Options(d).target, grpc::InsecureChannelCredentials()));
  // Two sessions over the raw API, to hold their secrets.
  RawSession a, b;
  OpenRaw(*stub, "vmm", a);
  OpenRaw(*stub, "vmm", b);
  ASSERT_EQ(a.opened.session_secret().size(), 32u);
  ASSERT_NE(a.opened.session_secret(), b.opened.session_secret());
  auto memfd = [](const std::string& bytes) {
    const int fd = memfd_create("session-test", MFD_CLOEXEC);
    EXPECT_EQ(write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
    return fd;
  };
  const int allocation = memfd("not GPU memory: the cpu daemon never maps it");
  auto register_vmm = [&](uint32_t pid, int proof) {
    v1::RegisterKvRequest req;
    req.set_session_id(a.opened.session_id());
    v1::KvTensor* t = req.add_tensors();
    t->set_num_blocks(1);
    t->set_block_tokens(16);
    t->set_block_stride(16384);
    t->set_token_stride(1024);
    t->set_kind(v1::ROW_KIND_BF16);
    t->set_vmm_pid(pid);
    t->set_vmm_proof_fd(proof);
    v1::VmmAllocation* v = t->add_vmm_allocations();
    v->set_fd(allocation);
    v->set_size(2 << 20);
    grpc::ClientContext ctx;
    v1::RegisterKvResponse resp;
    const grpc::Status st = stub->RegisterKv(&ctx, req, &resp);
    EXPECT_FALSE(st.ok());
    return testing::ReasonOf(ctx);
  };
  const uint32_t self = static_cast<uint32_t>(getpid());
  const int own = memfd(a.opened.session_secret());
  const std::string with_own = register_vmm(self, own);
  if (with_own == "WORKER_NOT_ACCESSIBLE") {
    GTEST_SKIP() << "kvferryd may not take this process's descriptors here (ptrace access)";
  }
  // Proved. Then, without a GPU, the daemon has no backend to map with (UNKNOWN_DEVICE); with
  // one, the driver refuses the memfd as a CUDA allocation (INVALID_REQUEST).
  const auto proved = [](const std::string& reason) {
    return reason == "UNKNOWN_DEVICE" || reason == "INVALID_REQUEST";
  };
  EXPECT_TRUE(proved(with_own)) << with_own;
  // Another session's secret, a wrong one, none, a descriptor the process lacks, and a
  // process that is not there.
  const int others = memfd(b.opened.session_secret());
  EXPECT_EQ(register_vmm(self, others), "WORKER_NOT_ACCESSIBLE");
  std::string wrong = a.opened.session_secret();
  wrong[0] ^= 1;
  const int wrong_fd = memfd(wrong);
  EXPECT_EQ(register_vmm(self, wrong_fd), "WORKER_NOT_ACCESSIBLE");
  const int empty = memfd("");
  EXPECT_EQ(register_vmm(self, empty), "WORKER_NOT_ACCESSIBLE");
  EXPECT_EQ(register_vmm(self, 1 << 20), "INVALID_REQUEST");
  EXPECT_EQ(register_vmm(0x7FFFFFF0, own), "WORKER_NOT_ACCESSIBLE");
  // The client library makes the proof itself.
  auto session = Session::Open(Options(d), "vmm-client", 0);
  ASSERT_TRUE(session.ok()) << session.status();
  client::KvTensor t{.num_blocks = 1, .block_tokens = 16, .block_stride = 16384, .token_stride = 1024};
  t.vmm_pid = self;
  t.vmm_allocations.push_back({allocation, 2 << 20});
  const std::string by_client = client::ErrorReason((*session)->RegisterKv(t).status());
  EXPECT_TRUE(proved(by_client)) << by_client;
  for (int fd : {allocation, own, others, wrong_fd, empty}) close(fd);
  for (RawSession* o : {&a, &b}) {
    o->stream->WritesDone();
    o->ctx.TryCancel();
  }
}

// The completion area's name cannot be guessed (so nobody creates it first), and it is
// gone once the worker mapped the area — or, for a worker that never says so, once the
// session ends.
TEST(SessionCompletionTest, TheAreasNameIsUnguessableAndRemovedOnceMapped) {
  testing::Daemon d;
  auto stub = v1::KvSession::NewStub(
      grpc::CreateChannel(Options(d).target, grpc::InsecureChannelCredentials()));
  auto exists = [](const std::string& name) {
    const int fd = shm_open(name.c_str(), O_RDONLY, 0);
    if (fd >= 0) close(fd);
    return fd >= 0;
  };
  // Polls for the daemon's handling of a message on the stream.
  auto gone = [&](const std::string& name) {
    for (int i = 0; i < 100 && exists(name); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return !exists(name);
  };
  RawSession a, b;
  OpenRaw(*stub, "names", a);
  OpenRaw(*stub, "names", b);
  const std::string& a_name = a.opened.completion_shm();
  const std::string& b_name = b.opened.completion_shm();
  ASSERT_TRUE(exists(a_name)) << a_name;
  ASSERT_TRUE(exists(b_name)) << b_name;
  // /kvferry-PID-ID-HEX: 32 hex digits (128 bits) that differ between sessions.
  const std::regex form(R"(/kvferry-[0-9]+-[0-9]+-([0-9a-f]{32}))");
  std::smatch ma, mb;
  ASSERT_TRUE(std::regex_match(a_name, ma, form)) << a_name;
  ASSERT_TRUE(std::regex_match(b_name, mb, form)) << b_name;
  EXPECT_NE(ma[1].str(), mb[1].str());
  // a maps and says so: its name goes while its session lives on.
  v1::SessionRequest mapped;
  mapped.mutable_mapped();
  ASSERT_TRUE(a.stream->Write(mapped));
  EXPECT_TRUE(gone(a_name));
  EXPECT_TRUE(exists(b_name));
  // b never says so: its name goes with the session.
  v1::SessionRequest bye;
  bye.mutable_close();
  b.stream->Write(bye);
  b.stream->WritesDone();
  v1::SessionEvent ignored;
  while (b.stream->Read(&ignored)) {
  }
  EXPECT_TRUE(b.stream->Finish().ok());
  EXPECT_TRUE(gone(b_name));
  a.stream->WritesDone();
  while (a.stream->Read(&ignored)) {
  }
  a.stream->Finish();
  // The client library says so as soon as it has mapped the area: no kvferry area is left
  // under /dev/shm for this daemon while its session is open.
  auto session = Session::Open(Options(d), "library", 0);
  ASSERT_TRUE(session.ok()) << session.status();
  const std::string prefix = "kvferry-" + std::to_string(d.pid()) + "-";
  auto areas = [&] {
    int n = 0;
    for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
      n += entry.path().filename().string().rfind(prefix, 0) == 0;
    }
    return n;
  };
  for (int i = 0; i < 100 && areas() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(areas(), 0);
  EXPECT_TRUE((*session)->Close().ok());
}

TEST(SessionArgsTest, EveryBadRequestIsRefusedWithItsReason) {
  testing::Daemon d;
  testing::CreatePool(d, "s", Layout::kV41, 16, 8);
  auto session = Session::Open(Options(d), "args", 0);
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  // A tensor on a daemon without a GPU (or with a bogus handle on one): refused.
  client::KvTensor t{.ipc_handle = std::string(64, '\x01'), .num_blocks = 1, .block_tokens = 16,
                     .block_stride = 16384, .token_stride = 1024};
  absl::Status r = s.RegisterKv(t).status();
  EXPECT_FALSE(r.ok());
  const std::string reason = client::ErrorReason(r);
  EXPECT_TRUE(reason == "UNKNOWN_DEVICE" || reason == "INVALID_REQUEST") << r;
  auto pages = s.AllocatePages("s", 1);
  ASSERT_TRUE(pages.ok());
  const std::vector<client::BlockSlot> from = {{0, 0}};
  const std::vector<client::TokenLocation> to = {{(*pages)[0], 0}};
  r = s.Save(12345, "s", 0, from, to).status();
  EXPECT_EQ(r.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client::ErrorReason(r), "TENSOR_NOT_FOUND");
  r = s.LoadAsync(12345, "s", 0, to, from).status();
  EXPECT_EQ(client::ErrorReason(r), "TENSOR_NOT_FOUND");
  r = s.MapPool("nope").status();
  EXPECT_EQ(client::ErrorReason(r), "POOL_NOT_FOUND");
  r = s.UnmapPool(99);
  EXPECT_EQ(client::ErrorReason(r), "EXPORT_NOT_FOUND");
  // Page-form transfers name their pages as handles or packed, never both, and the packed
  // arrays pair up: refused before anything is looked at.
  {
    auto stub = v1::KvSession::NewStub(
        grpc::CreateChannel(Options(d).target, grpc::InsecureChannelCredentials()));
    auto refused = [&](const v1::SaveRequest& req, const std::string& needle) {
      grpc::ClientContext ctx;
      v1::TransferResponse resp;
      const grpc::Status st = stub->Save(&ctx, req, &resp);
      EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
      EXPECT_NE(st.error_message().find(needle), std::string::npos) << st.error_message();
    };
    v1::SaveRequest both;
    both.set_pool("s");
    both.add_source_blocks(0);
    both.add_destination_pages()->set_page_id((*pages)[0].page_id);
    both.mutable_destination_page_list()->add_page_ids((*pages)[0].page_id);
    both.mutable_destination_page_list()->add_generations((*pages)[0].generation);
    refused(both, "not both");
    v1::SaveRequest uneven;
    uneven.set_pool("s");
    uneven.add_source_blocks(0);
    uneven.mutable_destination_page_list()->add_page_ids((*pages)[0].page_id);
    refused(uneven, "1 page ids and 0 generations");

    // By key (the KV cache through the session): mixed or malformed requests are refused
    // with their reason before anything moves, and nothing is stored.
    client::NamespaceInfo ns = *client::Client::Connect(Options(d)).value()->CreateNamespace(
        {.name = "ns", .model_fingerprint = "m", .block_tokens = 16, .pools = {"s"}});
    auto call = [&](auto method, const auto& req, std::string* reason) {
      grpc::ClientContext ctx;
      v1::TransferResponse resp;
      const grpc::Status st = ((*stub).*method)(&ctx, req, &resp);
      *reason = testing::ReasonOf(ctx);
      return st;
    };
    std::string why;
    v1::SaveRequest by_key;
    by_key.set_session_id(s.id());
    by_key.set_pool("s");
    by_key.add_source_blocks(0);
    by_key.add_layer_tensor_ids(12345);
    by_key.mutable_cache()->set_namespace_("ns");
    by_key.mutable_cache()->set_digest(ns.digest);
    by_key.mutable_cache()->add_keys("k0");
    v1::SaveRequest async_by_key = by_key;
    async_by_key.mutable_completion()->set_slot(0);
    EXPECT_EQ(call(&v1::KvSession::Stub::Save, async_by_key, &why).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(why, "INVALID_REQUEST");
    v1::SaveRequest pages_and_keys = by_key;
    *pages_and_keys.add_destination_pages() = v1::PageHandle();
    EXPECT_EQ(call(&v1::KvSession::Stub::Save, pages_and_keys, &why).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
    v1::SaveRequest layers_without_keys = by_key;
    layers_without_keys.clear_cache();
    EXPECT_EQ(call(&v1::KvSession::Stub::Save, layers_without_keys, &why).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(why, "INVALID_REQUEST");
    v1::SaveRequest more_keys = by_key;
    more_keys.mutable_cache()->add_keys("k1");
    EXPECT_EQ(call(&v1::KvSession::Stub::Save, more_keys, &why).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
    v1::SaveRequest wrong_digest = by_key;
    wrong_digest.mutable_cache()->set_digest(ns.digest ^ 1);
    EXPECT_EQ(call(&v1::KvSession::Stub::Save, wrong_digest, &why).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_EQ(why, "NAMESPACE_MISMATCH");
    // A well-formed save naming a tensor the session does not have: its page is freed again.
    const uint64_t used = PagesUsed(d);
    EXPECT_EQ(call(&v1::KvSession::Stub::Save, by_key, &why).error_code(),
              grpc::StatusCode::NOT_FOUND);
    EXPECT_EQ(why, "TENSOR_NOT_FOUND");
    EXPECT_EQ(PagesUsed(d), used);
    // Loads by key: a lease nobody holds, and pages beside the lease.
    v1::LoadRequest load;
    load.set_session_id(s.id());
    load.set_tensor_id(12345);
    load.set_pool("s");
    load.add_destination_blocks(0);
    load.mutable_cache()->set_namespace_("ns");
    load.mutable_cache()->set_digest(ns.digest);
    load.mutable_cache()->set_lease_id(777);
    EXPECT_EQ(call(&v1::KvSession::Stub::Load, load, &why).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_EQ(why, "LEASE_EXPIRED");
    v1::LoadRequest load_and_pages = load;
    load_and_pages.mutable_source_page_list()->add_page_ids(0);
    load_and_pages.mutable_source_page_list()->add_generations(0);
    EXPECT_EQ(call(&v1::KvSession::Stub::Load, load_and_pages, &why).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(why, "INVALID_REQUEST");
  }
  // A session id nobody opened.
  client::ClientOptions o = Options(d);
  auto other = Session::Open(o, "other", 0, 70000);
  EXPECT_EQ(other.status().code(), absl::StatusCode::kInvalidArgument) << other.status();
  EXPECT_TRUE(s.Close().ok());
  EXPECT_TRUE(d.Alive());
}

// A request enqueued without waiting, which the daemon refuses: its Pending is done and
// carries the daemon's status and reason, and its completion slot is free again (more
// refusals than the session has slots each report theirs). Close waits for enqueued calls
// still on their way; their Pendings outlive the session.
TEST(SessionArgsTest, AnEnqueuedRequestTheDaemonRefusesCarriesItsReason) {
  testing::Daemon d;
  testing::CreatePool(d, "s", Layout::kV41, 16, 8);
  auto session = Session::Open(Options(d), "enqueue", 0, /*slots=*/2);
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  auto pages = s.AllocatePages("s", 2);
  ASSERT_TRUE(pages.ok()) << pages.status();
  const std::vector<uint64_t> blocks = {0, 1};
  for (int i = 0; i < 5; ++i) {
    auto p = i % 2 == 0 ? s.EnqueueSaveBlocks(12345, "s", 0, blocks, *pages)
                        : s.EnqueueLoadBlocks(12345, "s", 0, *pages, blocks);
    ASSERT_TRUE(p.ok()) << "request " << i << ": " << p.status();
    const absl::Status w = p->Wait(absl::Seconds(30));
    EXPECT_TRUE(p->Done());
    EXPECT_EQ(w.code(), absl::StatusCode::kNotFound) << w;
    EXPECT_EQ(client::ErrorReason(w), "TENSOR_NOT_FOUND") << w;
  }
  // A pool that does not exist: refused the same way, with its own reason.
  auto missing = s.EnqueueSaveBlocks(12345, "nope", 0, blocks, *pages);
  ASSERT_TRUE(missing.ok());
  const absl::Status w = missing->Wait(absl::Seconds(30));
  EXPECT_FALSE(w.ok());
  EXPECT_FALSE(client::ErrorReason(w).empty()) << w;
  std::vector<Session::Pending> last;
  for (int i = 0; i < 2; ++i) {
    auto p = s.EnqueueSaveBlocks(12345, "s", 0, blocks, *pages);
    ASSERT_TRUE(p.ok()) << p.status();
    last.push_back(*p);
  }
  EXPECT_TRUE(s.Close().ok());
  for (const Session::Pending& p : last) {
    EXPECT_TRUE(p.Done());
    EXPECT_EQ(client::ErrorReason(p.Wait(absl::Seconds(1))), "TENSOR_NOT_FOUND");
  }
  EXPECT_TRUE(d.Alive());
}

// Established TCP connections on this machine whose remote end is 127.0.0.1:`port` (the
// clients' side of connections to a daemon listening there), from /proc/net/tcp and tcp6
// (gRPC connects IPv6 sockets to IPv4-mapped addresses).
int ConnectionsTo(int port) {
  int n = 0;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    char v4[32], mapped[64];
    std::snprintf(v4, sizeof(v4), "0100007F:%04X", port);
    std::snprintf(mapped, sizeof(mapped), "0000000000000000FFFF00000100007F:%04X", port);
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, rem, state;
      fields >> slot >> local >> rem >> state;
      if ((rem == v4 || rem == mapped) && state == "01") ++n;
    }
  }
  return n;
}

// ClientOptions::session_connections: a session's calls go round robin over that many
// connections (one may be shared with other channels to the daemon), and a value below 1
// (hostile or careless) means one: its calls still reach the daemon and get its answers.
TEST(SessionConnectionsTest, ASessionsCallsSpreadOverTheConnectionsAskedFor) {
  testing::Daemon d;
  testing::CreatePool(d, "s", Layout::kV41, 16, 8);
  auto calls = [&](Session& s) {
    auto pages = s.AllocatePages("s", 1);
    ASSERT_TRUE(pages.ok()) << pages.status();
    const std::vector<uint64_t> blocks = {0};
    for (int i = 0; i < 8; ++i) {
      EXPECT_EQ(client::ErrorReason(s.SaveBlocks(12345, "s", 0, blocks, *pages).status()),
                "TENSOR_NOT_FOUND");
    }
  };
  for (const int asked : {4, 0, -3}) {
    SCOPED_TRACE(asked);
    const int before = ConnectionsTo(d.grpc_port());
    client::ClientOptions o = Options(d);
    o.session_connections = asked;
    auto session = Session::Open(o, "connections", 0);
    ASSERT_TRUE(session.ok()) << session.status();
    calls(**session);
    const int opened = ConnectionsTo(d.grpc_port()) - before;
    if (asked == 4) {
      EXPECT_GE(opened, 3);
      EXPECT_LE(opened, 4);
    } else {
      EXPECT_LE(opened, 1);
    }
    EXPECT_TRUE((*session)->Close().ok());
    session->reset();
    // The session's own connections close with it (before the next round counts).
    for (int i = 0; i < 100 && ConnectionsTo(d.grpc_port()) > before; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  EXPECT_TRUE(d.Alive());
}

TEST(SessionPagesTest, PagesOfASessionAreFreedWhenItClosesOrItsWorkerIsKilled) {
  testing::Daemon d;
  testing::CreatePool(d, "p", Layout::kV4, 16, 64);
  testing::Allocate(d, "p", 2);  // plain pages: kept
  {
    auto session = Session::Open(Options(d), "clean", 0);
    ASSERT_TRUE(session.ok());
    ASSERT_TRUE((*session)->AllocatePages("p", 5).ok());
    EXPECT_EQ(PagesUsed(d), 7u);
    EXPECT_NE(testing::Metrics(d).find("kvferry_sessions 1"), std::string::npos);
  }  // destroyed: closed
  EXPECT_EQ(PagesUsed(d), 2u);

  // A worker process killed with SIGKILL while it holds 9 pages of its session.
  const std::string command = testing::SessionWorkerPath() + " 127.0.0.1:" +
                              std::to_string(d.grpc_port()) + " 9 p";
  FILE* worker = popen(("exec " + command).c_str(), "r");
  ASSERT_NE(worker, nullptr);
  char line[64] = {};
  ASSERT_NE(fgets(line, sizeof(line), worker), nullptr);
  // The worker says its own pid (a search by command line could find another process).
  int pid = 0;
  ASSERT_EQ(std::sscanf(line, "ready %d", &pid), 1) << line;
  EXPECT_EQ(PagesUsed(d), 11u);
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  pclose(worker);
  // The daemon notices the stream's end and frees the pages (bounded wait).
  for (int i = 0; i < 200 && PagesUsed(d) != 2u; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(PagesUsed(d), 2u);
  EXPECT_NE(testing::Metrics(d).find("kvferry_sessions 0"), std::string::npos);
  EXPECT_TRUE(d.Alive());
  // The freed pages come back zeroed and usable.
  EXPECT_EQ(testing::Allocate(d, "p", 62).size(), 62u);
}

TEST(SessionTenantTest, AnotherTenantsSessionIsNotFound) {
  char dir[] = "/tmp/kvferry-session-auth-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string d = dir;
  ASSERT_EQ(std::system(("for t in alice bob; do printf \"$t %s\\n\" $(printf \"$t-token\" | sha256sum | cut -d' ' -f1); done > " +
                         d + "/tokens").c_str()),
            0);
  testing::Daemon daemon({"--auth_tokens=" + d + "/tokens"});
  client::ClientOptions alice = Options(daemon), bob = Options(daemon);
  alice.bearer_token = "alice-token";
  bob.bearer_token = "bob-token";
  ASSERT_TRUE((*client::Client::Connect(alice))->CreatePool({"a", client::Layout::kV4, 16, 8, 1, "cpu"}).ok());
  auto session = Session::Open(alice, "alice-worker", 0);
  ASSERT_TRUE(session.ok()) << session.status();
  auto pages = (*session)->AllocatePages("a", 2);
  ASSERT_TRUE(pages.ok()) << pages.status();
  // Bob names alice's session: as absent as one nobody opened.
  auto channel = grpc::CreateChannel(bob.target, grpc::InsecureChannelCredentials());
  auto stub = v1::KvSession::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", "Bearer bob-token");
  v1::MapPoolRequest map;
  map.set_session_id((*session)->id());
  map.set_pool("a");
  v1::MapPoolResponse mapped;
  EXPECT_EQ(stub->MapPool(&ctx, map, &mapped).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(testing::ReasonOf(ctx), "SESSION_NOT_FOUND");
  // Bob's own session cannot reach alice's pool either.
  auto bobs = Session::Open(bob, "bob-worker", 0);
  ASSERT_TRUE(bobs.ok());
  EXPECT_EQ(client::ErrorReason((*bobs)->AllocatePages("a", 1).status()), "POOL_NOT_FOUND");
  EXPECT_EQ(client::ErrorReason((*bobs)->MapPool("a").status()), "POOL_NOT_FOUND");
  // Without a token there is no session at all.
  EXPECT_EQ(Session::Open(Options(daemon), "nobody", 0).status().code(),
            absl::StatusCode::kUnauthenticated);
  std::system(("rm -rf " + d).c_str());
}

}  // namespace
}  // namespace kvferry
