// Pages between daemons (kvferry.v1.Transfer for clients, kvferry.v1.Peer between daemons):
// gRPC agrees on a transfer, UCX (transport/ucx_worker.h) moves its bytes.
//
// The side that receives the bytes stages them whole (a StagedWrite of pages, with its
// checks), posts one UCX receive per message into that staging, and commits once every
// message arrived: all pages or none. The side that sends reads its pages as a page Reader
// does for ReadPages (pinned, checked, transcoded on the way when asked), one message per
// batch, so gathering the next batch overlaps sending this one.
#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <span>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "kvferry/mutex.h"
#include "core/pool_manager.h"
#include "core/reader.h"
#include "core/staged_write.h"
#include "security/authenticator.h"
#include "transport/ucx_worker.h"
#include "service/peer_channel.h"
#include "service/stream_watchdog.h"
#include "kvferry/v1/transfer.grpc.pb.h"

namespace kvferry::server {

struct PeerOptions {
  // A transfer fails UNAVAILABLE (PEER_UNAVAILABLE) when the peer moves nothing (no message
  // completes, no reply) for this long; with the commit that follows, a dead peer is
  // reported within twice this.
  double timeout_seconds = 5;
  // The bearer token this daemon presents to peers (a file holding it); empty: none.
  std::string token_file;
  // Peers are reached over TLS when set: their certificate must be signed by this CA; the
  // daemon's own certificate and key (when set) are offered for mutual TLS. Like the token
  // file, these are read again when they change (rotation needs no restart).
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  // Bytes per UCX message (rounded down to whole pages, at least one page).
  int64_t message_bytes = int64_t{8} << 20;
  // Batches of a transfer the sender holds at once: while one is gathered, depth - 1
  // messages are in flight (at least 2).
  int send_depth = 3;
  // The same for pages UCX moves in device memory (cuda_ipc, GPUDirect RDMA): there each
  // message costs a rendezvous of a few hundred microseconds whatever its size, so fewer,
  // larger messages move faster (bench/RESULTS.md). Used for a pool whose memory this
  // daemon's UCX may hand to some peer directly.
  int64_t device_message_bytes = int64_t{32} << 20;
  int device_send_depth = 4;
  // The file holding the secret the daemons of the deployment share (security/peer_secret.h);
  // the daemon reads it into `secret` at start. A sender connects only to a UCX address
  // whose ready proves it. Empty: no proof asked or given, and with `require_secret` (a
  // daemon that authenticates its clients) no transfers at all.
  std::string secret_file;
  std::string secret;
  bool require_secret = false;
};

// One finished transfer, for the metrics.
struct PeerTransferRecord {
  const char* op;          // "push" or "pull"
  std::string peer;        // the peer's gRPC address, as the client named it
  bool sent;               // this daemon sent the bytes (else received them)
  uint64_t bytes = 0;
  double seconds = 0;
  absl::Status status;
};

class TransferEngine {
 public:
  // `ucx` may be null (UCX off): every transfer is then FAILED_PRECONDITION
  // (TRANSPORT_UNAVAILABLE). All pointers outlive the engine.
  TransferEngine(PoolManager* pools, UcxWorker* ucx, const Authenticator* auth,
                 WriteLimits write_limits, PeerOptions options,
                 std::function<void(const PeerTransferRecord&)> observer);

  absl::Status Push(const TenantAccount& tenant, const v1::PushRequest& req, grpc::ServerContext& context,
                    v1::TransferPagesResponse* out);
  absl::Status Pull(const TenantAccount& tenant, const v1::PullRequest& req, grpc::ServerContext& context,
                    v1::TransferPagesResponse* out);
  // A peer's side of its transfer: the receiver of a Push, the sender of a Pull.
  // `progress` is told whenever the transfer is alive (the stream watchdog's sign).
  absl::Status Serve(const TenantAccount& tenant, grpc::ServerContext& context,
                     grpc::ServerReaderWriter<v1::PeerMessage, v1::PeerMessage>* stream,
                     const std::function<void()>& progress = [] {});

  const Authenticator* auth() const { return auth_; }

