// The gRPC face of CUDA IPC sessions (kvferry.v1.KvSession): thin handlers over the core's
// SessionManager.
#pragma once

#include <grpcpp/grpcpp.h>

#include "core/session.h"
#include "security/authenticator.h"
#include "kvferry/v1/session.grpc.pb.h"

namespace kvferry::server {

class SessionService final : public kvferry::v1::KvSession::Service {
 public:
  // `auth` (who is calling) outlives the service.
  SessionService(SessionManager* sessions, const Authenticator* auth)
      : sessions_(sessions), auth_(auth) {}

  grpc::Status OpenSession(
      grpc::ServerContext*,
      grpc::ServerReaderWriter<v1::SessionEvent, v1::SessionRequest>* stream) override;
  grpc::Status RegisterKv(grpc::ServerContext*, const v1::RegisterKvRequest*,
                          v1::RegisterKvResponse*) override;
  grpc::Status Save(grpc::ServerContext*, const v1::SaveRequest*, v1::TransferResponse*) override;
  grpc::Status Load(grpc::ServerContext*, const v1::LoadRequest*, v1::TransferResponse*) override;
  grpc::Status MapPool(grpc::ServerContext*, const v1::MapPoolRequest*,
                       v1::MapPoolResponse*) override;
  grpc::Status UnmapPool(grpc::ServerContext*, const v1::UnmapPoolRequest*,
                         v1::UnmapPoolResponse*) override;

 private:
  // Authenticates, runs `body(tenant)`, maps its status once.
  template <typename Body>
  grpc::Status Handle(grpc::ServerContext* context, Body&& body) const;

  SessionManager* const sessions_;
  const Authenticator* const auth_;
};

}  // namespace kvferry::server
