// Lists the pools of the kvferryd at argv[1] and prints the call's status code name.
#include <iostream>

#include "kvferry/client/client.h"

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  kvferry::client::ClientOptions options;
  options.target = argv[1];
  options.timeout = absl::Seconds(5);
  options.max_attempts = 1;
  auto client = kvferry::client::Client::Connect(options);
  if (!client.ok()) return 1;
  auto pools = (*client)->ListPools();
  std::cout << absl::StatusCodeToString(pools.status().code()) << "\n";
  return 0;
}
