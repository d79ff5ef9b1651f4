// Device guards of the fused decode (docs/safety.md, "Which kernels are guarded"): bad device
// metadata of one row (a block id outside the pool or -1 where a page is read, a seq_len past the
// row's table or negative, a cache_indirection entry that names no beam) on the mma.sync kernels
// (groups of 4, 16 and 32 heads, 16-bit and 8-bit caches, paged, cyclic and beams) and the sm90
// wgmma kernel, with and without splits and through each split merge. The call returns, the
// faulting row is zeros with LSE -inf, every other row equals the same call with good metadata bit
// for bit, check_device_errors() reports the kind, argument, row, index, value and bound, and
// checked mode throws at once. Fresh random data per run (decode_case_util.h).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/device_errors.h"
#include "common/output_rows.h"
#include "cuda/decode/decode_launch.h"
#include "gpu/decode_case_util.h"
#include "gpu/fault_test_util.h"
#include "gpu/gpu_util.h"

namespace attnkit::test {
namespace {

// A call's outputs as stored: out's bytes and the LSEs.
struct Outputs {
  std::vector<uint8_t> out;
  std::vector<float> lse;
};

// Runs the prepared call (outputs poisoned with NaN first) and downloads its outputs.
Outputs run(PreparedCase& pc) {
  Outputs o;
  pc.poison(nullptr);
  EXPECT_NO_THROW(decode(pc.spec, pc.args, nullptr));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  o.out.resize(pc.d_out.bytes());
  o.lse.resize(pc.d_lse.bytes() / sizeof(float));
  EXPECT_EQ(cudaMemcpy(o.out.data(), pc.d_out.data(), o.out.size(), cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(cudaMemcpy(o.lse.data(), pc.d_lse.data(), pc.d_lse.bytes(), cudaMemcpyDeviceToHost),
            cudaSuccess);
  return o;
}

// The call's outputs as rows (one a decode row: Hq x D elements, Hq LSEs).
OutputRows rows_of(const PreparedCase& pc, const Outputs& o) {
  const int64_t rows = static_cast<int64_t>(pc.c.seq_lens.size());
  return {o.out.data(), o.out.size() / static_cast<size_t>(rows), o.lse.data(), pc.c.hq, rows};
}

// Row `bad` of `got` is zeros (+0.0 in every element) with LSE -inf; with `bitwise`, every other
// row equals `good` bit for bit (else: only free of NaN, for the accumulating merge, whose L2 sums
// vary in their last bits from run to run).
void expect_row_zeroed(const PreparedCase& pc, const Outputs& good, const Outputs& got, int64_t bad,
                       bool bitwise = true) {
  const OutputRows g = rows_of(pc, got), ref = rows_of(pc, good);
  for (int64_t r = 0; r < g.rows; ++r) {
    SCOPED_TRACE(detail::concat("row ", r, bad == r ? " (the faulting row)" : ""));
    if (r == bad) {
      EXPECT_TRUE(is_zeroed_row(g, r));
    } else if (bitwise) {
      EXPECT_TRUE(same_row(g, r, ref, r));
    } else {
      for (int64_t h = 0; h < g.heads; ++h)
        EXPECT_FALSE(std::isnan(g.lse_row(r)[h])) << "head " << h;
    }
  }
}

// check_device_errors() throws DeviceFaultError for a fault of this kind, argument, row, index,
// value and bound, recorded by a decode call; the word is clear afterwards.
void expect_decode_fault(FaultKind kind, FaultArg arg, int64_t row, int64_t index, int64_t value,
                         int64_t bound) {
  expect_fault(take_device_fault(), {kind, arg, Op::kDecode, row, index, value, bound, 0});
  EXPECT_NO_THROW(check_device_errors());
}

int64_t wgmma_launches() { return cuda::decode_wgmma_launches(2) + cuda::decode_wgmma_launches(3); }

// Whether a group of 16+ heads at head_dim 128 takes the wgmma kernel on this device and build.
bool wgmma_expected() {
  int major = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  return major == 9 && cuda::decode_wgmma_compiled();
}

// Block-table entry (row, column) of the prepared case set to `value` on the device; restores the
// good table when it goes out of scope.
struct BadTableEntry {
  PreparedCase& pc;
  BadTableEntry(PreparedCase& p, int64_t row, int64_t column, int32_t value) : pc(p) {
    HostTensor table = pc.h.block_table;
    table.data<int32_t>()[row * pc.h.max_blocks + column] = value;
    pc.d_table.upload(table);
  }
  ~BadTableEntry() { pc.d_table.upload(pc.h.block_table); }
};

struct BadSeqLen {
  PreparedCase& pc;
  BadSeqLen(PreparedCase& p, int64_t row, int32_t value) : pc(p) {
    HostTensor lens = pc.h.seq_lens;
    lens.data<int32_t>()[row] = value;
    pc.d_lens.upload(lens);
  }
  ~BadSeqLen() { pc.d_lens.upload(pc.h.seq_lens); }
};

// For each split setting: the good call (checked against the oracle once, no fault recorded),
// then row 1's block-table entry at its first column (read by split 0's early ramp) and at its
// last used column set to 10000 and to -1. expect_wgmma: the calls take the wgmma kernel.
void block_id_faults(const DecodeCase& base, uint64_t salt, bool expect_wgmma = false) {
  ASSERT_GE(base.seq_lens.size(), 2u);
  for (int32_t splits : {1, 4, 0}) {
    DecodeCase c = base;
    c.num_splits = splits;
    SCOPED_TRACE(c.str());
    PreparedCase pc(c, salt++);
    ASSERT_NO_THROW(check_device_errors());
    const int64_t launches = wgmma_launches();
    const Outputs good = run(pc);
    if (expect_wgmma) EXPECT_EQ(wgmma_launches(), launches + 1) << "not the wgmma kernel";
    EXPECT_NO_THROW(check_device_errors()) << "a valid call recorded a fault";
    if (splits == 4) pc.check();
    const int64_t last = (c.seq_lens[1] - 1) / pc.h.tokens_per_block;
    for (int64_t column : {int64_t{0}, last}) {
      for (int32_t value : {10000, -1}) {
        SCOPED_TRACE(detail::concat("block_table[1][", column, "] = ", value));
        {
          BadTableEntry bad(pc, 1, column, value);
          const Outputs got = run(pc);
          expect_row_zeroed(pc, good, got, 1);
        }
        expect_decode_fault(FaultKind::kBlockId, FaultArg::kBlockTable, 1, column, value,
                            pc.h.num_blocks);
      }
    }
  }
}

DecodeCase paged_case(int32_t hq, int32_t hkv, std::vector<int32_t> seq_lens,
                      DType kv = DType::kBF16) {
  DecodeCase c;
  c.hq = hq;
  c.hkv = hkv;
  c.page = 16;
  c.kv_dtype = kv;
  c.seq_lens = std::move(seq_lens);
  return c;
}

// Groups of 4 heads (keys as MMA rows), 16-bit cache.
TEST(DecodeFault, BadBlockIdGroupsOfFour) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  block_id_faults(paged_case(8, 2, {90, 300, 47}), 9100);
}

// An fp8 cache (128-key tiles, two runs a warp) and an int8 one.
TEST(DecodeFault, BadBlockIdEightBitCaches) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  block_id_faults(paged_case(8, 2, {200, 390, 47}, DType::kFp8E4M3), 9200);
  block_id_faults(paged_case(16, 2, {33, 170, 100}, DType::kInt8), 9210);
}

// Groups of 16 heads over enough rows for the sm90 wgmma kernel (rows x KV heads x 16 >= the SMs);
// elsewhere the 16-row mma.sync kernel.
TEST(DecodeFault, BadBlockIdWgmmaKernel) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::vector<int32_t> lens{100, 250, 17, 64, 65, 1, 130, 200, 31, 77};
  block_id_faults(paged_case(16, 1, lens), 9300, wgmma_expected());
}

// MQA 32/1 over 110 rows of at most 4096 keys: the two-M-block (32-head) mma.sync kernel.
TEST(DecodeFault, BadBlockIdThirtyTwoHeadKernel) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() ^ 0x5eed);
  std::vector<int32_t> lens = lengths(rng, 110, 16, 96);
  lens[1] = 90;
  block_id_faults(paged_case(32, 1, lens), 9400);
}

