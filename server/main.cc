// kvferryd: flags and config file → DaemonOptions → serve until SIGTERM or SIGINT (SIGHUP
// re-reads the token file), then shut down cleanly.
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <fstream>

#include "absl/flags/flag.h"
#include "absl/flags/internal/parse.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "config/config.h"
#include "daemon.h"
#include "kvferry/kernels/format.h"
#include "common/log.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051", "gRPC listen address (host:port; port 0 picks one)");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9464",
          "Prometheus /metrics address (host:port); empty disables it");
ABSL_FLAG(std::string, default_device, "",
          "Device of pools created without one: cpu or cuda:N (default: cuda:0 if a GPU is usable)");
ABSL_FLAG(int32_t, cpu_threads, 0,
          "Threads the cpu backend splits large requests across; 0: the cores kvferryd may use");
ABSL_FLAG(int64_t, max_message_bytes, 4 << 20, "Largest gRPC message accepted or sent, bytes");
ABSL_FLAG(int64_t, chunk_bytes, 1 << 20, "Default and largest read stream piece, bytes");
ABSL_FLAG(int64_t, max_write_tokens, 1 << 20, "Most tokens one WriteTokens call may stage");
ABSL_FLAG(int64_t, max_write_bytes, int64_t{1} << 30, "Most page bytes one WritePages call may stage");
ABSL_FLAG(double, shutdown_grace_seconds, 10, "How long in-flight RPCs may finish on shutdown");
ABSL_FLAG(std::string, log_level, "info", "trace, debug, info, warn, error or off");
ABSL_FLAG(std::string, tls_cert, "",
          "Server certificate chain (PEM): serve gRPC over TLS and /metrics over HTTPS");
ABSL_FLAG(std::string, tls_key, "", "Private key of --tls_cert (PEM)");
ABSL_FLAG(std::string, tls_client_ca, "",
          "Mutual TLS: refuse clients without a certificate signed by this CA (PEM)");
ABSL_FLAG(bool, allow_insecure_remote, false,
          "Serve plaintext gRPC and /metrics on addresses other than loopback (unsafe)");
ABSL_FLAG(std::string, auth_tokens, "",
          "Token file: '<tenant> <sha256 hex of token> [quota=value ...]' per line; every rpc "
          "but the health check then needs 'authorization: Bearer <token>'");
ABSL_FLAG(int32_t, security_reload_seconds, 5,
          "How often certificate and token files are checked for changes");
ABSL_FLAG(int64_t, cache_events, int64_t{1} << 16,
          "Cache events kept per tenant for subscribers (SubscribeEvents); an older one is lost");
ABSL_FLAG(int64_t, cache_max_lease_seconds, 600, "Longest lease a cache lookup may ask for");
ABSL_FLAG(int64_t, max_pools, 4096, "Most pools all clients together may hold");
ABSL_FLAG(int64_t, max_streams, 256,
          "Most streaming calls (reads and writes) open at once, all clients together");
ABSL_FLAG(int64_t, max_staged_write_bytes, 0,
          "Most bytes all writes in flight may stage together; 0: an eighth of "
          "--cpu_memory_limit_bytes");
ABSL_FLAG(int64_t, tenant_max_streams, 64,
          "With --auth_tokens: streams one tenant may hold open where its quota sets none");
ABSL_FLAG(int64_t, tenant_max_staged_write_bytes, 0,
          "With --auth_tokens: staged write bytes of one tenant where its quota sets none; 0: a "
          "quarter of --max_staged_write_bytes");
ABSL_FLAG(int64_t, cpu_memory_limit_bytes, 0,
          "Host memory the cpu backend may commit (pools, staging, read buffers), counted as "
          "promised; pools may take all but an eighth. 0: three quarters of the machine's "
          "memory or of the cgroup's memory.max, whichever is lower");
