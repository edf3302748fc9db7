// Push and Pull between daemons: gRPC for the agreement, UCX for the bytes.
#include "service/transfer_service.h"

#include <sys/stat.h>


#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <limits>
#include <mutex>
#include <thread>

#include "absl/container/flat_hash_set.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/errors.h"
#include "common/files.h"
#include "common/log.h"
#include "kvferry/kernels/status_macros.h"
#include "kvferry/thread_name.h"
#include "security/peer_secret.h"
#include "service/convert.h"
#include "service/status.h"

namespace kvferry::server {
namespace {

using Tenant = std::shared_ptr<TenantAccount>;
using PeerStream = grpc::ClientReaderWriter<v1::PeerMessage, v1::PeerMessage>;

constexpr int64_t kMaxMessageBytes = int64_t{64} << 20;
// The most UCX messages one transfer may take. The receiver posts a receive (and builds its
// pieces) for each, on its lane's progress thread, before it answers: an offer of tiny
// messages must not make it post millions. A sender makes its messages large enough.
constexpr int64_t kMaxMessagesPerTransfer = int64_t{1} << 16;
static_assert(kMaxMessagesPerTransfer <= (int64_t{1} << kUcxTagIndexBits));

double Seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The UCX lanes an offer's sender has: 0 (a sender that says nothing of lanes) is 1, and
// no more than any daemon can have.
int OfferedLanes(const v1::PeerOffer& offer) {
  return static_cast<int>(std::clamp<uint32_t>(offer.lanes(), 1, kMaxUcxLanes));
}

absl::Status PeerUnavailable(absl::string_view what) {
  return Error(absl::StatusCode::kUnavailable, ErrorReason::kPeerUnavailable, what);
}

// The status a peer's stream ended with, its reason read back from the trailer. A stream
// our own timer cancelled, or one that broke, is the peer's unavailability.
absl::Status FromPeer(const grpc::Status& status, const grpc::ClientContext& context,
                      bool timed_out, absl::string_view peer) {
  if (status.ok()) return absl::OkStatus();
  if (timed_out) {
    return PeerUnavailable(absl::StrCat("peer ", peer, " did not answer in time"));
  }
  const auto& trailers = context.GetServerTrailingMetadata();
  ErrorReason reason = ErrorReason::kUnspecified;
  if (auto it = trailers.find(kErrorReasonKey); it != trailers.end()) {
    reason = ReasonFromName(absl::string_view(it->second.data(), it->second.size()));
  }
  const auto code = static_cast<absl::StatusCode>(status.error_code());
  if (reason == ErrorReason::kUnspecified &&
      (code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kCancelled ||
       code == absl::StatusCode::kDeadlineExceeded || code == absl::StatusCode::kUnknown)) {
    return PeerUnavailable(absl::StrCat("peer ", peer, ": ", status.error_message()));
  }
  return Error(code, reason == ErrorReason::kUnspecified ? ReasonOf(absl::Status(code, "")) : reason,
               absl::StrCat("peer ", peer, ": ", status.error_message()));
}

// Cancels a client call unless disarmed within the time given: bounds every blocking read
// of a peer's stream. One thread watches every call of the process (looking every 50 ms
// while any exists, sleeping otherwise), so that a transfer starts no thread of its own and
// arming or disarming around each read or write is a store.
class Deadman {
 public:
  explicit Deadman(grpc::ClientContext* context) : context_(context) { Watcher().Add(this); }
  ~Deadman() { Watcher().Remove(this); }
  Deadman(const Deadman&) = delete;
  Deadman& operator=(const Deadman&) = delete;
  void Arm(absl::Duration d) { deadline_ns_.store(absl::ToUnixNanos(absl::Now() + d)); }
  void Disarm() { deadline_ns_.store(kNever); }
  bool fired() const { return fired_.load(); }

 private:
  static constexpr int64_t kNever = std::numeric_limits<int64_t>::max();

  class Watch {
   public:
    void Add(Deadman* d) {
      std::lock_guard lock(mu_);
      armed_.insert(d);
      if (!thread_.joinable()) {
        thread_ = std::thread([this] {
          NameThisThread("kvf-deadlines");
          Run();
        });
      }
      cv_.notify_all();
    }
    // Once it returns, the thread no longer looks at `d`.
    void Remove(Deadman* d) {
      std::lock_guard lock(mu_);
      armed_.erase(d);
    }

   private:
    [[noreturn]] void Run() {
      std::unique_lock lock(mu_);
      for (;;) {
        if (armed_.empty()) {
          cv_.wait(lock);
          continue;
        }
        const int64_t now = absl::ToUnixNanos(absl::Now());
        for (Deadman* d : armed_) {
          if (now >= d->deadline_ns_.load()) {
            d->deadline_ns_.store(kNever);
            d->fired_.store(true);
            d->context_->TryCancel();
          }
        }
        cv_.wait_for(lock, std::chrono::milliseconds(50));
      }
    }
    std::mutex mu_;
    std::condition_variable cv_;
    absl::flat_hash_set<Deadman*> armed_;
    std::thread thread_;
  };
  // Never destroyed: calls may end during the process's exit.
  static Watch& Watcher() {
    static Watch* const watch = new Watch;
    return *watch;
  }

