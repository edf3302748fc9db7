// spdlog set-up for kvferryd: timestamped lines on stderr.
#include "log.h"

#include <spdlog/sinks/stdout_sinks.h>

namespace kvferry::server::log {

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