 private:
  class Receiving;
  // FAILED_PRECONDITION unless this daemon moves pages between daemons (UCX on, and a peer
  // secret where clients authenticate).
  absl::Status CheckTransfers() const;
  // Sender: UNAUTHENTICATED unless `ready` carries the mac of this offer's nonce and its
  // fields (its lane addresses: `lane_addresses`) under the peer secret (nothing is checked
  // without a secret).
  absl::Status CheckReady(const v1::PeerOffer& offer, const v1::PeerReady& ready,
                          std::span<const std::string> lane_addresses) const;
  absl::StatusOr<std::shared_ptr<grpc::Channel>> Channel(const std::string& address);
  absl::Status AddToken(grpc::ClientContext& context) const;
  // Receiver: stages the offered pages and posts the receives; fills `ready`.
  absl::StatusOr<std::unique_ptr<Receiving>> Receive(const std::shared_ptr<Pool>& pool,
                                                     std::span<const PageHandle> pages,
                                                     const v1::PeerOffer& offer,
                                                     v1::PeerReady* ready);
  // Whether `pool` is in the GPU memory this daemon's UCX was given (it may move it).
  bool InUcxDeviceMemory(Pool& pool) const;
  // Whether UCX moves `pool`'s memory itself to or from the peer on `peer_host` (a GPU pool
  // on the device UCX was given, and a transport that reaches that peer without the host:
  // UcxWorker::DeviceMemoryTo). Where both sides' pools are such, the bytes are sent from
  // and received into device memory, with no copy through the host (PeerOffer and
  // PeerReady.device_memory tell the other side).
  bool UcxMovesMemoryOf(Pool& pool, const std::string& peer_host) const;
  // Sender: whether `pool`'s bytes go out of device memory, for a receiver that answered
  // `ready` (it takes them into device memory, and UCX moves the pool's memory to its host).
  bool SendsFromDevice(Pool& pool, const v1::PeerReady& ready) const;
  // Sender: a reader of the pages and the offer that describes its bytes, for a receiver
  // on `peer_host` (as best known; empty: another host). Where UCX moves the pool's device
  // memory to that host, the offer asks for device-sized messages on one lane; otherwise
  // (host memory, host staging) for host-sized messages on every lane this daemon has. The
  // reader is prepared for that memory and those lanes (PrepareSend).
  absl::StatusOr<std::unique_ptr<Reader>> Offer(const std::shared_ptr<Pool>& pool,
                                                std::span<const PageHandle> pages,
                                                const google::protobuf::RepeatedField<uint32_t>& layers,
                                                v1::Layout transcode_to,
                                                const std::string& peer_host,
                                                v1::PeerOffer* offer);
  // Sender: every batch of `reader` as one message to the receiver named by `ready`, from
  // device memory when `on_device`.
  absl::Status SendAll(std::unique_ptr<Reader> reader, const v1::PeerOffer& offer,
                       const v1::PeerReady& ready, bool on_device,
                       const UcxWorker::CancelCheck& cancelled);
  // Sender: the reader's depth and output memory for a transfer from `on_device` memory
  // over the lanes it offered.
  void PrepareSend(Reader& reader, bool on_device, int lanes) const;
  // Sender: the host of the peer at `address` as its last ready said (empty: none yet).
  std::string LastHostOf(const std::string& address);
  absl::Duration idle() const { return absl::Seconds(options_.timeout_seconds); }
  void Record(const char* op, const std::string& peer, bool sent, uint64_t bytes, double seconds,
              const absl::Status& status) const;

  PoolManager* const pools_;
  UcxWorker* const ucx_;
  const Authenticator* const auth_;
  const WriteLimits write_limits_;
  const PeerOptions options_;
  const std::function<void(const PeerTransferRecord&)> observer_;
  // The peer credentials from the CA, certificate and key files as they are now: read again
  // (and every channel made anew) when one of the files changed since the last transfer.
  void RefreshCredentials() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  kvferry::Mutex mu_;
  std::string credentials_files_ ABSL_GUARDED_BY(mu_);  // their identity when last read
  std::shared_ptr<grpc::ChannelCredentials> credentials_ ABSL_GUARDED_BY(mu_);
  absl::Status credentials_status_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(mu_);
  // Each peer's host as its last ready said, by gRPC address (LastHostOf).
  absl::flat_hash_map<std::string, std::string> peer_hosts_ ABSL_GUARDED_BY(mu_);
};

class TransferService final : public v1::Transfer::Service {
 public:
  explicit TransferService(TransferEngine* engine) : engine_(engine) {}
  grpc::Status Push(grpc::ServerContext*, const v1::PushRequest*,
                    v1::TransferPagesResponse*) override;
  grpc::Status Pull(grpc::ServerContext*, const v1::PullRequest*,
                    v1::TransferPagesResponse*) override;

 private:
  TransferEngine* const engine_;
};

// A peer's stream holds one of its tenant's streams and is bound by the stream watchdog
// (a caller that opens it and says nothing is cancelled at the idle timeout).
class PeerService final : public v1::Peer::Service {
 public:
  PeerService(TransferEngine* engine, StreamWatchdog* watchdog)
      : engine_(engine), watchdog_(watchdog) {}
  grpc::Status Exchange(grpc::ServerContext*,
                        grpc::ServerReaderWriter<v1::PeerMessage, v1::PeerMessage>*) override;

 private:
  TransferEngine* const engine_;
  StreamWatchdog* const watchdog_;
};

}  // namespace kvferry::server