  grpc::ClientContext* const context_;
  std::atomic<int64_t> deadline_ns_{kNever};
  std::atomic<bool> fired_{false};
};

// One call to a peer's Peer.Exchange, its reads bounded by the idle time.
class PeerCall {
 public:
  PeerCall(std::string peer, absl::Duration idle)
      : peer_(std::move(peer)), idle_(idle), deadman_(&context_) {}
  grpc::ClientContext& context() { return context_; }
  // Opening waits for the connection (a peer that accepts it and never speaks HTTP/2 holds
  // it): bounded like every other step.
  void Open(v1::Peer::Stub& stub) {
    deadman_.Arm(idle_);
    stream_ = stub.Exchange(&context_);
    deadman_.Disarm();
  }
  absl::Status Write(const v1::PeerMessage& m) {
    deadman_.Arm(idle_);
    const bool ok = stream_->Write(m);
    deadman_.Disarm();
    return ok ? absl::OkStatus() : Finish();
  }
  // The next message, which must be of `kind`.
  absl::StatusOr<v1::PeerMessage> Read(v1::PeerMessage::KindCase kind) {
    v1::PeerMessage m;
    deadman_.Arm(idle_);
    const bool ok = stream_->Read(&m);
    deadman_.Disarm();
    if (!ok) {
      absl::Status s = Finish();
      if (s.ok()) {
        s = PeerUnavailable(absl::StrCat("peer ", peer_, " ended the transfer early"));
      }
      return s;
    }
    if (m.kind_case() != kind) {
      Cancel();
      return Error(absl::StatusCode::kInternal, ErrorReason::kInternalError,
                   absl::StrCat("peer ", peer_, " answered out of turn (message ",
                                static_cast<int>(m.kind_case()), ")"));
    }
    return m;
  }
  absl::Status Finish() {
    if (finished_) return finish_status_;
    finished_ = true;
    stream_->WritesDone();
    deadman_.Arm(idle_);
    StopWatching();  // the peer ends its side once it read ours
    const grpc::Status s = stream_->Finish();
    deadman_.Disarm();
    finish_status_ = FromPeer(s, context_, deadman_.fired(), peer_);
    return finish_status_;
  }
  void Cancel() {
    context_.TryCancel();
    StopWatching();
    if (!finished_) {
      finished_ = true;
      stream_->Finish().IgnoreError();
    }
  }
  // For a side that then waits on UCX alone (a Pull's receiver, whose sender says nothing
  // more until the bytes are sent): a reader of the stream that returns only when the peer
  // ends it, so that a sender that failed is heard at once, with its reason (Finish), not
  // after the idle time. Nothing else reads the stream meanwhile.
  void WatchForEnd() {
    watcher_ = std::thread([this] {
      NameThisThread("kvf-peer-end");
      v1::PeerMessage ignored;
      while (stream_->Read(&ignored)) {
      }
      ended_ = true;
    });
  }
  bool ended() const { return ended_.load(); }
  ~PeerCall() {
    if (!finished_ && stream_ != nullptr) Cancel();
  }

 private:
  const std::string peer_;
  const absl::Duration idle_;
  grpc::ClientContext context_;
  Deadman deadman_;
  std::unique_ptr<PeerStream> stream_;
  bool finished_ = false;
  absl::Status finish_status_;
  std::thread watcher_;
  std::atomic<bool> ended_{false};

  void StopWatching() {
    if (watcher_.joinable()) watcher_.join();
  }
};

std::vector<int64_t> Layers(const google::protobuf::RepeatedField<uint32_t>& layers,
                            const Pool& pool) {
  std::vector<int64_t> out(layers.begin(), layers.end());
  if (out.empty()) {
    for (int64_t l = 0; l < pool.config().num_layers; ++l) out.push_back(l);
  }
  return out;
}

}  // namespace

// ---- the receiving side --------------------------------------------------------------------

class TransferEngine::Receiving {
 public:
  std::shared_ptr<StagedWrite> write;
  std::unique_ptr<UcxWorker::Receives> receives;
  int64_t bytes = 0;
  bool in_place = false;  // received straight into the pool
  int lanes = 1;          // the UCX lanes its messages come over
  absl::Duration settle;  // how long the end of a failed write in place is waited for

