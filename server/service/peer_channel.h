// The keepalive policy of kvferryd's gRPC connections, both ends: what its server accepts
// from any client, and what its own channels to peer daemons send.
#pragma once

#include <grpcpp/grpcpp.h>

#include <algorithm>

namespace kvferry::server {

// The server: keepalive pings from a client no more often than this while no data flows;
// each one sooner is a strike, and past kMaxPingStrikes the server closes the connection
// (GOAWAY "too_many_pings"), failing every call on it.
inline constexpr int kMinRecvPingIntervalMs = 5000;
inline constexpr int kMaxPingStrikes = 2;

// A channel to a peer daemon (`timeout_seconds`: the peer timeout). Its keepalive pings find
// a dead peer while the stream is quiet (a transfer's bytes move over UCX, not gRPC), but
// never more often than the peer's server accepts: twice its interval, so that timer jitter
// cannot make a strike. Every wait on the stream is bounded by the peer timeout anyway, and
// UCX reports a dead peer of a transfer under way.
inline grpc::ChannelArguments PeerChannelArguments(double timeout_seconds) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(4 << 20);
  const int keepalive_ms =
      std::max(2 * kMinRecvPingIntervalMs, static_cast<int>(timeout_seconds * 500));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, keepalive_ms);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
              static_cast<int>(std::max(1000.0, timeout_seconds * 500)));
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  return args;
}

}  // namespace kvferry::server
