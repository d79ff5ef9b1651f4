// The NCCL communicator (include/attnkit/context_parallel.h). libnccl is opened with dlopen at
// the first use, so that libattnkit carries no link-time dependency on it (a consumer without
// NCCL loads attnkit as before) and a process that has NCCL loaded already (PyTorch) shares that
// copy: dlopen of the soname returns the library in the process. Transfers are enqueued on the
// stream the driver passes (its communication stream), a ring exchange as one group of sends and
// receives so that NCCL progresses both directions at once.
#ifdef ATTNKIT_WITH_NCCL

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <cstring>
#include <mutex>
#include <string>
#include <type_traits>

#include "attnkit/context_parallel.h"
#include "core/check.h"
#include "cp/device_ops.h"
#include "cuda/common/cuda_status.h"

#ifndef ATTNKIT_NCCL_LIBRARY
#define ATTNKIT_NCCL_LIBRARY ""
#endif

namespace attnkit::cp {
namespace {

static_assert(sizeof(ncclUniqueId) == sizeof(NcclUniqueId::bytes),
              "NcclUniqueId must hold an ncclUniqueId");

// The NCCL functions attnkit calls, resolved from the loaded library.
struct NcclApi {
  decltype(&ncclGetVersion) get_version = nullptr;
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRank) comm_init_rank = nullptr;
  decltype(&ncclCommDestroy) comm_destroy = nullptr;
  decltype(&ncclCommCount) comm_count = nullptr;
  decltype(&ncclCommUserRank) comm_user_rank = nullptr;
  decltype(&ncclCommCuDevice) comm_cu_device = nullptr;
  decltype(&ncclGetErrorString) get_error_string = nullptr;
  decltype(&ncclGetLastError) get_last_error = nullptr;  // NCCL >= 2.13; may stay null
  decltype(&ncclGroupStart) group_start = nullptr;
  decltype(&ncclGroupEnd) group_end = nullptr;
  decltype(&ncclSend) send = nullptr;
  decltype(&ncclRecv) recv = nullptr;
  decltype(&ncclAllGather) all_gather = nullptr;
  std::string error;  // why the library could not be used; "" when it can
};

const NcclApi& nccl_api() {
  static const NcclApi api = [] {
    NcclApi a;
    std::string tried;
    void* handle = nullptr;
    for (const char* name : {"libnccl.so.2", ATTNKIT_NCCL_LIBRARY, "libnccl.so"}) {
      if (name[0] == '\0') continue;
      handle = dlopen(name, RTLD_NOW | RTLD_GLOBAL);
      if (handle != nullptr) break;
      tried += std::string(tried.empty() ? "" : ", ") + name;
    }
    if (handle == nullptr) {
      a.error = "libnccl could not be loaded (tried " + tried +
                "): put libnccl.so.2 on LD_LIBRARY_PATH (the CUDA toolkit's, or PyPI's "
                "nvidia-nccl-cu12 / -cu13)";
      return a;
    }
    const auto resolve = [&](auto& fn, const char* symbol, bool required) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(handle, symbol));
      if (fn == nullptr && required && a.error.empty()) {
        a.error = std::string("libnccl has no ") + symbol + " (NCCL 2.7 or newer is needed)";
      }
    };
    resolve(a.get_version, "ncclGetVersion", true);
    resolve(a.get_unique_id, "ncclGetUniqueId", true);
    resolve(a.comm_init_rank, "ncclCommInitRank", true);
    resolve(a.comm_destroy, "ncclCommDestroy", true);
    resolve(a.comm_count, "ncclCommCount", true);
    resolve(a.comm_user_rank, "ncclCommUserRank", true);
    resolve(a.comm_cu_device, "ncclCommCuDevice", true);
    resolve(a.get_error_string, "ncclGetErrorString", true);
    resolve(a.get_last_error, "ncclGetLastError", false);
    resolve(a.group_start, "ncclGroupStart", true);
    resolve(a.group_end, "ncclGroupEnd", true);
    resolve(a.send, "ncclSend", true);
    resolve(a.recv, "ncclRecv", true);
    resolve(a.all_gather, "ncclAllGather", true);
    return a;
  }();
  return api;
}

const NcclApi& loaded_api(const char* what) {
  const NcclApi& api = nccl_api();
  ATTNKIT_CHECK(api.error.empty(), what, ": ", api.error);
  return api;
}

void check_nccl(const NcclApi& api, ncclResult_t status, const char* what, ncclComm_t comm) {
  if (status == ncclSuccess) return;
  std::string detail;
  if (comm != nullptr && api.get_last_error != nullptr) {
    const char* last = api.get_last_error(comm);
    if (last != nullptr && last[0] != '\0') detail = std::string(" (") + last + ")";
  }
  attnkit::detail::fail(what, ": NCCL error ", api.get_error_string(status), detail);
}

