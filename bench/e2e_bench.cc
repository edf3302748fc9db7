// End-to-end benchmark over loopback gRPC: WriteTokens ingest and ReadWorkspace / ReadPages
// serving in tokens/s and GB/s with 1, 4 and 16 concurrent streams, against the ceiling of
// a plain gRPC stream of the same messages that does nothing with them (a null service in
// the same process, measured in the same run).
//
// Usage: e2e_bench [--device cpu|cuda:0] [--tokens-per-stream N] [--reps R] [--rounds K]
//                  [--streams 1,4,16] [--ops WriteTokens,ReadWorkspace,ReadPages]
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_split.h"
#include "common/random_rows.h"
#include "daemon.h"
#include "kvferry/v1/kvferry.grpc.pb.h"

namespace kvferry {
namespace {

constexpr int kPageSize = 64;
constexpr int kRowsPerMessage = 1000;  // ~1 MB messages

// Receives and discards writes; serves reads from one pre-built message: the ceiling.
class NullService final : public v1::KvFerry::Service {
 public:
  grpc::Status WriteTokens(grpc::ServerContext*, grpc::ServerReader<v1::WriteTokensRequest>* reader,
                           v1::WriteResponse* out) override {
    v1::WriteTokensRequest msg;
    uint64_t n = 0;
    while (reader->Read(&msg)) n += msg.locations_size();
    out->set_tokens_written(n);
    return grpc::Status::OK;
  }
  grpc::Status ReadWorkspace(grpc::ServerContext*, const v1::ReadWorkspaceRequest* req,
                             grpc::ServerWriter<v1::WorkspaceChunk>* writer) override {
    v1::WorkspaceChunk chunk;
    const int64_t rows_per = (1 << 20) / kBf16RowBytes;
    chunk.set_rows(std::string(rows_per * kBf16RowBytes, '\x01'));
    for (int64_t first = 0; first < req->locations_size(); first += rows_per) {
      const int64_t n = std::min<int64_t>(rows_per, req->locations_size() - first);
      if (n != rows_per) chunk.mutable_rows()->resize(n * kBf16RowBytes);
      chunk.set_first_row(first);
      writer->Write(chunk);
    }
    return grpc::Status::OK;
  }
  grpc::Status ReadPages(grpc::ServerContext*, const v1::ReadPagesRequest* req,
                         grpc::ServerWriter<v1::PageChunk>* writer) override {
    const int64_t total = req->pages_size() * PageBytes(static_cast<Layout>(kLayoutIndex), kPageSize);
    v1::PageChunk chunk;
    chunk.set_data(std::string(1 << 20, '\x02'));
    for (int64_t at = 0; at < total; at += 1 << 20) {
      if (total - at < (1 << 20)) chunk.mutable_data()->resize(total - at);
      chunk.set_offset(at);
      writer->Write(chunk);
    }
    return grpc::Status::OK;
  }
  static constexpr int kLayoutIndex = 1;  // V41, the bench's pool layout
};

std::unique_ptr<v1::KvFerry::Stub> Connect(int port) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(8 << 20);
  args.SetMaxSendMessageSize(8 << 20);
  // A channel per stream, so streams do not share one HTTP/2 connection.
  args.SetInt("grpc.channel_id", std::rand());
  return v1::KvFerry::NewStub(grpc::CreateCustomChannel(
      "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials(), args));
}

// Runs `streams` threads each doing `op` `reps` times; returns seconds of the whole.
template <typename Op>
double RunParallel(int streams, int reps, Op op) {
  std::vector<std::thread> threads;
  const auto start = std::chrono::steady_clock::now();
  for (int s = 0; s < streams; ++s) {
    threads.emplace_back([&, s] {
      for (int r = 0; r < reps; ++r) op(s);
    });
  }
  for (auto& t : threads) t.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int Main(int argc, char** argv) {
  std::string device = "cpu";
  int64_t tokens = 16384;  // per stream per call
  int reps = 3;
  int rounds = 5;
  std::vector<int> stream_counts = {1, 4, 16};
  std::vector<std::string> ops = {"WriteTokens", "ReadWorkspace", "ReadPages"};
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--rounds")) rounds = std::max(1, std::atoi(argv[i + 1]));
    if (!std::strcmp(argv[i], "--device")) device = argv[i + 1];
    if (!std::strcmp(argv[i], "--tokens-per-stream")) tokens = std::atoll(argv[i + 1]);
    if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--streams")) {
      stream_counts.clear();
      const std::vector<std::string> counts = absl::StrSplit(argv[i + 1], ',', absl::SkipEmpty());
      for (const std::string& n : counts) {
        stream_counts.push_back(std::clamp(std::atoi(n.c_str()), 1, 16));
      }
    }
    if (!std::strcmp(argv[i], "--ops")) ops = absl::StrSplit(argv[i + 1], ',', absl::SkipEmpty());
  }
  server::DaemonOptions options;
  options.listen = "127.0.0.1:0";
  options.metrics_listen = "";
  options.default_device = device;
  absl::StatusOr<std::unique_ptr<server::Daemon>> daemon = server::Daemon::Start(options);
  if (!daemon.ok()) {
    std::fprintf(stderr, "e2e_bench: %s\n", daemon.status().ToString().c_str());
    return 1;
  }
  NullService null_service;
  int null_port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &null_port);
  builder.RegisterService(&null_service);
  builder.SetMaxReceiveMessageSize(8 << 20);
  auto null_server = builder.BuildAndStart();