  // A write in place that did not commit zeroes what landed once UCX can write no more:
  // the receives are cancelled and each waited for (bounded by `settle`; a receive that
  // matched ends when its message is in or UCX gives its peer up), then the write is
  // dropped here, on the handler's thread, so the rollback runs before the caller is
  // answered and never on the UCX progress thread. Past the bound the write is left to the
  // last receive to end (it then zeroes and unpins on the UCX thread).
  ~Receiving() {
    if (write == nullptr || !write->in_place()) return;
    const bool ended = receives == nullptr || receives->Abandon(settle);
    receives.reset();
    if (!ended) {
      log::Warn("a failed transfer's receives did not end within {}: its pages are zeroed "
                "again and released when they do", absl::FormatDuration(settle));
    }
    write.reset();
  }
  int64_t message_bytes = 0;
  // Where its bytes land, for the log.
  const char* Path() const {
    if (in_place) return write->device_staging() ? " in place in device memory" : " in place";
    if (write->device_staging()) return " through device staging";
    if (write->mirrored()) return " through host staging, copied to the device as it arrived";
    return " through host staging";
  }
  // Waits for every message; a write mirrored to the device (host staging for a GPU pool)
  // starts each message's copy to the device as soon as it arrived.
  absl::Status Land(absl::Duration idle, const UcxWorker::CancelCheck& cancelled) {
    if (!write->mirrored()) return receives->Wait(idle, cancelled);
    for (;;) {
      KVF_ASSIGN_OR_RETURN(const std::vector<int64_t> arrived, receives->WaitArrived(idle, cancelled));
      if (arrived.empty()) return absl::OkStatus();
      for (const int64_t i : arrived) {
        const int64_t offset = i * message_bytes;
        KVF_RETURN_IF_ERROR(write->MirrorToDevice(offset, std::min(message_bytes, bytes - offset)));
      }
    }
  }
  // Waits for every message, then commits all pages or none.
  absl::StatusOr<int64_t> Finish(absl::Duration idle, const UcxWorker::CancelCheck& cancelled) {
    KVF_RETURN_IF_ERROR(Land(idle, cancelled));
    return Commit();
  }
  // Once every message arrived: all pages or none.
  absl::StatusOr<int64_t> Commit() {
    write->MarkReceived();
    return write->Commit();
  }
};

TransferEngine::TransferEngine(PoolManager* pools, UcxWorker* ucx, const Authenticator* auth,
                               WriteLimits write_limits, PeerOptions options,
                               std::function<void(const PeerTransferRecord&)> observer)
    : pools_(pools),
      ucx_(ucx),
      auth_(auth),
      write_limits_(write_limits),
      options_(std::move(options)),
      observer_(std::move(observer)) {
  kvferry::MutexLock lock(&mu_);
  RefreshCredentials();
}

namespace {

// What tells a file's content changed: device, inode, size and modification time ("" when
// it cannot be read; a rewrite renamed into place is a new inode).
std::string FileIdentity(const std::string& path) {
  struct stat st;
  if (path.empty() || stat(path.c_str(), &st) != 0) return "";
  return absl::StrCat(st.st_dev, ":", st.st_ino, ":", st.st_size, ":", st.st_mtim.tv_sec, ".",
                      st.st_mtim.tv_nsec);
}

}  // namespace

void TransferEngine::RefreshCredentials() {
  if (options_.tls_ca_file.empty()) {
    if (credentials_ == nullptr) credentials_ = grpc::InsecureChannelCredentials();
    return;
  }
  const std::string files = absl::StrCat(FileIdentity(options_.tls_ca_file), "|",
                                         FileIdentity(options_.tls_cert_file), "|",
                                         FileIdentity(options_.tls_key_file));
  if (credentials_ != nullptr && files == credentials_files_) return;
  credentials_files_ = files;
  grpc::SslCredentialsOptions ssl;
  const absl::Status read = [&]() -> absl::Status {
    KVF_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadFile(options_.tls_ca_file, "the peers' CA"));
    if (!options_.tls_cert_file.empty() && !options_.tls_key_file.empty()) {
      KVF_ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadFile(options_.tls_cert_file, "certificate"));
      KVF_ASSIGN_OR_RETURN(ssl.pem_private_key, ReadFile(options_.tls_key_file, "key"));
    }
    return absl::OkStatus();
  }();
  if (!read.ok() && credentials_ != nullptr) {
    // As for the token file: a rewrite that cannot be read leaves the credentials in force.
    log::Warn("peer TLS files changed but cannot be read ({}); the earlier ones stay",
              read.ToString());
    return;
  }
  credentials_status_ = read;
  if (!read.ok()) return;
  credentials_ = grpc::SslCredentials(ssl);
  channels_.clear();  // new connections use the new credentials; calls in flight keep theirs
}

absl::Status TransferEngine::CheckTransfers() const {
  if (ucx_ == nullptr) {
    return Error(absl::StatusCode::kFailedPrecondition, ErrorReason::kTransportUnavailable,
                 "this kvferryd runs without UCX (--ucx=false, or UCX could not start), so it "
                 "cannot move pages to or from another daemon");
  }
  if (options_.secret.empty() && options_.require_secret) {
    return Error(absl::StatusCode::kFailedPrecondition, ErrorReason::kPeerNotAuthenticated,
                 "this kvferryd authenticates its clients (--auth_tokens) but has no "
                 "--peer_secret_file, so it could not tell a daemon's UCX address from a forged "
                 "one: it moves no pages to or from another daemon");
  }
  return absl::OkStatus();
}

absl::Status TransferEngine::CheckReady(const v1::PeerOffer& offer, const v1::PeerReady& ready,
                                        std::span<const std::string> lane_addresses) const {
  if (options_.secret.empty()) return absl::OkStatus();  // a daemon that trusts its network
  if (ready.mac().empty()) {
    return Error(absl::StatusCode::kUnauthenticated, ErrorReason::kPeerNotAuthenticated,
                 "the receiving peer's ready carries no mac (it runs without "
                 "--peer_secret_file): nothing was sent to the address it gave");
  }
  if (!PeerReadyMacMatches(ready.mac(), options_.secret, offer.nonce(), ready.transfer_id(),
                           ready.worker_address(), ready.host(), ready.transport(),
                           lane_addresses)) {
    return Error(absl::StatusCode::kUnauthenticated, ErrorReason::kPeerNotAuthenticated,
                 "the receiving peer's ready carries a wrong mac (another --peer_secret_file, or "
                 "not a daemon of this deployment): nothing was sent to the address it gave");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> TransferEngine::Channel(const std::string& address) {
  if (address.empty()) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                 "the peer's address is empty; give host:port of its gRPC listener");
  }
  kvferry::MutexLock lock(&mu_);
  RefreshCredentials();
  KVF_RETURN_IF_ERROR(credentials_status_);
  auto it = channels_.find(address);
  if (it == channels_.end()) {
    it = channels_.emplace(address, grpc::CreateCustomChannel(
                                        address, credentials_,
                                        PeerChannelArguments(options_.timeout_seconds)))
             .first;
  }
  return it->second;
}

absl::Status TransferEngine::AddToken(grpc::ClientContext& context) const {
  if (options_.token_file.empty()) return absl::OkStatus();
  KVF_ASSIGN_OR_RETURN(std::string token, ReadFile(options_.token_file, "the peer token file"));
  context.AddMetadata("authorization",
                      absl::StrCat("Bearer ", absl::StripAsciiWhitespace(token)));
  return absl::OkStatus();
}

void TransferEngine::Record(const char* op, const std::string& peer, bool sent, uint64_t bytes,
                            double seconds, const absl::Status& status) const {
  if (!status.ok()) {
    log::Info("transfer op={} peer={} failed: {}", op, log::Quoted(peer), status.ToString());
  }
  if (observer_) observer_(PeerTransferRecord{op, peer, sent, bytes, seconds, status});
}