// A cyclic cache (window + sinks): the key offsets of the general path (slot_of).
TEST(DecodeFault, BadBlockIdCyclicCache) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  for (int32_t splits : {1, 4}) {
    DecodeCase c = paged_case(8, 2, {200, 150, 30});
    c.cyclic = true;
    c.mask.kind = MaskKind::kSlidingWindow;
    c.mask.window = 40;
    c.mask.sink_tokens = 4;
    c.num_splits = splits;
    SCOPED_TRACE(c.str());
    PreparedCase pc(c, 9500 + splits);
    ASSERT_NO_THROW(check_device_errors());
    const Outputs good = run(pc);
    EXPECT_NO_THROW(check_device_errors());
    pc.check();
    // Column 0 holds the sinks, which every row of more than 4 keys attends.
    for (int32_t value : {10000, -1}) {
      {
        BadTableEntry bad(pc, 1, 0, value);
        expect_row_zeroed(pc, good, run(pc), 1);
      }
      expect_decode_fault(FaultKind::kBlockId, FaultArg::kBlockTable, 1, 0, value, pc.h.num_blocks);
    }
  }
}

// Each split merge meets the faulted mark: the separate kernel and the last CTA's (bit for bit
// for the other rows) and the last CTA's over L2 sums (their last bits vary between runs).
TEST(DecodeFault, EverySplitMergeZeroesTheFaultingRow) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  struct Restore {
    ~Restore() { cuda::set_decode_merge_mode(cuda::DecodeMergeMode::kAuto); }
  } restore;
  for (cuda::DecodeMergeMode mode :
       {cuda::DecodeMergeMode::kSeparate, cuda::DecodeMergeMode::kInKernel,
        cuda::DecodeMergeMode::kAccumulate}) {
    cuda::set_decode_merge_mode(mode);
    const bool bitwise = mode != cuda::DecodeMergeMode::kAccumulate;
    SCOPED_TRACE(detail::concat("merge mode ", static_cast<int>(mode)));
    DecodeCase c = paged_case(8, 2, {300, 500, 120});
    c.num_splits = 6;
    PreparedCase pc(c, 9600 + static_cast<int>(mode));
    ASSERT_NO_THROW(check_device_errors());
    const Outputs good = run(pc);
    EXPECT_NO_THROW(check_device_errors());
    pc.check();
    {
      BadTableEntry bad(pc, 1, 20, 10000);  // keys 320-335: split 2 of 128 keys each
      expect_row_zeroed(pc, good, run(pc), 1, bitwise);
    }
    expect_decode_fault(FaultKind::kBlockId, FaultArg::kBlockTable, 1, 20, 10000, pc.h.num_blocks);
  }
}

