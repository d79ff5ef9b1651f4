#include "attnkit/interrupt.h"

#include <atomic>
#include <string>

#include "core/interrupt_poll.h"

namespace attnkit {
namespace {

// One process-wide check: a binding installs it once, every thread's calls poll it.
std::atomic<InterruptCheck> g_interrupt_check{nullptr};

}  // namespace

void set_interrupt_check(InterruptCheck check) {
  g_interrupt_check.store(check, std::memory_order_release);
}

InterruptCheck interrupt_check() { return g_interrupt_check.load(std::memory_order_acquire); }

namespace detail {

void InterruptPoll::throw_interrupted() const {
  throw Interrupted(std::string(op_) +
                    ": interrupted by the interrupt check (the outputs are partly written)");
}

}  // namespace detail
}  // namespace attnkit
