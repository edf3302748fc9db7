// `kvferry format ...`: offline tools to build, read and convert captured pool files.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace kvferry::cli {

// Exit codes of the kvferry command.
inline constexpr int kExitOk = 0;
inline constexpr int kExitInvalidInput = 1;
inline constexpr int kExitUsage = 2;

// Runs `format <words...>` (words exclude "format"); returns the exit code. Messages for
// the user go to `out`, errors to `err`.
int RunFormatCommand(const std::vector<std::string>& words, std::ostream& out, std::ostream& err);

// The usage text of the format subcommands.
const char* FormatUsage();

}  // namespace kvferry::cli