// seq_len past the row's table (the issue's report: 5000 tokens over a 7-entry table of 16-token
// pages, capacity 112) and negative, on the mma.sync kernels and the wgmma one, split or not.
TEST(DecodeFault, BadSeqLen) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  uint64_t salt = 9700;
  struct Shape {
    int32_t hq, hkv;
    DType kv;
    int rows;
  };
  for (const Shape& s : {Shape{8, 2, DType::kBF16, 3}, Shape{8, 2, DType::kFp8E4M3, 3},
                         Shape{16, 1, DType::kBF16, 10}}) {
    for (int32_t splits : {1, 4, 0}) {
      std::vector<int32_t> lens(s.rows, 60);
      lens[0] = 112;  // 7 columns of 16-token pages
      lens[2] = 37;
      DecodeCase c = paged_case(s.hq, s.hkv, lens, s.kv);
      c.num_splits = splits;
      SCOPED_TRACE(c.str());
      PreparedCase pc(c, salt++);
      ASSERT_EQ(pc.h.max_blocks, 7);
      ASSERT_NO_THROW(check_device_errors());
      const Outputs good = run(pc);
      EXPECT_NO_THROW(check_device_errors());
      for (int32_t value : {5000, 113, -3}) {
        SCOPED_TRACE(detail::concat("seq_lens[1] = ", value));
        {
          BadSeqLen bad(pc, 1, value);
          expect_row_zeroed(pc, good, run(pc), 1);
        }
        expect_decode_fault(FaultKind::kSeqLen, FaultArg::kSeqLens, 1, 0, value, 112);
      }
    }
  }
}