ABSL_FLAG(int32_t, max_threads, 0,
          "Threads of the gRPC server (each open call holds one; beyond, calls are refused "
          "with RESOURCE_EXHAUSTED); 0: --max_streams + 256");
ABSL_FLAG(int32_t, max_streams_per_connection, 64,
          "Streams one client connection may have open at once (HTTP/2 MAX_CONCURRENT_STREAMS); "
          "more calls on it wait in the client until one ends. The per-client bound where no "
          "tokens tell clients apart");
ABSL_FLAG(double, stream_idle_timeout_seconds, 60,
          "A stream that neither sends nor takes a message for this long is cancelled "
          "(reason STREAM_IDLE_TIMEOUT); 0: never");
ABSL_FLAG(double, max_stream_seconds, 600,
          "A stream open this long is cancelled (reason STREAM_TOO_LONG); 0: no limit");
ABSL_FLAG(double, keepalive_seconds, 10,
          "Ping a gRPC connection after this much silence; an unanswered ping ends it and its "
          "calls");
ABSL_FLAG(double, keepalive_timeout_seconds, 20,
          "How long a keepalive ping may go unanswered (a synchronous gRPC client answers "
          "only from inside a call or from its backup poller, every 5 s)");
ABSL_FLAG(int32_t, http_threads, 32, "/metrics and /healthz connections served at once");
ABSL_FLAG(double, http_read_timeout_seconds, 2,
          "/metrics and /healthz: the longest wait for a request's next bytes");
ABSL_FLAG(double, malloc_trim_seconds, 10,
          "Return free heap memory to the system this often (malloc_trim); 0: never");
ABSL_FLAG(int64_t, malloc_top_pad_bytes, int64_t{4} << 20,
          "Free memory glibc keeps at the top of each heap for the next requests (0 to 64 MiB; "
          "0: glibc's own, 128 KiB)");
ABSL_FLAG(bool, ucx, true,
          "Move pages to and from other kvferryd daemons over UCX (Push/Pull); false turns it off");
ABSL_FLAG(std::string, ucx_transports, "",
          "UCX transports (UCX_TLS) for peers: tcp, sm, rc, ... ; empty: UCX's choice or $UCX_TLS");
ABSL_FLAG(std::string, ucx_net_devices, "",
          "UCX_NET_DEVICES: network devices peers reach this daemon on (eth0, mlx5_0:1, ...); "
          "empty: every device UCX finds");
ABSL_FLAG(int32_t, ucx_lanes, 0,
          "UCX workers, each with its progress thread, that one Push/Pull spreads its messages "
          "over where its bytes go through host memory (each its own connection to the peer; 1 "
          "to 16); 0: one per 8 cores kvferryd may use, 1 to 4");
ABSL_FLAG(bool, ucx_device_memory, true,
          "Where the UCX library moves CUDA memory to a peer without the host (cuda_ipc on one "
          "host, GPUDirect RDMA), send and receive the default GPU's pages in device memory; "
          "false: always through host memory");
ABSL_FLAG(double, peer_timeout_seconds, 5,
          "A Push/Pull fails UNAVAILABLE when the peer moves nothing for this long");
ABSL_FLAG(std::string, peer_token_file, "",
          "File holding the bearer token this daemon presents to peer daemons");
ABSL_FLAG(std::string, peer_secret_file, "",
          "File holding the secret every daemon of the deployment shares (at least 16 bytes, "
          "e.g. `openssl rand -hex 32`): a daemon connects its UCX only to a peer address "
          "proven with it. Needed for Push/Pull where clients authenticate (--auth_tokens)");
ABSL_FLAG(std::string, peer_tls_ca, "",
          "Reach peer daemons over TLS, checking their certificate against this CA (PEM); "
          "--tls_cert/--tls_key are offered to them for mutual TLS");
ABSL_FLAG(int64_t, peer_message_bytes, int64_t{8} << 20,
          "Bytes per UCX message of a Push/Pull (whole pages; at most 64 MiB)");