bool TransferEngine::InUcxDeviceMemory(Pool& pool) const {
  return ucx_ != nullptr && pool.backend().device() == ucx_->device_memory();
}

bool TransferEngine::UcxMovesMemoryOf(Pool& pool, const std::string& peer_host) const {
  return InUcxDeviceMemory(pool) &&
         ucx_->DeviceMemoryTo(!peer_host.empty() && peer_host == ucx_->host());
}

bool TransferEngine::SendsFromDevice(Pool& pool, const v1::PeerReady& ready) const {
  return ready.device_memory() && UcxMovesMemoryOf(pool, ready.host());
}

absl::StatusOr<std::unique_ptr<Reader>> TransferEngine::Offer(
    const std::shared_ptr<Pool>& pool, std::span<const PageHandle> pages,
    const google::protobuf::RepeatedField<uint32_t>& layer_list, v1::Layout transcode_to,
    const std::string& peer_host, v1::PeerOffer* offer) {
  KVF_ASSIGN_OR_RETURN(const std::optional<Layout> transcode, TranscodeFromProto(transcode_to));
  const std::vector<int64_t> layers = Layers(layer_list, *pool);
  const int64_t page_bytes = OutputPageBytes(*pool, transcode);
  const bool device = UcxMovesMemoryOf(*pool, peer_host);
  const int64_t message_bytes = device ? options_.device_message_bytes : options_.message_bytes;
  const int64_t units = static_cast<int64_t>(pages.size() * layers.size());
  const int64_t per_message =
      std::max({int64_t{1}, std::min(message_bytes, kMaxMessageBytes) / page_bytes,
                (units + kMaxMessagesPerTransfer - 1) / kMaxMessagesPerTransfer});
  KVF_ASSIGN_OR_RETURN(std::unique_ptr<Reader> reader,
                       server::ReadPages(pool, pages, layers, transcode, per_message * page_bytes));
  for (int64_t l : layers) offer->add_layers(static_cast<uint32_t>(l));
  offer->set_layout(ToProto(transcode.value_or(pool->config().layout)));
  offer->set_page_bytes(static_cast<uint64_t>(page_bytes));
  offer->set_message_bytes(static_cast<uint64_t>(per_message * page_bytes));
  offer->set_units(static_cast<uint64_t>(units));
  offer->set_host(ucx_->host());
  offer->set_device_memory(InUcxDeviceMemory(*pool));
  // Bytes UCX moves in device memory (cuda_ipc, GPUDirect RDMA) are copied by the GPU, not
  // by a thread per connection: one lane. Host memory and host staging take every lane.
  const int lanes = device ? 1 : ucx_->lanes();
  offer->set_lanes(static_cast<uint32_t>(lanes));
  KVF_ASSIGN_OR_RETURN(std::string nonce, PeerNonce());
  offer->set_nonce(std::move(nonce));
  // The first batch is gathered while the receiver reserves its pages, into the memory this
  // offer is for (SendAll launches the batch again if the ready says otherwise).
  PrepareSend(*reader, device, lanes);
  return reader;
}