// A cyclic cache's length is unbounded (its slots wrap); a negative one is a fault.
TEST(DecodeFault, CyclicCacheNegativeSeqLen) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  DecodeCase c = paged_case(8, 2, {200, 150, 30});
  c.cyclic = true;
  c.mask.kind = MaskKind::kSlidingWindow;
  c.mask.window = 40;
  c.num_splits = 2;
  PreparedCase pc(c, 9800);
  ASSERT_NO_THROW(check_device_errors());
  const Outputs good = run(pc);
  EXPECT_NO_THROW(check_device_errors());
  {
    BadSeqLen bad(pc, 1, -1);
    expect_row_zeroed(pc, good, run(pc), 1);
  }
  expect_decode_fault(FaultKind::kSeqLen, FaultArg::kSeqLens, 1, 0, -1,
                      std::numeric_limits<int64_t>::max());
}

// A cache_indirection entry that names no beam (beam_width 2): row s * 2 + b, index t.
TEST(DecodeFault, BadCacheIndirectionEntry) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  for (bool paged : {true, false}) {
    for (int32_t splits : {1, 4}) {
      DecodeCase c = paged_case(8, 2, {70, 70, 130, 130});
      c.paged = paged;
      c.beam_width = 2;
      c.num_splits = splits;
      SCOPED_TRACE(c.str());
      PreparedCase pc(c, 9900 + splits + (paged ? 10 : 0));
      ASSERT_NO_THROW(check_device_errors());
      const Outputs good = run(pc);
      EXPECT_NO_THROW(check_device_errors());
      pc.check();
      const int64_t max_seq = pc.h.indirection.view().shape[2];
      for (int32_t value : {7, -1}) {
        // Sequence 1, beam 0 (row 2), position 100.
        HostTensor ind = pc.h.indirection;
        ind.data<int32_t>()[(1 * 2 + 0) * max_seq + 100] = value;
        pc.d_ind.upload(ind);
        const Outputs got = run(pc);
        pc.d_ind.upload(pc.h.indirection);
        expect_row_zeroed(pc, good, got, 2);
        expect_decode_fault(FaultKind::kIndirection, FaultArg::kCacheIndirection, 2, 100, value, 2);
      }
    }
  }
}

// Checked mode: the call itself throws DeviceFaultError (and clears the word); the outputs are
// written as in the default mode.
TEST(DecodeFault, CheckedModeThrowsAtOnce) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  for (int32_t splits : {1, 4}) {
    DecodeCase c = paged_case(8, 2, {90, 300, 47});
    c.num_splits = splits;
    PreparedCase pc(c, 9950 + splits);
    pc.args.checked = true;
    ASSERT_NO_THROW(check_device_errors());
    EXPECT_NO_THROW(decode(pc.spec, pc.args, nullptr));  // valid: nothing to report
    BadTableEntry bad(pc, 1, 3, 10000);
    try {
      decode(pc.spec, pc.args, nullptr);
      ADD_FAILURE() << "checked mode did not throw";
    } catch (const DeviceFaultError& e) {
      EXPECT_EQ(e.fault().kind, static_cast<int32_t>(FaultKind::kBlockId));
      EXPECT_EQ(e.fault().row, 1);
      EXPECT_EQ(e.fault().index, 3);
      EXPECT_EQ(e.fault().value, 10000);
    }
    EXPECT_NO_THROW(check_device_errors());
  }
}

}  // namespace
}  // namespace attnkit::test
