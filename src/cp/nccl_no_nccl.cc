// Builds without NCCL (ATTNKIT_WITH_NCCL off, or no CUDA): the NCCL communicator is rejected
// (src/cuda/cp/nccl_communicator.cc replaces these definitions when NCCL was found).
#ifndef ATTNKIT_WITH_NCCL

#include "attnkit/context_parallel.h"
#include "core/check.h"

namespace attnkit::cp {
namespace {

[[noreturn]] void no_nccl(const char* what) {
  attnkit::detail::fail(
      what,
      ": attnkit was built without NCCL (configure with the CUDA backend and "
      "-DATTNKIT_WITH_NCCL=ON or AUTO where nccl.h is found: docs/building.md); use "
      "make_in_process_group for ranks of one process");
}

}  // namespace

bool nccl_available() { return false; }
NcclUniqueId nccl_unique_id() { no_nccl("nccl_unique_id"); }
std::unique_ptr<Communicator> make_nccl_communicator(const NcclUniqueId&, int32_t, int32_t, int) {
  no_nccl("make_nccl_communicator");
}
std::unique_ptr<Communicator> wrap_nccl_communicator(void*) { no_nccl("wrap_nccl_communicator"); }

}  // namespace attnkit::cp

#endif  // ATTNKIT_WITH_NCCL