absl::StatusOr<std::unique_ptr<TransferEngine::Receiving>> TransferEngine::Receive(
    const std::shared_ptr<Pool>& pool, std::span<const PageHandle> pages,
    const v1::PeerOffer& offer, v1::PeerReady* ready) {
  KVF_ASSIGN_OR_RETURN(const Layout layout, FromProto(offer.layout()));
  const std::vector<int64_t> layers(offer.layers().begin(), offer.layers().end());
  const uint64_t m = offer.message_bytes();
  if (offer.units() != pages.size() * layers.size() || offer.page_bytes() == 0 || m == 0 ||
      m % offer.page_bytes() != 0 || m > static_cast<uint64_t>(kMaxMessageBytes)) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                 absl::StrCat("the offer does not fit: ", offer.units(), " units for ",
                              pages.size(), " pages x ", layers.size(), " layers, messages of ",
                              m, " bytes, pages of ", offer.page_bytes()));
  }
  // Staging in pieces of one message each, so that every message lands in one contiguous
  // buffer (UCX moves contiguous receives zero-copy; an I/O vector falls back to copies).
  // A host memory pool whose pages hold nothing yet receives in place instead (an I/O vector
  // over the pool's pages): no staging to fault in, no copy at the commit. So does a pool in
  // device memory (below) where each message lands in one run of its pages: no device
  // staging to hold the transfer twice, no scatter at the commit.
  // A GPU pool whose memory UCX moves itself from this sender, whose pages are in device
  // memory too, is staged in device memory (host bytes into device memory would take UCX's
  // slow pipeline on one lane; host staging copies them to the device as they arrive).
  // Staging pieces no larger than the whole transfer (the quota is charged for the bytes
  // sent, so a small transfer with large messages must not take a large piece); units is
  // pages x layers here, so the product cannot overflow. ForPages rounds a piece to whole
  // pages, at least one.
  const int64_t page_bytes = pool->geometry().page_bytes();
  const int64_t piece = static_cast<int64_t>(
      std::min<uint64_t>(m, offer.units() * static_cast<uint64_t>(page_bytes)));
  KVF_ASSIGN_OR_RETURN(std::unique_ptr<StagedWrite> write,
                       StagedWrite::ForPages(pool, layout, write_limits_, piece,
                                             offer.device_memory() &&
                                                 UcxMovesMemoryOf(*pool, offer.host())));
  if (offer.page_bytes() != static_cast<uint64_t>(page_bytes)) {
    return Error(absl::StatusCode::kFailedPrecondition, ErrorReason::kLayoutMismatch,
                 absl::StrCat("the source's pages are ", offer.page_bytes(), " bytes, pool '",
                              pool->config().name, "' has pages of ", page_bytes,
                              " bytes (another page size)"));
  }
  KVF_RETURN_IF_ERROR(
      write->ReservePages(pages, layers, /*in_place=*/true, static_cast<int64_t>(m)));
  auto r = std::make_unique<Receiving>();
  r->write = std::move(write);
  r->settle = idle();
  r->in_place = r->write->in_place();
  r->bytes = static_cast<int64_t>(offer.units()) * page_bytes;
  const int64_t message_bytes = static_cast<int64_t>(m);
  r->message_bytes = message_bytes;
  // ReservePages bounded bytes by the write limits, so the count cannot overflow.
  const int64_t count = (r->bytes + message_bytes - 1) / message_bytes;
  if (count > kMaxMessagesPerTransfer) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                 absl::StrCat("the offer's messages of ", message_bytes, " bytes make ", count,
                              " messages, more than the ", kMaxMessagesPerTransfer,
                              " one transfer may take"));
  }
  // A GPU pool staged on the host: each message goes on to the device as it arrives.
  KVF_RETURN_IF_ERROR(r->write->PrepareDeviceMirror().status());
  std::vector<std::vector<std::span<uint8_t>>> messages;
  std::vector<MemoryBlock> blocks;  // registered once each, reused by later transfers
  messages.reserve(static_cast<size_t>(count));
  blocks.reserve(static_cast<size_t>(count));
  for (int64_t at = 0; at < r->bytes; at += message_bytes) {
    messages.push_back(r->write->StagingPieces(at, std::min(message_bytes, r->bytes - at)));
    blocks.push_back(r->write->StagingBlock(at));
  }
  absl::BitGen random;
  const uint64_t id = absl::Uniform<uint64_t>(random, 1, uint64_t{1} << 40);
  const bool on_device = r->write->device_staging();
  // As many lanes as both sides have (message i on lane i % lanes, on both).
  const int lanes = on_device ? 1 : std::min(OfferedLanes(offer), ucx_->lanes());
  r->lanes = lanes;
  KVF_ASSIGN_OR_RETURN(r->receives,
                       ucx_->PostReceives(UcxTag(id, 0), std::move(messages), r->write,
                                          on_device, std::move(blocks), lanes));
  log::Debug("transfer {}: receiving {} bytes{} on {} lane(s)", id, r->bytes, r->Path(), lanes);
  ready->set_worker_address(ucx_->address());
  const std::span<const std::string> lane_addresses =
      std::span(ucx_->addresses()).subspan(1, static_cast<size_t>(lanes - 1));
  for (const std::string& address : lane_addresses) ready->add_lane_addresses(address);
  ready->set_host(ucx_->host());
  ready->set_device_memory(on_device);
  ready->set_transfer_id(id);
  ready->set_transport(ucx_->transports());
  if (!options_.secret.empty()) {
    ready->set_mac(PeerReadyMac(options_.secret, offer.nonce(), id, ready->worker_address(),
                                ready->host(), ready->transport(), lane_addresses));
  }
  return r;
}

absl::Status TransferEngine::SendAll(std::unique_ptr<Reader> owned, const v1::PeerOffer& offer,
                                     const v1::PeerReady& ready, bool on_device,
                                     const UcxWorker::CancelCheck& cancelled) {
  // UCX trusts a worker address fully (a forged one crashes the process unpacking it): only
  // an address the ready proves is a daemon's is connected to.
  // Lane j of this daemon to the receiver's lane j; never more lanes than were offered.
  std::vector<std::string> addresses = {ready.worker_address()};
  addresses.insert(addresses.end(), ready.lane_addresses().begin(), ready.lane_addresses().end());
  KVF_RETURN_IF_ERROR(CheckReady(offer, ready, std::span(addresses).subspan(1)));
  if (addresses.size() > static_cast<size_t>(OfferedLanes(offer))) {
    return Error(absl::StatusCode::kInternal, ErrorReason::kInternalError,
                 absl::StrCat("the receiving peer answered with ", addresses.size(),
                              " UCX lanes, more than the ", offer.lanes(),
                              " offered: nothing was sent"));
  }
  KVF_ASSIGN_OR_RETURN(std::unique_ptr<UcxWorker::Sender> sender, ucx_->Connect(addresses));
  Reader& reader = *owned;
  // Batches in memory at once. The call that returns batch i launches batch i+1 into the
  // slot of batch i+1-depth, so message i+1-depth must be complete before it, and message i
  // is posted only after it returns. At depth 2 that left the wire empty while a batch was
  // gathered: message i-1 complete, the gather of i+1 (on the cpu backend it runs inside
  // the call), then message i posted — each message cost its gather plus its wire time, and
  // UCX's rendezvous handshake of each message waited for the one before. At depth 3
  // message i-1 is still on the wire while batch i+1 is gathered, and two messages are in
  // flight (bench/RESULTS.md). --peer_send_depth sets it (--peer_device_send_depth for
  // batches left in device memory).
  // A first batch prefetched for other memory launches again; then the depth follows the
  // lanes the receiver agreed to (the offer's lanes keep the prefetched batch otherwise).
  PrepareSend(reader, on_device,
              on_device == reader.device_output() ? OfferedLanes(offer)
                                                  : static_cast<int>(addresses.size()));
  const int kDepth = reader.depth();
  const uint64_t total = offer.units() * offer.page_bytes();
  uint64_t sent = 0;
  auto fail = [&](absl::Status s) {
    // The batch in flight on the device ends and its pages are unpinned now; the batches'
    // memory stays with the sender until UCX can read it no more (the peer may only be slow
    // or frozen: its endpoint is closed once it answers, not by force under its feet).
    sender->Abandon(reader.TakeMemory());
    sender.reset();
    return s;
  };
  int64_t i = 0;
  for (;; ++i) {
    if (i + 1 - kDepth >= 0) {
      if (absl::Status s = sender->WaitThrough(i + 2 - kDepth, idle(), cancelled); !s.ok()) {
        return fail(s);
      }
    }
    absl::StatusOr<std::span<const uint8_t>> batch = reader.Next();
    if (!batch.ok()) return fail(batch.status());
    if (batch->empty()) break;
    const uint64_t expected = std::min<uint64_t>(offer.message_bytes(), total - sent);
    if (batch->size() != expected) {
      return fail(Error(absl::StatusCode::kInternal, ErrorReason::kInternalError,
                        absl::StrCat("batch ", i, " has ", batch->size(), " bytes, expected ",
                                     expected)));
    }
    if (absl::Status s = sender->Post(UcxTag(ready.transfer_id(), static_cast<uint64_t>(i)),
                                      *batch, reader.device_output(), reader.last_block());
        !s.ok()) {
      return fail(s);
    }
    sent += batch->size();
  }
  if (absl::Status s = sender->WaitThrough(i, idle(), cancelled); !s.ok()) return fail(s);
  return absl::OkStatus();
}

