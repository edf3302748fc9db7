// The gRPC face of the KV cache (kvferry.v1.KvCache): thin handlers over the core's
// BlockIndex and BlockPut; pools are resolved through the PoolManager, as the caller's.
#pragma once

#include <grpcpp/grpcpp.h>

#include "core/block_index.h"
#include "core/pool_manager.h"
#include "security/authenticator.h"
#include "service/pool_service.h"
#include "kvferry/v1/cache.grpc.pb.h"

namespace kvferry::server {

class KvCacheService final : public kvferry::v1::KvCache::Service {
 public:
  // Everything passed outlives the service.
  KvCacheService(PoolManager* pools, BlockIndex* index, ServiceOptions options,
                 const Authenticator* auth)
      : pools_(pools), index_(index), options_(options), auth_(auth),
        own_watchdog_(OwnWatchdog(options_)),
        watchdog_(options_.watchdog != nullptr ? options_.watchdog : own_watchdog_.get()) {}

  grpc::Status CreateNamespace(grpc::ServerContext*, const v1::CreateNamespaceRequest*,
                               v1::Namespace*) override;
  grpc::Status DescribeNamespace(grpc::ServerContext*, const v1::DescribeNamespaceRequest*,
                                 v1::Namespace*) override;
  grpc::Status DeleteNamespace(grpc::ServerContext*, const v1::DeleteNamespaceRequest*,
                               v1::DeleteNamespaceResponse*) override;
  grpc::Status PutRows(grpc::ServerContext*, grpc::ServerReader<v1::PutRowsRequest>*,
                       v1::PutResponse*) override;
  grpc::Status PutPages(grpc::ServerContext*, grpc::ServerReader<v1::PutPagesRequest>*,
                        v1::PutResponse*) override;
  grpc::Status Lookup(grpc::ServerContext*, const v1::LookupRequest*,
                      v1::LookupResponse*) override;
  grpc::Status ReleaseLease(grpc::ServerContext*, const v1::ReleaseLeaseRequest*,
                            v1::ReleaseLeaseResponse*) override;
  grpc::Status LoadRows(grpc::ServerContext*, const v1::LoadRowsRequest*,
                        grpc::ServerWriter<v1::WorkspaceChunk>*) override;
  grpc::Status LoadPages(grpc::ServerContext*, const v1::LoadPagesRequest*,
                         grpc::ServerWriter<v1::PageChunk>*) override;
  grpc::Status SubscribeEvents(grpc::ServerContext*, const v1::SubscribeEventsRequest*,
                               grpc::ServerWriter<v1::EventBatch>*) override;
  grpc::Status Snapshot(grpc::ServerContext*, const v1::SnapshotRequest*,
                        grpc::ServerWriter<v1::SnapshotChunk>*) override;

 private:
  // Authenticates, runs `body(tenant)`, maps its status once (stream: holds a stream slot
  // and runs `body(tenant, watch)` under the watchdog).
  template <typename Body>
  grpc::Status Handle(grpc::ServerContext* context, Body&& body) const;
  template <typename Body>
  grpc::Status HandleStream(grpc::ServerContext* context, Body&& body) const;
  int64_t ChunkBytes(uint32_t requested) const;

  PoolManager* const pools_;
  BlockIndex* const index_;
  const ServiceOptions options_;
  const Authenticator* const auth_;
  std::unique_ptr<StreamWatchdog> own_watchdog_;
  StreamWatchdog* const watchdog_;
};

}  // namespace kvferry::server
