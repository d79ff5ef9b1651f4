// The polling side of include/attnkit/interrupt.h: long host loops (the reference backend) own an
// InterruptPoll and call it once per row; it calls the installed check only when
// kInterruptPollInterval has passed, so a poll costs an atomic load and a clock read.
#pragma once

#include <chrono>

#include "attnkit/interrupt.h"

namespace attnkit::detail {

class InterruptPoll {
 public:
  // `op` names the call in the Interrupted message ("prefill", "dense", ...).
  explicit InterruptPoll(const char* op) : op_(op), last_(std::chrono::steady_clock::now()) {}

  // Throws Interrupted when the installed check asks to stop.
  void operator()() {
    const InterruptCheck check = interrupt_check();
    if (check == nullptr) return;
    const auto now = std::chrono::steady_clock::now();
    if (now - last_ < kInterruptPollInterval) return;
    last_ = now;
    if (check()) throw_interrupted();
  }

 private:
  [[noreturn]] void throw_interrupted() const;

  const char* op_;
  std::chrono::steady_clock::time_point last_;
};

}  // namespace attnkit::detail
