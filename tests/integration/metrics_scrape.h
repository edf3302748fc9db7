// The daemon's /metrics as the integration tests read it: one scrape, and one sample of it.
#pragma once

#include <httplib.h>

#include <chrono>
#include <optional>
#include <sstream>
#include <string>
#include <thread>

#include "daemon_harness.h"

namespace kvferry::testing {

// The exposition text ("" when the endpoint did not answer 200).
inline std::string Metrics(const Daemon& d) {
  httplib::Client client("127.0.0.1", d.metrics_port());
  client.set_connection_timeout(10);
  client.set_read_timeout(10);
  auto res = client.Get("/metrics");
  return res && res->status == 200 ? res->body : "";
}

// The value of the sample "name{labels}" of `text`; nullopt when there is none.
inline std::optional<double> FindSample(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  }
  return std::nullopt;
}

// As FindSample, 0 when absent (counters and gauges not yet exported).
inline double Sample(const std::string& text, const std::string& series) {
  return FindSample(text, series).value_or(0);
}

// The daemon's staged write bytes once they fell to zero, or after 10 s what they were (-1:
// the endpoint did not answer with the series).
inline double StagedBytesSettled(const Daemon& d) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  double staged = -1;
  while (std::chrono::steady_clock::now() < deadline) {
    staged = FindSample(Metrics(d), "kvferry_budget_used{resource=\"staged_write_bytes\"}").value_or(-1);
    if (staged == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return staged;
}

}  // namespace kvferry::testing
