// Prometheus text rendering of kvferryd's counters, histograms and pool gauges.
#include "metrics/metrics.h"

#include <httplib.h>

#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kvferry/thread_name.h"

namespace kvferry::server {
namespace {

std::string Escape(const std::string& value) {
  std::string out;
  for (char c : value) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

std::string LabelText(const std::vector<std::string>& names, const std::vector<std::string>& values,
                      const std::string& extra = "") {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    absl::StrAppend(&out, out.empty() ? "" : ",", names[i], "=\"", Escape(values[i]), "\"");
  }
  if (!extra.empty()) absl::StrAppend(&out, out.empty() ? "" : ",", extra);
  return out.empty() ? "" : absl::StrCat("{", out, "}");
}

std::string Number(double x) {
  if (std::isinf(x)) return x > 0 ? "+Inf" : "-Inf";
  return absl::StrCat(x);
}

void Header(std::string& out, const std::string& name, const std::string& help, const char* type) {
  absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
}

}  // namespace

void CounterFamily::Add(const std::vector<std::string>& values, double amount) {
  kvferry::MutexLock lock(&mu_);
  values_[values] += amount;
}

void CounterFamily::Render(std::string& out) const {
  Header(out, name_, help_, "counter");
  kvferry::MutexLock lock(&mu_);
  for (const auto& [labels, value] : values_) {
    absl::StrAppend(&out, name_, LabelText(labels_, labels), " ", Number(value), "\n");
  }
}

void HistogramFamily::Observe(const std::vector<std::string>& values, double x) {
  kvferry::MutexLock lock(&mu_);
  Series& s = series_[values];
  if (s.buckets.empty()) s.buckets.assign(bounds_.size(), 0);
  for (size_t i = 0; i < bounds_.size(); ++i) {
    if (x <= bounds_[i]) {
      ++s.buckets[i];
      break;
    }
  }
  ++s.count;
  s.sum += x;
}

void HistogramFamily::Render(std::string& out) const {
  Header(out, name_, help_, "histogram");
  kvferry::MutexLock lock(&mu_);
  for (const auto& [labels, s] : series_) {
    uint64_t cumulative = 0;
    for (size_t i = 0; i < bounds_.size(); ++i) {
      cumulative += s.buckets[i];
      absl::StrAppend(&out, name_, "_bucket",
                      LabelText(labels_, labels, absl::StrCat("le=\"", Number(bounds_[i]), "\"")),
                      " ", cumulative, "\n");
    }
    absl::StrAppend(&out, name_, "_bucket", LabelText(labels_, labels, "le=\"+Inf\""), " ",
                    s.count, "\n");
    absl::StrAppend(&out, name_, "_sum", LabelText(labels_, labels), " ", Number(s.sum), "\n");
    absl::StrAppend(&out, name_, "_count", LabelText(labels_, labels), " ", s.count, "\n");
  }
}

namespace {
std::vector<double> LatencyBounds() {
  return {1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1, 5, 10};
}
}  // namespace

DaemonMetrics::DaemonMetrics(std::function<std::vector<PoolStats>()> pools)
    : pools_(std::move(pools)),
      transfers_("kvferry_session_transfers_total",
                 "Save and Load operations of CUDA IPC sessions by op and result.", {"op", "result"}),
      transfer_bytes_("kvferry_session_transfer_bytes_total",
                      "Bytes moved by Save and Load (rows or pages read plus records written).", {"op"}),
      transfer_seconds_("kvferry_session_transfer_seconds",
                        "Save and Load latency from request to completion, in seconds.", {"op"},
                        LatencyBounds()),
      rpcs_("kvferry_rpc_requests_total", "Finished RPCs by method and status code.",
            {"method", "code"}),
      rpc_latency_("kvferry_rpc_latency_seconds", "RPC latency by method and status code, in seconds.",
                   {"method", "code"}, LatencyBounds()),
      errors_("kvferry_errors_total", "Failed RPCs by method and error reason (the status code where none).",
              {"method", "reason"}),
      bytes_received_("kvferry_bytes_received_total", "Request message bytes by method.",
                      {"method"}),
      bytes_sent_("kvferry_bytes_sent_total", "Response message bytes by method.", {"method"}),
      kernel_seconds_("kvferry_kernel_seconds", "Device op time by op and layout, in seconds.",
                      {"op", "layout"}, LatencyBounds()),
      refusals_("kvferry_refusals_total",
                "Requests refused or streams ended by a budget, quota or time bound, by reason "
                "and resource.",
                {"reason", "resource"}),
      peer_bytes_("kvferry_peer_bytes_total",
                  "Page bytes moved over UCX with each peer daemon, by direction (sent, received).",
                  {"peer", "direction"}),
      peer_seconds_("kvferry_peer_transfer_seconds",
                    "Push and Pull latency, first message to the destination's commit, in seconds "
                    "(succeeded transfers, on the daemon the client called and on its peer).",
                    {"op"}, LatencyBounds()),
      peer_failures_("kvferry_peer_transfer_failures_total",
                     "Failed Push and Pull transfers by op and error reason.", {"op", "reason"}) {}

void DaemonMetrics::RecordPeerTransfer(const std::string& op, const std::string& peer, bool sent,
                                       uint64_t bytes, double seconds, const std::string& failure) {
  if (bytes > 0) peer_bytes_.Add({peer, sent ? "sent" : "received"}, static_cast<double>(bytes));
  if (failure.empty()) {
    peer_seconds_.Observe({op}, seconds);
  } else {
    std::string label = failure;
    for (char& c : label) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    peer_failures_.Add({op, label}, 1);
  }
}

void DaemonMetrics::RecordRefusal(const std::string& reason, const std::string& resource) {
  refusals_.Add({reason, resource}, 1);
}

void DaemonMetrics::RecordRpc(const std::string& method, const std::string& code,
                              const std::string& reason, double seconds) {
  rpcs_.Add({method, code}, 1);
  rpc_latency_.Observe({method, code}, seconds);
  if (code != "OK") {
    // The error reason, or the status code where there is none (gRPC's own errors).
    std::string label = reason.empty() ? code : reason;
    for (char& c : label) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    errors_.Add({method, label}, 1);
  }
}

void DaemonMetrics::RecordTransfer(const char* op, bool ok, uint64_t bytes, double seconds) {
  transfers_.Add({op, ok ? "ok" : "error"}, 1);
  if (bytes > 0) transfer_bytes_.Add({op}, static_cast<double>(bytes));
  if (ok) transfer_seconds_.Observe({op}, seconds);
}

void DaemonMetrics::RecordBytes(const std::string& method, uint64_t received, uint64_t sent) {
  if (received > 0) bytes_received_.Add({method}, static_cast<double>(received));
  if (sent > 0) bytes_sent_.Add({method}, static_cast<double>(sent));
}

void DaemonMetrics::RecordOp(const char* op, Layout layout, double seconds) {
  kernel_seconds_.Observe({op, LayoutName(layout)}, seconds);
}

std::string DaemonMetrics::Render() const {
  std::string out;
  const std::vector<PoolStats> pools = pools_();
  // Pools are namespaced by tenant: its name (never a token) tells same-named pools
  // apart. The default tenant of a daemon without tokens has no label.
  auto labels = [](const PoolStats& p) {
    return absl::StrCat(p.tenant.empty() ? "" : absl::StrCat("tenant=\"", Escape(p.tenant), "\","),
                        "pool=\"", Escape(p.name), "\",layout=\"", LayoutName(p.layout),
                        "\",device=\"", Escape(p.device), "\"");
  };
  auto simple = [&](const char* name, const char* help, auto value) {
    Header(out, name, help, "gauge");
    for (const PoolStats& p : pools) {
      absl::StrAppend(&out, name, "{", labels(p), "} ", Number(static_cast<double>(value(p))), "\n");
    }
  };
  simple("kvferry_pool_pages_used", "Allocated pages.", [](const PoolStats& p) { return p.pages_used; });
  simple("kvferry_pool_pages_free", "Free pages.",
         [](const PoolStats& p) { return p.pages_free; });
  simple("kvferry_pool_tokens", "Token slots written in at least one layer.",
         [](const PoolStats& p) { return p.tokens_held; });
  simple("kvferry_pool_records", "Token x layer records written.",
         [](const PoolStats& p) { return p.records_held; });
  simple("kvferry_pool_bytes", "Device bytes held by the pool.",
         [](const PoolStats& p) { return p.pool_bytes; });
  Header(out, "kvferry_pool_bytes_per_token",
         "Bytes per token: the record alone (nominal) or with page padding (effective).", "gauge");
  for (const PoolStats& p : pools) {
    absl::StrAppend(&out, "kvferry_pool_bytes_per_token{", labels(p), ",kind=\"nominal\"} ",
                    Number(p.savings.nominal_bytes_per_token), "\n");
    absl::StrAppend(&out, "kvferry_pool_bytes_per_token{", labels(p), ",kind=\"effective\"} ",
                    Number(p.savings.effective_bytes_per_token), "\n");
  }
  Header(out, "kvferry_pool_bytes_saved",
         "Bytes saved by the records held, against bf16 (1024 B/token) and against V4.", "gauge");
  for (const PoolStats& p : pools) {
    absl::StrAppend(&out, "kvferry_pool_bytes_saved{", labels(p), ",baseline=\"bf16\"} ",
                    Number(p.bytes_saved_vs_bf16), "\n");
    absl::StrAppend(&out, "kvferry_pool_bytes_saved{", labels(p), ",baseline=\"v4\"} ",
                    Number(p.bytes_saved_vs_v4), "\n");
  }
  if (sessions_) {
    const SessionCounts c = sessions_();
    auto gauge = [&](const char* name, const char* help, int64_t value) {
      Header(out, name, help, "gauge");
      absl::StrAppend(&out, name, " ", value, "\n");
    };
    gauge("kvferry_sessions", "Open CUDA IPC sessions.", c.sessions);
    gauge("kvferry_session_tensors", "Worker tensors registered by open sessions.", c.tensors);
    gauge("kvferry_session_registered_bytes", "Bytes of worker tensors registered by open sessions.",
          c.registered_bytes);
    gauge("kvferry_session_pool_exports", "Pools exported to open sessions.", c.exports);
  }
  if (cache_) {
    const CacheCounts c = cache_();
    auto one = [&](const char* name, const char* help, const char* type, int64_t value) {
      Header(out, name, help, type);
      absl::StrAppend(&out, name, " ", value, "\n");
    };
    one("kvferry_cache_lookups_total", "Cache lookups.", "counter", c.lookups);
    one("kvferry_cache_requested_tokens_total",
        "Prompt tokens looked up (keys x block_tokens); hit_tokens / requested_tokens is the hit "
        "rate.", "counter", c.requested_tokens);
    one("kvferry_cache_hit_tokens_total", "Prompt tokens of the prefixes found.", "counter",
        c.hit_tokens);
    one("kvferry_cache_evictions_total", "Blocks evicted (least recently used, unpinned).",
        "counter", c.evictions);
    one("kvferry_cache_lease_expirations_total", "Leases that expired before being released.",
        "counter", c.lease_expirations);
    one("kvferry_cache_leases", "Leases held now.", "gauge", c.leases);
    Header(out, "kvferry_cache_blocks", "Blocks stored, per namespace and member pool.", "gauge");
    for (const CacheCounts::Blocks& b : c.blocks) {
      absl::StrAppend(&out, "kvferry_cache_blocks{",
                      b.tenant.empty() ? "" : absl::StrCat("tenant=\"", Escape(b.tenant), "\","),
                      "namespace=\"", Escape(b.name_space), "\",pool=\"", Escape(b.pool), "\"} ",
                      b.blocks, "\n");
    }
  }
  if (budgets_) {
    const std::vector<Budget> budgets = budgets_();
    Header(out, "kvferry_budget_used", "Use of the daemon-wide budgets, all clients together.",
           "gauge");
    for (const Budget& b : budgets) {
      absl::StrAppend(&out, "kvferry_budget_used{resource=\"", b.resource, "\"} ", b.used, "\n");
    }
    Header(out, "kvferry_budget_limit", "The daemon-wide budgets (absent: unlimited).", "gauge");
    for (const Budget& b : budgets) {
      if (b.limit >= 0) {
        absl::StrAppend(&out, "kvferry_budget_limit{resource=\"", b.resource, "\"} ", b.limit, "\n");
      }
    }
  }
  if (registrations_) {
    const Registrations r = registrations_();
    Header(out, "kvferry_ucx_registered_blocks",
           "Memory blocks (staging, read slots, host memory pools) registered with UCX.", "gauge");
    absl::StrAppend(&out, "kvferry_ucx_registered_blocks ", r.blocks, "\n");
    Header(out, "kvferry_ucx_registered_bytes", "Bytes of the blocks registered with UCX.",
           "gauge");
    absl::StrAppend(&out, "kvferry_ucx_registered_bytes ", r.bytes, "\n");
  }
  transfers_.Render(out);
  transfer_bytes_.Render(out);
  transfer_seconds_.Render(out);
  rpcs_.Render(out);
  rpc_latency_.Render(out);
  errors_.Render(out);
  bytes_received_.Render(out);
  bytes_sent_.Render(out);
  kernel_seconds_.Render(out);
  refusals_.Render(out);
  peer_bytes_.Render(out);
  peer_seconds_.Render(out);
  peer_failures_.Render(out);
  return out;
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& address, const DaemonMetrics* metrics,
    std::function<bool(ssl_ctx_st&)> tls_setup, HttpOptions options) {
  const size_t colon = address.rfind(':');
  int port;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) ||
      port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address '", address, "' is not host:port"));
  }
  const std::string host = address.substr(0, colon);
  std::unique_ptr<MetricsServer> server(new MetricsServer());
  if (tls_setup) {
    auto https = std::make_unique<httplib::SSLServer>(tls_setup);
    if (!https->is_valid()) {
      return absl::InvalidArgumentError("metrics: cannot set up TLS from the certificate files");
    }
    server->http_ = std::move(https);
  } else {
    server->http_ = std::make_unique<httplib::Server>();
  }
  // SO_REUSEADDR only: httplib's default adds SO_REUSEPORT, which lets a second daemon bind
  // the same port and take half of the scrapes.
  server->http_->set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, reinterpret_cast<void*>(&yes), sizeof(yes));
  });
  // A fixed pool of workers, each connection's reads bounded: a client that opens
  // connections and sends nothing, or drips a byte at a time, holds one worker at most
  // read_timeout per byte, and /healthz is answered by the others (httplib's default is
  // 8 workers and 5 s).
  const int threads = std::max(options.threads, 1);
  server->http_->new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  server->http_->set_read_timeout(std::chrono::duration<double>(options.read_timeout_seconds));
  server->http_->set_write_timeout(std::chrono::duration<double>(options.read_timeout_seconds * 5));
  server->http_->set_keep_alive_timeout(static_cast<time_t>(std::max(1.0, options.read_timeout_seconds)));
  server->http_->Get("/metrics", [metrics](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics->Render(), "text/plain; version=0.0.4; charset=utf-8");
  });
  server->http_->Get("/healthz", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("ok\n", "text/plain");
  });
  if (port == 0) {
    server->port_ = server->http_->bind_to_any_port(host);
    if (server->port_ < 0) {
      return absl::UnavailableError(absl::StrCat("cannot listen for metrics on ", address));
    }
  } else {
    if (!server->http_->bind_to_port(host, port)) {
      return absl::UnavailableError(absl::StrCat("cannot listen for metrics on ", address,
                                                 ": address in use or not available"));
    }
    server->port_ = port;
  }
  httplib::Server* http = server->http_.get();
  server->thread_ = std::thread([http] {
    NameThisThread("kvf-http");  // and cpp-httplib's pool, which this thread starts
    http->listen_after_bind();
  });
  return server;
}

MetricsServer::~MetricsServer() {
  if (http_) http_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace kvferry::server