  const int kMaxStreams = 16;
  const int64_t pages_per_stream = (tokens + kPageSize - 1) / kPageSize;
  {
    auto stub = Connect((*daemon)->grpc_port());
    grpc::ClientContext ctx;
    v1::CreatePoolRequest req;
    req.set_name("bench");
    req.set_layout(v1::LAYOUT_V41);
    req.set_page_size(kPageSize);
    req.set_num_pages(pages_per_stream * kMaxStreams);
    req.set_num_layers(1);
    v1::Pool pool;
    const grpc::Status s = stub->CreatePool(&ctx, req, &pool);
    if (!s.ok()) {
      std::fprintf(stderr, "e2e_bench: CreatePool: %s\n", s.error_message().c_str());
      return 1;
    }
  }
  // Per stream: its pages, the write messages, the read requests.
  const auto rows = testing::RandomRows(kRowsPerMessage, 1);
  struct Stream {
    std::vector<v1::WriteTokensRequest> messages;
    v1::ReadWorkspaceRequest workspace;
    v1::ReadPagesRequest pages;
  };
  std::vector<Stream> work(kMaxStreams);
  for (int s = 0; s < kMaxStreams; ++s) {
    auto stub = Connect((*daemon)->grpc_port());
    grpc::ClientContext ctx;
    v1::AllocatePagesRequest req;
    req.set_pool("bench");
    req.set_count(pages_per_stream);
    v1::AllocatePagesResponse resp;
    if (!stub->AllocatePages(&ctx, req, &resp).ok()) return 1;
    work[s].workspace.set_pool("bench");
    work[s].pages.set_pool("bench");
    for (const auto& h : resp.pages()) *work[s].pages.add_pages() = h;
    for (int64_t first = 0; first < tokens; first += kRowsPerMessage) {
      const int64_t n = std::min<int64_t>(kRowsPerMessage, tokens - first);
      v1::WriteTokensRequest msg;
      if (first == 0) msg.set_pool("bench");
      for (int64_t i = 0; i < n; ++i) {
        v1::TokenLocation* l = msg.add_locations();
        *l->mutable_page() = resp.pages((first + i) / kPageSize);
        l->set_slot((first + i) % kPageSize);
        *work[s].workspace.add_locations() = *l;
      }
      msg.set_rows(reinterpret_cast<const char*>(rows.data()), n * kBf16RowBytes);
      work[s].messages.push_back(std::move(msg));
    }
    work[s].messages.back().set_finish_write(true);  // the end of each write
  }

  std::printf("device %s, V41 pool, page size %d, %lld tokens per stream per call, %d calls "
              "per round, median of %d alternating rounds\n\n",
              device.c_str(), kPageSize, (long long)tokens, reps, rounds);
  std::printf("| op | streams | kvferryd tokens/s | kvferryd GB/s | null-stream GB/s (ceiling) | fraction |\n"
              "|---|---|---|---|---|---|\n");
  for (int streams : stream_counts) {
    for (const std::string& op_name : ops) {
      const char* op = op_name.c_str();
      // kvferryd and the null service alternate for `rounds` rounds; each side's median
      // round is reported, so drift of the machine affects both alike.
      std::vector<double> times[2];
      for (int round = 0; round < rounds; ++round) {
        for (int target = 0; target < 2; ++target) {
          const int port = target == 0 ? (*daemon)->grpc_port() : null_port;
          std::vector<std::unique_ptr<v1::KvFerry::Stub>> stubs;
          for (int s = 0; s < streams; ++s) stubs.push_back(Connect(port));
          std::atomic<int> errors{0};
          times[target].push_back(RunParallel(streams, reps, [&](int s) {
            grpc::ClientContext ctx;
            if (!std::strcmp(op, "WriteTokens")) {
              v1::WriteResponse resp;
              auto writer = stubs[s]->WriteTokens(&ctx, &resp);
              for (const auto& m : work[s].messages) writer->Write(m);
              writer->WritesDone();
              if (!writer->Finish().ok()) ++errors;
            } else if (!std::strcmp(op, "ReadWorkspace")) {
              auto reader = stubs[s]->ReadWorkspace(&ctx, work[s].workspace);
              v1::WorkspaceChunk chunk;
              while (reader->Read(&chunk)) {
              }
              if (!reader->Finish().ok()) ++errors;
            } else {
              auto reader = stubs[s]->ReadPages(&ctx, work[s].pages);
              v1::PageChunk chunk;
              while (reader->Read(&chunk)) {
              }
              if (!reader->Finish().ok()) ++errors;
            }
          }));
          if (errors > 0) {
            std::fprintf(stderr, "e2e_bench: %d failed calls of %s\n", errors.load(), op);
            return 1;
          }
        }
      }
      double seconds[2];
      for (int target = 0; target < 2; ++target) {
        std::sort(times[target].begin(), times[target].end());
        seconds[target] = times[target][times[target].size() / 2];
      }
      // Bytes on the wire per token: bf16 rows for writes and workspace reads, the stored
      // record (page bytes / page size) for page reads.
      const double per_token = !std::strcmp(op, "ReadPages")
                                   ? static_cast<double>(PageBytes(Layout::kV41, kPageSize)) / kPageSize
                                   : kBf16RowBytes;
      const double total_tokens = static_cast<double>(tokens) * streams * reps;
      const double gbs = total_tokens * per_token / seconds[0] / 1e9;
      const double ceiling = total_tokens * per_token / seconds[1] / 1e9;
      std::printf("| %s | %d | %.3g | %.2f | %.2f | %.0f %% |\n", op, streams,
                  total_tokens / seconds[0], gbs, ceiling, 100.0 * gbs / ceiling);
    }
  }
  null_server->Shutdown();
  (*daemon)->Shutdown(1);
  return 0;
}

}  // namespace
}  // namespace kvferry

int main(int argc, char** argv) { return kvferry::Main(argc, argv); }