class NcclCommunicator final : public Communicator {
 public:
  // owned: destroy the communicator with this object.
  NcclCommunicator(ncclComm_t comm, bool owned)
      : api_(loaded_api("NCCL communicator")), comm_(comm), owned_(owned) {
    int value = 0;
    check_nccl(api_, api_.comm_count(comm_, &value), "ncclCommCount", comm_);
    world_size_ = value;
    check_nccl(api_, api_.comm_user_rank(comm_, &value), "ncclCommUserRank", comm_);
    rank_ = value;
    check_nccl(api_, api_.comm_cu_device(comm_, &value), "ncclCommCuDevice", comm_);
    device_ = value;
    comm_stream_ = detail::cuda_ops::stream_create(device_);
  }
  ~NcclCommunicator() override {
    detail::cuda_ops::stream_destroy(device_, comm_stream_);
    if (owned_) {
      const cuda::DeviceScope scope(device_, nullptr);
      api_.comm_destroy(comm_);
    }
  }
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int32_t rank() const override { return rank_; }
  int32_t world_size() const override { return world_size_; }
  Device device() const override { return Device::cuda(device_); }
  Stream comm_stream() const override { return comm_stream_; }

  void ring_exchange(std::span<const RingTransfer> transfers, Stream stream) override {
    const cuda::DeviceScope scope(device_, "ring_exchange: cudaSetDevice");
    const int next = (rank_ + 1) % world_size_, prev = (rank_ + world_size_ - 1) % world_size_;
    const cudaStream_t s = cuda::as_cuda_stream(stream);
    check_nccl(api_, api_.group_start(), "ring_exchange: ncclGroupStart", comm_);
    // A zero-byte transfer is skipped on both sides (the sizes match by contract).
    for (const RingTransfer& t : transfers) {
      if (t.send_bytes > 0) {
        check_nccl(api_,
                   api_.send(t.send, static_cast<size_t>(t.send_bytes), ncclUint8, next, comm_, s),
                   "ring_exchange: ncclSend", comm_);
      }
      if (t.recv_bytes > 0) {
        check_nccl(api_,
                   api_.recv(t.recv, static_cast<size_t>(t.recv_bytes), ncclUint8, prev, comm_, s),
                   "ring_exchange: ncclRecv", comm_);
      }
    }
    check_nccl(api_, api_.group_end(), "ring_exchange: ncclGroupEnd", comm_);
  }

  void all_gather(const void* send, void* recv, int64_t bytes, Stream stream) override {
    const cuda::DeviceScope scope(device_, "all_gather: cudaSetDevice");
    check_nccl(api_,
               api_.all_gather(send, recv, static_cast<size_t>(bytes), ncclUint8, comm_,
                               cuda::as_cuda_stream(stream)),
               "all_gather: ncclAllGather", comm_);
  }

 private:
  const NcclApi& api_;
  ncclComm_t comm_;
  bool owned_;
  int32_t rank_ = 0, world_size_ = 1;
  int device_ = 0;
  Stream comm_stream_ = nullptr;
};

}  // namespace

bool nccl_available() { return nccl_api().error.empty(); }

NcclUniqueId nccl_unique_id() {
  const NcclApi& api = loaded_api("nccl_unique_id");
  ncclUniqueId id;
  check_nccl(api, api.get_unique_id(&id), "nccl_unique_id: ncclGetUniqueId", nullptr);
  NcclUniqueId out;
  std::memcpy(out.bytes.data(), &id, sizeof(id));
  return out;
}

std::unique_ptr<Communicator> make_nccl_communicator(const NcclUniqueId& id, int32_t rank,
                                                     int32_t world_size, int device) {
  ATTNKIT_CHECK(world_size >= 1, "make_nccl_communicator: world_size must be >= 1, got ",
                world_size);
  ATTNKIT_CHECK(rank >= 0 && rank < world_size, "make_nccl_communicator: rank must be in [0, ",
                world_size, "), got ", rank);
  ATTNKIT_CHECK(device >= 0, "make_nccl_communicator: device must be a CUDA ordinal >= 0, got ",
                device);
  const NcclApi& api = loaded_api("make_nccl_communicator");
  const cuda::DeviceScope scope(device, "make_nccl_communicator: cudaSetDevice");
  ncclUniqueId nccl_id;
  std::memcpy(&nccl_id, id.bytes.data(), sizeof(nccl_id));
  ncclComm_t comm = nullptr;
  check_nccl(api, api.comm_init_rank(&comm, world_size, nccl_id, rank),
             "make_nccl_communicator: ncclCommInitRank", nullptr);
  try {
    return std::make_unique<NcclCommunicator>(comm, /*owned=*/true);
  } catch (...) {
    api.comm_destroy(comm);
    throw;
  }
}

std::unique_ptr<Communicator> wrap_nccl_communicator(void* nccl_comm) {
  ATTNKIT_CHECK(nccl_comm != nullptr,
                "wrap_nccl_communicator: nccl_comm must be an ncclComm_t, "
                "got nullptr");
  return std::make_unique<NcclCommunicator>(static_cast<ncclComm_t>(nccl_comm), /*owned=*/false);
}

}  // namespace attnkit::cp

#endif  // ATTNKIT_WITH_NCCL
