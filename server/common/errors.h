// Errors with a machine-readable reason: absl::Status plus a reason payload.
//
// The core raises every error through Error(); the service turns the reason into the
// `kvferry-error-reason` trailer (proto/kvferry/v1/errors.proto lists the same names, in the
// same order; a test holds the two lists equal).
#pragma once

#include "absl/strings/string_view.h"

#include "absl/status/status.h"

namespace kvferry::server {

// Mirrors kvferry.v1.ErrorReason (same names, same numbers).
enum class ErrorReason {
  kUnspecified = 0,
  kInvalidName,
  kInvalidLayout,
  kInvalidGeometry,
  kUnknownDevice,
  kPoolExists,
  kPoolNotFound,
  kPoolDeleted,
  kPoolFull,
  kDeviceOutOfMemory,
  kStalePageHandle,
  kPageOutOfRange,
  kSlotOutOfRange,
  kLayerOutOfRange,
  kDuplicateLocation,
  kDuplicatePage,
  kDuplicateLayer,
  kNonFiniteValue,
  kBadRowLength,
  kLayoutMismatch,
  kWriteTooLarge,
  kStreamTargetChanged,
  kPageIncomplete,
  kPageBytesOutOfOrder,
  kEmptyWrite,
  kTooManyPages,
  kHandleGenerationChanged,
  kInvalidRequest,
  kDeviceError,
  kClientCancelled,
  kDeadlineExceeded,
  kInternalError,
  kShuttingDown,
  kSessionNotFound,
  kTensorNotFound,
  kBlockOutOfRange,
  kTensorOutOfBounds,
  kKindMismatch,
  kDeviceMismatch,
  kExportNotFound,
  kQuotaExceeded,
  kNotAuthenticated,
  kNamespaceNotFound,
  kNamespaceExists,
  kNamespaceMismatch,
  kLeaseExpired,
  kBlockIncomplete,
  kCacheFull,
  kEventsLost,
  kPublisherChanged,
  kNamespaceDeleted,
  kNotAMember,
  kPeerUnavailable,
  kTransportUnavailable,
  kWorkerNotAccessible,
  kPagesBusy,
  kWriteNotFinished,
  kPeerNotAuthenticated,
  // 58-59: unused.
  kDaemonBudgetExhausted = 60,
  kStreamIdleTimeout = 61,
  kStreamTooLong = 62,
};
// One past the largest reason number; numbers in between may be unused (ReasonName gives
// ERROR_REASON_UNSPECIFIED for those).
inline constexpr int kNumErrorReasons = static_cast<int>(ErrorReason::kStreamTooLong) + 1;

// The proto name of a reason ("STALE_PAGE_HANDLE").
const char* ReasonName(ErrorReason reason);

// The reason named `name` ("STALE_PAGE_HANDLE"); kUnspecified for a name it does not know.
ErrorReason ReasonFromName(absl::string_view name);

// A status of `code` whose reason is `reason`.
absl::Status Error(absl::StatusCode code, ErrorReason reason, absl::string_view message);

// `status` with `reason` attached, unless it already has one (the innermost reason wins).
absl::Status WithReason(absl::Status status, ErrorReason reason);

// The status's reason; for a status without one, a reason derived from its code.
ErrorReason ReasonOf(const absl::Status& status);

}  // namespace kvferry::server
