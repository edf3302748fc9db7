// The `kvferry` command: offline format tools, and a client of a running kvferryd.
#include <unistd.h>

#include <iostream>
#include <string>
#include <vector>

#include "daemon_commands.h"
#include "format_commands.h"

int main(int argc, char** argv) {
  std::vector<std::string> words(argv + 1, argv + argc);
  auto usage = [](std::ostream& to) {
    to << "kvferry: tools for the kvferry KV-cache sidecar\n"
       << kvferry::cli::FormatUsage() << kvferry::cli::DaemonUsage();
  };
  if (words.empty()) {
    usage(std::cerr);
    return kvferry::cli::kExitUsage;
  }
  if (words[0] == "--help" || words[0] == "help") {
    usage(std::cout);
    return kvferry::cli::kExitOk;
  }
  if (words[0] == "format") {
    return kvferry::cli::RunFormatCommand({words.begin() + 1, words.end()}, std::cout,
                                          std::cerr);
  }
  // Global options may come before the command: find the first positional word.
  for (size_t i = 0; i < words.size(); ++i) {
    if (words[i].rfind("--", 0) == 0) {
      if (words[i] != "--json" && words[i] != "--help" && words[i].find('=') == std::string::npos) ++i;
      continue;
    }
    if (kvferry::cli::IsDaemonCommand(words[i])) {
      return kvferry::cli::RunDaemonCommand(words, std::cout, std::cerr, isatty(2) != 0);
    }
    break;
  }
  std::cerr << "kvferry: unknown command\n";
  usage(std::cerr);
  return kvferry::cli::kExitUsage;
}
