// The UCX data plane of one daemon: a UCX context and its workers ("lanes"), each driven by
// its own progress thread that sleeps on the worker's event fd when idle (never a spinning
// core).
//
// Lanes: a transfer may spread its messages over several workers, message i on lane
// i % lanes, each lane its own connection to the peer's lane of the same number. Over TCP
// one connection moves its bytes through one thread's socket copies on each side, so one
// lane tops out near one core's copy rate; several lanes move a transfer on several cores
// at once (bench/RESULTS.md). One lane is the single-worker data plane.
//
// Bytes move as tagged messages: the receiving daemon posts one receive per message into
// its staging (an I/O vector over the staging's pieces) before the sender sends, so every
// message lands where it was expected and nothing waits in UCX's unexpected queue. Tagged
// receives rather than remote puts because a receive can be cancelled: when a transfer is
// abandoned, the receiver cancels what has not matched and keeps the staging alive until
// UCX has completed every receive it posted, so a late message can never land in memory
// that was freed (a put into freed staging cannot be stopped on tcp or shared memory). On
// RDMA transports large messages still move zero-copy (UCX's rendezvous protocol).
//
// Endpoints are created with peer error handling: a peer that dies completes every
// request to it with an error. Every UCX call on a worker runs on its lane's progress
// thread; the public methods are thread-safe and block the caller, never those threads.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "backend/backend.h"

struct ucp_context;

namespace kvferry::server {

// Registrations. A request may name the block (MemoryBlock: an allocation its backend keeps
// and reuses — a staging chunk, a read slot, a host memory pool) that its bytes lie in. UCX
// registers a block once, at its first use (ucp_mem_map), and every later request in it
// passes that registration instead of looking one up; it lasts until the backend frees the
// block (it tells release_listener()) or the worker ends. Without a block UCX registers per
// request, through its own registration cache.

struct UcxOptions {
  // UCX_TLS for this daemon's context ("tcp", "sm", "rc,sm,self", ...); empty: UCX's own
  // choice (or the UCX_TLS environment variable).
  std::string transports;
  // UCX_NET_DEVICES: the network devices peers reach this daemon on ("eth0", "mlx5_0:1",
  // a comma-separated list); empty: every device UCX finds.
  std::string net_devices;
  // The GPU ("cuda:N") whose memory may be handed to UCX directly when this UCX moves CUDA
  // memory (a build with its CUDA transports: cuda_copy, cuda_ipc, RDMA with GPUDirect);
  // empty: none, every byte goes through host memory. `bind_device` runs first on the
  // progress thread, where every UCX call runs: it makes that GPU's context current there.
  std::string device;
  std::function<void()> bind_device;
  // UCX_KEEPALIVE_INTERVAL: how often an endpoint checks its peer (UCX's own default, 20 s,
  // when zero or when the environment sets it). A receive whose sender gave up mid-message
  // ends only when its endpoint is found dead, and until then holds the pages it lands in.
  absl::Duration keepalive = absl::ZeroDuration();
  // How long an abandoned transfer's endpoint waits for its messages in flight to end before
  // it is closed by force (Sender::Abandon); zero: 5 s.
  absl::Duration abandon_grace = absl::ZeroDuration();
  // Workers, each with its progress thread, that a transfer's messages spread over (1 to
  // kMaxUcxLanes); 0: one per 8 cores this process may use, 1 to 4 (UcxAutoLanes).
  int lanes = 1;
};

inline constexpr int kMaxUcxLanes = 16;
// The lanes of UcxOptions::lanes = 0 for a process that may use `cores` cores: one lane per
// 8, at least 1 and at most 4 (each lane's thread copies a connection's bytes on its own
// core at busy times, beside the daemon's other work).
inline int UcxAutoLanes(int cores) { return std::clamp(cores / 8, 1, 4); }

class UcxWorker {
 public:
  // UNAVAILABLE when UCX cannot start (no usable transport).
  static absl::StatusOr<std::unique_ptr<UcxWorker>> Create(const UcxOptions& options);
  ~UcxWorker();
  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;

  // The address of lane 0's worker, as a peer connects to it (opaque bytes).
  const std::string& address() const { return addresses_.front(); }
  // Every lane's worker address, lane 0 first.
  const std::vector<std::string>& addresses() const { return addresses_; }
  int lanes() const { return static_cast<int>(addresses_.size()); }
  // The transports this context was asked for ("default" when UCX chose).
  const std::string& transports() const { return transports_; }
  // The GPU whose memory UCX moves directly ("cuda:N"), or "" when UCX reports no CUDA
  // memory support (Debian's UCX has none) or no device was given.
  const std::string& device_memory() const { return device_memory_; }
  // Whether device memory is worth handing to UCX for a peer: only where a transport moves
  // it without the host — cuda_ipc to a daemon on the same host, RDMA with GPUDirect (a NIC
  // that registers GPU memory) to others. Otherwise UCX would pipeline it through host
  // fragments of its own (cuda_copy over tcp: 0.45 GB/s on the H200 host, where host
  // staging moves 3 GB/s), so the caller stages through the host itself.
  bool DeviceMemoryTo(bool same_host) const {
    return !device_memory_.empty() && (same_host ? cuda_ipc_ : gpudirect_rdma_);
  }
  bool DeviceMemoryToAnyPeer() const { return DeviceMemoryTo(true) || DeviceMemoryTo(false); }
  // This host, as peers compare it: the kernel's boot id (daemons on one machine, in
  // containers or not, share it).
  const std::string& host() const { return host_; }

