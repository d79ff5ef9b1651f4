// Interrupting long host computations. The CPU reference backend runs a call to completion on the
// calling thread (a 2k-token x 32-head prefill takes tens of seconds); a caller that lets its user
// stop such a call (the Python binding on Ctrl-C, a server cancelling a request) installs an
// interrupt check. The reference polls it between rows and heads, at most once per
// kInterruptPollInterval, and abandons the call with attnkit::Interrupted when it returns true.
// CUDA calls only enqueue work and never poll.
#pragma once

#include <chrono>

#include "attnkit/types.h"

namespace attnkit {

// Thrown by a call that an interrupt check stopped. Its outputs are then partly written (the rows
// computed before the check); nothing else is changed.
class Interrupted : public Error {
 public:
  using Error::Error;
};

// Returns true to stop the running call. Called on the thread that runs the call, from inside
// the library: it must not call back into attnkit.
using InterruptCheck = bool (*)();

// Installs `check` for every thread of the process (nullptr, the default: calls are never
// interrupted). Safe to call while calls run on other threads; they see the new check at their
// next poll.
void set_interrupt_check(InterruptCheck check);
InterruptCheck interrupt_check();

// The longest time between two polls of a running reference call (the latency of an interrupt).
inline constexpr std::chrono::milliseconds kInterruptPollInterval{20};

}  // namespace attnkit
