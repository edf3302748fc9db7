// Daemon metrics in the Prometheus text exposition format, and the /metrics HTTP endpoint.
//
// Written here rather than taken from prometheus-cpp, which Debian 12 does not package: a
// few labelled counters and histograms and their text rendering are all kvferryd needs.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kvferry/mutex.h"
#include "core/block_index.h"
#include "core/session.h"
#include "core/types.h"

namespace httplib {
class Server;
}
struct ssl_ctx_st;  // OpenSSL's SSL_CTX

namespace kvferry::server {

// A family of counters with the same label names. Thread-safe.
class CounterFamily {
 public:
  CounterFamily(std::string name, std::string help, std::vector<std::string> labels)
      : name_(std::move(name)), help_(std::move(help)), labels_(std::move(labels)) {}
  void Add(const std::vector<std::string>& values, double amount) ABSL_LOCKS_EXCLUDED(mu_);
  void Render(std::string& out) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const std::string name_, help_;
  const std::vector<std::string> labels_;
  mutable kvferry::Mutex mu_;
  std::map<std::vector<std::string>, double> values_ ABSL_GUARDED_BY(mu_);
};

// A family of histograms (cumulative buckets, _sum, _count). Thread-safe.
class HistogramFamily {
 public:
  HistogramFamily(std::string name, std::string help, std::vector<std::string> labels,
                  std::vector<double> bounds)
      : name_(std::move(name)), help_(std::move(help)), labels_(std::move(labels)),
        bounds_(std::move(bounds)) {}
  void Observe(const std::vector<std::string>& values, double x) ABSL_LOCKS_EXCLUDED(mu_);
  void Render(std::string& out) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Series {
    std::vector<uint64_t> buckets;  // per bound, not cumulative
    uint64_t count = 0;
    double sum = 0;
  };
  const std::string name_, help_;
  const std::vector<std::string> labels_;
  const std::vector<double> bounds_;
  mutable kvferry::Mutex mu_;
  std::map<std::vector<std::string>, Series> series_ ABSL_GUARDED_BY(mu_);
};

// Everything kvferryd exports. Pool gauges are read from `pools` at scrape time.
class DaemonMetrics : public OpObserver, public TransferObserver {
 public:
  explicit DaemonMetrics(std::function<std::vector<PoolStats>()> pools);
  // Session gauges are read from `sessions` at scrape time (unset: not exported).
  void SetSessionSource(std::function<SessionCounts()> sessions) { sessions_ = std::move(sessions); }
  // Cache counters and gauges are read from `cache` at scrape time (unset: not exported).
  void SetCacheSource(std::function<CacheCounts()> cache) { cache_ = std::move(cache); }
  // The daemon-wide budgets, read at scrape time (unset: not exported).
  struct Budget {
    std::string resource;  // "streams"
    int64_t used = 0;
    int64_t limit = 0;     // < 0: no limit
  };
  void SetBudgetSource(std::function<std::vector<Budget>()> budgets) { budgets_ = std::move(budgets); }
  // The memory blocks registered with UCX, read at scrape time (unset: not exported).
  struct Registrations {
    int64_t blocks = 0;
    uint64_t bytes = 0;
  };
  void SetRegistrationSource(std::function<Registrations()> source) {
    registrations_ = std::move(source);
  }
  void RecordTransfer(const char* op, bool ok, uint64_t bytes, double seconds) override;

  // One finished RPC: method name, status code name (e.g. "OK", "INVALID_ARGUMENT") and, for
  // errors, the reason name ("STALE_PAGE_HANDLE"; empty when the error has none).
  void RecordRpc(const std::string& method, const std::string& code, const std::string& reason,
                 double seconds);
  void RecordBytes(const std::string& method, uint64_t received, uint64_t sent);
  void RecordOp(const char* op, Layout layout, double seconds) override;
  // A request refused or ended by a budget or time bound: the reason ("quota_exceeded",
  // "daemon_budget_exhausted", "stream_idle_timeout", ...) and the resource ("streams").
  void RecordRefusal(const std::string& reason, const std::string& resource);
  // One transfer with a peer daemon (Push/Pull): op "push" or "pull", the peer's address,
  // whether this daemon sent or received the bytes, its bytes and time, and for a failure
  // its reason name ("" when it succeeded).
  void RecordPeerTransfer(const std::string& op, const std::string& peer, bool sent,
                          uint64_t bytes, double seconds, const std::string& failure);

  // The whole exposition text.
  std::string Render() const;

 private:
  std::function<std::vector<PoolStats>()> pools_;
  std::function<SessionCounts()> sessions_;
  std::function<CacheCounts()> cache_;
  std::function<std::vector<Budget>()> budgets_;
  std::function<Registrations()> registrations_;
  CounterFamily transfers_;
  CounterFamily transfer_bytes_;
  HistogramFamily transfer_seconds_;
  CounterFamily rpcs_;
  HistogramFamily rpc_latency_;
  CounterFamily errors_;
  CounterFamily bytes_received_;
  CounterFamily bytes_sent_;
  HistogramFamily kernel_seconds_;
  CounterFamily refusals_;
  CounterFamily peer_bytes_;
  HistogramFamily peer_seconds_;
  CounterFamily peer_failures_;
};

// The HTTP endpoint's own bounds.
struct HttpOptions {
  int threads = 32;                  // connections served at once (others wait to be accepted)
  double read_timeout_seconds = 2;   // the longest wait for a request's next bytes
};

// Serves GET /metrics (and GET /healthz) on its own thread.
class MetricsServer {
 public:
  // Binds `address` ("host:port"; port 0 picks a free one). The metrics outlive the server.
  // With `tls_setup` it serves HTTPS: the function sets up the server's SSL_CTX (its
  // certificates, client verification) and returns false if it cannot.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const std::string& address, const DaemonMetrics* metrics,
      std::function<bool(ssl_ctx_st&)> tls_setup = {}, HttpOptions options = {});
  ~MetricsServer();
  int port() const { return port_; }

 private:
  MetricsServer() = default;
  std::unique_ptr<httplib::Server> http_;
  std::thread thread_;
  int port_ = 0;
};

}  // namespace kvferry::server