ABSL_FLAG(int32_t, peer_send_depth, 3,
          "Batches of one Push/Pull the sender holds at once, each one message: while one is "
          "gathered, the others are in flight (2 to 64)");
ABSL_FLAG(int64_t, peer_device_message_bytes, int64_t{32} << 20,
          "Bytes per UCX message of a Push/Pull of pages UCX moves in device memory (cuda_ipc, "
          "GPUDirect RDMA; whole pages; at most 64 MiB)");
ABSL_FLAG(int32_t, peer_device_send_depth, 4,
          "--peer_send_depth for pages UCX moves in device memory (2 to 64)");
ABSL_FLAG(std::string, port_file, "",
          "If set, write 'grpc_port metrics_port' here once listening (for tests and scripts)");

ABSL_FLAG(std::string, config, "",
          "TOML config file: any flag above by name, and [[pool]] tables of pools to create at "
          "start-up; a flag given on the command line wins over the file");
ABSL_FLAG(std::string, check_config, "",
          "Check this config file together with the other flags, print the effective "
          "configuration and exit (0: valid) without starting");

namespace {

namespace config = kvferry::server::config;
using kvferry::server::DaemonOptions;

// Every flag of this file but --config/--check-config is a config file key.
config::FlagScope ConfigScope() {
  return config::FlagScope{
      .defined_in = __FILE__,
      .excluded = {"config", "check_config"},
      // Abseil keeps this bit only in its internal namespace; it is what "set on the command
      // line" means, --flagfile included, which a scan of argv would miss.
      .set_on_command_line =
          [](std::string_view name) {
            return absl::flags_internal::WasPresentOnCommandLine(
                absl::string_view(name.data(), name.size()));
          },
  };
}

// The options the flags (and the file's pools) describe; INVALID_ARGUMENT, naming the flag,
// for values that cannot work together.
absl::StatusOr<DaemonOptions> OptionsFromFlags(const config::ConfigFile* file) {
  DaemonOptions options;
  options.listen = absl::GetFlag(FLAGS_listen);
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  options.default_device = absl::GetFlag(FLAGS_default_device);
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  options.cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
  options.service.default_chunk_bytes = absl::GetFlag(FLAGS_chunk_bytes);
  options.service.max_chunk_bytes = absl::GetFlag(FLAGS_chunk_bytes);
  options.service.write_limits.max_tokens = absl::GetFlag(FLAGS_max_write_tokens);
  options.service.write_limits.max_bytes = absl::GetFlag(FLAGS_max_write_bytes);
  options.tls.cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls.key_file = absl::GetFlag(FLAGS_tls_key);
  options.tls.client_ca_file = absl::GetFlag(FLAGS_tls_client_ca);
  options.tls.reload_seconds = absl::GetFlag(FLAGS_security_reload_seconds);
  options.tls.allow_insecure_remote = absl::GetFlag(FLAGS_allow_insecure_remote);
  options.auth_tokens_file = absl::GetFlag(FLAGS_auth_tokens);
  options.cache.event_capacity = absl::GetFlag(FLAGS_cache_events);
  options.cache.max_lease_ttl = absl::Seconds(absl::GetFlag(FLAGS_cache_max_lease_seconds));
  if (options.cache.event_capacity < 1 || options.cache.max_lease_ttl < absl::Seconds(1)) {
    return absl::InvalidArgumentError("--cache_events and --cache_max_lease_seconds must be >= 1");
  }
  options.limits.daemon[kvferry::server::Resource::kPools] = absl::GetFlag(FLAGS_max_pools);
  options.limits.daemon[kvferry::server::Resource::kStreams] = absl::GetFlag(FLAGS_max_streams);
  if (const int64_t b = absl::GetFlag(FLAGS_max_staged_write_bytes); b > 0) {
    options.limits.daemon[kvferry::server::Resource::kStagedWriteBytes] = b;
  }
  options.limits.per_tenant[kvferry::server::Resource::kStreams] =
      absl::GetFlag(FLAGS_tenant_max_streams);
  if (const int64_t b = absl::GetFlag(FLAGS_tenant_max_staged_write_bytes); b > 0) {
    options.limits.per_tenant[kvferry::server::Resource::kStagedWriteBytes] = b;
  }
  options.cpu_memory_limit_bytes =
      static_cast<uint64_t>(std::max<int64_t>(0, absl::GetFlag(FLAGS_cpu_memory_limit_bytes)));
  options.max_threads = absl::GetFlag(FLAGS_max_threads);
  options.max_streams_per_connection = absl::GetFlag(FLAGS_max_streams_per_connection);
  options.service.stream_limits.idle_timeout =
      absl::Seconds(absl::GetFlag(FLAGS_stream_idle_timeout_seconds));
  options.service.stream_limits.max_duration = absl::Seconds(absl::GetFlag(FLAGS_max_stream_seconds));
  options.keepalive_seconds = absl::GetFlag(FLAGS_keepalive_seconds);
  options.keepalive_timeout_seconds = absl::GetFlag(FLAGS_keepalive_timeout_seconds);
  options.http_threads = absl::GetFlag(FLAGS_http_threads);
  options.http_read_timeout_seconds = absl::GetFlag(FLAGS_http_read_timeout_seconds);
  options.malloc_trim_seconds = absl::GetFlag(FLAGS_malloc_trim_seconds);
  options.malloc_top_pad_bytes = absl::GetFlag(FLAGS_malloc_top_pad_bytes);
  options.ucx = absl::GetFlag(FLAGS_ucx);
  options.ucx_options.transports = absl::GetFlag(FLAGS_ucx_transports);
  options.ucx_options.net_devices = absl::GetFlag(FLAGS_ucx_net_devices);
  options.ucx_device_memory = absl::GetFlag(FLAGS_ucx_device_memory);
  options.ucx_options.lanes = absl::GetFlag(FLAGS_ucx_lanes);
  options.peer.timeout_seconds = absl::GetFlag(FLAGS_peer_timeout_seconds);
  options.peer.token_file = absl::GetFlag(FLAGS_peer_token_file);
  options.peer.secret_file = absl::GetFlag(FLAGS_peer_secret_file);
  options.peer.tls_ca_file = absl::GetFlag(FLAGS_peer_tls_ca);
  options.peer.tls_cert_file = options.tls.cert_file;
  options.peer.tls_key_file = options.tls.key_file;
  options.peer.message_bytes = absl::GetFlag(FLAGS_peer_message_bytes);
  options.peer.send_depth = absl::GetFlag(FLAGS_peer_send_depth);
  options.peer.device_message_bytes = absl::GetFlag(FLAGS_peer_device_message_bytes);
  options.peer.device_send_depth = absl::GetFlag(FLAGS_peer_device_send_depth);
  auto bad_size = [](int64_t bytes) { return bytes < 1 || bytes > (int64_t{64} << 20); };
  auto bad_depth = [](int depth) { return depth < 2 || depth > 64; };
  if (options.peer.timeout_seconds <= 0 || bad_size(options.peer.message_bytes) ||
      bad_size(options.peer.device_message_bytes) || bad_depth(options.peer.send_depth) ||
      bad_depth(options.peer.device_send_depth)) {
    return absl::InvalidArgumentError(
        "--peer_timeout_seconds must be positive, --peer_message_bytes and "
        "--peer_device_message_bytes in [1, 64 MiB], --peer_send_depth and "
        "--peer_device_send_depth in [2, 64]");
  }
  if (options.ucx_options.lanes < 0 || options.ucx_options.lanes > kvferry::server::kMaxUcxLanes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--ucx_lanes must be 0 (one per 8 cores) or 1 to ", kvferry::server::kMaxUcxLanes));
  }
  for (const auto& [name, value] :
       {std::pair<const char*, int64_t>{"--max_pools", absl::GetFlag(FLAGS_max_pools)},
        {"--max_streams", absl::GetFlag(FLAGS_max_streams)},
        {"--tenant_max_streams", absl::GetFlag(FLAGS_tenant_max_streams)},
        {"--max_streams_per_connection", absl::GetFlag(FLAGS_max_streams_per_connection)}}) {
    if (value < 1) return absl::InvalidArgumentError(absl::StrCat(name, " must be at least 1"));
  }
  if (options.keepalive_seconds < 1 || options.keepalive_timeout_seconds < 1 ||
      options.http_read_timeout_seconds <= 0 || options.http_threads < 1) {
    return absl::InvalidArgumentError(
        "--keepalive_seconds and --keepalive_timeout_seconds must be at least 1, "
        "--http_read_timeout_seconds above 0, --http_threads at least 1");
  }
  if (options.malloc_top_pad_bytes < 0 || options.malloc_top_pad_bytes > (int64_t{64} << 20)) {
    return absl::InvalidArgumentError("--malloc_top_pad_bytes must be within 0 and 64 MiB");
  }
  if (options.tls.reload_seconds < 1) {
    return absl::InvalidArgumentError("--security_reload_seconds must be at least 1");
  }
  if (options.max_message_bytes < options.service.max_chunk_bytes + 4096) {
    return absl::InvalidArgumentError("--max_message_bytes must exceed --chunk_bytes by 4 KiB");
  }
  if (absl::GetFlag(FLAGS_shutdown_grace_seconds) < 0) {
    return absl::InvalidArgumentError("--shutdown_grace_seconds must not be negative");
  }
  if (file != nullptr) {
    for (const config::PoolSpec& p : file->pools) {
      options.pools.push_back(kvferry::server::StartupPool{
          p.config, p.device, p.tenant, absl::StrCat(file->path, ":", p.line)});
    }
  }
  return options;
}

// Accepts --check-config for --check_config (every flag): Abseil's names are identifiers,
// the usual command-line spelling has dashes. Only the name before '=' changes, and only
// up to a bare "--".
void DashesToUnderscores(int argc, char** argv) {
  for (int i = 1; i < argc && std::string_view(argv[i]) != "--"; ++i) {
    char* arg = argv[i];
    if (arg[0] != '-') continue;
    char* name = arg + (arg[1] == '-' ? 2 : 1);
    for (char* c = name; *c != '\0' && *c != '='; ++c) {
      if (*c == '-' && c != name) *c = '_';
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("kvferryd: KV-cache sidecar for DeepSeek-V4-class inference");
  DashesToUnderscores(argc, argv);
  absl::ParseCommandLine(argc, argv);
  const std::string check_path = absl::GetFlag(FLAGS_check_config);
  const std::string config_path = check_path.empty() ? absl::GetFlag(FLAGS_config) : check_path;
  if (!check_path.empty() && !absl::GetFlag(FLAGS_config).empty() &&
      absl::GetFlag(FLAGS_config) != check_path) {
    std::fprintf(stderr, "kvferryd: --config and --check-config name different files\n");
    return 2;
  }
  const config::FlagScope scope = ConfigScope();
  std::optional<config::ConfigFile> file;
  if (!config_path.empty()) {
    absl::StatusOr<config::ConfigFile> loaded = config::Load(config_path, scope);
    absl::Status applied = loaded.ok() ? config::ApplyToFlags(*loaded, scope) : loaded.status();
    if (!applied.ok()) {
      std::fprintf(stderr, "kvferryd: config: %s\n", std::string(applied.message()).c_str());
      return 2;
    }
    file = *std::move(loaded);
  }
  if (!kvferry::server::log::Init(absl::GetFlag(FLAGS_log_level))) {
    std::fprintf(stderr, "kvferryd: unknown --log_level '%s'\n", absl::GetFlag(FLAGS_log_level).c_str());
    return 2;
  }
  absl::StatusOr<DaemonOptions> options = OptionsFromFlags(file ? &*file : nullptr);
  if (!options.ok()) {
    std::fprintf(stderr, "kvferryd: %s\n", std::string(options.status().message()).c_str());
    return 2;
  }
  const std::vector<config::Setting> effective = config::Effective(file ? &*file : nullptr, scope);
  if (!check_path.empty()) {
    for (const config::Setting& s : effective) {
      std::printf("%s = %s  # %s\n", s.key.c_str(), s.value.empty() ? "\"\"" : s.value.c_str(),
                  s.source.c_str());
    }
    for (const config::PoolSpec& p : file->pools) {
      std::printf("pool %s: layout=%s page_size=%d num_pages=%lld num_layers=%d device=%s tenant=%s\n",
                  p.config.name.c_str(), kvferry::LayoutName(p.config.layout), p.config.page_size,
                  static_cast<long long>(p.config.num_pages), p.config.num_layers,
                  p.device.empty() ? "(default)" : p.device.c_str(),
                  p.tenant.empty() ? "(default)" : p.tenant.c_str());
    }
    std::printf("%s: valid\n", check_path.c_str());
    return 0;
  }
  kvferry::server::log::Info("configuration file={}", file ? file->path : "(none)");
  for (const config::Setting& s : effective) {
    kvferry::server::log::Info("configuration {}={} source={}", s.key, s.value, s.source);
  }
  for (const kvferry::server::StartupPool& p : options->pools) {
    kvferry::server::log::Info(
        "configuration pool={} layout={} page_size={} num_pages={} num_layers={} device={} "
        "tenant={} at={}",
        p.config.name, kvferry::LayoutName(p.config.layout), p.config.page_size,
        p.config.num_pages, p.config.num_layers, p.device.empty() ? "(default)" : p.device,
        p.tenant.empty() ? "(default)" : p.tenant, p.origin);
  }
  // Signals are taken by sigwait below, in this thread only: block them before any other
  // thread starts so that none of those receives them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  // A client that hangs up while /metrics answers over HTTPS (OpenSSL writes with write())
  // must cost that connection, not the daemon.
  signal(SIGPIPE, SIG_IGN);

  absl::StatusOr<std::unique_ptr<kvferry::server::Daemon>> daemon =
      kvferry::server::Daemon::Start(*std::move(options));
  if (!daemon.ok()) {
    kvferry::server::log::Error("cannot start: {}", daemon.status().ToString());
    return 1;
  }
  kvferry::server::log::Info(
      "kvferryd {} serving grpc_port={} metrics_port={} default_device={} {} ucx={} "
      "formats=v4(584),v41(528),v41_fp4(288)",
      KVFERRY_VERSION, (*daemon)->grpc_port(), (*daemon)->metrics_port(),
      (*daemon)->default_device(), (*daemon)->security_summary(), (*daemon)->ucx_summary());
  if (const std::string path = absl::GetFlag(FLAGS_port_file); !path.empty()) {
    const std::string temp = path + ".tmp";
    std::ofstream(temp) << (*daemon)->grpc_port() << " " << (*daemon)->metrics_port() << "\n";
    std::rename(temp.c_str(), path.c_str());
  }
  int signal_number = 0;
  while (sigwait(&signals, &signal_number) == 0 && signal_number == SIGHUP) {
    if (absl::Status s = (*daemon)->ReloadTokens(); !s.ok()) {
      kvferry::server::log::Error("SIGHUP: token file not reloaded, the previous tokens stay: {}",
                                  std::string(s.message()));
    }
  }
  kvferry::server::log::Info("signal {}: shutting down", signal_number);
  (*daemon)->Shutdown(absl::GetFlag(FLAGS_shutdown_grace_seconds));
  kvferry::server::log::Info("stopped");
  return 0;
}
