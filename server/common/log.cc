// spdlog set-up for kvferryd: timestamped lines on stderr.
#include "common/log.h"

#include <spdlog/sinks/stdout_sinks.h>

namespace kvferry::server::log {

std::string Quoted(std::string_view text) {
  constexpr size_t kMaxBytes = 128;
  std::string out = "\"";
  for (size_t i = 0; i < text.size() && i < kMaxBytes; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c >= 0x7F) {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  if (text.size() > kMaxBytes) out += "...";
  out += '"';
  return out;
}

bool Init(const std::string& level) {
  const spdlog::level::level_enum parsed = spdlog::level::from_str(level);
  if (parsed == spdlog::level::off && level != "off") return false;
  auto logger = spdlog::stderr_logger_mt("kvferryd");
  logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ %v");
  logger->set_level(parsed);
  spdlog::set_default_logger(logger);
  return true;
}

}  // namespace kvferry::server::log
