// Pieces of the device-fault tests (bad device metadata through the public API, docs/safety.md):
// the recorded fault of a call, its expected fields, and a device KV cache whose pool sits between
// guard bands of sentinel bytes, so that a write outside the pool is seen.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "attnkit/device_errors.h"
#include "common/reference_oracle.h"
#include "gpu/gpu_util.h"

namespace attnkit::test {

// Clears a fault another test may have left, so that a test starts from an empty word.
inline void drain_device_faults() {
  try {
    check_device_errors();
  } catch (const DeviceFaultError&) {
  }
}

// What check_device_errors() reported after a call (faulted = false: it returned).
struct TakenFault {
  bool faulted = false;
  DeviceFault fault{};
  std::string message;
};

inline TakenFault take_device_fault() {
  TakenFault taken;
  try {
    check_device_errors();
  } catch (const DeviceFaultError& e) {
    taken.faulted = true;
    taken.fault = e.fault();
    taken.message = e.what();
  }
  return taken;
}

struct ExpectedFault {
  FaultKind kind;
  FaultArg arg;
  Op op;
  int64_t row, index, value, bound;
  unsigned long long count;  // 0: not compared (only >= 1)
};

inline void expect_fault(const TakenFault& taken, const ExpectedFault& e) {
  ASSERT_TRUE(taken.faulted) << "check_device_errors() reported no fault";
  const DeviceFault& f = taken.fault;
  EXPECT_EQ(f.kind, static_cast<int32_t>(e.kind)) << taken.message;
  EXPECT_EQ(f.arg, static_cast<int32_t>(e.arg)) << taken.message;
  EXPECT_EQ(f.op, static_cast<int32_t>(e.op)) << taken.message;
  EXPECT_EQ(f.row, e.row) << taken.message;
  EXPECT_EQ(f.index, e.index) << taken.message;
  EXPECT_EQ(f.value, e.value) << taken.message;
  EXPECT_EQ(f.bound, e.bound) << taken.message;
  if (e.count != 0) {
    EXPECT_EQ(f.count, e.count) << taken.message;
  } else {
    EXPECT_GE(f.count, 1u) << taken.message;
  }
  const std::string prefix = std::string(op_name(e.op)) + ": " + fault_arg_name(e.arg) + ": ";
  EXPECT_EQ(taken.message.rfind(prefix, 0), 0u) << taken.message;
}

// A copy of an oracle cache on the device: the pool between two guard bands of kSentinel bytes
// (each at least four blocks, so that a block id just outside the pool, -1 included, lands in
// one), the block table, seq_lens and scales as device copies.
class GuardedDeviceCache {
 public:
  static constexpr uint8_t kSentinel = 0xA5;

  explicit GuardedDeviceCache(const OracleKvCache& host) : view_(host.view()) {
    const KvCacheView h = host.view();
    pool_bytes_ = static_cast<int64_t>(host.pool().bytes().size());
    guard_bytes_ = (std::max<int64_t>(64 << 10, 4 * h.block_stride_bytes) + 255) / 256 * 256;
    const int64_t total = pool_bytes_ + 2 * guard_bytes_;
    if (cudaMalloc(&buffer_, static_cast<size_t>(total)) != cudaSuccess) std::abort();
    cudaMemset(buffer_, kSentinel, static_cast<size_t>(total));
    cudaMemcpy(buffer_ + guard_bytes_, host.pool().bytes().data(), static_cast<size_t>(pool_bytes_),
               cudaMemcpyHostToDevice);
    const int64_t v_offset = static_cast<uint8_t*>(h.v_base) - static_cast<uint8_t*>(h.k_base);
    view_.k_base = buffer_ + guard_bytes_;
    view_.v_base = buffer_ + guard_bytes_ + v_offset;
    view_.device = Device::cuda(0);
    view_.block_table = mirror(h.block_table, block_table_);
    view_.seq_lens = mirror(h.seq_lens, seq_lens_);
    view_.k_scale = mirror(h.k_scale, k_scale_);
    view_.v_scale = mirror(h.v_scale, v_scale_);
  }
  GuardedDeviceCache(const GuardedDeviceCache&) = delete;
  GuardedDeviceCache& operator=(const GuardedDeviceCache&) = delete;
  ~GuardedDeviceCache() { cudaFree(buffer_); }

  const KvCacheView& view() const { return view_; }

  // The pool's bytes now; ADD_FAILURE for every guard band byte that is not the sentinel.
  std::vector<uint8_t> pool_checking_guards(const std::string& what) const {
    std::vector<uint8_t> all(static_cast<size_t>(pool_bytes_ + 2 * guard_bytes_));
    cudaMemcpy(all.data(), buffer_, all.size(), cudaMemcpyDeviceToHost);
    int64_t before = 0, after = 0;
    for (int64_t i = 0; i < guard_bytes_; ++i) {
      before += all[i] != kSentinel;
      after += all[guard_bytes_ + pool_bytes_ + i] != kSentinel;
    }
    EXPECT_EQ(before, 0) << what << ": bytes written before the pool";
    EXPECT_EQ(after, 0) << what << ": bytes written after the pool";
    return std::vector<uint8_t>(all.begin() + guard_bytes_,
                                all.begin() + guard_bytes_ + pool_bytes_);
  }

 private:
  static TensorView mirror(const TensorView& t, DeviceTensor& storage) {
    if (!t.defined()) return TensorView();
    HostTensor copy(t.dtype, std::vector<int64_t>(t.shape.begin(), t.shape.begin() + t.ndim));
    std::memcpy(copy.view().data, t.data, copy.numel() * dtype_size(t.dtype));
    storage = DeviceTensor(copy);
    return storage.view();
  }

  KvCacheView view_;
  uint8_t* buffer_ = nullptr;
  int64_t pool_bytes_ = 0, guard_bytes_ = 0;
  DeviceTensor block_table_, seq_lens_, k_scale_, v_scale_;
};

// The first byte where a and b differ, -1 when they are equal.
inline int64_t first_difference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

}  // namespace attnkit::test
