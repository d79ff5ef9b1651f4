// Pieces of the device-fault tests (bad device metadata through the public API, docs/safety.md):
// the recorded fault of a call and its expected fields, a call's outputs and their rows, and a
// device KV cache whose pool sits between guard bands of sentinel bytes, so that a write outside
// the pool is seen.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "attnkit/device_errors.h"
#include "common/output_rows.h"
#include "common/reference_oracle.h"
#include "gpu/gpu_case_util.h"
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

// One attention call with device metadata: the fault check_device_errors() reported after it,
// its out [rows, Hq, D] (bf16) and lse [rows, Hq].
struct AttnOutcome {
  TakenFault fault;
  HostTensor out, lse;

  OutputRows rows() const {
    const TensorView o = out.view();
    return {out.bytes().data(), static_cast<size_t>(o.shape[1] * o.shape[2]) * 2, lse.data<float>(),
            o.shape[1], o.shape[0]};
  }
};

// Runs call(out, lse), which must return, into NaN-poisoned device outputs of `rows` rows (bf16
// Hq x D, Hq LSEs), from a cleared status word.
template <typename Call>
AttnOutcome run_with_outputs(int64_t rows, int32_t hq, int32_t d, Call call) {
  drain_device_faults();
  const HostTensor out_poison = poisoned(DType::kBF16, {rows, hq, d});
  const HostTensor lse_poison = poisoned(DType::kF32, {rows, hq});
  DeviceTensor dout(out_poison), dlse(lse_poison);
  AttnOutcome outcome;
  EXPECT_NO_THROW(call(dout.view(), dlse.view()));
  outcome.fault = take_device_fault();
  outcome.out = downloaded(dout, out_poison);
  outcome.lse = downloaded(dlse, lse_poison);
  return outcome;
}

// `bad`'s rows in `faulting` are zeros with LSE -inf, the others equal `good`'s (the same call
// with good metadata, which recorded no fault) byte for byte.
inline void expect_faulting_rows(const AttnOutcome& bad, const AttnOutcome& good,
                                 const std::vector<int64_t>& faulting) {
  EXPECT_FALSE(good.fault.faulted) << "the call with good metadata faulted: " << good.fault.message;
  expect_rows_zeroed_where(bad.rows(), good.rows(), [&](int64_t r) {
    return std::find(faulting.begin(), faulting.end(), r) != faulting.end();
  });
}

// A copy of an oracle cache on the device: the pool between two guard bands of sentinel bytes
// (each at least four blocks, so that a block id just outside the pool, -1 included, lands in
// one), the block table, seq_lens and scales as device copies.
class GuardedDeviceCache {
 public:
  explicit GuardedDeviceCache(const OracleKvCache& host)
      : view_(host.view()),
        pool_(host.pool().bytes(),
              std::max<int64_t>(64 << 10, 4 * host.view().block_stride_bytes)) {
    const KvCacheView h = host.view();
    const int64_t v_offset = static_cast<uint8_t*>(h.v_base) - static_cast<uint8_t*>(h.k_base);
    view_.k_base = pool_.data();
    view_.v_base = pool_.data() + v_offset;
    view_.device = Device::cuda(0);
    view_.block_table = device_copy(h.block_table, block_table_);
    view_.seq_lens = device_copy(h.seq_lens, seq_lens_);
    view_.k_scale = device_copy(h.k_scale, k_scale_);
    view_.v_scale = device_copy(h.v_scale, v_scale_);
  }

  const KvCacheView& view() const { return view_; }

  // The pool's bytes now; a failure for every guard band byte that is not the sentinel.
  std::vector<uint8_t> pool_checking_guards(const std::string& what) const {
    return pool_.download_checking_guards(what + ": the pool");
  }

 private:
  KvCacheView view_;
  GuardedDeviceBuffer pool_;
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
