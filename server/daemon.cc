// Wiring of kvferryd: pools, service, health, reflection, interceptors, metrics.
#include "daemon.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/impl/server_builder_option.h>
#include <grpcpp/impl/server_builder_plugin.h>

#include <malloc.h>

#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "backend/backend.h"
#include "common/log.h"
#include "kvferry/thread_name.h"
#include "security/peer_secret.h"
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

// Returns the heap's free memory to the system every period: after a burst (many cancelled
// reads, say) glibc otherwise keeps the peak (bench/RESULTS.md, issue 17).
class MemoryTrimmer {
 public:
  explicit MemoryTrimmer(absl::Duration period)
      : thread_([this, period] {
          NameThisThread("kvf-trim");
          Run(period);
        }) {}
  ~MemoryTrimmer() {
    {
      kvferry::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
  }

 private:
  void Run(absl::Duration period) {
    kvferry::MutexLock lock(&mu_);
    while (!mu_.AwaitWithTimeout(kvferry::Condition(&stop_), period)) malloc_trim(0);
  }
  kvferry::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(DaemonOptions options) {
  // absl::Mutex's deadlock detection (on in Debian's Abseil) records every lock order in one
  // global graph under a global lock, on every lock of every thread: a few percent of a
  // write-heavy run. kvferry's lock annotations are checked by clang's -Wthread-safety, and
  // its locking by ThreadSanitizer, in the test command instead.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  if (options.malloc_top_pad_bytes > 0) {
    // glibc grows and shrinks each heap by what a call needs (plus 128 KiB): a request of a
    // few hundred KiB (a Save naming 16384 pages) then faults fresh pages in on every call.
    // A larger top pad keeps that much at each heap's top. Setting it also stops glibc from
    // raising its mmap threshold as mapped blocks are freed (it stays at 128 KiB); the net
    // of both is what bench/RESULTS.md measured. It is not a trim threshold on purpose: the
    // periodic malloc_trim cannot shrink the tops of the other threads' heaps, so whatever
    // stays there stays.
    mallopt(M_TOP_PAD, static_cast<int>(options.malloc_top_pad_bytes));
  }
  std::unique_ptr<Daemon> d(new Daemon());
  Daemon* raw = d.get();
  // Budgets: defaults from the host's memory, refusals counted by the metrics.
  const uint64_t cpu_memory = options.cpu_memory_limit_bytes > 0
                                  ? options.cpu_memory_limit_bytes
                                  : HostMemoryLimit() / 4 * 3;
  if (options.limits.daemon[Resource::kStagedWriteBytes] == TenantQuota::kUnlimited &&
      cpu_memory > 0) {
    options.limits.daemon[Resource::kStagedWriteBytes] = static_cast<int64_t>(cpu_memory / 8);
  }
  // The metrics read pool stats through the manager, created below.
  d->daemon_metrics_ =
      std::make_unique<DaemonMetrics>([raw] { return raw->pools_->Stats().pools; });
  DaemonMetrics* metrics = d->daemon_metrics_.get();
  options.limits.on_refusal = [metrics](Resource resource, bool daemon_wide) {
    metrics->RecordRefusal(daemon_wide ? "daemon_budget_exhausted" : "quota_exceeded",
                           ResourceName(resource));
  };
  if (options.auth_tokens_file.empty()) {
    // No tenants: every caller is the one default tenant, bounded by the daemon's budgets.
    options.limits.per_tenant = TenantQuota{};
  } else if (options.limits.per_tenant[Resource::kStagedWriteBytes] == TenantQuota::kUnlimited &&
             options.limits.daemon[Resource::kStagedWriteBytes] != TenantQuota::kUnlimited) {
    options.limits.per_tenant[Resource::kStagedWriteBytes] =
        options.limits.daemon[Resource::kStagedWriteBytes] / 4;
  }
  d->tenants_ = std::make_unique<TenantRegistry>(options.limits);
  d->daemon_metrics_->SetBudgetSource([account = d->tenants_->daemon()] {
    std::vector<DaemonMetrics::Budget> budgets;
    for (Resource r : {Resource::kPools, Resource::kStreams, Resource::kStagedWriteBytes}) {
      const int64_t limit = account->limit(r);
      budgets.push_back({ResourceName(r), account->used(r),
                         limit == TenantQuota::kUnlimited ? -1 : limit});
    }
    return budgets;
  });
  options.service.on_stream_expired = [metrics](ErrorReason reason) {
    std::string name = ReasonName(reason);
    for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    metrics->RecordRefusal(name, "streams");
  };
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
    d->auth_ = std::make_unique<OpenAuthenticator>(d->tenants_->Get(""));
  } else {
    absl::StatusOr<std::unique_ptr<TokenAuthenticator>> tokens = TokenAuthenticator::Start(
        TokenAuthOptions{options.auth_tokens_file,
                         static_cast<double>(options.tls.reload_seconds)},
        d->tenants_.get());
    if (!tokens.ok()) return tokens.status();
    d->tokens_ = tokens->get();
    d->auth_ = std::move(*tokens);
  }
  // Transfers between daemons that authenticate their clients need the peer secret.
  options.peer.require_secret = !options.auth_tokens_file.empty();
  if (!options.peer.secret_file.empty()) {
    absl::StatusOr<std::string> secret = ReadPeerSecret(options.peer.secret_file);
    if (!secret.ok()) return secret.status();
    options.peer.secret = *std::move(secret);
  }
  d->security_summary_ =
      absl::StrCat("tls=", !tls ? "off" : options.tls.client_ca_file.empty() ? "on" : "mutual",
                   " tokens=", options.auth_tokens_file.empty() ? "off" : "on",
                   " peer_secret=", options.peer.secret.empty() ? "off" : "on");

