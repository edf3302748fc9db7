// KVF_RETURN_IF_ERROR: return a non-OK absl::Status from the enclosing function.
#pragma once

#include "absl/status/status.h"

#define KVF_RETURN_IF_ERROR(expr)                                  \
  do {                                                             \
    if (absl::Status _kvf_status = (expr); !_kvf_status.ok()) {   \
      return _kvf_status;                                          \
    }                                                              \
  } while (false)
