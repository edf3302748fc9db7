// The gRPC face of the pools (kvferry.v1.KvFerry): thin handlers that convert the request,
// call the core, and map its status once. Message chunking of reads happens here.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>

#include "core/pool_manager.h"
#include "core/session.h"
#include "core/staged_write.h"
#include "core/tenant.h"
#include "security/authenticator.h"
#include "service/stream_watchdog.h"
#include "kvferry/v1/kvferry.grpc.pb.h"

namespace kvferry::server {

struct ServiceOptions {
  int64_t default_chunk_bytes = 1 << 20;  // read stream pieces when the request says 0
  int64_t max_chunk_bytes = 1 << 20;      // a request asking for more gets this
  WriteLimits write_limits;               // per WriteTokens / WritePages call
  int64_t max_pages_per_call = 65536;     // AllocatePages count: its reply must fit a message
  int64_t max_page_size = 1000;           // pools per ListPools / GetStats reply
  StreamLimits stream_limits;             // idle timeout and longest duration of a stream
  std::function<void(ErrorReason)> on_stream_expired;  // each stream the limits ended (metrics)
  // The daemon's one watchdog, shared by its services (outlives them); null: a service
  // makes its own from stream_limits.
  StreamWatchdog* watchdog = nullptr;
};

// Every handler first asks `auth` who calls: a call it refuses does nothing else. The
// caller's tenant is the owner of the pools it names; streaming calls also hold one of its
// `streams` while open.
class KvFerryService final : public kvferry::v1::KvFerry::Service {
 public:
  // Every caller is the one default tenant. `sessions` may be null (no session-owned pages).
  KvFerryService(PoolManager* pools, SessionManager* sessions, ServiceOptions options);
  // `auth` outlives the service.
  KvFerryService(PoolManager* pools, SessionManager* sessions, ServiceOptions options,
                 const Authenticator* auth);

  grpc::Status CreatePool(grpc::ServerContext*, const v1::CreatePoolRequest*, v1::Pool*) override;
  grpc::Status DescribePool(grpc::ServerContext*, const v1::DescribePoolRequest*,
                            v1::Pool*) override;
  grpc::Status ListPools(grpc::ServerContext*, const v1::ListPoolsRequest*,
                         v1::ListPoolsResponse*) override;
  grpc::Status DeletePool(grpc::ServerContext*, const v1::DeletePoolRequest*,
                          v1::DeletePoolResponse*) override;
  grpc::Status AllocatePages(grpc::ServerContext*, const v1::AllocatePagesRequest*,
                             v1::AllocatePagesResponse*) override;
  grpc::Status FreePages(grpc::ServerContext*, const v1::FreePagesRequest*,
                         v1::FreePagesResponse*) override;
  grpc::Status RenewPages(grpc::ServerContext*, const v1::RenewPagesRequest*,
                          v1::RenewPagesResponse*) override;
  grpc::Status WriteTokens(grpc::ServerContext*, grpc::ServerReader<v1::WriteTokensRequest>*,
                           v1::WriteResponse*) override;
  grpc::Status WritePages(grpc::ServerContext*, grpc::ServerReader<v1::WritePagesRequest>*,
                          v1::WriteResponse*) override;
  grpc::Status ReadPages(grpc::ServerContext*, const v1::ReadPagesRequest*,
                         grpc::ServerWriter<v1::PageChunk>*) override;
  grpc::Status ReadWorkspace(grpc::ServerContext*, const v1::ReadWorkspaceRequest*,
                             grpc::ServerWriter<v1::WorkspaceChunk>*) override;
  grpc::Status GetStats(grpc::ServerContext*, const v1::GetStatsRequest*, v1::Stats*) override;

 private:
  int64_t ChunkBytes(uint32_t requested) const;
  // Authenticates, runs `body(tenant)`, maps its status once.
  template <typename Body>
  grpc::Status Handle(grpc::ServerContext* context, Body&& body) const;
  // A stream: also holds a stream slot and runs `body(tenant, watch)` under the watchdog.
  template <typename Body>
  grpc::Status HandleStream(grpc::ServerContext* context, Body&& body) const;
  // The page of `pools` (sorted by name) that `page_token` and `page_size` ask for; sets
  // `*next_token`.
  absl::StatusOr<std::vector<PoolStats>> Page(std::vector<PoolStats> pools, uint32_t page_size,
                                              const std::string& page_token,
                                              std::string* next_token) const;

  PoolManager* const pools_;
  SessionManager* const sessions_;
  const ServiceOptions options_;
  std::unique_ptr<Authenticator> default_auth_;  // when constructed without one
  const Authenticator* auth_;
  std::unique_ptr<StreamWatchdog> own_watchdog_;
  StreamWatchdog* watchdog_;
};

}  // namespace kvferry::server
