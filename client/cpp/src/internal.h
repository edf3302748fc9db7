// Pieces the client's sources share: status and message conversion.
#pragma once

#include <grpcpp/grpcpp.h>

#include <span>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "kvferry/client/client.h"
#include "kvferry/v1/kvferry.pb.h"

// Returns a non-OK absl::Status from the enclosing function (the client has no dependency
// on the daemon's status macros).
#define KVF_CLIENT_RETURN(expr)                                  \
  do {                                                           \
    if (absl::Status _kvf_s = (expr); !_kvf_s.ok()) return _kvf_s; \
  } while (false)

namespace kvferry::client::internal {


inline constexpr char kReasonPayload[] = "kvferry.dev/error-reason";
inline constexpr char kReasonTrailer[] = "kvferry-error-reason";
inline constexpr int kRowValues = 512;
inline constexpr int kRowBytes = kRowValues * 2;

inline v1::Layout ToProto(Layout layout) {
  switch (layout) {
    case Layout::kV4: return v1::LAYOUT_V4;
    case Layout::kV41: return v1::LAYOUT_V41;
    case Layout::kV41Fp4: return v1::LAYOUT_V41_FP4;
  }
  return v1::LAYOUT_UNSPECIFIED;
}

inline Layout FromProto(v1::Layout layout) {
  switch (layout) {
    case v1::LAYOUT_V41: return Layout::kV41;
    case v1::LAYOUT_V41_FP4: return Layout::kV41Fp4;
    default: return Layout::kV4;
  }
}

inline void ToProto(const PageHandle& h, v1::PageHandle* out) {
  out->set_page_id(h.page_id);
  out->set_generation(h.generation);
}

// Page handles packed (PageList): a transfer names thousands of pages, which parse and are
// checked far faster so than as PageHandle messages.
inline void Pack(std::span<const PageHandle> pages, v1::PageList* out) {
  out->mutable_page_ids()->Reserve(static_cast<int>(pages.size()));
  out->mutable_generations()->Reserve(static_cast<int>(pages.size()));
  for (const PageHandle& h : pages) {
    out->add_page_ids(h.page_id);
    out->add_generations(h.generation);
  }
}

inline PoolInfo FromProto(const v1::Pool& p) {
  PoolInfo info;
  info.spec = PoolSpec{p.name(), FromProto(p.layout()), p.page_size(), p.num_pages(),
                       p.num_layers(), p.device()};
  info.pool_id = p.pool_id();
  info.page_bytes = p.page_bytes();
  info.pool_bytes = p.pool_bytes();
  info.pages_used = p.pages_used();
  info.pages_free = p.pages_free();
  info.tokens_held = p.tokens_held();
  return info;
}

inline absl::StatusCode ToAbslCode(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK: return absl::StatusCode::kOk;
    case grpc::StatusCode::CANCELLED: return absl::StatusCode::kCancelled;
    case grpc::StatusCode::UNKNOWN: return absl::StatusCode::kUnknown;
    case grpc::StatusCode::INVALID_ARGUMENT: return absl::StatusCode::kInvalidArgument;
    case grpc::StatusCode::DEADLINE_EXCEEDED: return absl::StatusCode::kDeadlineExceeded;
    case grpc::StatusCode::NOT_FOUND: return absl::StatusCode::kNotFound;
    case grpc::StatusCode::ALREADY_EXISTS: return absl::StatusCode::kAlreadyExists;
    case grpc::StatusCode::PERMISSION_DENIED: return absl::StatusCode::kPermissionDenied;
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return absl::StatusCode::kResourceExhausted;
    case grpc::StatusCode::FAILED_PRECONDITION: return absl::StatusCode::kFailedPrecondition;
    case grpc::StatusCode::ABORTED: return absl::StatusCode::kAborted;
    case grpc::StatusCode::OUT_OF_RANGE: return absl::StatusCode::kOutOfRange;
    case grpc::StatusCode::UNIMPLEMENTED: return absl::StatusCode::kUnimplemented;
    case grpc::StatusCode::INTERNAL: return absl::StatusCode::kInternal;
    case grpc::StatusCode::UNAVAILABLE: return absl::StatusCode::kUnavailable;
    case grpc::StatusCode::DATA_LOSS: return absl::StatusCode::kDataLoss;
    case grpc::StatusCode::UNAUTHENTICATED: return absl::StatusCode::kUnauthenticated;
    default: return absl::StatusCode::kUnknown;
  }
}

// The server's status as absl, with its reason trailer as a payload.
inline absl::Status FromGrpc(const grpc::Status& s, const grpc::ClientContext& ctx) {
  if (s.ok()) return absl::OkStatus();
  absl::Status out(ToAbslCode(s.error_code()), s.error_message());
  const auto& trailers = ctx.GetServerTrailingMetadata();
  if (auto it = trailers.find(kReasonTrailer); it != trailers.end()) {
    out.SetPayload(kReasonPayload, absl::Cord(absl::string_view(it->second.data(), it->second.size())));
  }
  return out;
}


// Sets the call's deadline and bearer token.
inline void Prepare(grpc::ClientContext& ctx, const ClientOptions& options,
                    absl::Duration timeout) {
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  if (!options.bearer_token.empty()) {
    ctx.AddMetadata("authorization", "Bearer " + options.bearer_token);
  }
}

// A channel for `options` (message limits sized to its messages). `own_connection`: the
// channel does not share its connection with other channels to the same target.
inline std::shared_ptr<grpc::Channel> MakeChannel(const ClientOptions& options,
                                                  bool own_connection = false) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(options.message_bytes + (1 << 20)));
  args.SetMaxSendMessageSize(static_cast<int>(options.message_bytes + (1 << 20)));
  if (own_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(
      options.target,
      options.credentials ? options.credentials : grpc::InsecureChannelCredentials(), args);
}

}  // namespace kvferry::client::internal
