// Counts every RPC (method, status code, reason, latency, message bytes) into DaemonMetrics.
//
// Method labels come from a fixed set (the methods the daemon serves); any other method a
// client names is counted as "unknown", so clients cannot grow the label set. Messages are
// read as protobuf messages only for the daemon's own services: others (the built-in health
// service) pass raw byte buffers.
#pragma once

#include <grpcpp/support/server_interceptor.h>

#include <string>

#include "absl/container/flat_hash_map.h"
#include "metrics/metrics.h"

namespace kvferry::server {

class MetricsInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  // `known`: full method name ("/kvferry.v1.KvFerry/ReadPages") → whether its messages are
  // protobuf messages the interceptor may read.
  MetricsInterceptorFactory(DaemonMetrics* metrics, absl::flat_hash_map<std::string, bool> known)
      : metrics_(metrics), known_(std::move(known)) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override;

  // The known methods of the daemon's generated services (by service full name), plus the
  // health and reflection services.
  static absl::flat_hash_map<std::string, bool> KnownMethods(
      std::initializer_list<const char*> own_services);

 private:
  DaemonMetrics* const metrics_;
  const absl::flat_hash_map<std::string, bool> known_;
};

}  // namespace kvferry::server