void TransferEngine::PrepareSend(Reader& reader, bool on_device, int lanes) const {
  // Host batches: depth - 1 messages in flight on each lane (the receiver may answer with
  // fewer lanes than this daemon has: deeper than needed then, never too shallow). Device
  // batches are few and large (device memory): at least one in flight per lane.
  reader.set_depth(on_device ? std::max(options_.device_send_depth, lanes + 1)
                             : std::min(64, 1 + (options_.send_depth - 1) * lanes));
  reader.set_device_output(on_device);
}

std::string TransferEngine::LastHostOf(const std::string& address) {
  kvferry::MutexLock lock(&mu_);
  auto it = peer_hosts_.find(address);
  return it == peer_hosts_.end() ? std::string() : it->second;
}

// ---- the three entry points ----------------------------------------------------------------

absl::Status TransferEngine::Push(const TenantAccount& tenant, const v1::PushRequest& req,
                                  grpc::ServerContext& context, v1::TransferPagesResponse* out) {
  KVF_RETURN_IF_ERROR(CheckTransfers());
  KVF_ASSIGN_OR_RETURN(const std::shared_ptr<Pool> pool, pools_->Get(tenant, req.pool()));
  using Clock = std::chrono::steady_clock;
  const Clock::time_point t0 = Clock::now();
  KVF_ASSIGN_OR_RETURN(const std::vector<PageHandle> pages,
                       PagesFromProto(req.pages(), req.has_page_list(), req.page_list(), "source"));
  KVF_ASSIGN_OR_RETURN(const std::vector<PageHandle> to_pages,
                       PagesFromProto(req.to_pages(), req.has_to_page_list(), req.to_page_list(),
                                      "destination"));
  if (to_pages.size() != pages.size()) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                 absl::StrCat(pages.size(), " source pages but ", to_pages.size(),
                              " destination pages; name one destination page per source page"));
  }
  // The peer's host as its last ready said (none yet: another host, until it answers).
  const std::string peer_host = LastHostOf(req.to_address());
  v1::PeerMessage offer;
  KVF_ASSIGN_OR_RETURN(std::unique_ptr<Reader> reader,
                       Offer(pool, pages, req.layers(), req.transcode_to(), peer_host,
                             offer.mutable_offer()));
  const Clock::time_point offered = Clock::now();
  bool from_device = false;
  Clock::time_point got_ready = offered, sent_all = offered;
  offer.mutable_offer()->set_pool(req.to_pool());
  PackPages(to_pages, offer.mutable_offer()->mutable_page_list());
  KVF_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, Channel(req.to_address()));
  v1::Peer::Stub stub(channel);
  const double start = Seconds();
  uint64_t bytes = 0;
  absl::Status status = [&]() -> absl::Status {
    PeerCall call(req.to_address(), idle());
    KVF_RETURN_IF_ERROR(AddToken(call.context()));
    call.Open(stub);
    KVF_RETURN_IF_ERROR(call.Write(offer));
    // The first batch, gathered while the peer reserves its pages (Offer prepared it).
    if (absl::Status s = reader->Prefetch(); !s.ok()) {
      call.Cancel();
      return s;
    }
    KVF_ASSIGN_OR_RETURN(const v1::PeerMessage ready, call.Read(v1::PeerMessage::kReady));
    got_ready = Clock::now();
    from_device = SendsFromDevice(*pool, ready.ready());
    absl::Status sent = SendAll(std::move(reader), offer.offer(), ready.ready(), from_device,
                                [&] { return context.IsCancelled(); });
    sent_all = Clock::now();
    if (!sent.ok()) {
      call.Cancel();
      return sent;
    }
    {
      kvferry::MutexLock lock(&mu_);
      peer_hosts_[req.to_address()] = ready.ready().host();
    }
    bytes = offer.offer().units() * offer.offer().page_bytes();
    KVF_ASSIGN_OR_RETURN(const v1::PeerMessage done, call.Read(v1::PeerMessage::kDone));
    KVF_RETURN_IF_ERROR(call.Finish());
    out->set_pages(done.done().pages());
    out->set_transport(ready.ready().transport());
    return absl::OkStatus();
  }();
  const double seconds = Seconds() - start;
  const Clock::time_point end = Clock::now();
  log::Debug("push of {} bytes{}: {:.3f} ms (offer {:.3f}, until ready {:.3f}, sending {:.3f}, "
             "until done {:.3f})",
             bytes, from_device ? " from device memory" : "", log::Millis(t0, end), log::Millis(t0, offered), log::Millis(offered, got_ready),
             log::Millis(got_ready, sent_all), log::Millis(sent_all, end));
  Record("push", req.to_address(), true, bytes, seconds, status);
  KVF_RETURN_IF_ERROR(status);
  out->set_bytes(bytes);
  out->set_seconds(seconds);
  return absl::OkStatus();
}