  d->default_device_ = options.default_device.empty() ? DefaultDevice() : options.default_device;
  PoolManagerOptions pool_options;
  pool_options.default_device = d->default_device_;
  pool_options.observer = d->daemon_metrics_.get();
  pool_options.backend.cpu_threads = options.cpu_threads;
  pool_options.backend.cpu_memory_limit_bytes = cpu_memory;
  d->pools_ = std::make_unique<PoolManager>(std::move(pool_options));
  // The default device's backend, made now: a bad --default_device fails start-up.
  if (absl::Status s = d->pools_->BackendFor(d->default_device_).status(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("default device: ", s.message()));
  }
  for (const StartupPool& p : options.pools) {
    if (!p.tenant.empty() && options.auth_tokens_file.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          p.origin, ": pool '", p.config.name, "' belongs to tenant '", p.tenant,
          "', but without a token file every caller is the default tenant"));
    }
    absl::StatusOr<std::shared_ptr<Pool>> pool =
        d->pools_->Create(d->tenants_->Get(p.tenant), p.config, p.device);
    if (!pool.ok()) {
      return absl::Status(pool.status().code(), absl::StrCat(p.origin, ": pool '", p.config.name,
                                                             "': ", pool.status().message()));
    }
  }
  // An AllocatePages reply holds at most ~26 bytes per handle; keep it well inside a message.
  options.service.max_pages_per_call =
      std::min<int64_t>(options.service.max_pages_per_call, (options.max_message_bytes - 4096) / 32);
  d->watchdog_ = std::make_unique<StreamWatchdog>(options.service.stream_limits,
                                                  options.service.on_stream_expired);
  options.service.watchdog = d->watchdog_.get();
  d->sessions_ = std::make_unique<SessionManager>(d->pools_.get(), d->daemon_metrics_.get());
  SessionManager* sessions = d->sessions_.get();
  d->cache_ = std::make_unique<BlockIndex>(options.cache);
  BlockIndex* cache = d->cache_.get();
  d->pools_->SetDeleteListener([sessions, cache](const Pool& pool) {
    sessions->PoolDeleted(pool);
    cache->PoolDeleted(pool);
  });
  d->daemon_metrics_->SetSessionSource([sessions] { return sessions->Counts(); });
  d->daemon_metrics_->SetCacheSource([cache] { return cache->Counts(); });
  d->service_ = std::make_unique<KvFerryService>(d->pools_.get(), sessions, options.service,
                                                 d->auth_.get());
  d->session_service_ = std::make_unique<SessionService>(sessions, cache, d->auth_.get(),
                                                         d->watchdog_.get());
  d->cache_service_ =
      std::make_unique<KvCacheService>(d->pools_.get(), cache, options.service, d->auth_.get());
  if (options.ucx) {
    UcxOptions ucx_options = options.ucx_options;
    // A receive whose sender gave up mid-message holds its pages until UCX finds the
    // sender's endpoint gone: checked twice per peer timeout, so that within about the
    // timeout such pages are released (UCX's own interval is 20 s).
    ucx_options.keepalive = absl::Seconds(options.peer.timeout_seconds / 2);
    ucx_options.abandon_grace = absl::Seconds(options.peer.timeout_seconds);
    if (options.ucx_device_memory && d->default_device_ != "cpu") {
      // A UCX that moves CUDA memory gets the default device's pool pages directly.
      std::shared_ptr<Backend> backend = *d->pools_->BackendFor(d->default_device_);
      ucx_options.device = d->default_device_;
      ucx_options.bind_device = [backend] {
        if (absl::Status s = backend->BindThread(); !s.ok()) {
          log::Warn("ucx: the progress thread cannot use {}: {}", backend->device(), s.ToString());
        }
      };
    }
    absl::StatusOr<std::unique_ptr<UcxWorker>> ucx = UcxWorker::Create(ucx_options);
    if (ucx.ok()) {
      d->ucx_ = std::move(*ucx);
      log::Info("ucx: transports {}, {} lane(s): a Push/Pull spreads its messages over that many "
                "workers and connections", d->ucx_->transports(), d->ucx_->lanes());
      d->pools_->SetReleaseListener(d->ucx_->release_listener());
      UcxWorker* ucx_worker = d->ucx_.get();
      d->daemon_metrics_->SetRegistrationSource([ucx_worker] {
        const UcxWorker::Registrations r = ucx_worker->registrations();
        return DaemonMetrics::Registrations{r.blocks, r.bytes};
      });
    } else if (!options.ucx_options.transports.empty() ||
               !options.ucx_options.net_devices.empty()) {
      // Asked for by name: a daemon that cannot do what it was configured for does not start.
      return absl::Status(ucx.status().code(),
                          absl::StrCat("UCX with the transports and devices configured "
                                       "(--ucx_transports, --ucx_net_devices) could not start: ",
                                       ucx.status().message()));
    } else {
      log::Warn("UCX could not start ({}); Push and Pull are off", ucx.status().ToString());
    }
  }
  if (d->ucx_ != nullptr && options.peer.secret.empty()) {
    if (options.peer.require_secret) {
      log::Warn("no --peer_secret_file: Push, Pull and peer transfers are refused "
                "(PEER_NOT_AUTHENTICATED), since clients authenticate here");
    } else {
      log::Warn("no --peer_secret_file: transfers connect to any UCX address a peer gives; "
                "give the daemons a shared secret unless the network is trusted");
    }
  }
  d->transfers_ = std::make_unique<TransferEngine>(
      d->pools_.get(), d->ucx_.get(), d->auth_.get(), options.service.write_limits, options.peer,
      [metrics](const PeerTransferRecord& r) {
        metrics->RecordPeerTransfer(r.op, r.peer, r.sent, r.bytes, r.seconds,
                                    r.status.ok() ? "" : ReasonName(ReasonOf(r.status)));
      });
  d->transfer_service_ = std::make_unique<TransferService>(d->transfers_.get());
  d->peer_service_ = std::make_unique<PeerService>(d->transfers_.get(), d->watchdog_.get());

  // The health service answers without a token (probes have none). Reflection cannot check
  // tokens, so it is only offered when there are none.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // gRPC allows SO_REUSEPORT by default: a second daemon would then share the port and
  // take half the clients. Start-up must fail instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Dead peers (a killed or frozen client, a cut network) are found by keepalive pings
  // within keepalive + timeout; their calls end and release what they held. Clients may
  // ping too, but not more often than every 5 s without data (else GOAWAY).
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS,
                             static_cast<int>(options.keepalive_seconds * 1000));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                             static_cast<int>(options.keepalive_timeout_seconds * 1000));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             kMinRecvPingIntervalMs);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, kMaxPingStrikes);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, options.max_streams_per_connection);
  // Each open call holds a thread of the synchronous server: bound them, so that a flood
  // of calls is refused (RESOURCE_EXHAUSTED) instead of growing the process without end.
  const int64_t streams = options.limits.daemon[Resource::kStreams];
  const int max_threads =
      options.max_threads > 0
          ? options.max_threads
          : static_cast<int>(std::min<int64_t>(streams == TenantQuota::kUnlimited ? 4096 : streams,
                                               1 << 20) + 256);
  grpc::ResourceQuota quota("kvferryd");
  quota.SetMaxThreads(max_threads);
  builder.SetResourceQuota(quota);
  if (!options.auth_tokens_file.empty()) builder.SetOption(std::make_unique<WithoutReflection>());
  builder.AddListeningPort(options.listen, *credentials, &d->grpc_port_);
  builder.RegisterService(d->service_.get());
  builder.RegisterService(d->session_service_.get());
  builder.RegisterService(d->cache_service_.get());
  builder.RegisterService(d->transfer_service_.get());
  builder.RegisterService(d->peer_service_.get());
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<MetricsInterceptorFactory>(
      d->daemon_metrics_.get(), MetricsInterceptorFactory::KnownMethods(
                                  {"kvferry.v1.KvFerry", "kvferry.v1.KvSession", "kvferry.v1.KvCache",
                                   "kvferry.v1.Transfer", "kvferry.v1.Peer"})));
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
                             tls ? HttpsSetup(options.tls) : nullptr,
                             HttpOptions{options.http_threads, options.http_read_timeout_seconds});
    if (!m.ok()) {
      d->Shutdown(0);
      return m.status();
    }
    d->metrics_ = std::move(*m);
  }
  if (options.malloc_trim_seconds > 0) {
    d->trimmer_ = std::make_unique<MemoryTrimmer>(absl::Seconds(options.malloc_trim_seconds));
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
    // Event subscriptions and sessions would otherwise run until the grace period cancels
    // them (a subscriber that does not read blocks its handler in Write).
    if (cache_) cache_->events().Close();
    if (watchdog_) watchdog_->CancelLongLived();
    server_->Shutdown(std::chrono::system_clock::now() +
                      std::chrono::milliseconds(static_cast<int64_t>(grace_seconds * 1000)));
    server_->Wait();
  }
  metrics_.reset();
  trimmer_.reset();
  if (pools_) pools_->Clear();
}

Daemon::~Daemon() { Shutdown(0); }

}  // namespace kvferry::server
