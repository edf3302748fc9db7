// kvferryd as an object: the pools, the gRPC server, the metrics endpoint, and shutdown.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "core/block_index.h"
#include "core/pool_manager.h"
#include "core/tenant.h"
#include "metrics/metrics.h"
#include "core/session.h"
#include "security/authenticator.h"
#include "security/tls.h"
#include "service/cache_service.h"
#include "service/pool_service.h"
#include "service/session_service.h"
#include "service/transfer_service.h"
#include "transport/ucx_worker.h"

namespace kvferry::server {

// A pool the daemon creates before it serves (the config file's [[pool]] tables).
struct StartupPool {
  PoolConfig config;
  std::string device;  // empty: the default device
  std::string tenant;  // empty: the default tenant; another needs auth_tokens_file
  std::string origin;  // where it was defined, for messages ("kvferryd.toml:12")
};

struct DaemonOptions {
  std::string listen = "127.0.0.1:50051";          // gRPC address; port 0 picks a free one
  std::string metrics_listen = "127.0.0.1:9464";   // /metrics; empty disables it
  std::string default_device;                      // empty: cuda:0 if a GPU is usable, else cpu
  int64_t max_message_bytes = 4 << 20;             // largest gRPC message accepted or sent
  int cpu_threads = 0;                             // cpu backend workers; 0: the usable cores
  ServiceOptions service;
  // gRPC and /metrics transport: TLS or mutual TLS from the same files (/metrics as HTTPS);
  // without TLS, plaintext only on loopback unless tls.allow_insecure_remote.
  TlsOptions tls;
  // Bearer tokens and tenants (security/token_file.h); empty: no tokens, every caller is
  // the one default tenant. Re-read every tls.reload_seconds when it changed, and on
  // ReloadTokens().
  std::string auth_tokens_file;
  // Created in order before serving; one that cannot be created fails Start.
  std::vector<StartupPool> pools;
  // The KV cache's index: events kept for subscribers, the longest lease, key limits.
  BlockIndexOptions cache;

  // ---- resource governance: 0 means the default stated ----
  // Budgets of all clients together (TenantLimits::daemon) and of each tenant where the
  // token file gives none (TenantLimits::per_tenant); kUnlimited where none. Staged write
  // bytes left unlimited in `daemon` default to an eighth of the cpu memory limit.
  TenantLimits limits;
  // Host memory the cpu backend may commit (pools, staging, read buffers); 0: three
  // quarters of the machine's or the cgroup's memory (HostMemoryLimit()).
  uint64_t cpu_memory_limit_bytes = 0;
  // Threads of gRPC's synchronous server (each open call holds one); beyond, gRPC answers
  // RESOURCE_EXHAUSTED itself. 0: the streams budget plus 256 for unary calls.
  int max_threads = 0;
  // Streams one client connection may have open at once (HTTP/2 SETTINGS
  // MAX_CONCURRENT_STREAMS): the bound per client where there are no tokens to tell
  // clients apart. More calls on the connection wait in the client until one ends.
  int max_streams_per_connection = 64;
  // HTTP/2 keepalive: a ping after this much silence on a connection, which fails when not
  // answered within keepalive_timeout_seconds (the connection and its calls end). The
  // timeout is gRPC's own default: a synchronous gRPC client answers a ping only from a
  // thread inside one of its calls or from its backup poller (every 5 s), so a client busy
  // between calls may take longer than 5 s; a frozen client is still found within 30 s.
  double keepalive_seconds = 10;
  double keepalive_timeout_seconds = 20;
  // /metrics and /healthz: worker threads (connections served at once) and the longest
  // wait for a request's next bytes.
  int http_threads = 32;
  double http_read_timeout_seconds = 2;
  // Pages between daemons (Push/Pull): UCX on unless `ucx` is false. A UCX that cannot
  // start leaves the daemon serving without it (Push/Pull then say TRANSPORT_UNAVAILABLE),
  // unless transports or devices were named: then Start fails.
  bool ucx = true;
  UcxOptions ucx_options;
  // Where the UCX library moves CUDA memory to a peer without the host (cuda_ipc, GPUDirect
  // RDMA), pages of the default device's pools go to and from UCX in device memory, not
  // through host staging.
  bool ucx_device_memory = true;
  PeerOptions peer;
  // Every this many seconds glibc is asked to return free heap memory to the system
  // (malloc_trim); 0: never.
  double malloc_trim_seconds = 0;
  // Free memory glibc keeps at the top of each heap (M_TOP_PAD) when it grows or shrinks
  // one: request buffers of hundreds of KiB then reuse memory rather than fault fresh pages
  // in on every call. 0: glibc's own (128 KiB).
  int64_t malloc_top_pad_bytes = 0;
};

class MemoryTrimmer;

class Daemon {
 public:
  // Starts serving; returns when both endpoints listen.
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(DaemonOptions options);
  ~Daemon();

  int grpc_port() const { return grpc_port_; }
  int metrics_port() const { return metrics_ ? metrics_->port() : 0; }
  const std::string& default_device() const { return default_device_; }
  // A one-line description of the security in force, for the start-up log.
  const std::string& security_summary() const { return security_summary_; }
  // The UCX transports in use ("tcp", "default", ...), or "off".
  // "off", or the transports and, where UCX moves a GPU's memory, " device_memory=cuda:N".
  std::string ucx_summary() const {
    if (!ucx_) return "off";
    return ucx_->device_memory().empty()
               ? ucx_->transports()
               : absl::StrCat(ucx_->transports(), " device_memory=", ucx_->device_memory());
  }

  // Re-reads the token file now (SIGHUP); on an error the tokens in force stay. OK when
  // there is no token file.
  absl::Status ReloadTokens();

  // Stops accepting, lets in-flight RPCs finish (cancelling those still running after
  // `grace_seconds`), stops /metrics and frees every pool.
  void Shutdown(double grace_seconds);

 private:
  Daemon() = default;
  std::string default_device_;
  std::string security_summary_;
  std::unique_ptr<DaemonMetrics> daemon_metrics_;
  std::unique_ptr<TenantRegistry> tenants_;
  std::unique_ptr<Authenticator> auth_;
  TokenAuthenticator* tokens_ = nullptr;  // auth_, when it is the token file's
  std::unique_ptr<PoolManager> pools_;
  std::unique_ptr<StreamWatchdog> watchdog_;  // every service's streams
  std::unique_ptr<SessionManager> sessions_;
  std::unique_ptr<BlockIndex> cache_;
  std::unique_ptr<KvCacheService> cache_service_;
  std::unique_ptr<KvFerryService> service_;
  std::unique_ptr<SessionService> session_service_;
  std::unique_ptr<UcxWorker> ucx_;
  std::unique_ptr<TransferEngine> transfers_;
  std::unique_ptr<TransferService> transfer_service_;
  std::unique_ptr<PeerService> peer_service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<MetricsServer> metrics_;
  int grpc_port_ = 0;
  bool stopped_ = false;
  std::unique_ptr<MemoryTrimmer> trimmer_;
};

}  // namespace kvferry::server
