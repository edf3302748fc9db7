// A client process for the kill test: writes every slot of the given pages in layer 0 of a
// pool — rows from a seed (testing::RandomRows), a few tokens per message, a pause between
// messages — and prints "started" after its first message and "committed" when the daemon
// accepted the write. The test kills it with SIGKILL at random points of the stream.
// Usage: stream_writer TARGET POOL PAGE_SIZE SEED TOKENS_PER_MESSAGE PAUSE_US ID:GEN...
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "common/random_rows.h"
#include "kvferry/v1/kvferry.grpc.pb.h"

int main(int argc, char** argv) {
  if (argc < 8) return 2;
  namespace v1 = kvferry::v1;
  const std::string pool = argv[2];
  const int page_size = std::stoi(argv[3]);
  const uint64_t seed = std::stoull(argv[4]);
  const int per_message = std::stoi(argv[5]);
  const int pause_us = std::stoi(argv[6]);
  std::vector<v1::TokenLocation> where;
  for (int i = 7; i < argc; ++i) {
    const std::string h = argv[i];
    const size_t colon = h.find(':');
    for (int s = 0; s < page_size; ++s) {
      v1::TokenLocation l;
      l.mutable_page()->set_page_id(std::stoull(h.substr(0, colon)));
      l.mutable_page()->set_generation(std::stoull(h.substr(colon + 1)));
      l.set_slot(s);
      where.push_back(l);
    }
  }
  const std::vector<uint16_t> rows = kvferry::testing::RandomRows(static_cast<int64_t>(where.size()), seed);
  auto stub = v1::KvFerry::NewStub(grpc::CreateChannel(argv[1], grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::WriteResponse resp;
  auto writer = stub->WriteTokens(&ctx, &resp);
  for (size_t at = 0; at < where.size(); at += per_message) {
    v1::WriteTokensRequest msg;
    if (at == 0) {
      msg.set_pool(pool);
      msg.set_layer(0);
    }
    const size_t n = std::min(where.size() - at, static_cast<size_t>(per_message));
    for (size_t i = 0; i < n; ++i) *msg.add_locations() = where[at + i];
    msg.set_rows(reinterpret_cast<const char*>(rows.data() + (at * 512)), n * 1024);
    msg.set_finish_write(at + n == where.size());
    if (!writer->Write(msg)) break;
    if (at == 0) {
      std::printf("started\n");
      std::fflush(stdout);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(pause_us));
  }
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  std::printf("%s\n", status.ok() ? "committed" : status.error_message().c_str());
  return status.ok() ? 0 : 1;
}
