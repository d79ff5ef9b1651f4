// Checked mode of the entry points (docs/safety.md): after a call's CUDA work is enqueued,
// synchronize its stream and raise a recorded device fault at once.
#pragma once

#include "attnkit/device_errors.h"

namespace attnkit::detail {

// ATTNKIT_CHECKED's rule (checked_mode_from_environment) on an explicit value; throws Error on an
// unknown value. nullptr = unset.
bool parse_checked_mode(const char* value);

// Whether a call with its args' `checked` flag runs in checked mode.
inline bool checked_call(bool flag) { return flag || checked_mode_from_environment(); }

// Checked mode after a CUDA call of `op`: synchronizes `stream`, throws Error for an asynchronous
// CUDA error and DeviceFaultError for a recorded fault (clearing the word). A capturing stream
// has run nothing: nothing is checked.
void check_after_cuda_call(const char* op, void* stream);

}  // namespace attnkit::detail