absl::Status TransferEngine::Pull(const TenantAccount& tenant, const v1::PullRequest& req,
                                  grpc::ServerContext& context, v1::TransferPagesResponse* out) {
  KVF_RETURN_IF_ERROR(CheckTransfers());
  KVF_ASSIGN_OR_RETURN(const std::shared_ptr<Pool> pool, pools_->Get(tenant, req.pool()));
  KVF_ASSIGN_OR_RETURN(const std::vector<PageHandle> from_pages,
                       PagesFromProto(req.from_pages(), req.has_from_page_list(),
                                      req.from_page_list(), "source"));
  KVF_ASSIGN_OR_RETURN(const std::vector<PageHandle> pages,
                       PagesFromProto(req.pages(), req.has_page_list(), req.page_list(),
                                      "destination"));
  if (pages.size() != from_pages.size()) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                 absl::StrCat(from_pages.size(), " source pages but ", pages.size(),
                              " destination pages; name one destination page per source page"));
  }
  // The destination's handles are checked before the peer is asked for anything.
  KVF_RETURN_IF_ERROR(pool->table().CheckHandles(pages));
  KVF_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, Channel(req.from_address()));
  v1::Peer::Stub stub(channel);
  const double start = Seconds();
  uint64_t bytes = 0;
  absl::Status status = [&]() -> absl::Status {
    PeerCall call(req.from_address(), idle());
    KVF_RETURN_IF_ERROR(AddToken(call.context()));
    call.Open(stub);
    v1::PeerMessage request;
    v1::PeerRequest& r = *request.mutable_request();
    r.set_pool(req.from_pool());
    PackPages(from_pages, r.mutable_page_list());
    *r.mutable_layers() = req.layers();
    r.set_transcode_to(req.transcode_to());
    r.set_num_destination_pages(pages.size());
    r.set_host(ucx_->host());
    KVF_RETURN_IF_ERROR(call.Write(request));
    KVF_ASSIGN_OR_RETURN(const v1::PeerMessage offer, call.Read(v1::PeerMessage::kOffer));
    // Each listed layer lands in the same layer here: a source that offers other layers
    // than the request listed is refused before anything is reserved.
    if (req.layers_size() > 0 &&
        !std::equal(req.layers().begin(), req.layers().end(), offer.offer().layers().begin(),
                    offer.offer().layers().end())) {
      call.Cancel();
      return Error(absl::StatusCode::kInternal, ErrorReason::kInternalError,
                   absl::StrCat("the source offered layers [",
                                absl::StrJoin(offer.offer().layers(), ","),
                                "] for the layers asked for, [", absl::StrJoin(req.layers(), ","),
                                "]: refused"));
    }
    v1::PeerMessage ready;
    absl::StatusOr<std::unique_ptr<Receiving>> receiving =
        Receive(pool, pages, offer.offer(), ready.mutable_ready());
    if (!receiving.ok()) {
      call.Cancel();
      return receiving.status();
    }
    KVF_RETURN_IF_ERROR(call.Write(ready));
    call.WatchForEnd();
    bool sender_ended = false;  // the wait stopped because the sender's stream ended
    absl::StatusOr<int64_t> committed = (*receiving)->Finish(idle(), [&] {
      if (context.IsCancelled()) return true;
      sender_ended = call.ended();
      return sender_ended;
    });
    if (!committed.ok()) {
      if (sender_ended) {
        // The sender gave up: its reason, not this side's wait.
        const absl::Status sender = call.Finish();
        return sender.ok() ? PeerUnavailable(absl::StrCat("peer ", req.from_address(),
                                                          " ended the transfer before every page was sent"))
                           : sender;
      }
      call.Cancel();
      return committed.status();
    }
    bytes = static_cast<uint64_t>((*receiving)->bytes);
    log::Debug("pull received: {} bytes{}; {} lane(s)", bytes, (*receiving)->Path(),
               (*receiving)->lanes);
    v1::PeerMessage done;
    done.mutable_done()->set_pages(static_cast<uint64_t>(*committed));
    // The pages are committed: the peer only learns that it may stop waiting.
    call.Write(done).IgnoreError();
    call.Finish().IgnoreError();
    out->set_pages(static_cast<uint64_t>(*committed));
    out->set_transport(ucx_->transports());
    return absl::OkStatus();
  }();
  const double seconds = Seconds() - start;
  Record("pull", req.from_address(), false, bytes, seconds, status);
  KVF_RETURN_IF_ERROR(status);
  out->set_bytes(bytes);
  out->set_seconds(seconds);
  return absl::OkStatus();
}

