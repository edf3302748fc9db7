// kvferryd's logging: spdlog behind a few functions, one line per event, key=value fields.
#pragma once

#include <spdlog/spdlog.h>

#include <chrono>
#include <string>
#include <string_view>

namespace kvferry::server::log {

// A client-chosen string made safe for one log line: control characters, quotes and
// backslashes escaped, at most 128 bytes kept (then "..."), in double quotes.
std::string Quoted(std::string_view text);

// Milliseconds between two instants, for timings in debug lines.
inline double Millis(std::chrono::steady_clock::time_point from,
                     std::chrono::steady_clock::time_point to) {
  return std::chrono::duration<double, std::milli>(to - from).count();
}

// Sets the level from "trace", "debug", "info", "warn", "error" or "off"; false if unknown.
bool Init(const std::string& level);

template <typename... Args>
void Info(spdlog::format_string_t<Args...> fmt, Args&&... args) {
  spdlog::info(fmt, std::forward<Args>(args)...);
}
template <typename... Args>
void Debug(spdlog::format_string_t<Args...> fmt, Args&&... args) {
  spdlog::debug(fmt, std::forward<Args>(args)...);
}
template <typename... Args>
void Warn(spdlog::format_string_t<Args...> fmt, Args&&... args) {
  spdlog::warn(fmt, std::forward<Args>(args)...);
}
template <typename... Args>
void Error(spdlog::format_string_t<Args...> fmt, Args&&... args) {
  spdlog::error(fmt, std::forward<Args>(args)...);
}

}  // namespace kvferry::server::log
