// The gRPC face of CUDA IPC sessions (kvferry.v1.KvSession): thin handlers over the core's
// SessionManager.
#pragma once

#include <grpcpp/grpcpp.h>

#include "core/block_index.h"
#include "core/session.h"
#include "security/authenticator.h"
#include "service/stream_watchdog.h"
#include "kvferry/v1/session.grpc.pb.h"

namespace kvferry::server {

class SessionService final : public kvferry::v1::KvSession::Service {
 public:
  // `auth` (who is calling) and `watchdog` outlive the service. A session stream holds one
  // of its tenant's streams while open; until its `open` message it is bound by the
  // watchdog's idle timeout, then it is long-lived (keepalive finds a dead worker).
  // `cache` serves Save and Load by key.
  SessionService(SessionManager* sessions, BlockIndex* cache, const Authenticator* auth,
                 StreamWatchdog* watchdog)
      : sessions_(sessions), cache_(cache), auth_(auth), watchdog_(watchdog) {}

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
  // An opened session's life on its stream: the `opened` event, revocations, until the
  // worker closes or goes away; then the session is closed.
  void Serve(const SessionManager::Opened& opened, const v1::SessionOpen& open,
             grpc::ServerContext* context,
             grpc::ServerReaderWriter<v1::SessionEvent, v1::SessionRequest>* stream);

  SessionManager* const sessions_;
  BlockIndex* const cache_;
  const Authenticator* const auth_;
  StreamWatchdog* const watchdog_;
};

}  // namespace kvferry::server