  // Polled while a caller waits: true ends the wait with CANCELLED.
  using CancelCheck = std::function<bool()>;

  // Receives posted for one transfer. Destroying it cancels what has not completed; the
  // memory stays alive (through the keep-alive given to PostReceives) until UCX has
  // completed every receive.
  class Receives {
   public:
    virtual ~Receives() = default;
    // Blocks until every message arrived (OK), a receive failed, `idle` passed without a
    // message completing (UNAVAILABLE, PEER_UNAVAILABLE), or `cancelled` said so.
    virtual absl::Status Wait(absl::Duration idle, const CancelCheck& cancelled) = 0;
    // Blocks until a message not yet reported here has arrived whole, and returns the index
    // of every such message, in the order they arrived; empty once every message arrived and
    // was reported. Failures as Wait's. (For a receiver that uses each message as it lands.)
    virtual absl::StatusOr<std::vector<int64_t>> WaitArrived(absl::Duration idle,
                                                             const CancelCheck& cancelled) = 0;
    // Cancels the receives that have not matched and waits up to `bound` until UCX has
    // ended every receive, so that none can write any more: true when they all ended. (A
    // receive that matched ends when its message is in or its peer is given up.)
    virtual bool Abandon(absl::Duration bound) = 0;
  };
  // Posts receive i of `messages` (the pieces message i fills, in order) under tag
  // tag_base + i, on lane i % `lanes` (1 to lanes()); `keep_alive` owns the memory and is
  // released once no receive can write. `on_device`: the pieces are memory of
  // device_memory()'s GPU. `blocks`: empty, or for each message the block its (single) piece
  // lies in.
  absl::StatusOr<std::unique_ptr<Receives>> PostReceives(
      uint64_t tag_base, std::vector<std::vector<std::span<uint8_t>>> messages,
      std::shared_ptr<void> keep_alive, bool on_device = false, std::vector<MemoryBlock> blocks = {},
      int lanes = 1);

  // A connection to a peer's workers for one transfer.
  class Sender {
   public:
    virtual ~Sender() = default;
    // Posts `data` as the message `tag` on lane n % lanes: the n-th Post of this sender is
    // message n of WaitThrough. `data` must stay valid until WaitThrough says its message completed (or,
    // after a failure, as Abandon says). A failure (here or in WaitThrough) is UNAVAILABLE
    // (PEER_UNAVAILABLE) when the peer failed or nothing completed for the idle time; the
    // owner then abandons the transfer. `on_device`: `data` is memory of device_memory()'s
    // GPU; `block`: the block `data` lies in.
    virtual absl::Status Post(uint64_t tag, std::span<const uint8_t> data,
                              bool on_device = false, MemoryBlock block = {}) = 0;
    // Blocks until the first `messages` posted are complete (failure rules as Post).
    virtual absl::Status WaitThrough(int64_t messages, absl::Duration idle,
                                     const CancelCheck& cancelled) = 0;
    // Ends a transfer that failed or was given up, without waiting: its endpoint takes no
    // more transfers, and `memory` (what the messages still in flight lie in) is kept until
    // UCX can read it no more. The endpoint (which every transfer to the peer shares) closes
    // once the other transfers already on it have ended and those messages have (a peer that
    // was only slow or frozen gets them when it answers again and finds its transfer ended),
    // or by force when, the others ended, the peer stays silent for
    // UcxOptions::abandon_grace after the last abandonment. An owner that does not call it
    // before ending the sender has its endpoint closed by force and the messages waited for.
    virtual void Abandon(std::shared_ptr<void> memory) = 0;
  };
  // To be told of every block a backend frees (Backend::set_release_listener): the block's
  // registration is released before its memory.
  std::shared_ptr<ReleaseListener> release_listener() const;
  // Blocks registered now, and their bytes.
  struct Registrations {
    int64_t blocks = 0;
    uint64_t bytes = 0;
  };
  Registrations registrations() const;

  // Endpoints from lane j to the peer's worker at `addresses[j]` (at most lanes() of them;
  // each cached per address while it works).
  absl::StatusOr<std::unique_ptr<Sender>> Connect(const std::vector<std::string>& addresses);
  absl::StatusOr<std::unique_ptr<Sender>> Connect(const std::string& address) {
    return Connect(std::vector<std::string>{address});
  }

  struct State;  // one lane's, shared with the UCX callbacks
  class Registry;

 private:
  UcxWorker() = default;
  static void Loop(State& st);

  ucp_context* context_ = nullptr;
  std::vector<std::shared_ptr<State>> lanes_;
  std::shared_ptr<Registry> registry_;
  std::vector<std::string> addresses_;
  std::string transports_;
  std::string device_memory_;
  bool cuda_ipc_ = false;
  bool gpudirect_rdma_ = false;
  std::string host_;
  std::vector<std::thread> threads_;
};

// The tag of message `index` of transfer `transfer`: 40 bits of transfer id, 24 of index.
inline constexpr int kUcxTagIndexBits = 24;
inline uint64_t UcxTag(uint64_t transfer, uint64_t index) {
  return (transfer << kUcxTagIndexBits) | index;
}

}  // namespace kvferry::server
