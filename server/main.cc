// kvferryd: flags → DaemonOptions → serve until SIGTERM or SIGINT (SIGHUP re-reads the token
// file), then shut down cleanly.
#include <signal.h>

#include <cstdio>
#include <fstream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
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
ABSL_FLAG(std::string, port_file, "",
          "If set, write 'grpc_port metrics_port' here once listening (for tests and scripts)");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("kvferryd: KV-cache sidecar for DeepSeek-V4-class inference");
  absl::ParseCommandLine(argc, argv);
  if (!kvferry::server::log::Init(absl::GetFlag(FLAGS_log_level))) {
    std::fprintf(stderr, "kvferryd: unknown --log_level '%s'\n", absl::GetFlag(FLAGS_log_level).c_str());
    return 2;
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

  kvferry::server::DaemonOptions options;
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
  if (options.tls.reload_seconds < 1) {
    std::fprintf(stderr, "kvferryd: --security_reload_seconds must be at least 1\n");
    return 2;
  }
  if (options.max_message_bytes < options.service.max_chunk_bytes + 4096) {
    std::fprintf(stderr, "kvferryd: --max_message_bytes must exceed --chunk_bytes by 4 KiB\n");
    return 2;
  }

  absl::StatusOr<std::unique_ptr<kvferry::server::Daemon>> daemon =
      kvferry::server::Daemon::Start(options);
  if (!daemon.ok()) {
    kvferry::server::log::Error("cannot start: {}", daemon.status().ToString());
    return 1;
  }
  kvferry::server::log::Info(
      "kvferryd {} serving grpc_port={} metrics_port={} default_device={} {} "
      "formats=v4(584),v41(528),v41_fp4(288)",
      KVFERRY_VERSION, (*daemon)->grpc_port(), (*daemon)->metrics_port(),
      (*daemon)->default_device(), (*daemon)->security_summary());
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
