// Pages pushed between two kvferryd processes over UCX, per transport, against the ceiling
// measured in the same run: ucx_perftest tag_bw with 4 MiB messages on the same transports,
// with peer error handling like kvferryd's endpoints
// (and, beside it, the gRPC ReadPages path of the same bytes).
//
// Usage: transfer_bench [--device cpu|cuda:N] [--peer-device D] [--transports tcp;tcp,cma]
//                       [--reps N] [--perftest PATH] [--message-bytes N] [--cpu-threads N]
//                       [--sizes-mib 64,1024] [--layers N] [--daemon-arg FLAG]...   (e.g. --daemon-arg --log_level=debug: the
//                                                 daemons' phase timings of each transfer)
// --layers N: pools of N layers, every layer pushed (the same bytes in N times fewer pages;
// a multi-layer transfer into a GPU pool lands in device staging, then a scatter).
// Prints one line per (transport, size): GB/s of Push, of ReadPages, the ceiling, and the
// ratio. GB = 1e9 bytes. For cuda pools it also measures, in the same run, the issue's other
// ceiling of GPU pools: pinned host <-> device copies (cudaMemcpy of 256 MiB, the slower
// direction), and prints the ratio to min(ucx_perftest, that copy).
#include <grpcpp/grpcpp.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(KVFERRY_BENCH_CUDA)
#include <cuda_runtime_api.h>
#endif

#include "integration/daemon_harness.h"
#include "kvferry/v1/kvferry.grpc.pb.h"
#include "kvferry/v1/transfer.grpc.pb.h"

namespace {

using kvferry::testing::Daemon;
namespace v1 = kvferry::v1;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string Arg(int argc, char** argv, const std::string& name, const std::string& fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (argv[i] == "--" + name) return argv[i + 1];
  }
  return fallback;
}

// ucx_perftest tag_bw, 4 MiB messages, on `transports`: the overall bandwidth in GB/s.
// With a CUDA transport in the list, both buffers are GPU memory (-m cuda), as the daemons'
// are when their UCX moves CUDA memory.
double Perftest(const std::string& perftest, const std::string& transports, int port) {
  const std::string env = "UCX_TLS=" + transports + " ";
  // -e: endpoints with peer error handling, as kvferryd creates them (UCX then uses only
  // transports that report a dead peer: cma, for one, is left out).
  std::string args = " -t tag_bw -e -s 4194304 -n 400 -p " + std::to_string(port);
  if (transports.find("cuda") != std::string::npos) args += " -m cuda";
  const std::string server = env + perftest + args + " > /dev/null 2>&1 &";
  if (std::system(server.c_str()) != 0) return 0;
  std::this_thread::sleep_for(std::chrono::seconds(1));
  FILE* out = popen((env + perftest + " 127.0.0.1" + args + " 2>&1").c_str(), "r");
  if (out == nullptr) return 0;
  char line[512];
  double mbs = 0;
  while (fgets(line, sizeof(line), out) != nullptr) {
    double v[7];
    if (std::sscanf(line, "Final: %lf %lf %lf %lf %lf %lf %lf", &v[0], &v[1], &v[2], &v[3], &v[4],
                    &v[5], &v[6]) == 7) {
      mbs = v[5];  // overall bandwidth, MB/s (2^20 bytes)
    }
  }
  pclose(out);
  return mbs * 1048576.0 / 1e9;
}

