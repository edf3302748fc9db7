// KVF_RETURN_IF_ERROR: return a non-OK absl::Status from the enclosing function.
// KVF_ASSIGN_OR_RETURN: unwrap an absl::StatusOr, or return its non-OK status.
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KVF_RETURN_IF_ERROR(expr)                                  \
  do {                                                             \
    if (absl::Status _kvf_status = (expr); !_kvf_status.ok()) {   \
      return _kvf_status;                                          \
    }                                                              \
  } while (false)

// KVF_ASSIGN_OR_RETURN(lhs, expr): evaluates `expr` (an absl::StatusOr); returns its status
// when it is not OK, else moves its value into `lhs`, a declaration or an lvalue.
#define KVF_ASSIGN_OR_RETURN(lhs, expr) \
  KVF_ASSIGN_OR_RETURN_IMPL(KVF_STATUS_CONCAT(_kvf_statusor_, __LINE__), lhs, expr)

#define KVF_ASSIGN_OR_RETURN_IMPL(statusor, lhs, expr) \
  auto statusor = (expr);                              \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(*statusor)

#define KVF_STATUS_CONCAT(a, b) KVF_STATUS_CONCAT_INNER(a, b)
#define KVF_STATUS_CONCAT_INNER(a, b) a##b
