// The `kvferry` command: offline format tools (and, with a daemon, its client).
#include <iostream>
#include <string>
#include <vector>

#include "format_commands.h"

int main(int argc, char** argv) {
  std::vector<std::string> words(argv + 1, argv + argc);
  if (words.empty() || words[0] == "--help" || words[0] == "help") {
    std::cerr << "kvferry: tools for the kvferry KV-cache sidecar\n"
              << kvferry::cli::FormatUsage();
    return words.empty() ? kvferry::cli::kExitUsage : kvferry::cli::kExitOk;
  }
  if (words[0] == "format") {
    return kvferry::cli::RunFormatCommand({words.begin() + 1, words.end()}, std::cout,
                                          std::cerr);
  }
  std::cerr << "kvferry: unknown command '" << words[0] << "'\n" << kvferry::cli::FormatUsage();
  return kvferry::cli::kExitUsage;
}
