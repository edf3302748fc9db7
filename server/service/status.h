// absl::Status → grpc::Status at the service edge, once, with the error reason trailer.
#pragma once

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"

namespace kvferry::server {

// The trailing metadata key that carries an error's reason (proto/kvferry/v1/errors.proto).
inline constexpr char kErrorReasonKey[] = "kvferry-error-reason";

// One explicit switch between the code enums (absl's kUnknown stays UNKNOWN).
grpc::StatusCode ToGrpcCode(absl::StatusCode code);

// The gRPC status of `status`; a non-OK status also sets the reason trailer on `context`.
grpc::Status ToGrpcStatus(grpc::ServerContext* context, const absl::Status& status);

// Status code name as Prometheus labels and logs spell it ("INVALID_ARGUMENT").
const char* CodeName(grpc::StatusCode code);

}  // namespace kvferry::server
