// KV cache lookup benchmark over loopback gRPC: Lookup latency and keys/s with 1, 64 and
// 1024 keys per call while many blocks are resident, against the ceiling of a null KvCache
// service in the same process that parses the same requests and answers an empty reply
// (measured in the same run, alternating with kvferryd).
//
// Every lookup is a full hit: the longest prefix is the whole key list, so the index walks
// every key. kvferryd is the daemon's own code (server::Daemon), started in this process.
//
// Usage: cache_bench [--blocks N] [--seconds S] [--rounds K] [--threads T]
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

#include "daemon.h"
#include "kvferry/v1/cache.grpc.pb.h"
#include "kvferry/v1/kvferry.grpc.pb.h"

namespace kvferry {
namespace {

using Clock = std::chrono::steady_clock;

// Answers every Lookup with an empty reply: the cost of the RPC and its message alone.
class NullCache final : public v1::KvCache::Service {
 public:
  grpc::Status Lookup(grpc::ServerContext*, const v1::LookupRequest*, v1::LookupResponse*) override {
    return grpc::Status::OK;
  }
};

std::shared_ptr<grpc::Channel> Channel(int port) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  // One connection per client thread, as separate workers would have.
  args.SetInt("kvferry.bench.channel", std::rand());
  return grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port),
                                   grpc::InsecureChannelCredentials(), args);
}

// A 16-byte key: the block's index run through a mixer, as a chain hash would look.
std::string KeyOf(uint64_t i) {
  uint64_t a = (i + 1) * 0x9E3779B97F4A7C15ull, b = a ^ (a >> 31) ^ 0xD6E8FEB86659FD93ull;
  std::string key(16, '\0');
  std::memcpy(key.data(), &a, 8);
  std::memcpy(key.data() + 8, &b, 8);
  return key;
}

struct Result {
  double calls_per_s = 0, keys_per_s = 0, p50_us = 0, p99_us = 0;
};

// `threads` clients call Lookup back to back for `seconds`, each on its own channel.
// `full_hits`: every reply must say the whole key list hit (kvferryd, not the null service).
Result Run(int port, const v1::Namespace& ns, int keys_per_call, int threads, double seconds,
           int64_t blocks, bool full_hits) {
  std::vector<std::vector<double>> latencies(threads);
  std::atomic<int64_t> calls{0}, failures{0};
  std::vector<std::thread> clients;
  const auto end = Clock::now() + std::chrono::duration<double>(seconds);
  for (int t = 0; t < threads; ++t) {
    clients.emplace_back([&, t] {
      auto stub = v1::KvCache::NewStub(Channel(port));
      // Requests prepared up front: key lists starting at spread-out resident blocks.
      std::vector<v1::LookupRequest> requests(64);
      for (size_t r = 0; r < requests.size(); ++r) {
        requests[r].set_namespace_(ns.name());
        requests[r].set_digest(ns.digest());
        const int64_t first = ((t * 64 + r) * 7919) % (blocks - keys_per_call + 1);
        for (int k = 0; k < keys_per_call; ++k) requests[r].add_keys(KeyOf(first + k));
      }
      v1::LookupResponse resp;
      for (size_t i = 0; Clock::now() < end; ++i) {
        grpc::ClientContext ctx;
        const auto start = Clock::now();
        const grpc::Status s = stub->Lookup(&ctx, requests[i % requests.size()], &resp);
        latencies[t].push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
        if (!s.ok()) {
          ++failures;
          std::fprintf(stderr, "cache_bench: Lookup: %s\n", s.error_message().c_str());
        } else if (full_hits && resp.hit_blocks() != static_cast<uint64_t>(keys_per_call)) {
          ++failures;
        }
        ++calls;
      }
    });
  }
  for (auto& c : clients) c.join();
  if (failures > 0) std::fprintf(stderr, "cache_bench: %lld failed lookups\n", (long long)failures.load());
  std::vector<double> all;
  for (auto& l : latencies) all.insert(all.end(), l.begin(), l.end());
  std::sort(all.begin(), all.end());
  Result r;
  r.calls_per_s = calls / seconds;
  r.keys_per_s = r.calls_per_s * keys_per_call;
  r.p50_us = all[all.size() / 2];
  r.p99_us = all[all.size() * 99 / 100];
  return r;
}

}  // namespace
}  // namespace kvferry

