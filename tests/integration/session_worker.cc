// A worker process for session tests: opens a session with the daemon at argv[1], allocates
// argv[2] pages of pool argv[3] in it, optionally (argv[4] == "gpu") registers a device
// tensor and saves it into those pages, prints "ready PID" (its process id, for the test to
// kill it by) and waits to be killed.
#include <unistd.h>

#include <iostream>
#include <string>
#include <vector>

#include "kvferry/client/session.h"
#if defined(KVFERRY_WORKER_CUDA)
#include <cuda_runtime_api.h>

#include "kvferry/client/cuda_ipc.h"
#endif

int main(int argc, char** argv) {
  if (argc < 4) return 2;
  kvferry::client::ClientOptions options;
  options.target = argv[1];
  auto session = kvferry::client::Session::Open(options, "session-worker", 0);
  if (!session.ok()) {
    std::cerr << session.status() << "\n";
    return 1;
  }
  const uint32_t count = static_cast<uint32_t>(std::stoul(argv[2]));
  auto pages = (*session)->AllocatePages(argv[3], count);
  if (!pages.ok()) {
    std::cerr << pages.status() << "\n";
    return 1;
  }
#if defined(KVFERRY_WORKER_CUDA)
  if (argc > 4 && std::string(argv[4]) == "gpu") {
    // A bf16 tensor of one block per page, rows of 0.5, saved into the session's pages.
    const uint32_t page_size = static_cast<uint32_t>(std::stoul(argv[5]));
    const size_t bytes = static_cast<size_t>(count) * page_size * 1024;
    void* d = nullptr;
    if (cudaMalloc(&d, bytes) != cudaSuccess) return 1;
    std::vector<uint16_t> rows(bytes / 2, 0x3F00);
    cudaMemcpy(d, rows.data(), bytes, cudaMemcpyHostToDevice);
    kvferry::client::KvTensor t{.num_blocks = count, .block_tokens = page_size,
                                .block_stride = page_size * 1024ull, .token_stride = 1024};
    if (!kvferry::client::DescribeDevicePointer(d, t).ok()) return 1;
    auto id = (*session)->RegisterKv(t);
    if (!id.ok()) {
      std::cerr << id.status() << "\n";
      return 1;
    }
    std::vector<kvferry::client::BlockSlot> from;
    std::vector<kvferry::client::TokenLocation> to;
    for (uint32_t p = 0; p < count; ++p) {
      for (uint32_t s = 0; s < page_size; ++s) {
        from.push_back({p, s});
        to.push_back({(*pages)[p], s});
      }
    }
    auto saved = (*session)->Save(*id, argv[3], 0, from, to);
    if (!saved.ok()) {
      std::cerr << saved.status() << "\n";
      return 1;
    }
    auto mapped = (*session)->MapPool(argv[3]);
    if (!mapped.ok()) return 1;
  }
#endif
  std::cout << "ready " << getpid() << std::endl;
  while (true) pause();
}
