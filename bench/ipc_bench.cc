// CUDA IPC sessions against the GPU's own copy rate: Save and Load of many tokens between
// this process (the worker) and a kvferryd child process, beside a device-to-device copy
// measured in the same run; and the latency of a 64-token Save/Load through the rpc and
// through the completion word, next to WriteTokens/ReadWorkspace of the same tokens.
//
// Then the engine's pattern: one layer after another saved (loaded) asynchronously into the
// same pages, the completion words polled once all are issued, from one issuing thread and
// from several.
//
// Usage: ipc_bench --daemon PATH [--tokens N] [--reps R] [--layout v41] [--layers L]
//                  [--daemon-log-level L] [--daemon-arg FLAG]...
#include <cuda_runtime_api.h>
#include <httplib.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/random_rows.h"
#include "kvferry/client/client.h"
#include "kvferry/client/cuda_ipc.h"
#include "kvferry/client/session.h"
#include "kvferry/kernels/format.h"

namespace kvferry {
namespace {

using client::BlockSlot;
using client::TokenLocation;
using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <typename F>
double TimeMedian(int reps, F&& f) {
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto start = Clock::now();
    if (!f()) return -1;
    t.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  return Median(t);
}

int Main(int argc, char** argv) {
  std::string daemon;
  std::string log_level = "warn";  // debug: the daemon logs where each call's host time goes
  std::vector<std::string> daemon_args;  // more flags for kvferryd
  int64_t tokens = 1 << 20;
  int reps = 5;
  std::string layout_name = "v41";
  int layers = 8;  // of the pool, for the layer-after-layer rows
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--layers")) layers = std::max(1, std::atoi(argv[i + 1]));
    if (!std::strcmp(argv[i], "--daemon")) daemon = argv[i + 1];
    if (!std::strcmp(argv[i], "--tokens")) tokens = std::atoll(argv[i + 1]);
    if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--layout")) layout_name = argv[i + 1];
    if (!std::strcmp(argv[i], "--daemon-log-level")) log_level = argv[i + 1];
    if (!std::strcmp(argv[i], "--daemon-arg")) daemon_args.push_back(argv[i + 1]);
  }
  Layout layout;
  client::Layout client_layout;
  if (daemon.empty() || !ParseLayoutName(layout_name, &layout) ||
      !client::ParseLayout(layout_name, &client_layout)) {
    std::fprintf(stderr, "usage: ipc_bench --daemon PATH [--tokens N] [--reps R] [--layout L]\n");
    return 2;
  }
  // kvferryd on this GPU.
  char dir[] = "/tmp/ipc-bench-XXXXXX";
  mkdtemp(dir);
  const std::string ports = std::string(dir) + "/ports";
  const pid_t child = fork();
  if (child == 0) {
    std::vector<std::string> args = {daemon, "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
                                     "--port_file=" + ports, "--default_device=cuda:0",
                                     "--log_level=" + log_level, "--max_message_bytes=268435456"};
    args.insert(args.end(), daemon_args.begin(), daemon_args.end());
    std::vector<char*> argp;
    for (std::string& a : args) argp.push_back(a.data());
    argp.push_back(nullptr);
    execv(daemon.c_str(), argp.data());
    _exit(127);
  }
  int port = 0, metrics_port = 0;
  for (int i = 0; i < 600 && port == 0; ++i) {
    std::ifstream in(ports);
    in >> port >> metrics_port;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  struct Reap {
    pid_t pid;
    ~Reap() {
      kill(pid, SIGTERM);
      waitpid(pid, nullptr, 0);
    }
  } reap{child};
  client::ClientOptions options;
  options.target = "127.0.0.1:" + std::to_string(port);
  options.message_bytes = 200 << 20;  // a Save of 1M tokens names 1M locations (~30 MB)
  auto c = *client::Client::Connect(options);
  auto session = client::Session::Open(options, "ipc-bench", 0);
  if (!session.ok()) {
    std::fprintf(stderr, "%s\n", std::string(session.status().message()).c_str());
    return 1;
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);

  // Ceiling: a device-to-device copy of 1 GiB (bytes read + written).
  const size_t copy_bytes = size_t{1} << 30;
  void *a, *b;
  cudaMalloc(&a, copy_bytes);
  cudaMalloc(&b, copy_bytes);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<double> copies;
  for (int i = 0; i < reps + 1; ++i) {
    cudaEventRecord(e0);
    cudaMemcpy(b, a, copy_bytes, cudaMemcpyDeviceToDevice);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    if (i > 0) copies.push_back(2.0 * copy_bytes / (ms * 1e-3) / 1e9);
  }
  cudaFree(a);
  cudaFree(b);
  const double ceiling = Median(copies);

  const int ps = 64;
  const int64_t pages_n = tokens / ps;
  const auto rows = testing::RandomRows(tokens, 1);
  void* cache;
  cudaMalloc(&cache, tokens * 1024);
  cudaMemcpy(cache, rows.data(), tokens * 1024, cudaMemcpyHostToDevice);
  client::KvTensor t{.num_blocks = static_cast<uint64_t>(pages_n), .block_tokens = ps,
                     .block_stride = ps * 1024ull, .token_stride = 1024};
  if (!client::DescribeDevicePointer(cache, t).ok()) return 1;
  const uint64_t tensor = *(*session)->RegisterKv(t);
  // One tensor per layer for the layer-after-layer rows (layer 0's is `tensor`).
  std::vector<void*> layer_caches;
  std::vector<uint64_t> layer_tensors = {tensor};
  for (int l = 1; l < layers; ++l) {
    void* m;
    if (cudaMalloc(&m, tokens * 1024) != cudaSuccess) return 1;
    cudaMemcpy(m, cache, tokens * 1024, cudaMemcpyDeviceToDevice);
    layer_caches.push_back(m);
    client::KvTensor lt = t;
    if (!client::DescribeDevicePointer(m, lt).ok()) return 1;
    layer_tensors.push_back(*(*session)->RegisterKv(lt));
  }
  if (!c->CreatePool({"bench", client_layout, ps, static_cast<uint64_t>(pages_n),
                      static_cast<uint32_t>(layers), "cuda:0"}).ok()) {
    return 1;
  }
  std::vector<client::PageHandle> pages;
  while (static_cast<int64_t>(pages.size()) < pages_n) {
    auto more = *c->AllocatePages("bench", static_cast<uint32_t>(std::min<int64_t>(65536, pages_n - pages.size())));
    pages.insert(pages.end(), more.begin(), more.end());
  }
  std::vector<BlockSlot> from(tokens);
  std::vector<TokenLocation> to(tokens);
  for (int64_t i = 0; i < tokens; ++i) {
    from[i] = {static_cast<uint64_t>(i / ps), static_cast<uint32_t>(i % ps)};
    to[i] = {pages[i / ps], static_cast<uint32_t>(i % ps)};
  }
  const double record = GetLayoutInfo(layout).bytes_per_token();
  const double bytes = tokens * (1024 + record);
  std::printf("device %s; %s pool, page size %d; %lld tokens; median of %d\n\n", prop.name,
              layout_name.c_str(), ps, static_cast<long long>(tokens), reps);
  std::printf("| op | time | GB/s (rows + records) | D2D copy GB/s (ceiling) | fraction |\n|---|---|---|---|---|\n");
  auto report = [&](const char* what, double seconds) {
    std::printf("| %s | %.3f ms | %.0f | %.0f | %.1f %% |\n", what, seconds * 1e3, bytes / seconds / 1e9,
                ceiling, 100 * bytes / seconds / 1e9 / ceiling);
  };
  // The device part, as the daemon measures it (kvferry_kernel_seconds{op="save"|"load"}).
  auto device_seconds = [&](const char* op) {
    httplib::Client http("127.0.0.1", metrics_port);
    auto res = http.Get("/metrics");
    double sum = 0, count = 0;
    if (res) {
      const std::string key = std::string("kvferry_kernel_seconds_sum{op=\"") + op + "\",layout=\"" + layout_name + "\"} ";
      const std::string ckey = std::string("kvferry_kernel_seconds_count{op=\"") + op + "\",layout=\"" + layout_name + "\"} ";
      if (size_t at = res->body.find(key); at != std::string::npos) sum = std::stod(res->body.substr(at + key.size()));
      if (size_t at = res->body.find(ckey); at != std::string::npos) count = std::stod(res->body.substr(at + ckey.size()));
    }
    return std::make_pair(sum, count);
  };
  std::vector<uint64_t> block_ids(pages_n);
  for (int64_t i = 0; i < pages_n; ++i) block_ids[i] = i;
  // Frees the pages and allocates as many again; the token locations follow them.
  auto fresh_pages = [&]() -> bool {
    if (!c->FreePages("bench", pages).ok()) return false;
    pages.clear();
    while (static_cast<int64_t>(pages.size()) < pages_n) {
      auto more = c->AllocatePages("bench", static_cast<uint32_t>(std::min<int64_t>(65536, pages_n - pages.size())));
      if (!more.ok()) return false;
      pages.insert(pages.end(), more->begin(), more->end());
    }
    for (int64_t k = 0; k < tokens; ++k) to[k].page = pages[k / ps];
    return true;
  };
  for (const char* op : {"save", "load"}) {
    const bool save = op[0] == 's';
    const auto before = device_seconds(op);
    std::vector<double> times;
    for (int i = 0; i < reps; ++i) {
      // A prefill saves into fresh pages: free and allocate again (untimed).
      if (save && !fresh_pages()) return 1;
      const auto start = Clock::now();
      const bool ok = (save ? (*session)->SaveBlocks(tensor, "bench", 0, block_ids, pages)
                            : (*session)->LoadBlocks(tensor, "bench", 0, pages, block_ids)).ok();
      if (!ok) return 1;
      times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
    }
    const double blocks = Median(times);
    const auto after = device_seconds(op);
    // The same pages as an engine moves them: 16 requests of 1/16th each, 4 threads issuing
    // them at once, so the host part of one overlaps the device part of another.
    const int chunks = 16, threads = 4;
    std::vector<double> piped;
    for (int i = 0; i < reps; ++i) {
      if (save && !fresh_pages()) return 1;
      std::atomic<int> next{0}, failed{0};
      const int64_t per = pages_n / chunks;
      const auto start = Clock::now();
      std::vector<std::thread> pool;
      for (int t = 0; t < threads; ++t) {
        pool.emplace_back([&] {
          for (int k; (k = next.fetch_add(1)) < chunks;) {
            const std::span<const uint64_t> ids(block_ids.data() + k * per, per);
            const std::span<const client::PageHandle> pg(pages.data() + k * per, per);
            if (!(save ? (*session)->SaveBlocks(tensor, "bench", 0, ids, pg)
                       : (*session)->LoadBlocks(tensor, "bench", 0, pg, ids)).ok()) {
              ++failed;
            }
          }
        });
      }
      for (auto& th : pool) th.join();
      if (failed > 0) return 1;
      piped.push_back(std::chrono::duration<double>(Clock::now() - start).count());
    }
    const double pipelined = Median(piped);
    const double tokens_rpc = TimeMedian(2, [&] {
      return (save ? (*session)->Save(tensor, "bench", 0, from, to)
                   : (*session)->Load(tensor, "bench", 0, to, from)).ok();
    });
    // Layer after layer, asynchronously: every layer's request issued (from `issuers`
    // threads, each taking the next layer), then every completion word polled.
    // `enqueue`: the requests go out without waiting for the daemon to take them.
    auto layer_by_layer = [&](int issuers, bool enqueue) {
      std::vector<double> t;
      for (int i = 0; i < reps; ++i) {
        if (save && !fresh_pages()) return -1.0;
        std::vector<std::optional<client::Session::Pending>> pending(layers);
        std::atomic<int> next{0}, failed{0};
        const auto start = Clock::now();
        std::vector<std::thread> pool;
        for (int k = 0; k < issuers; ++k) {
          pool.emplace_back([&] {
            for (int l; (l = next.fetch_add(1)) < layers;) {
              client::Session& s = **session;
              auto p = enqueue ? (save ? s.EnqueueSaveBlocks(layer_tensors[l], "bench", l, block_ids, pages)
                                       : s.EnqueueLoadBlocks(layer_tensors[l], "bench", l, pages, block_ids))
                               : (save ? s.SaveBlocksAsync(layer_tensors[l], "bench", l, block_ids, pages)
                                       : s.LoadBlocksAsync(layer_tensors[l], "bench", l, pages, block_ids));
              if (p.ok()) {
                pending[l] = *p;
              } else {
                std::fprintf(stderr, "layer %d: %s\n", l, std::string(p.status().message()).c_str());
                ++failed;
              }
            }
          });
        }
        for (auto& th : pool) th.join();
        for (auto& p : pending) {
          if (!p.has_value()) continue;
          if (const absl::Status w = p->Wait(); !w.ok()) {
            std::fprintf(stderr, "%s\n", std::string(w.message()).c_str());
            ++failed;
          }
        }
        if (failed > 0) return -1.0;
        t.push_back(std::chrono::duration<double>(Clock::now() - start).count() / layers);
      }
      return Median(t);
    };
    struct Mode {
      int issuers;
      bool enqueue;
    };
    const std::vector<Mode> modes = {{1, false}, {4, false}, {8, false}, {1, true}};
    std::vector<double> per_layer_times;
    for (const Mode& m : modes) {
      per_layer_times.push_back(layer_by_layer(m.issuers, m.enqueue));
      if (per_layer_times.back() < 0) return 1;
    }
    const std::string name = save ? "Save" : "Load";
    report((name + ", device (kernel in place, mean)").c_str(),
           (after.first - before.first) / std::max(1.0, after.second - before.second));
    report((name + ", page form rpc (returns when stored)").c_str(), blocks);
    report((name + ", page form, 16 rpcs from 4 threads (all stored)").c_str(), pipelined);
    report((name + ", token form rpc (1M token pairs in the request)").c_str(), tokens_rpc);
    const std::string per_layer = ", page form async, " + std::to_string(layers) + " layers one after another";
    for (size_t k = 0; k < modes.size(); ++k) {
      const std::string how = modes[k].enqueue ? " enqueued from 1 thread"
                                               : " from " + std::to_string(modes[k].issuers) + " threads";
      report((name + per_layer + how + " (per layer)").c_str(), per_layer_times[k]);
    }
  }
  std::printf("\n");

  // 64 tokens: the engine-step case.
  const int n = 64, lat_reps = 200;
  std::vector<BlockSlot> f64(from.begin(), from.begin() + n);
  std::vector<TokenLocation> t64(to.begin(), to.begin() + n);
  std::vector<uint16_t> r64(rows.begin(), rows.begin() + n * 512);
  std::printf("| 64 tokens | median latency |\n|---|---|\n");
  auto row = [&](const char* what, double s) { std::printf("| %s | %.1f µs |\n", what, s * 1e6); };
  row("Health rpc (nothing to do: the rpc alone)", TimeMedian(lat_reps, [&] { return c->Health().ok(); }));
  row("Save, rpc (returns when stored)", TimeMedian(lat_reps, [&] { return (*session)->Save(tensor, "bench", 0, f64, t64).ok(); }));
  row("Save, async + completion word", TimeMedian(lat_reps, [&] {
        auto p = (*session)->SaveAsync(tensor, "bench", 0, f64, t64);
        return p.ok() && p->Wait().ok();
      }));
  row("WriteTokens over gRPC", TimeMedian(lat_reps, [&] { return c->WriteTokens("bench", 0, t64, r64).ok(); }));
  row("Load, rpc", TimeMedian(lat_reps, [&] { return (*session)->Load(tensor, "bench", 0, t64, f64).ok(); }));
  row("Load, async + completion word", TimeMedian(lat_reps, [&] {
        auto p = (*session)->LoadAsync(tensor, "bench", 0, t64, f64);
        return p.ok() && p->Wait().ok();
      }));
  std::vector<uint16_t> back(n * 512);
  row("ReadWorkspace over gRPC", TimeMedian(lat_reps, [&] { return c->ReadWorkspaceInto("bench", 0, t64, back).ok(); }));
  cudaFree(cache);
  for (void* m : layer_caches) cudaFree(m);
  return 0;
}

}  // namespace
}  // namespace kvferry

int main(int argc, char** argv) { return kvferry::Main(argc, argv); }