int main(int argc, char** argv) {
  using namespace kvferry;
  int64_t blocks = 65536;
  double seconds = 2;
  int rounds = 3;
  int threads = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--blocks")) blocks = std::atoll(argv[i + 1]);
    if (!std::strcmp(argv[i], "--seconds")) seconds = std::atof(argv[i + 1]);
    if (!std::strcmp(argv[i], "--rounds")) rounds = std::max(1, std::atoi(argv[i + 1]));
    if (!std::strcmp(argv[i], "--threads")) threads = std::max(1, std::atoi(argv[i + 1]));
  }
  server::DaemonOptions options;
  options.listen = "127.0.0.1:0";
  options.metrics_listen = "";
  options.default_device = "cpu";
  absl::StatusOr<std::unique_ptr<server::Daemon>> daemon = server::Daemon::Start(options);
  if (!daemon.ok()) {
    std::fprintf(stderr, "cache_bench: %s\n", daemon.status().ToString().c_str());
    return 1;
  }
  const int port = (*daemon)->grpc_port();
  NullCache null_cache;
  int null_port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &null_port);
  builder.RegisterService(&null_cache);
  builder.SetMaxReceiveMessageSize(8 << 20);
  auto null_server = builder.BuildAndStart();

  // A V41_FP4 pool of one-token pages (512 B with padding) holds `blocks` blocks in little memory;
  // the lookup cost does not depend on the page size.
  auto channel = Channel(port);
  auto pools = v1::KvFerry::NewStub(channel);
  auto cache = v1::KvCache::NewStub(channel);
  v1::Pool pool;
  {
    grpc::ClientContext ctx;
    v1::CreatePoolRequest req;
    req.set_name("bench");
    req.set_layout(v1::LAYOUT_V41_FP4);
    req.set_page_size(1);
    req.set_num_pages(blocks);
    req.set_num_layers(1);
    const grpc::Status s = pools->CreatePool(&ctx, req, &pool);
    if (!s.ok()) {
      std::fprintf(stderr, "cache_bench: CreatePool: %s\n", s.error_message().c_str());
      return 1;
    }
  }
  v1::Namespace ns;
  {
    grpc::ClientContext ctx;
    v1::CreateNamespaceRequest req;
    req.set_name("bench");
    req.set_model_fingerprint("bench");
    req.set_block_tokens(64);
    req.add_pools("bench");
    const grpc::Status s = cache->CreateNamespace(&ctx, req, &ns);
    if (!s.ok()) {
      std::fprintf(stderr, "cache_bench: CreateNamespace: %s\n", s.error_message().c_str());
      return 1;
    }
  }
  const auto fill_start = Clock::now();
  const std::string record(pool.page_bytes(), '\x11');
  for (int64_t first = 0; first < blocks; first += 8192) {
    grpc::ClientContext ctx;
    v1::PutResponse resp;
    auto writer = cache->PutPages(&ctx, &resp);
    for (int64_t i = first; i < std::min(blocks, first + 8192); ++i) {
      v1::PutPagesRequest msg;
      if (i == first) {
        msg.set_namespace_("bench");
        msg.set_digest(ns.digest());
        msg.set_pool("bench");
        msg.set_layout(v1::LAYOUT_V41_FP4);
      }
      msg.set_key(KeyOf(i));
      msg.set_data(record);
      msg.set_finish_write(i + 1 == std::min(blocks, first + 8192));
      writer->Write(msg);
    }
    writer->WritesDone();
    const grpc::Status s = writer->Finish();
    if (!s.ok()) {
      std::fprintf(stderr, "cache_bench: PutPages: %s\n", s.error_message().c_str());
      return 1;
    }
  }
  std::printf("resident blocks: %lld (put in %.1f s)\n", (long long)blocks,
              std::chrono::duration<double>(Clock::now() - fill_start).count());
  std::printf("threads %d, %d rounds of %.1f s per side, medians\n\n", threads, rounds, seconds);
  std::printf("| keys/call | kvferryd calls/s | kvferryd keys/s | p50 µs | p99 µs | null calls/s | null keys/s | null p50 µs | fraction |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  for (int keys : {1, 64, 1024}) {
    std::vector<Result> ours, nulls;
    for (int r = 0; r < rounds; ++r) {
      ours.push_back(Run(port, ns, keys, threads, seconds, blocks, true));
      nulls.push_back(Run(null_port, ns, keys, threads, seconds, blocks, false));
    }
    auto median = [](std::vector<Result> v) {
      std::sort(v.begin(), v.end(), [](const Result& a, const Result& b) { return a.keys_per_s < b.keys_per_s; });
      return v[v.size() / 2];
    };
    const Result o = median(ours), n = median(nulls);
    std::printf("| %d | %.3g | %.3g | %.0f | %.0f | %.3g | %.3g | %.0f | %.0f %% |\n", keys,
                o.calls_per_s, o.keys_per_s, o.p50_us, o.p99_us, n.calls_per_s, n.keys_per_s,
                n.p50_us, 100.0 * o.keys_per_s / n.keys_per_s);
  }
  null_server->Shutdown();
  (*daemon)->Shutdown(1);
  return 0;
}
