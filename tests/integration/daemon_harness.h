// Starts the real kvferryd binary on free loopback ports and connects generated stubs.
#pragma once

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/support/client_interceptor.h>

#include "common/error_reason.h"
#include "gtest/gtest.h"
#include "kvferry/kernels/format.h"
#include "kvferry/v1/kvferry.grpc.pb.h"

// Built with AddressSanitizer (gcc's or clang's spelling): memory figures such as peak RSS
// say nothing there (freed memory waits in a quarantine).
#if defined(__SANITIZE_ADDRESS__)
#define KVFERRY_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVFERRY_TEST_ASAN 1
#endif
#endif
// Built with ThreadSanitizer: its own allocator and shadow memory, and every thread slowed.
#if defined(__SANITIZE_THREAD__)
#define KVFERRY_TEST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVFERRY_TEST_TSAN 1
#endif
#endif

namespace kvferry::testing {

// The device pools are created on: KVFERRY_TEST_DEVICE (e.g. cuda:0), default cpu.
inline std::string TestDevice() {
  const char* d = std::getenv("KVFERRY_TEST_DEVICE");
  return d != nullptr && *d != '\0' ? d : "cpu";
}

// Bytes a token write stages (and charges to staged_write_bytes) per row on the test
// device: a host memory pool stages the row's record, a device pool the bf16 row itself.
inline int64_t StagedBytesPerRow(Layout layout) {
  return TestDevice() == "cpu" ? GetLayoutInfo(layout).bytes_per_token() : kBf16RowBytes;
}

// The daemon binary: set by CMake, or KVFERRY_DAEMON when run from elsewhere.
inline std::string DaemonPath() {
  const char* d = std::getenv("KVFERRY_DAEMON");
  return d != nullptr && *d != '\0' ? d : KVFERRY_DAEMON_PATH;
}

#ifdef KVFERRY_CLI
// The kvferry command: set by CMake, or KVFERRY_CLI when run from elsewhere.
inline std::string CliPath() {
  const char* c = std::getenv("KVFERRY_CLI");
  return c != nullptr && *c != '\0' ? c : KVFERRY_CLI;
}
#endif

// Adds `authorization: Bearer <token>` to every call of a channel (call credentials would
// need a secure channel; this works on plaintext loopback too).
class BearerToken final : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit BearerToken(std::string token) : token_(std::move(token)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new Adder(token_);
  }

 private:
  class Adder final : public grpc::experimental::Interceptor {
   public:
    explicit Adder(const std::string& token) : value_("Bearer " + token) {}
    void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
      if (methods->QueryInterceptionHookPoint(
              grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
        methods->GetSendInitialMetadata()->insert({"authorization", value_});
      }
      methods->Proceed();
    }

   private:
    const std::string value_;
  };
  const std::string token_;
};

// A channel to 127.0.0.1:port; `token` non-empty: sent with every call; `server_name`
// non-empty: the name the server's certificate must carry (TLS).
inline std::shared_ptr<grpc::Channel> MakeChannel(int port,
                                                  std::shared_ptr<grpc::ChannelCredentials> creds,
                                                  const std::string& token = "",
                                                  const std::string& server_name = "") {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  if (!server_name.empty()) args.SetSslTargetNameOverride(server_name);
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  if (!token.empty()) interceptors.push_back(std::make_unique<BearerToken>(token));
  return grpc::experimental::CreateCustomChannelWithInterceptors(
      "127.0.0.1:" + std::to_string(port), creds, args, std::move(interceptors));
}

// A number of /proc/<pid>/status ("VmRSS" and "VmHWM" in KiB, "Threads"); -1 when absent.
inline int64_t ProcStatus(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1));
  }
  return -1;
}

// The threads of `pid` by name (/proc/<pid>/task/*/comm, which Linux cuts at 15 characters).
inline std::map<std::string, int> ThreadCounts(pid_t pid) {
  std::map<std::string, int> by_name;
  std::error_code ec;
  for (const auto& task :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec)) {
    std::ifstream in(task.path() / "comm");
    std::string name;
    if (std::getline(in, name)) ++by_name[name];
  }
  return by_name;
}
// The same as "name x count" pairs, most frequent first: what a failed thread count shows.
inline std::string ThreadNames(const std::map<std::string, int>& by_name) {
  std::vector<std::pair<int, std::string>> sorted;
  for (const auto& [name, n] : by_name) sorted.emplace_back(-n, name);
  std::sort(sorted.begin(), sorted.end());
  std::string out;
  for (const auto& [n, name] : sorted) {
    out += (out.empty() ? "" : ", ") + name + " x" + std::to_string(-n);
  }
  return out;
}

