// `kvferry` subcommands that talk to a running kvferryd through the C++ client library.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace kvferry::cli {

// True when `command` is one of the daemon subcommands (pool, pages, put, get-pages,
// get-workspace, stats, bench, health).
bool IsDaemonCommand(const std::string& command);

// Runs a daemon subcommand. `words` are every argument after the program name, global
// options (--target, --json) included anywhere. Returns the exit code (0 / 1 error /
// 2 usage); results go to `out`, messages to `err`.
int RunDaemonCommand(const std::vector<std::string>& words, std::ostream& out, std::ostream& err,
                     bool err_is_terminal);

// The usage text of the daemon subcommands.
const char* DaemonUsage();

}  // namespace kvferry::cli