// Pinned host <-> device copy rate of `device` ("cuda:N"), GB/s: the slower direction of
// 256 MiB cudaMemcpy, best of 5 each. 0 for cpu or without CUDA.
double PinnedCopyGBs(const std::string& device) {
#if defined(KVFERRY_BENCH_CUDA)
  if (device.rfind("cuda:", 0) != 0) return 0;
  if (cudaSetDevice(std::atoi(device.c_str() + 5)) != cudaSuccess) return 0;
  const size_t bytes = size_t{256} << 20;
  void* host = nullptr;
  void* dev = nullptr;
  if (cudaMallocHost(&host, bytes) != cudaSuccess || cudaMalloc(&dev, bytes) != cudaSuccess) {
    return 0;
  }
  std::memset(host, 1, bytes);
  double best[2] = {1e9, 1e9};
  for (int r = 0; r < 6; ++r) {
    for (int dir = 0; dir < 2; ++dir) {
      const double start = Now();
      if (dir == 0) cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice);
      else cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost);
      if (r > 0) best[dir] = std::min(best[dir], Now() - start);  // the first warms up
    }
  }
  cudaFree(dev);
  cudaFreeHost(host);
  return static_cast<double>(bytes) / std::max(best[0], best[1]) / 1e9;
#else
  (void)device;
  return 0;
#endif
}