absl::Status TransferEngine::Serve(
    const TenantAccount& tenant, grpc::ServerContext& context,
    grpc::ServerReaderWriter<v1::PeerMessage, v1::PeerMessage>* stream,
    const std::function<void()>& progress) {
  KVF_RETURN_IF_ERROR(CheckTransfers());
  const std::string peer = context.peer();
  const double start = Seconds();
  v1::PeerMessage first;
  if (!stream->Read(&first)) {
    return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                 "the transfer stream ended before its first message");
  }
  progress();
  // Polled while bytes move (each wait bounded by the peer timeout).
  auto cancelled = [&] {
    progress();
    return context.IsCancelled();
  };
  if (first.has_offer()) {
    // Push: this daemon receives.
    const v1::PeerOffer& offer = first.offer();
    uint64_t bytes = 0;
    absl::Status status = [&]() -> absl::Status {
      KVF_ASSIGN_OR_RETURN(const std::shared_ptr<Pool> pool, pools_->Get(tenant, offer.pool()));
      KVF_ASSIGN_OR_RETURN(const std::vector<PageHandle> pages,
                           PagesFromProto(offer.pages(), offer.has_page_list(),
                                          offer.page_list(), "destination"));
      v1::PeerMessage ready;
      using Clock = std::chrono::steady_clock;
      const Clock::time_point t0 = Clock::now();
      KVF_ASSIGN_OR_RETURN(std::unique_ptr<Receiving> receiving,
                           Receive(pool, pages, offer, ready.mutable_ready()));
      const Clock::time_point posted = Clock::now();
      if (!stream->Write(ready)) {
        return PeerUnavailable("the sending peer left before the transfer started");
      }
      KVF_RETURN_IF_ERROR(receiving->Land(idle(), cancelled));
      // A sender that gave up (its caller told the transfer failed) may still have had its
      // bytes delivered, when this daemon was only slow or frozen: they are not committed.
      if (context.IsCancelled()) {
        return PeerUnavailable("the sending peer ended the transfer before every page landed");
      }
      const Clock::time_point received = Clock::now();
      KVF_ASSIGN_OR_RETURN(const int64_t committed, receiving->Commit());
      log::Debug("push received: {} bytes{}, {:.3f} ms (staging and receives posted {:.3f}, "
                 "bytes {:.3f}, commit {:.3f}; {} lane(s))",
                 receiving->bytes, receiving->Path(), log::Millis(t0, Clock::now()),
                 log::Millis(t0, posted),
                 log::Millis(posted, received), log::Millis(received, Clock::now()),
                 receiving->lanes);
      bytes = static_cast<uint64_t>(receiving->bytes);
      v1::PeerMessage done;
      done.mutable_done()->set_pages(static_cast<uint64_t>(committed));
      // The last message: it goes out with the call's status, one write instead of two
      // before the sender can answer its caller.
      stream->Write(done, grpc::WriteOptions().set_last_message());
      return absl::OkStatus();
    }();
    Record("push", peer, false, bytes, Seconds() - start, status);
    return status;
  }
  if (first.has_request()) {
    // Pull: this daemon sends.
    const v1::PeerRequest& request = first.request();
    uint64_t bytes = 0;
    absl::Status status = [&]() -> absl::Status {
      KVF_ASSIGN_OR_RETURN(const std::shared_ptr<Pool> pool, pools_->Get(tenant, request.pool()));
      KVF_ASSIGN_OR_RETURN(const std::vector<PageHandle> pages,
                           PagesFromProto(request.pages(), request.has_page_list(),
                                          request.page_list(), "source"));
      if (request.num_destination_pages() != pages.size()) {
        return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
                     "source and destination page counts differ");
      }
      v1::PeerMessage offer;
      KVF_ASSIGN_OR_RETURN(std::unique_ptr<Reader> reader,
                           Offer(pool, pages, request.layers(), request.transcode_to(),
                                 request.host(), offer.mutable_offer()));
      if (!stream->Write(offer)) return PeerUnavailable("the receiving peer left");
      // The first batch, gathered while the receiver reserves its pages (Offer prepared it).
      KVF_RETURN_IF_ERROR(reader->Prefetch());
      v1::PeerMessage ready;
      if (!stream->Read(&ready) || !ready.has_ready()) {
        return PeerUnavailable("the receiving peer refused or left before it was ready");
      }
      KVF_RETURN_IF_ERROR(SendAll(std::move(reader), offer.offer(), ready.ready(),
                                  SendsFromDevice(*pool, ready.ready()), cancelled));
      bytes = offer.offer().units() * offer.offer().page_bytes();
      v1::PeerMessage done;
      stream->Read(&done);  // the receiver's commit (or its end)
      return absl::OkStatus();
    }();
    Record("pull", peer, true, bytes, Seconds() - start, status);
    return status;
  }
  return Error(absl::StatusCode::kInvalidArgument, ErrorReason::kInvalidRequest,
               "a transfer starts with an offer or a request");
}

// ---- gRPC faces ----------------------------------------------------------------------------

namespace {

template <typename Body>
grpc::Status Handle(const Authenticator& auth, grpc::ServerContext* context, Body&& body) {
  absl::StatusOr<std::shared_ptr<TenantAccount>> tenant = auth.Authenticate(*context);
  if (!tenant.ok()) return ToGrpcStatus(context, tenant.status());
  return ToGrpcStatus(context, body(**tenant));
}

}  // namespace

grpc::Status TransferService::Push(grpc::ServerContext* context, const v1::PushRequest* req,
                                   v1::TransferPagesResponse* out) {
  return Handle(*engine_->auth(), context, [&](const TenantAccount& tenant) {
    return engine_->Push(tenant, *req, *context, out);
  });
}

grpc::Status TransferService::Pull(grpc::ServerContext* context, const v1::PullRequest* req,
                                   v1::TransferPagesResponse* out) {
  return Handle(*engine_->auth(), context, [&](const TenantAccount& tenant) {
    return engine_->Pull(tenant, *req, *context, out);
  });
}

grpc::Status PeerService::Exchange(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<v1::PeerMessage, v1::PeerMessage>* stream) {
  absl::StatusOr<std::shared_ptr<TenantAccount>> tenant = engine_->auth()->Authenticate(*context);
  if (!tenant.ok()) return ToGrpcStatus(context, tenant.status());
  const absl::Status status =
      RunStream(*watchdog_, context, *tenant, [&](StreamWatchdog::Watch& watch) {
        return engine_->Serve(**tenant, *context, stream, [&] { watch.Touch(); });
      });
  return ToGrpcStatus(context, status);
}

}  // namespace kvferry::server
