// Error reasons carried as an absl::Status payload.
#include "common/errors.h"

#include <string>

#include "absl/strings/cord.h"
#include "absl/types/optional.h"

namespace kvferry::server {
namespace {

constexpr absl::string_view kReasonPayload = "kvferry.dev/error-reason";

constexpr const char* kNames[kNumErrorReasons] = {
    "ERROR_REASON_UNSPECIFIED", "INVALID_NAME", "INVALID_LAYOUT", "INVALID_GEOMETRY",
    "UNKNOWN_DEVICE", "POOL_EXISTS", "POOL_NOT_FOUND", "POOL_DELETED", "POOL_FULL",
    "DEVICE_OUT_OF_MEMORY", "STALE_PAGE_HANDLE", "PAGE_OUT_OF_RANGE", "SLOT_OUT_OF_RANGE",
    "LAYER_OUT_OF_RANGE", "DUPLICATE_LOCATION", "DUPLICATE_PAGE", "DUPLICATE_LAYER",
    "NON_FINITE_VALUE", "BAD_ROW_LENGTH", "LAYOUT_MISMATCH", "WRITE_TOO_LARGE",
    "STREAM_TARGET_CHANGED", "PAGE_INCOMPLETE", "PAGE_BYTES_OUT_OF_ORDER", "EMPTY_WRITE",
    "TOO_MANY_PAGES", "HANDLE_GENERATION_CHANGED", "INVALID_REQUEST", "DEVICE_ERROR",
    "CLIENT_CANCELLED", "DEADLINE_EXCEEDED", "INTERNAL_ERROR", "SHUTTING_DOWN",
    "SESSION_NOT_FOUND", "TENSOR_NOT_FOUND", "BLOCK_OUT_OF_RANGE", "TENSOR_OUT_OF_BOUNDS",
    "KIND_MISMATCH", "DEVICE_MISMATCH", "EXPORT_NOT_FOUND",
    "QUOTA_EXCEEDED", "NOT_AUTHENTICATED", "NAMESPACE_NOT_FOUND", "NAMESPACE_EXISTS",
    "NAMESPACE_MISMATCH", "LEASE_EXPIRED", "BLOCK_INCOMPLETE", "CACHE_FULL", "EVENTS_LOST",
    "PUBLISHER_CHANGED", "NAMESPACE_DELETED", "NOT_A_MEMBER",
    "PEER_UNAVAILABLE", "TRANSPORT_UNAVAILABLE", "WORKER_NOT_ACCESSIBLE", "PAGES_BUSY",
    "WRITE_NOT_FINISHED", "PEER_NOT_AUTHENTICATED", nullptr, nullptr,  // 58-59: unused
    "DAEMON_BUDGET_EXHAUSTED", "STREAM_IDLE_TIMEOUT", "STREAM_TOO_LONG",
};

}  // namespace

const char* ReasonName(ErrorReason reason) {
  const int i = static_cast<int>(reason);
  return i >= 0 && i < kNumErrorReasons && kNames[i] != nullptr ? kNames[i] : kNames[0];
}

ErrorReason ReasonFromName(absl::string_view name) {
  for (int i = 1; i < kNumErrorReasons; ++i) {
    if (kNames[i] != nullptr && name == kNames[i]) return static_cast<ErrorReason>(i);
  }
  return ErrorReason::kUnspecified;
}

absl::Status Error(absl::StatusCode code, ErrorReason reason, absl::string_view message) {
  absl::Status status(code, message);
  status.SetPayload(kReasonPayload, absl::Cord(std::string(1, static_cast<char>(reason))));
  return status;
}

absl::Status WithReason(absl::Status status, ErrorReason reason) {
  if (status.ok() || status.GetPayload(kReasonPayload).has_value()) return status;
  status.SetPayload(kReasonPayload, absl::Cord(std::string(1, static_cast<char>(reason))));
  return status;
}

ErrorReason ReasonOf(const absl::Status& status) {
  if (absl::optional<absl::Cord> payload = status.GetPayload(kReasonPayload);
      payload.has_value() && payload->size() == 1) {
    const int i = static_cast<unsigned char>(*payload->char_begin());
    if (i < kNumErrorReasons && kNames[i] != nullptr) return static_cast<ErrorReason>(i);
  }
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return ErrorReason::kUnspecified;
    case absl::StatusCode::kCancelled:
      return ErrorReason::kClientCancelled;
    case absl::StatusCode::kDeadlineExceeded:
      return ErrorReason::kDeadlineExceeded;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      return ErrorReason::kInvalidRequest;
    case absl::StatusCode::kResourceExhausted:
      return ErrorReason::kDeviceOutOfMemory;
    case absl::StatusCode::kUnavailable:
      return ErrorReason::kShuttingDown;
    case absl::StatusCode::kNotFound:
      return ErrorReason::kPoolNotFound;
    case absl::StatusCode::kUnauthenticated:
      return ErrorReason::kNotAuthenticated;
    default:
      return ErrorReason::kInternalError;
  }
}

}  // namespace kvferry::server
