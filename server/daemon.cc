// Wiring of kvferryd: pools, service, health, reflection, interceptors, metrics.
#include "daemon.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/impl/server_builder_option.h>
#include <grpcpp/impl/server_builder_plugin.h>

#include <chrono>

#include "absl/strings/str_cat.h"
#include "backend/backend.h"
#include "common/log.h"
#include "service/metrics_interceptor.h"

namespace kvferry::server {
namespace {

// Drops the reflection plugin, which the library registers for every server once linked.
class WithoutReflection final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    std::erase_if(*plugins, [](const std::unique_ptr<grpc::ServerBuilderPlugin>& p) {
      return p->name() == "proto_server_reflection";
    });
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(DaemonOptions options) {
  std::unique_ptr<Daemon> d(new Daemon());
  // Security first: a daemon that would serve in the open, or with unusable certificate or
  // token files, must not start.
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      ServerCredentials(options.listen, options.tls);
  if (!credentials.ok()) return credentials.status();
  const bool tls = !options.tls.cert_file.empty();
  if (!options.metrics_listen.empty() && !tls) {
    if (absl::Status s = CheckPlaintextAllowed("/metrics", options.metrics_listen,
                                               options.tls.allow_insecure_remote);
        !s.ok()) {
      return s;
    }
  }
  if (options.auth_tokens_file.empty()) {
    d->auth_ = std::make_unique<OpenAuthenticator>(d->tenants_.Get(""));
  } else {
    absl::StatusOr<std::unique_ptr<TokenAuthenticator>> tokens = TokenAuthenticator::Start(
        TokenAuthOptions{options.auth_tokens_file,
                         static_cast<double>(options.tls.reload_seconds)},
        &d->tenants_);
    if (!tokens.ok()) return tokens.status();
    d->tokens_ = tokens->get();
    d->auth_ = std::move(*tokens);
  }
  d->security_summary_ =
      absl::StrCat("tls=", !tls ? "off" : options.tls.client_ca_file.empty() ? "on" : "mutual",
                   " tokens=", options.auth_tokens_file.empty() ? "off" : "on");

  d->default_device_ = options.default_device.empty() ? DefaultDevice() : options.default_device;
  // The metrics read pool stats through the manager, created right after.
  Daemon* raw = d.get();
  d->daemon_metrics_ =
      std::make_unique<DaemonMetrics>([raw] { return raw->pools_->Stats().pools; });
  PoolManagerOptions pool_options;
  pool_options.default_device = d->default_device_;
  pool_options.observer = d->daemon_metrics_.get();
  pool_options.backend.cpu_threads = options.cpu_threads;
  d->pools_ = std::make_unique<PoolManager>(std::move(pool_options));
  // The default device's backend, made now: a bad --default_device fails start-up.
  if (absl::Status s = d->pools_->BackendFor(d->default_device_).status(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("default device: ", s.message()));
  }
  // An AllocatePages reply holds at most ~26 bytes per handle; keep it well inside a message.
  options.service.max_pages_per_call =
      std::min<int64_t>(options.service.max_pages_per_call, (options.max_message_bytes - 4096) / 32);
  d->sessions_ = std::make_unique<SessionManager>(d->pools_.get(), d->daemon_metrics_.get());
  SessionManager* sessions = d->sessions_.get();
  d->pools_->SetDeleteListener([sessions](const Pool& pool) { sessions->PoolDeleted(pool); });
  d->daemon_metrics_->SetSessionSource([sessions] { return sessions->Counts(); });
  d->service_ = std::make_unique<KvFerryService>(d->pools_.get(), sessions, options.service,
                                                 d->auth_.get());
  d->session_service_ = std::make_unique<SessionService>(sessions, d->auth_.get());

  // The health service answers without a token (probes have none). Reflection cannot check
  // tokens, so it is only offered when there are none.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // gRPC allows SO_REUSEPORT by default: a second daemon would then share the port and
  // take half the clients. Start-up must fail instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  if (!options.auth_tokens_file.empty()) builder.SetOption(std::make_unique<WithoutReflection>());
  builder.AddListeningPort(options.listen, *credentials, &d->grpc_port_);
  builder.RegisterService(d->service_.get());
  builder.RegisterService(d->session_service_.get());
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<MetricsInterceptorFactory>(
      d->daemon_metrics_.get(), MetricsInterceptorFactory::KnownMethods({"kvferry.v1.KvFerry", "kvferry.v1.KvSession"})));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  d->server_ = builder.BuildAndStart();
  if (!d->server_ || d->grpc_port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.listen, ": address in use or not available"));
  }
  d->server_->GetHealthCheckService()->SetServingStatus(true);
  if (!options.metrics_listen.empty()) {
    absl::StatusOr<std::unique_ptr<MetricsServer>> m =
        MetricsServer::Start(options.metrics_listen, d->daemon_metrics_.get(),
                             tls ? HttpsSetup(options.tls) : nullptr);
    if (!m.ok()) {
      d->Shutdown(0);
      return m.status();
    }
    d->metrics_ = std::move(*m);
  }
  return d;
}

absl::Status Daemon::ReloadTokens() {
  return tokens_ != nullptr ? tokens_->Reload() : absl::OkStatus();
}

void Daemon::Shutdown(double grace_seconds) {
  if (stopped_) return;
  stopped_ = true;
  if (server_) {
    server_->GetHealthCheckService()->SetServingStatus(false);
    server_->Shutdown(std::chrono::system_clock::now() +
                      std::chrono::milliseconds(static_cast<int64_t>(grace_seconds * 1000)));
    server_->Wait();
  }
  metrics_.reset();
  if (pools_) pools_->Clear();
}

Daemon::~Daemon() { Shutdown(0); }

}  // namespace kvferry::server
