// The metrics interceptor of kvferryd's gRPC server.
#include "service/metrics_interceptor.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>

#include <chrono>

#include "common/log.h"
#include "service/status.h"

namespace kvferry::server {
namespace {

using grpc::experimental::InterceptionHookPoints;

class MetricsInterceptor final : public grpc::experimental::Interceptor {
 public:
  MetricsInterceptor(std::string method, bool protobuf_messages, DaemonMetrics* metrics)
      : metrics_(metrics),
        method_(std::move(method)),
        protobuf_(protobuf_messages),
        start_(std::chrono::steady_clock::now()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (protobuf_ && methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE)) {
      if (const void* m = methods->GetRecvMessage(); m != nullptr) {
        received_ += static_cast<const google::protobuf::Message*>(m)->ByteSizeLong();
      }
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_MESSAGE)) {
      if (const grpc::ByteBuffer* b = methods->GetSerializedSendMessage(); b != nullptr) {
        sent_ += b->Length();
      } else if (const void* m = methods->GetSendMessage(); protobuf_ && m != nullptr) {
        sent_ += static_cast<const google::protobuf::Message*>(m)->ByteSizeLong();
      }
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status status = methods->GetSendStatus();
      std::string reason;
      if (!status.ok()) {
        if (auto* trailers = methods->GetSendTrailingMetadata(); trailers != nullptr) {
          if (auto it = trailers->find(kErrorReasonKey); it != trailers->end()) reason = it->second;
        }
      }
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
      metrics_->RecordRpc(method_, CodeName(status.error_code()), reason, seconds);
      metrics_->RecordBytes(method_, received_, sent_);
      if (!status.ok()) {
        log::Debug("rpc failed method={} code={} reason={} message={}", method_,
                   CodeName(status.error_code()), reason, log::Quoted(status.error_message()));
      }
    }
    methods->Proceed();
  }

 private:
  DaemonMetrics* const metrics_;
  const std::string method_;
  const bool protobuf_;
  const std::chrono::steady_clock::time_point start_;
  uint64_t received_ = 0, sent_ = 0;
};

}  // namespace

grpc::experimental::Interceptor* MetricsInterceptorFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  const std::string full = info->method() == nullptr ? "" : info->method();
  auto it = known_.find(full);
  if (it == known_.end()) return new MetricsInterceptor("unknown", false, metrics_);
  return new MetricsInterceptor(full.substr(full.rfind('/') + 1), it->second, metrics_);
}

absl::flat_hash_map<std::string, bool> MetricsInterceptorFactory::KnownMethods(
    std::initializer_list<const char*> own_services) {
  absl::flat_hash_map<std::string, bool> known;
  for (const char* name : own_services) {
    const google::protobuf::ServiceDescriptor* service =
        google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(name);
    if (service == nullptr) continue;
    for (int i = 0; i < service->method_count(); ++i) {
      known["/" + service->full_name() + "/" + service->method(i)->name()] = true;
    }
  }
  known["/grpc.health.v1.Health/Check"] = false;
  known["/grpc.health.v1.Health/Watch"] = false;
  known["/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"] = false;
  return known;
}

}  // namespace kvferry::server
