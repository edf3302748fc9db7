// What a large request costs kvferryd before any work: Save requests naming 0, 1024 and 16384
// pages (packed, as the client library sends them) of a session that does not exist, so the
// daemon receives and parses the whole request and refuses it at once. Median of 200 per
// size, against a real kvferryd started with the flags given (e.g. --malloc_top_pad_bytes=0
// for glibc's own heap settings). Needs no GPU.
//
// Usage: request_bench [kvferryd flags...]
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "integration/daemon_harness.h"
#include "kvferry/v1/session.grpc.pb.h"

int main(int argc, char** argv) {
  using namespace kvferry;
  const std::vector<std::string> flags(argv + 1, argv + argc);
  kvferry::testing::Daemon d(flags);
  auto stub = v1::KvSession::NewStub(d.channel());
  std::printf("| pages named | request bytes | median µs | p10 µs |\n|---|---|---|---|\n");
  for (const int pages : {0, 1024, 16384}) {
    v1::SaveRequest req;
    req.set_session_id(~uint64_t{0});
    req.set_pool("bench");
    for (int i = 0; i < pages; ++i) {
      req.add_source_blocks(i);
      req.mutable_destination_page_list()->add_page_ids(i);
      req.mutable_destination_page_list()->add_generations((uint64_t{1} << 40) | (i + 1));
    }
    std::vector<double> us;
    for (int r = 0; r < 220; ++r) {
      grpc::ClientContext ctx;
      v1::TransferResponse resp;
      const auto start = std::chrono::steady_clock::now();
      const grpc::Status s = stub->Save(&ctx, req, &resp);
      const double t = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
      if (s.error_code() != grpc::StatusCode::NOT_FOUND) {
        std::fprintf(stderr, "expected NOT_FOUND, got %d: %s\n", s.error_code(), s.error_message().c_str());
        return 1;
      }
      if (r >= 20) us.push_back(t);  // the first calls warm the connection up
    }
    std::sort(us.begin(), us.end());
    std::printf("| %d | %zu | %.1f | %.1f |\n", pages, req.ByteSizeLong(), us[us.size() / 2], us[us.size() / 10]);
  }
  return 0;
}