std::vector<v1::PageHandle> Allocate(Daemon& d, const std::string& pool, int64_t count) {
  std::vector<v1::PageHandle> pages;
  while (static_cast<int64_t>(pages.size()) < count) {
    const int n = static_cast<int>(std::min<int64_t>(count - pages.size(), 60000));
    auto more = kvferry::testing::Allocate(d, pool, n);
    pages.insert(pages.end(), more.begin(), more.end());
  }
  return pages;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string device = Arg(argc, argv, "device", "cpu");
  const std::string peer_device = Arg(argc, argv, "peer-device", device);
  const std::string perftest = Arg(argc, argv, "perftest", "ucx_perftest");
  const int reps = std::atoi(Arg(argc, argv, "reps", "3").c_str());
  const std::string message_bytes = Arg(argc, argv, "message-bytes", "8388608");
  // Workers of each daemon's cpu backend (0: the usable cores).
  const std::string cpu_threads = Arg(argc, argv, "cpu-threads", "0");
  const int layers = std::max(1, std::atoi(Arg(argc, argv, "layers", "1").c_str()));
  std::vector<std::string> transports;
  {
    std::string list = Arg(argc, argv, "transports", "tcp;tcp,cma");
    for (size_t at = 0; at <= list.size();) {
      const size_t end = std::min(list.find(';', at), list.size());
      transports.push_back(list.substr(at, end - at));
      at = end + 1;
    }
  }
  std::vector<int64_t> sizes;  // bytes pushed, from --sizes-mib (default 64,1024)
  {
    const std::string list = Arg(argc, argv, "sizes-mib", "64,1024");
    for (size_t at = 0; at < list.size();) {
      const size_t end = std::min(list.find(',', at), list.size());
      sizes.push_back(std::atoll(list.substr(at, end - at).c_str()) << 20);
      at = end + 1;
    }
  }
  constexpr int kPageSize = 64;
  const int64_t page_bytes = kvferry::PageBytes(kvferry::Layout::kV41, kPageSize);  // 33792
  int port = 13400;
  const double copy = PinnedCopyGBs(device);
  if (copy > 0) std::printf("pinned host<->device copy on %s: %.2f GB/s\n", device.c_str(), copy);
  for (const std::string& t : transports) {
    const double ceiling = Perftest(perftest, t, port++);
    setenv("KVFERRY_TEST_DEVICE", device.c_str(), 1);
    std::vector<std::string> flags = {"--ucx_transports=" + t,
                                            "--max_staged_write_bytes=4294967296",
                                            "--peer_message_bytes=" + message_bytes,
                                            "--cpu_threads=" + cpu_threads};
    for (int i = 1; i + 1 < argc; ++i) {
      if (std::string(argv[i]) == "--daemon-arg") flags.push_back(argv[i + 1]);
    }
    Daemon a(flags);
    setenv("KVFERRY_TEST_DEVICE", peer_device.c_str(), 1);
    Daemon b(flags);
    for (const int64_t bytes : sizes) {
      const int64_t n = bytes / (page_bytes * layers);
      setenv("KVFERRY_TEST_DEVICE", device.c_str(), 1);
      kvferry::testing::CreatePool(a, "src", kvferry::Layout::kV41, kPageSize, n, layers);
      setenv("KVFERRY_TEST_DEVICE", peer_device.c_str(), 1);
      kvferry::testing::CreatePool(b, "dst", kvferry::Layout::kV41, kPageSize, n, layers);
      const auto src = Allocate(a, "src", n);
      auto dst = Allocate(b, "dst", n);
      v1::PushRequest req;
      req.set_pool("src");
      // Packed page lists, as the clients send them.
      *req.mutable_page_list() = kvferry::testing::PackPages(src);
      req.set_to_address("127.0.0.1:" + std::to_string(b.grpc_port()));
      req.set_to_pool("dst");
      *req.mutable_to_page_list() = kvferry::testing::PackPages(dst);
      auto stub = v1::Transfer::NewStub(a.channel());
      double best = 1e9;
      std::vector<double> times;  // ms, every rep in order
      for (int r = 0; r < reps; ++r) {
        if (r > 0) {
          // Fresh destination pages each time, as a decode node allocates for each request
          // (pages that held nothing are received in place on a cpu pool).
          for (size_t at = 0; at < dst.size(); at += 60000) {
            const size_t end = std::min(dst.size(), at + 60000);
            if (!kvferry::testing::FreePages(b, "dst", {dst.begin() + at, dst.begin() + end}).ok()) {
              std::fprintf(stderr, "free failed\n");
              return 1;
            }
          }
          dst = Allocate(b, "dst", n);
          *req.mutable_to_page_list() = kvferry::testing::PackPages(dst);
        }
        grpc::ClientContext ctx;
        v1::TransferPagesResponse resp;
        const double start = Now();
        const grpc::Status s = stub->Push(&ctx, req, &resp);
        const double took = Now() - start;
        if (!s.ok()) {
          std::fprintf(stderr, "push failed: %s\n", s.error_message().c_str());
          return 1;
        }
        best = std::min(best, took);
        times.push_back(took * 1e3);
      }
      // The same bytes over gRPC: ReadPages from the source daemon.
      double grpc_best = 1e9;
      for (int r = 0; r < (std::getenv("TRANSFER_BENCH_NO_GRPC") ? 0 : reps); ++r) {
        std::string out;
        const double start = Now();
        if (!kvferry::testing::ReadPages(a, "src", src, &out).ok()) return 1;
        grpc_best = std::min(grpc_best, Now() - start);
      }
      const double moved = static_cast<double>(n * page_bytes * layers);
      const double gbs = moved / best / 1e9;
      std::printf(
          "transport=%s device=%s->%s layers=%d bytes=%.0f push=%.2f GB/s (%.1f ms) grpc_readpages=%.2f GB/s "
          "ceiling(ucx_perftest tag_bw 4MiB)=%.2f GB/s ratio=%.0f%%\n",
          t.c_str(), device.c_str(), peer_device.c_str(), layers, moved, gbs, best * 1e3,
          moved / grpc_best / 1e9, ceiling, ceiling > 0 ? 100.0 * gbs / ceiling : 0.0);
      if (copy > 0) {
        const double issue = std::min(ceiling, copy);
        std::printf("  ceiling min(ucx_perftest, pinned copy)=%.2f GB/s ratio=%.0f%%\n", issue,
                    100.0 * gbs / issue);
      }
      std::printf("  every push (ms):");
      for (double t : times) std::printf(" %.1f", t);
      std::printf("\n");
      std::fflush(stdout);
      if (std::getenv("TRANSFER_BENCH_METRICS") != nullptr) {
        for (Daemon* d : {&a, &b}) {
          const std::string cmd = "curl -s 127.0.0.1:" + std::to_string(d->metrics_port()) +
                                  "/metrics | grep -E '_(sum|count)' | grep -E 'kernel|peer|Push|Exchange'";
          std::system(cmd.c_str());
        }
      }
      kvferry::testing::DeletePool(a, "src");
      kvferry::testing::DeletePool(b, "dst");
    }
  }
  return 0;
}
