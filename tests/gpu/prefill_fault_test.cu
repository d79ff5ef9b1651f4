// The device-side guards of the fused prefill kernels (docs/safety.md, prefill) through the public
// API, for the portable kernel and the sm90 kernel (AttentionSpec::fused_kernel): block-table
// entries outside the pool (10000 and -1 in an 8-block pool), kv_seq_lens past the table,
// cu_seqlens_q out of order and past the packed extent, bad cu_seqlens_kv. Each call returns;
// check_device_errors() reports the fault (kind, argument, row, index, value, bound); the
// faulting sequence's rows are zeros with LSE -inf (a bad key range or page) or are not written at
// all (a bad query range); the other sequences equal the same call with good metadata bit for bit;
// the guard bands around out and lse (and, for a bad query range, the sentinel rows no good
// sequence owns) are unchanged. Data are random everywhere (no poison): the comparison is with the
// same kernel's good call, not with a reference.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/device_errors.h"
#include "common/output_rows.h"
#include "common/test_util.h"
#include "cuda/prefill/prefill_api.h"
#include "cuda/prefill/prefill_launch.h"
#include "gpu/fault_test_util.h"
#include "gpu/gpu_util.h"

namespace attnkit::test {
namespace {

using cuda::prefill::PrefillTile;

constexpr int kD = 128;
constexpr int kHq = 4;
constexpr int kHkv = 2;
constexpr int64_t kGuardBytes = 64 << 10;  // guard bands before and after out and lse
constexpr float kOutSentinel = 12345.f;
constexpr float kLseSentinel = 777.f;

// One batch: packed K/V or a paged (possibly cyclic) cache of num_blocks blocks.
struct Batch {
  bool paged = true;
  DType kv_dtype = DType::kBF16;  // paged: bf16 or fp8_e4m3
  MaskSpec mask{};                // causal by default
  int window_slots = 0;           // > 0: cyclic cache (mask sliding window)
  std::vector<int> q_lens, kv_lens;
  int page = 16;
  int table_cols = 4;
  int num_blocks = 8;
};

// The metadata of one call (host copies; uploaded per call).
struct Meta {
  std::vector<int32_t> cu_q, cu_kv, table, seq_lens;
};

struct Data {
  Batch s;
  int batch = 0;
  int64_t total_q = 0, total_kv = 0;
  HostTensor q, k, v, pool, k_scale, v_scale;
  Meta good;
};

Data make_data(const Batch& s, uint64_t salt) {
  std::mt19937_64 rng(test_seed() ^ salt);
  Data d;
  d.s = s;
  d.batch = static_cast<int>(s.q_lens.size());
  d.good.cu_q.assign(1, 0);
  d.good.cu_kv.assign(1, 0);
  for (int b = 0; b < d.batch; ++b) {
    d.good.cu_q.push_back(d.good.cu_q.back() + s.q_lens[b]);
    d.good.cu_kv.push_back(d.good.cu_kv.back() + s.kv_lens[b]);
  }
  d.total_q = d.good.cu_q.back();
  d.total_kv = d.good.cu_kv.back();
  d.q = HostTensor(DType::kBF16, {d.total_q, kHq, kD});
  d.q.fill_uniform(rng, -1.f, 1.f);
  if (!s.paged) {
    d.k = HostTensor(DType::kBF16, {d.total_kv, kHkv, kD});
    d.v = HostTensor(DType::kBF16, {d.total_kv, kHkv, kD});
    d.k.fill_uniform(rng, -1.f, 1.f);
    d.v.fill_uniform(rng, -1.f, 1.f);
    return d;
  }
  d.pool = HostTensor(s.kv_dtype, {s.num_blocks, 2, kHkv, s.page, kD});
  d.pool.fill_uniform(rng, -1.f, 1.f);
  d.k_scale = HostTensor(DType::kF32, {1});
  d.v_scale = HostTensor(DType::kF32, {1});
  d.k_scale.set(0, 0.75f);
  d.v_scale.set(0, 1.25f);
  // Every row holds the blocks of the slots it uses (a cyclic row at most sinks + window_slots),
  // from a shuffled pool; the columns after them are -1 (never read).
  std::vector<int32_t> ids(s.num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  d.good.table.assign(static_cast<size_t>(d.batch) * s.table_cols, -1);
  int next = 0;
  for (int b = 0; b < d.batch; ++b) {
    int slots = s.kv_lens[b];
    if (s.window_slots > 0) slots = std::min(slots, s.mask.sink_tokens + s.window_slots);
    const int blocks = (slots + s.page - 1) / s.page;
    EXPECT_LE(blocks, s.table_cols);
    for (int i = 0; i < blocks; ++i) d.good.table[b * s.table_cols + i] = ids.at(next++);
    d.good.seq_lens.push_back(s.kv_lens[b]);
  }
  return d;
}

HostTensor i32_tensor(const std::vector<int32_t>& values, std::vector<int64_t> shape) {
  HostTensor t(DType::kInt32, shape);
  std::copy(values.begin(), values.end(), t.data<int32_t>());
  return t;
}

// out and lse of one call: what the call left in device buffers that held the sentinels
// (fresh_out, fresh_lse) between guard bands (checked when they are read back).
struct Result {
  HostTensor out, lse;
  int64_t total_q = 0;
  OutputRows rows() const {
    return {out.bytes().data(), size_t{kHq} * kD * 2, lse.data<float>(), kHq, total_q};
  }
};

HostTensor fresh_out(int64_t total_q) {
  HostTensor out(DType::kBF16, {total_q, kHq, kD});
  out.fill(kOutSentinel);
  return out;
}
HostTensor fresh_lse(int64_t total_q) {
  HostTensor lse(DType::kF32, {total_q, kHq});
  lse.fill(kLseSentinel);
  return lse;
}

// The tensor's own bytes (without HostTensor's padding).
std::vector<uint8_t> bytes_of(const HostTensor& t) {
  const auto* first = t.bytes().data();
  return std::vector<uint8_t>(first, first + t.numel() * dtype_size(t.dtype()));
}

// Reads `buffer` back into `t` (its content has t's bytes), checking its guard bands.
void download_into(HostTensor& t, const GuardedDeviceBuffer& buffer, const char* what) {
  const std::vector<uint8_t> bytes = buffer.download_checking_guards(what);
  std::memcpy(t.view().data, bytes.data(), bytes.size());
}

AttentionSpec spec_of(const Batch& s, FusedKernel kernel) {
  AttentionSpec spec;
  spec.num_q_heads = kHq;
  spec.num_kv_heads = kHkv;
  spec.head_dim = kD;
  spec.mask = s.mask;
  spec.backend = Backend::kFused;
  spec.fused_kernel = kernel;
  return spec;
}

// Runs the fused prefill of `d` with metadata `m`; the call must return without an exception.
Result run(const Data& d, const Meta& m, FusedKernel kernel) {
  const Batch& s = d.s;
  Result r;
  r.total_q = d.total_q;
  r.out = fresh_out(d.total_q);
  r.lse = fresh_lse(d.total_q);
  GuardedDeviceBuffer d_out(bytes_of(r.out), kGuardBytes), d_lse(bytes_of(r.lse), kGuardBytes);
  DeviceTensor d_q(d.q);
  DeviceTensor d_cu_q(i32_tensor(m.cu_q, {d.batch + 1}));
  DeviceTensor d_cu_kv, d_k, d_v, d_pool, d_table, d_lens, d_ks, d_vs;
  PrefillArgs args;
  args.q = d_q;
  args.cu_seqlens_q = d_cu_q;
  args.out = TensorView(d_out.data(), DType::kBF16, {d.total_q, kHq, kD}, Device::cuda(0));
  args.lse = TensorView(d_lse.data(), DType::kF32, {d.total_q, kHq}, Device::cuda(0));
  // The good call's bounds: a bad entry must not change what the call is told.
  args.max_seqlen_q = *std::max_element(s.q_lens.begin(), s.q_lens.end());
  args.max_seqlen_kv = *std::max_element(s.kv_lens.begin(), s.kv_lens.end());
  KvCacheView view;
  if (!s.paged) {
    d_cu_kv = DeviceTensor(i32_tensor(m.cu_kv, {d.batch + 1}));
    d_k = DeviceTensor(d.k);
    d_v = DeviceTensor(d.v);
    args.k = d_k;
    args.v = d_v;
    args.cu_seqlens_kv = d_cu_kv;
  } else {
    d_pool = DeviceTensor(d.pool);
    d_table = DeviceTensor(i32_tensor(m.table, {d.batch, s.table_cols}));
    d_lens = DeviceTensor(i32_tensor(m.seq_lens, {d.batch}));
    d_ks = DeviceTensor(d.k_scale);
    d_vs = DeviceTensor(d.v_scale);
    view = paged_cache_view(d_pool.data(), s.kv_dtype, s.num_blocks, kHkv, s.page, kD);
    view.block_table = d_table;
    view.seq_lens = d_lens;
    view.k_scale = d_ks;
    view.v_scale = d_vs;
    view.window_slots = s.window_slots;
    view.sink_tokens = s.window_slots > 0 ? s.mask.sink_tokens : 0;
    args.kv_cache = &view;
  }
  EXPECT_NO_THROW(prefill(spec_of(s, kernel), args));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  download_into(r.out, d_out, "out");
  download_into(r.lse, d_lse, "lse");
  return r;
}

struct Expected {
  FaultKind kind;
  FaultArg arg;
  int64_t row, index, value, bound;
};

// check_device_errors() reports this fault of a prefill call (exactly_once: and no other).
void expect_prefill_fault(const Expected& want, bool exactly_once = false) {
  expect_fault(take_device_fault(), {want.kind, want.arg, Op::kPrefill, want.row, want.index,
                                     want.value, want.bound, exactly_once ? 1u : 0u});
}

// Token rows [begin, end) of `got` and `ref` hold the same bytes (out and lse).
void expect_rows_equal(const Result& got, const Result& ref, int64_t begin, int64_t end,
                       const char* what) {
  for (int64_t t = begin; t < end; ++t) {
    ASSERT_TRUE(same_row(got.rows(), t, ref.rows(), t)) << what;
  }
}

void expect_rows_zero(const Result& r, int64_t begin, int64_t end, const char* what) {
  for (int64_t t = begin; t < end; ++t) ASSERT_TRUE(is_zeroed_row(r.rows(), t)) << what;
}

// Token rows [begin, end) still hold the sentinels (never written).
void expect_rows_untouched(const Result& r, int64_t begin, int64_t end, const char* what) {
  Result fresh;
  fresh.total_q = r.total_q;
  fresh.out = fresh_out(r.total_q);
  fresh.lse = fresh_lse(r.total_q);
  for (int64_t t = begin; t < end; ++t) {
    ASSERT_TRUE(same_row(r.rows(), t, fresh.rows(), t)) << what << ": row " << t << " was written";
  }
}

// Every row written with finite values (a valid call).
void expect_all_written(const Result& r, const char* what) {
  for (int64_t t = 0; t < r.total_q; ++t) {
    for (int64_t i = 0; i < kHq * kD; ++i) {
      const float x = r.out.get(t * kHq * kD + i);
      ASSERT_TRUE(std::isfinite(x) && x != kOutSentinel) << what << ": out row " << t << " = " << x;
    }
    for (int h = 0; h < kHq; ++h) {
      ASSERT_NE(r.lse.get(t * kHq + h), kLseSentinel) << what << ": lse row " << t << " unwritten";
    }
  }
}

// The kernels of this build that this GPU runs for head_dim 128 bf16: the portable one, and the
// sm90 one on an H100 / H200.
std::vector<FusedKernel> kernels() {
  std::vector<FusedKernel> out;
  const std::vector<PrefillTile> tiles = cuda::prefill::runnable_tiles(kD, DType::kBF16, 0);
  const bool sm90 = std::find(tiles.begin(), tiles.end(), PrefillTile::kSm90) != tiles.end();
  if (tiles.size() > (sm90 ? 1u : 0u)) out.push_back(FusedKernel::kPortable);
  if (sm90) {
    out.push_back(FusedKernel::kHopper);
  } else {
    std::printf("[ SKIPPED  ] the sm90 kernel: not built or not this GPU; portable kernel only\n");
  }
  return out;
}

MaskSpec mask_of(MaskKind kind, int window = 0, int sinks = 0) {
  MaskSpec m;
  m.kind = kind;
  m.window = window;
  m.sink_tokens = sinks;
  return m;
}

// Three sequences; paged: 3 + 3 + 2 = 8 blocks of 16 tokens fill the 8-block pool, 4 columns a row.
Batch small_batch(bool paged, MaskKind mask = MaskKind::kCausal) {
  Batch s;
  s.paged = paged;
  s.mask = mask_of(mask);
  s.q_lens = {40, 17, 9};
  s.kv_lens = {48, 40, 32};
  return s;
}

std::string trace_of(FusedKernel kernel, const std::string& what) {
  return std::string("fused_kernel=") + fused_kernel_name(kernel) + " " + what;
}

// ---- no fault
// ------------------------------------------------------------------------------------
TEST(PrefillFault, ValidCallsRecordNothing) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  drain_device_faults();
  for (FusedKernel kernel : kernels()) {
    for (bool paged : {false, true}) {
      SCOPED_TRACE(trace_of(kernel, paged ? "paged" : "packed"));
      const Data d = make_data(small_batch(paged), paged ? 1 : 2);
      const Result r = run(d, d.good, kernel);
      EXPECT_FALSE(take_device_fault().faulted) << "a valid call recorded a fault";
      expect_all_written(r, "valid call");
      if (HasFatalFailure()) return;
    }
  }
}

// ---- block ids
// ----------------------------------------------------------------------------------- Sequence 1's
// page 1 (keys 16..31, attended by all its rows) holds a bad id: the sequence is zeros with LSE
// -inf, the others are exact, under both masks, for 16-bit and fp8 caches.
TEST(PrefillFault, PagedBadBlockIdZerosTheSequence) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  drain_device_faults();
  for (FusedKernel kernel : kernels()) {
    for (DType kv : {DType::kBF16, DType::kFp8E4M3}) {
      for (MaskKind mask : {MaskKind::kCausal, MaskKind::kNone}) {
        Batch s = small_batch(true, mask);
        s.kv_dtype = kv;
        const Data d = make_data(s, 3);
        const Result good = run(d, d.good, kernel);
        ASSERT_FALSE(take_device_fault().faulted);
        for (int32_t bad : {10000, -1}) {
          SCOPED_TRACE(trace_of(kernel, std::string("kv=") + dtype_name(kv) + " mask=" +
                                            mask_name(mask) + " id=" + std::to_string(bad)));
          Meta m = d.good;
          m.table[1 * s.table_cols + 1] = bad;
          const Result r = run(d, m, kernel);
          expect_prefill_fault({FaultKind::kBlockId, FaultArg::kBlockTable, 1, 1, bad, 8});
          expect_rows_equal(r, good, 0, 40, "sequence 0");
          expect_rows_zero(r, 40, 57, "sequence 1");
          expect_rows_equal(r, good, 57, 66, "sequence 2");
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

// A cyclic (sliding-window) cache: the portable kernel's per-chunk copy and the sm90 kernel's
// gathered copy read the table per row. Window 20 with 4 sinks: sequence 0's queries (positions
// 91..99) attend keys 72..99 in slots 24..51, and page 2 (slots 32..47) is bad.
TEST(PrefillFault, CyclicCacheBadBlockId) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  drain_device_faults();
  Batch s;
  s.mask = mask_of(MaskKind::kSlidingWindow, 20, 4);
  s.window_slots = cyclic_window_slots(20, 16);  // 48: 4 + 48 slots fill 4 pages of a row
  s.q_lens = {9, 5};
  s.kv_lens = {100, 60};
  s.table_cols = 4;
  s.num_blocks = 8;
  for (FusedKernel kernel : kernels()) {
    SCOPED_TRACE(trace_of(kernel, "cyclic"));
    const Data d = make_data(s, 4);
    const Result good = run(d, d.good, kernel);
    ASSERT_FALSE(take_device_fault().faulted);
    Meta m = d.good;
    m.table[0 * s.table_cols + 2] = 10000;
    const Result r = run(d, m, kernel);
    expect_prefill_fault({FaultKind::kBlockId, FaultArg::kBlockTable, 0, 2, 10000, 8});
    expect_rows_zero(r, 0, 9, "sequence 0");
    expect_rows_equal(r, good, 9, 14, "sequence 1");
    if (HasFatalFailure()) return;
  }
}

// A bad page at the end of a long causal sequence: the query blocks whose keys reach it are zeros,
// the others (rows 0..127 see keys 0..127 only) are exact, and every row is one or the other.
TEST(PrefillFault, BadPageZerosOnlyTheQueryBlocksThatReadIt) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  drain_device_faults();
  Batch s;
  s.q_lens = {300, 50};
  s.kv_lens = {300, 50};
  s.table_cols = 20;
  s.num_blocks = 19 + 4 + 1;
  for (FusedKernel kernel : kernels()) {
    SCOPED_TRACE(trace_of(kernel, "long causal"));
    const Data d = make_data(s, 5);
    const Result good = run(d, d.good, kernel);
    ASSERT_FALSE(take_device_fault().faulted);
    Meta m = d.good;
    m.table[0 * s.table_cols + 18] = 10000;  // keys 288..299
    const Result r = run(d, m, kernel);
    expect_prefill_fault({FaultKind::kBlockId, FaultArg::kBlockTable, 0, 18, 10000, s.num_blocks});
    expect_rows_equal(r, good, 0, 128, "query rows 0..127");
    expect_rows_zero(r, 299, 300, "the last query row");
    for (int64_t t = 128; t < 300; ++t) {
      if (is_zeroed_row(r.rows(), t)) continue;
      expect_rows_equal(r, good, t, t + 1, "a row not zeroed");
    }
    expect_rows_equal(r, good, 300, 350, "sequence 1");
    if (HasFatalFailure()) return;
  }
}

// ---- kv_seq_lens
// -----------------------------------------------------------------------------------
TEST(PrefillFault, SeqLensPastTheTable) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  drain_device_faults();
  for (FusedKernel kernel : kernels()) {
    const Batch s = small_batch(true);
    const Data d = make_data(s, 6);
    const Result good = run(d, d.good, kernel);
    ASSERT_FALSE(take_device_fault().faulted);
    {
      SCOPED_TRACE(trace_of(kernel, "seq_lens[2] = 65 > 4 x 16"));
      Meta m = d.good;
      m.seq_lens[2] = 65;
      const Result r = run(d, m, kernel);
      expect_prefill_fault({FaultKind::kSeqLen, FaultArg::kSeqLens, 2, 0, 65, 64}, true);
      expect_rows_equal(r, good, 0, 57, "sequences 0 and 1");
      expect_rows_zero(r, 57, 66, "sequence 2");
    }
    {
      SCOPED_TRACE(trace_of(kernel, "seq_lens[0] = -3"));
      Meta m = d.good;
      m.seq_lens[0] = -3;
      const Result r = run(d, m, kernel);
      expect_prefill_fault({FaultKind::kSeqLen, FaultArg::kSeqLens, 0, 0, -3, 64}, true);
      expect_rows_zero(r, 0, 40, "sequence 0");
      expect_rows_equal(r, good, 40, 66, "sequences 1 and 2");
    }
    if (HasFatalFailure()) return;
  }
}

// ---- cu_seqlens_q
// ------------------------------------------------------------------------------------ Good
// cu_seqlens_q: 0, 40, 57, 66. A sequence whose query range is bad writes nothing.
TEST(PrefillFault, CuSeqlensQOutOfOrder) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  drain_device_faults();
  for (FusedKernel kernel : kernels()) {
    for (bool paged : {false, true}) {
      SCOPED_TRACE(trace_of(kernel, paged ? "paged" : "packed"));
      const Data d = make_data(small_batch(paged), 7);
      const Result good = run(d, d.good, kernel);
      ASSERT_FALSE(take_device_fault().faulted);
      // cu[2] = 30 < cu[1] = 40: sequence 1 has no rows; sequence 2 ([30, 66)) starts before its
      // predecessor's start and writes nothing either, so sequence 0's rows 30..39 stay its own.
      Meta m = d.good;
      m.cu_q[2] = 30;
      const Result r = run(d, m, kernel);
      expect_prefill_fault({FaultKind::kCuSeqlensOrder, FaultArg::kCuSeqlensQ, 1, 2, 30, 40}, true);
      expect_rows_equal(r, good, 0, 40, "sequence 0");
      expect_rows_untouched(r, 40, 66, "sequences 1 and 2");
      if (HasFatalFailure()) return;
    }
  }
}

// Entries past the packed extent (66 rows) or negative: the kernel writes nothing outside out and
// lse, and nothing for the sequences that end or start at the bad entry.
TEST(PrefillFault, CuSeqlensQPastTheExtent) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  drain_device_faults();
  for (FusedKernel kernel : kernels()) {
    for (bool paged : {false, true}) {
      const Data d = make_data(small_batch(paged), 8);
      const Result good = run(d, d.good, kernel);
      ASSERT_FALSE(take_device_fault().faulted);
      {
        SCOPED_TRACE(trace_of(kernel, std::string(paged ? "paged" : "packed") + " cu[2] = 10000"));
        Meta m = d.good;
        m.cu_q[2] = 10000;
        const Result r = run(d, m, kernel);
        expect_prefill_fault({FaultKind::kCuSeqlensRange, FaultArg::kCuSeqlensQ, 1, 2, 10000, 66},
                             true);
        expect_rows_equal(r, good, 0, 40, "sequence 0");
        expect_rows_untouched(r, 40, 66, "sequences 1 and 2");
      }
      {
        SCOPED_TRACE(trace_of(kernel, std::string(paged ? "paged" : "packed") + " cu[3] = 67"));
        Meta m = d.good;
        m.cu_q[3] = 67;  // one row past the extent
        const Result r = run(d, m, kernel);
        expect_prefill_fault({FaultKind::kCuSeqlensRange, FaultArg::kCuSeqlensQ, 2, 3, 67, 66},
                             true);
        expect_rows_equal(r, good, 0, 57, "sequences 0 and 1");
        expect_rows_untouched(r, 57, 66, "sequence 2");
      }
      {
        SCOPED_TRACE(trace_of(kernel, std::string(paged ? "paged" : "packed") + " cu[1] = -5"));
        Meta m = d.good;
        m.cu_q[1] = -5;
        const Result r = run(d, m, kernel);
        expect_prefill_fault({FaultKind::kCuSeqlensRange, FaultArg::kCuSeqlensQ, 0, 1, -5, 66},
                             true);
        expect_rows_untouched(r, 0, 57, "sequences 0 and 1");
        expect_rows_equal(r, good, 57, 66, "sequence 2");
      }
      if (HasFatalFailure()) return;
    }
  }
}

// ---- cu_seqlens_kv (packed) ---------------------------------------------------------------------
// Good cu_seqlens_kv: 0, 48, 88, 120. A sequence whose key range is bad has no keys: zeros.
TEST(PrefillFault, CuSeqlensKvBad) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  drain_device_faults();
  for (FusedKernel kernel : kernels()) {
    const Data d = make_data(small_batch(false), 9);
    const Result good = run(d, d.good, kernel);
    ASSERT_FALSE(take_device_fault().faulted);
    {
      SCOPED_TRACE(trace_of(kernel, "cu_kv[2] = 10000"));
      Meta m = d.good;
      m.cu_kv[2] = 10000;  // sequence 1 ends and sequence 2 starts past the 120 keys
      const Result r = run(d, m, kernel);
      expect_prefill_fault({FaultKind::kCuSeqlensRange, FaultArg::kCuSeqlensKv, 1, 2, 10000, 120},
                           true);
      expect_rows_equal(r, good, 0, 40, "sequence 0");
      expect_rows_zero(r, 40, 66, "sequences 1 and 2");
    }
    {
      SCOPED_TRACE(trace_of(kernel, "cu_kv[2] = 47 < cu_kv[1]"));
      Meta m = d.good;
      m.cu_kv[2] = 47;
      const Result r = run(d, m, kernel);
      expect_prefill_fault({FaultKind::kCuSeqlensOrder, FaultArg::kCuSeqlensKv, 1, 2, 47, 48},
                           true);
      expect_rows_equal(r, good, 0, 40, "sequence 0");
      expect_rows_zero(r, 40, 57, "sequence 1");
      // Sequence 2's own entries (47, 120) are ordered and in range: its keys are read from there.
    }
    {
      SCOPED_TRACE(trace_of(kernel, "cu_kv[3] = 121"));
      Meta m = d.good;
      m.cu_kv[3] = 121;
      const Result r = run(d, m, kernel);
      expect_prefill_fault({FaultKind::kCuSeqlensRange, FaultArg::kCuSeqlensKv, 2, 3, 121, 120},
                           true);
      expect_rows_equal(r, good, 0, 57, "sequences 0 and 1");
      expect_rows_zero(r, 57, 66, "sequence 2");
    }
    if (HasFatalFailure()) return;
  }
}

}  // namespace
}  // namespace attnkit::test