// Reads a stream of PageChunk into one byte string, checking each chunk's offset and XXH64.
template <typename Reader>
void DrainPageChunks(Reader& reader, std::string* bytes) {
  v1::PageChunk chunk;
  bytes->clear();
  while (reader.Read(&chunk)) {
    EXPECT_EQ(chunk.offset(), bytes->size());
    EXPECT_EQ(chunk.xxh64(), XXH64(chunk.data().data(), chunk.data().size(), 0));
    bytes->append(chunk.data());
  }
}

#ifdef KVFERRY_SESSION_WORKER
// The session worker program: set by CMake, or KVFERRY_SESSION_WORKER when run from elsewhere.
inline std::string SessionWorkerPath() {
  const char* w = std::getenv("KVFERRY_SESSION_WORKER");
  return w != nullptr && *w != '\0' ? w : KVFERRY_SESSION_WORKER;
}
#endif

class Daemon {
 public:
  // `capture_log`: the daemon's stderr goes to a file that Log() reads, not to the test's.
  explicit Daemon(std::vector<std::string> extra_flags = {}, bool capture_log = false) {
    char dir[] = "/tmp/kvferryd-test-XXXXXX";
    if (mkdtemp(dir) == nullptr) throw std::runtime_error("mkdtemp");
    dir_ = dir;
    const std::string port_file = dir_ + "/ports";
    std::vector<std::string> args = {DaemonPath(), "--listen=127.0.0.1:0",
                                     "--metrics_listen=127.0.0.1:0", "--port_file=" + port_file,
                                     "--log_level=warn"};
    args.insert(args.end(), extra_flags.begin(), extra_flags.end());
    // KVFERRY_DAEMON_WRAPPER: a command the daemon runs under (e.g. compute-sanitizer with
    // its options, words split on spaces). The daemon is then stopped with SIGTERM, so that
    // the tool sees it exit and reports, and a tool's non-zero exit fails the test.
    if (const char* w = std::getenv("KVFERRY_DAEMON_WRAPPER"); w != nullptr && *w != '\0') {
      std::vector<std::string> wrapped;
      std::istringstream words(w);
      for (std::string word; words >> word;) wrapped.push_back(word);
      args.insert(args.begin(), wrapped.begin(), wrapped.end());
      wrapped_ = true;
    }
    pid_ = fork();
    if (pid_ == 0) {
      if (capture_log) freopen((dir_ + "/log").c_str(), "w", stderr);
      // Only stdin/out/err go to the daemon: an inherited descriptor (a build lock, a
      // pipe ctest waits on) would be held by a daemon that outlives a crashed test.
      close_range(3, ~0U, 0);
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execvp(argv[0], argv.data());
      _exit(127);
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (std::chrono::steady_clock::now() < deadline) {
      std::ifstream in(port_file);
      if (in >> grpc_port_ >> metrics_port_) break;
      int status;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        RemoveDir();
        throw std::runtime_error("kvferryd exited during start-up");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (grpc_port_ == 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
      pid_ = -1;
      RemoveDir();
      throw std::runtime_error("kvferryd did not start within 30 s");
    }
    grpc::ChannelArguments channel_args;
    channel_args.SetMaxReceiveMessageSize(64 << 20);
    channel_args.SetMaxSendMessageSize(64 << 20);
    channel_ = grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(grpc_port_),
                                         grpc::InsecureChannelCredentials(), channel_args);
    stub_ = v1::KvFerry::NewStub(channel_);
  }

  ~Daemon() {
    if (pid_ > 0 && wrapped_) {
      // The tool's own verdict: the exit code it was told to use for findings (86 unless
      // KVFERRY_DAEMON_WRAPPER_ERROR_EXITCODE says otherwise, e.g. compute-sanitizer
      // --error-exitcode 86), or no exit at all. Other codes are the tool's, not findings
      // (compute-sanitizer answers 1 when it cannot read the exit code of a daemon that
      // exited cleanly on SIGTERM).
      const char* e = std::getenv("KVFERRY_DAEMON_WRAPPER_ERROR_EXITCODE");
      const int finding = e != nullptr && *e != '\0' ? std::atoi(e) : 86;
      const int rc = Terminate();
      EXPECT_NE(rc, finding) << "the tool KVFERRY_DAEMON_WRAPPER runs kvferryd under reported findings";
      EXPECT_NE(rc, -1) << "kvferryd under KVFERRY_DAEMON_WRAPPER did not exit on SIGTERM";
    }
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    RemoveDir();
  }

  // Sends SIGTERM and returns the exit code (-1 if killed by a signal or over 30 s).
  int Terminate() {
    kill(DaemonPid(), SIGTERM);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(wrapped_ ? 180 : 30);
    int status = 0;
    while (std::chrono::steady_clock::now() < deadline) {
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return -1;
  }

  // The daemon's own process: the child of the wrapper when there is one.
  pid_t DaemonPid() const {
    if (!wrapped_) return pid_;
    std::ifstream children("/proc/" + std::to_string(pid_) + "/task/" + std::to_string(pid_) + "/children");
    pid_t child = 0;
    return children >> child ? child : pid_;
  }

  // Later calls through stub() (and the helpers below) use these credentials and token.
  void Connect(std::shared_ptr<grpc::ChannelCredentials> creds, const std::string& token = "",
               const std::string& server_name = "") {
    channel_ = MakeChannel(grpc_port_, std::move(creds), token, server_name);
    stub_ = v1::KvFerry::NewStub(channel_);
  }

  v1::KvFerry::Stub& stub() { return *stub_; }
  pid_t pid() const { return DaemonPid(); }
  int grpc_port() const { return grpc_port_; }
  // True while the daemon process runs.
  bool Alive() const { return pid_ > 0 && waitpid(pid_, nullptr, WNOHANG) == 0; }
  std::shared_ptr<grpc::Channel> channel() { return channel_; }
  int metrics_port() const { return metrics_port_; }
  const std::string& dir() const { return dir_; }
  // What the daemon logged so far (with capture_log).
  std::string Log() const {
    std::ifstream in(dir_ + "/log");
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }

 private:
  // A constructor that throws has no destructor run: it removes the directory itself.
  void RemoveDir() const { std::system(("rm -rf '" + dir_ + "'").c_str()); }

  std::string dir_;
  pid_t pid_ = -1;
  bool wrapped_ = false;  // started under KVFERRY_DAEMON_WRAPPER
  int grpc_port_ = 0, metrics_port_ = 0;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KvFerry::Stub> stub_;
};

// A unary call of any method with raw request bytes, through the generic stub.
inline grpc::Status RawUnary(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                      const std::string& request, std::string* response) {
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::Slice slice(request);
  grpc::ByteBuffer req(&slice, 1), resp;
  auto call = stub.PrepareUnaryCall(&ctx, method, req, &cq);
  call->StartCall();
  grpc::Status status;
  call->Finish(&resp, &status, reinterpret_cast<void*>(1));
  void* tag;
  bool ok;
  cq.Next(&tag, &ok);
  if (response != nullptr && status.ok()) {
    std::vector<grpc::Slice> slices;
    resp.Dump(&slices);
    response->clear();
    for (const auto& s : slices) response->append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return status;
}

inline v1::Layout ProtoLayout(Layout layout) {
  return static_cast<v1::Layout>(static_cast<int>(layout) + 1);
}

// Creates a pool; fails the test on error.
// On `device`, or the test device (TestDevice) when empty.
inline v1::Pool CreatePool(Daemon& d, const std::string& name, Layout layout, int page_size,
                           int64_t num_pages, int num_layers = 1, const std::string& device = "") {
  grpc::ClientContext ctx;
  v1::CreatePoolRequest req;
  req.set_name(name);
  req.set_layout(ProtoLayout(layout));
  req.set_page_size(page_size);
  req.set_num_pages(num_pages);
  req.set_num_layers(num_layers);
  req.set_device(device.empty() ? TestDevice() : device);
  v1::Pool pool;
  const grpc::Status s = d.stub().CreatePool(&ctx, req, &pool);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return pool;
}

inline std::vector<v1::PageHandle> Allocate(Daemon& d, const std::string& pool, int count) {
  grpc::ClientContext ctx;
  v1::AllocatePagesRequest req;
  req.set_pool(pool);
  req.set_count(count);
  v1::AllocatePagesResponse resp;
  const grpc::Status s = d.stub().AllocatePages(&ctx, req, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return {resp.pages().begin(), resp.pages().end()};
}

// `pages` packed (PageList), as the clients and daemons send them; `drop` generations left
// off the end (a malformed list).
inline v1::PageList PackPages(const std::vector<v1::PageHandle>& pages, size_t drop = 0) {
  v1::PageList list;
  for (const auto& p : pages) {
    list.add_page_ids(p.page_id());
    list.add_generations(p.generation());
  }
  for (size_t i = 0; i < drop; ++i) list.mutable_generations()->RemoveLast();
  return list;
}

inline grpc::Status FreePages(Daemon& d, const std::string& pool,
                              const std::vector<v1::PageHandle>& pages) {
  grpc::ClientContext ctx;
  v1::FreePagesRequest req;
  req.set_pool(pool);
  for (const auto& p : pages) *req.add_pages() = p;
  v1::FreePagesResponse resp;
  return d.stub().FreePages(&ctx, req, &resp);
}

inline grpc::Status DeletePool(Daemon& d, const std::string& name) {
  grpc::ClientContext ctx;
  v1::DeletePoolRequest req;
  req.set_name(name);
  v1::DeletePoolResponse resp;
  return d.stub().DeletePool(&ctx, req, &resp);
}

// One WriteTokens call: rows [n, 512] bf16 for locations, split into messages of `per`.
inline grpc::Status WriteTokens(Daemon& d, const std::string& pool, int layer,
                                const std::vector<v1::TokenLocation>& locs,
                                const std::vector<uint16_t>& rows, size_t per = 256,
                                v1::WriteResponse* out = nullptr, std::string* reason = nullptr) {
  grpc::ClientContext ctx;
  v1::WriteResponse resp;
  auto writer = d.stub().WriteTokens(&ctx, &resp);
  for (size_t first = 0; first < locs.size(); first += per) {
    const size_t n = std::min(per, locs.size() - first);
    v1::WriteTokensRequest msg;
    if (first == 0) {
      msg.set_pool(pool);
      msg.set_layer(layer);
    }
    for (size_t i = 0; i < n; ++i) *msg.add_locations() = locs[first + i];
    msg.set_rows(reinterpret_cast<const char*>(rows.data() + first * kHeadDim), n * kBf16RowBytes);
    msg.set_finish_write(first + n == locs.size());
    if (!writer->Write(msg)) break;
  }
  writer->WritesDone();
  const grpc::Status s = writer->Finish();
  if (out != nullptr) *out = resp;
  if (reason != nullptr) *reason = ReasonOf(ctx);
  return s;
}

// ReadPages into one byte string; checks each chunk's offset and XXH64.
inline grpc::Status ReadPages(Daemon& d, const std::string& pool,
                              const std::vector<v1::PageHandle>& pages, std::string* bytes,
                              v1::Layout transcode_to = v1::LAYOUT_UNSPECIFIED,
                              std::vector<uint32_t> layers = {}, std::string* reason = nullptr) {
  grpc::ClientContext ctx;
  v1::ReadPagesRequest req;
  req.set_pool(pool);
  for (const auto& p : pages) *req.add_pages() = p;
  for (uint32_t l : layers) req.add_layers(l);
  req.set_transcode_to(transcode_to);
  auto reader = d.stub().ReadPages(&ctx, req);
  DrainPageChunks(*reader, bytes);
  const grpc::Status s = reader->Finish();
  if (reason != nullptr) *reason = ReasonOf(ctx);
  return s;
}

inline grpc::Status ReadWorkspace(Daemon& d, const std::string& pool, int layer,
                                  const std::vector<v1::TokenLocation>& locs,
                                  std::vector<uint16_t>* rows) {
  grpc::ClientContext ctx;
  v1::ReadWorkspaceRequest req;
  req.set_pool(pool);
  req.set_layer(layer);
  for (const auto& l : locs) *req.add_locations() = l;
  auto reader = d.stub().ReadWorkspace(&ctx, req);
  v1::WorkspaceChunk chunk;
  std::string bytes;
  while (reader->Read(&chunk)) {
    EXPECT_EQ(chunk.first_row() * kBf16RowBytes, bytes.size());
    EXPECT_EQ(chunk.xxh64(), XXH64(chunk.rows().data(), chunk.rows().size(), 0));
    bytes.append(chunk.rows());
  }
  rows->resize(bytes.size() / 2);
  if (!bytes.empty()) std::memcpy(rows->data(), bytes.data(), bytes.size());
  return reader->Finish();
}

inline v1::Stats GetStats(Daemon& d) {
  grpc::ClientContext ctx;
  v1::Stats stats;
  EXPECT_TRUE(d.stub().GetStats(&ctx, v1::GetStatsRequest(), &stats).ok());
  return stats;
}

inline v1::TokenLocation Location(const v1::PageHandle& page, uint32_t slot) {
  v1::TokenLocation l;
  *l.mutable_page() = page;
  l.set_slot(slot);
  return l;
}

}  // namespace kvferry::testing
