// Regression tests named after bug classes that other attention engines shipped (docs/testing.md,
// "Bug classes other engines shipped"): an fp8 cache with prefix reuse, K/V scales not applied, a
// sliding window off by one, head_dim 256 paths, a row's result that changes with the batch it is
// in, an int8 cache that reads back as garbage. Every case runs through the public entry points on
// CUDA tensors (the fused backend; context attention with each fused_kernel this build and GPU
// run) and is held to the bound of docs/testing.md against the fp64 oracle and the CPU reference
// (gpu_case_util.h, forward_case_util.h), on fresh random data.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "cuda/cuda_backend.h"
#include "cuda/decode/decode_launch.h"
#include "cuda/prefill/prefill_api.h"
#include "gpu/forward_case_util.h"
#include "gpu/gpu_case_util.h"

namespace attnkit::test {
namespace {

using cuda::prefill::PrefillTile;

// ---- which kernels run here ---------------------------------------------------------------------

// Whether context attention with spec.fused_kernel = `kernel` runs (head_dim, dtype) in this build
// on this GPU: kPortable where a mma.sync tile is compiled and fits, kHopper where the sm90 kernel
// is compiled and the GPU is an H100 / H200, kAuto where either is. Says so when it does not.
bool kernel_runs(FusedKernel kernel, int32_t head_dim, DType dtype) {
  const std::vector<PrefillTile> tiles = cuda::prefill::runnable_tiles(head_dim, dtype, 0);
  const bool sm90 = std::find(tiles.begin(), tiles.end(), PrefillTile::kSm90) != tiles.end();
  const bool portable = std::any_of(tiles.begin(), tiles.end(),
                                    [](PrefillTile t) { return t != PrefillTile::kSm90; });
  const bool runs = kernel == FusedKernel::kHopper     ? sm90
                    : kernel == FusedKernel::kPortable ? portable
                                                       : portable || sm90;
  if (!runs) {
    std::printf("[ SKIPPED  ] fused_kernel %s at head_dim %d %s: not in this build or this GPU\n",
                fused_kernel_name(kernel), head_dim, dtype_name(dtype));
  }
  return runs;
}

// Whether the fused decode serves head_dim / the cache dtype in this build (else says so).
bool decode_runs(const AttentionSpec& spec, DType dtype, DType kv_dtype) {
  detail::DecodeProblem p;
  p.device = Device::cuda(0);
  p.dtype = dtype;
  p.kv_dtype = kv_dtype;
  p.num_rows = 1;
  const std::string why = cuda::fused_decode_unsupported(spec, p);
  if (!why.empty()) std::printf("[ SKIPPED  ] fused decode: %s\n", why.c_str());
  return why.empty();
}

// The Hopper warpgroup-MMA decode kernel (decode_wgmma.cu): on an H100 / H200 with sm_90a code.
bool wgmma_decode_available() {
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return major == 9 && cuda::decode_wgmma_compiled();
}

int64_t wgmma_launches() { return cuda::decode_wgmma_launches(2) + cuda::decode_wgmma_launches(3); }

std::string kernel_str(FusedKernel kernel) {
  return std::string(" fused_kernel=") + fused_kernel_name(kernel);
}

AttentionSpec plain_spec(int32_t hq, int32_t hkv, int32_t d, MaskSpec mask = {}) {
  AttentionSpec spec;
  spec.num_q_heads = hq;
  spec.num_kv_heads = hkv;
  spec.head_dim = d;
  spec.mask = mask;
  return spec;
}

MaskSpec window_of(int32_t window, int32_t sinks) {
  MaskSpec m;
  m.kind = MaskKind::kSlidingWindow;
  m.window = window;
  m.sink_tokens = sinks;
  return m;
}

// ---- data ---------------------------------------------------------------------------------------

// A packed batch: Q [total_q, Hq, D], K / V [total_kv, Hkv, D] of one dtype, uniform in [-1, 1].
struct PackedBatch {
  std::vector<int32_t> q_lens, kv_lens, cu_q{0}, cu_kv{0};
  HostTensor q, k, v;
};

PackedBatch packed_batch(DType dtype, int32_t hq, int32_t hkv, int32_t d,
                         const std::vector<int32_t>& q_lens, const std::vector<int32_t>& kv_lens,
                         std::mt19937_64& rng) {
  PackedBatch b;
  b.q_lens = q_lens;
  b.kv_lens = kv_lens;
  for (size_t i = 0; i < q_lens.size(); ++i) {
    b.cu_q.push_back(b.cu_q.back() + q_lens[i]);
    b.cu_kv.push_back(b.cu_kv.back() + kv_lens[i]);
  }
  b.q = HostTensor(dtype, {b.cu_q.back(), hq, d});
  b.k = HostTensor(dtype, {b.cu_kv.back(), hkv, d});
  b.v = HostTensor(dtype, {b.cu_kv.back(), hkv, d});
  b.q.fill_uniform(rng, -1.0f, 1.0f);
  b.k.fill_uniform(rng, -1.0f, 1.0f);
  b.v.fill_uniform(rng, -1.0f, 1.0f);
  return b;
}

// Elements [first, first + count) of `t` (same dtype, exact copies) as a tensor of `shape`.
HostTensor elements_of(const HostTensor& t, int64_t first, int64_t count,
                       const std::vector<int64_t>& shape) {
  HostTensor out(t.dtype(), shape);
  const size_t elt = dtype_size(t.dtype());
  std::memcpy(out.view().data, t.bytes().data() + first * elt, static_cast<size_t>(count) * elt);
  return out;
}

// Sequence i of `b` as a batch of its own (the same values).
PackedBatch sequence_of(const PackedBatch& b, size_t i) {
  const int64_t hq = b.q.view().shape[1], hkv = b.k.view().shape[1], d = b.q.view().shape[2];
  PackedBatch one;
  one.q_lens = {b.q_lens[i]};
  one.kv_lens = {b.kv_lens[i]};
  one.cu_q = {0, b.q_lens[i]};
  one.cu_kv = {0, b.kv_lens[i]};
  one.q = elements_of(b.q, b.cu_q[i] * hq * d, b.q_lens[i] * hq * d, {b.q_lens[i], hq, d});
  one.k = elements_of(b.k, b.cu_kv[i] * hkv * d, b.kv_lens[i] * hkv * d, {b.kv_lens[i], hkv, d});
  one.v = elements_of(b.v, b.cu_kv[i] * hkv * d, b.kv_lens[i] * hkv * d, {b.kv_lens[i], hkv, d});
  return one;
}

// V of key j (its position in the sequence) is e_{j mod D} for every head: see
// expect_attends_exactly.
void make_v_one_hot(PackedBatch& b) {
  const int64_t hkv = b.v.view().shape[1], d = b.v.view().shape[2];
  for (size_t i = 0; i < b.kv_lens.size(); ++i) {
    for (int64_t j = 0; j < b.kv_lens[i]; ++j) {
      for (int64_t h = 0; h < hkv; ++h) {
        for (int64_t e = 0; e < d; ++e) {
          b.v.set(((b.cu_kv[i] + j) * hkv + h) * d + e, e == j % d ? 1.0f : 0.0f);
        }
      }
    }
  }
}

// Random K/V scales of an 8-bit cache (one per tensor or per KV head) for values of magnitude up
// to max_abs: codes up to 1/2 to 1 of the format's largest (int8 127, fp8 448), never saturated.
// 16-bit caches keep no scales.
void set_random_scales(OracleKvCache& cache, bool per_head, double max_abs, std::mt19937_64& rng) {
  const KvCacheView view = cache.view();
  if (view.dtype != DType::kInt8 && view.dtype != DType::kFp8E4M3) return;
  const double top = view.dtype == DType::kInt8 ? 127.0 : 448.0;
  std::uniform_real_distribution<double> s(max_abs / top, 2.0 * max_abs / top);
  std::vector<float> k(per_head ? view.num_kv_heads : 1), v(k.size());
  for (float& x : k) x = static_cast<float>(s(rng));
  for (float& x : v) x = static_cast<float>(s(rng));
  cache.set_scales(k, v);
}

// Writes positions [0, len) of `row` in order (a cyclic cache keeps the newest in each slot),
// quantized with the cache's scales: K uniform in [-1, 1], V too or one-hot e_{p mod D}.
void fill_row(OracleKvCache& cache, int64_t row, int64_t len, bool one_hot_v,
              std::mt19937_64& rng) {
  const KvCacheView view = cache.view();
  const int32_t d = view.head_dim;
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<double> x(static_cast<size_t>(d));
  for (int64_t p = 0; p < len; ++p) {
    for (int32_t h = 0; h < view.num_kv_heads; ++h) {
      for (double& e : x) e = u(rng);
      cache.write(row, p, h, 0, x.data());
      for (int32_t e = 0; e < d; ++e) x[e] = one_hot_v ? (e == p % d ? 1.0 : 0.0) : u(rng);
      cache.write(row, p, h, 1, x.data());
    }
  }
}

// Row `row` of a paged `cache` as a cache of one row: its blocks' bytes copied into blocks of a
// fresh pool (other ids), the same scales and length.
OracleKvCache row_copy(const OracleKvCache& cache, int64_t row, std::mt19937_64& rng) {
  const KvCacheView v = cache.view();
  const int64_t cols = v.block_table.shape[1];
  OracleKvCache one = OracleKvCache::paged(v.dtype, v.num_kv_heads, v.head_dim, v.tokens_per_block,
                                           1, static_cast<int32_t>(cols), rng);
  const int32_t* table = static_cast<const int32_t*>(v.block_table.data);
  const auto* src = static_cast<const uint8_t*>(cache.pool().view().data);
  auto* dst = static_cast<uint8_t*>(one.pool().view().data);
  for (int64_t b = 0; b < cols; ++b) {
    std::memcpy(dst + one.block_id(0, b) * v.block_stride_bytes,
                src + table[row * cols + b] * v.block_stride_bytes,
                static_cast<size_t>(v.block_stride_bytes));
  }
  if (v.k_scale.defined()) {
    const auto* ks = static_cast<const float*>(v.k_scale.data);
    const auto* vs = static_cast<const float*>(v.v_scale.data);
    one.set_scales(std::vector<float>(ks, ks + v.k_scale.numel()),
                   std::vector<float>(vs, vs + v.v_scale.numel()));
  }
  one.set_seq_len(0, static_cast<const int32_t*>(v.seq_lens.data)[row]);
  return one;
}

int32_t seq_len_of(const OracleKvCache& cache, int64_t row) {
  return static_cast<const int32_t*>(cache.view().seq_lens.data)[row];
}

// ---- the calls, each against the oracle and the CPU reference ----------------------------------

int32_t longest(const std::vector<int32_t>& lens) {
  return std::max(1, *std::max_element(lens.begin(), lens.end()));
}

// Runs call(out, lse), a GPU call that writes into the device outputs it is given (NaN-poisoned,
// of cpu_out's and cpu_lse's shapes), and holds what it wrote to the fp64 oracle and the CPU
// reference's outputs (expect_attention_matches). `outs` (optional) receives the output.
template <typename Call>
void check_gpu_call(const std::string& run, const OracleAccumulator& oracle,
                    const HostTensor& cpu_out, const HostTensor& cpu_lse,
                    std::vector<HostTensor>* outs, Call call) {
  HostTensor out_poison = cpu_out, lse_poison = cpu_lse;
  out_poison.fill(NAN);
  lse_poison.fill(NAN);
  DeviceTensor dout(out_poison), dlse(lse_poison);
  ASSERT_NO_THROW(call(dout.view(), dlse.view())) << run;
  ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
  const HostTensor out = downloaded(dout, cpu_out), lse = downloaded(dlse, cpu_lse);
  expect_attention_matches(run, oracle, out, &lse, cpu_out, &cpu_lse);
  if (outs != nullptr) outs->push_back(out);
}

// Prefill over a packed batch on the CPU reference and on the GPU (backend fused) with each of
// `kernels`: every output within docs/testing.md's bound of the fp64 oracle
// (expect_attention_matches). `outs` (optional) receives the GPU outputs of the kernels that ran.
void check_packed_prefill(const std::string& what, const AttentionSpec& spec, const PackedBatch& b,
                          std::initializer_list<FusedKernel> kernels,
                          std::vector<HostTensor>* outs = nullptr) {
  const int32_t hq = spec.num_q_heads, d = spec.head_dim;
  const int64_t hkv = spec.num_kv_heads;
  const DType dtype = b.q.dtype();
  const int64_t tq = b.cu_q.back();
  HostTensor hcu_q = int32_tensor(b.cu_q), hcu_kv = int32_tensor(b.cu_kv);
  HostTensor cpu_out = poisoned(dtype, {tq, hq, d});
  HostTensor cpu_lse = poisoned(DType::kF32, {tq, hq});
  PrefillArgs args;
  args.q = b.q;
  args.k = b.k;
  args.v = b.v;
  args.cu_seqlens_q = hcu_q;
  args.cu_seqlens_kv = hcu_kv;
  args.out = cpu_out;
  args.lse = cpu_lse;
  AttentionSpec cpu_spec = spec;
  cpu_spec.backend = Backend::kAuto;
  ASSERT_NO_THROW(prefill(cpu_spec, args)) << what;

  OracleAccumulator oracle;
  for (size_t i = 0; i < b.q_lens.size(); ++i) {
    OracleProblem pr = oracle_problem_of(spec);
    pr.q = head_values(b.q, int64_t{b.cu_q[i]} * hq * d, int64_t{b.q_lens[i]} * hq * d);
    for (int32_t t = 0; t < b.q_lens[i]; ++t)
      pr.q_positions.push_back(b.kv_lens[i] - b.q_lens[i] + t);
    pr.k = head_values(b.k, int64_t{b.cu_kv[i]} * hkv * d, int64_t{b.kv_lens[i]} * hkv * d);
    pr.v = head_values(b.v, int64_t{b.cu_kv[i]} * hkv * d, int64_t{b.kv_lens[i]} * hkv * d);
    oracle.add(pr, dtype);
  }

  DeviceTensor dq(b.q), dk(b.k), dv(b.v), dcq(hcu_q), dckv(hcu_kv);
  for (FusedKernel kernel : kernels) {
    if (!kernel_runs(kernel, d, dtype)) continue;
    check_gpu_call(what + kernel_str(kernel), oracle, cpu_out, cpu_lse, outs,
                   [&](TensorView out, TensorView lse) {
                     PrefillArgs g;
                     g.q = dq;
                     g.k = dk;
                     g.v = dv;
                     g.cu_seqlens_q = dcq;
                     g.cu_seqlens_kv = dckv;
                     g.out = out;
                     g.lse = lse;
                     g.max_seqlen_q = longest(b.q_lens);
                     g.max_seqlen_kv = longest(b.kv_lens);
                     AttentionSpec gspec = spec;
                     gspec.backend = Backend::kFused;
                     gspec.fused_kernel = kernel;
                     prefill(gspec, g);
                   });
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// Prefill of sequence i's last q_lens[i] tokens over row i of a paged `cache` (whose seq_lens hold
// the key lengths), likewise.
void check_paged_prefill(const std::string& what, const AttentionSpec& spec,
                         const OracleKvCache& cache, const HostTensor& q,
                         const std::vector<int32_t>& q_lens,
                         std::initializer_list<FusedKernel> kernels,
                         std::vector<HostTensor>* outs = nullptr) {
  const int32_t hq = spec.num_q_heads, d = spec.head_dim;
  const DType dtype = q.dtype();
  std::vector<int32_t> cu = {0}, kv_lens;
  for (size_t i = 0; i < q_lens.size(); ++i) {
    cu.push_back(cu.back() + q_lens[i]);
    kv_lens.push_back(seq_len_of(cache, static_cast<int64_t>(i)));
  }
  const int64_t tq = cu.back();
  HostTensor hcu = int32_tensor(cu);
  HostTensor cpu_out = poisoned(dtype, {tq, hq, d});
  HostTensor cpu_lse = poisoned(DType::kF32, {tq, hq});
  const KvCacheView host_view = cache.view();
  PrefillArgs args;
  args.q = q;
  args.cu_seqlens_q = hcu;
  args.kv_cache = &host_view;
  args.out = cpu_out;
  args.lse = cpu_lse;
  AttentionSpec cpu_spec = spec;
  cpu_spec.backend = Backend::kAuto;
  ASSERT_NO_THROW(prefill(cpu_spec, args)) << what;

  OracleAccumulator oracle;
  for (size_t i = 0; i < q_lens.size(); ++i) {
    OracleProblem pr = oracle_problem_of(spec);
    pr.q = head_values(q, int64_t{cu[i]} * hq * d, int64_t{q_lens[i]} * hq * d);
    for (int32_t t = 0; t < q_lens[i]; ++t) pr.q_positions.push_back(kv_lens[i] - q_lens[i] + t);
    pr.k = cache.dense(static_cast<int64_t>(i), kv_lens[i], 0);
    pr.v = cache.dense(static_cast<int64_t>(i), kv_lens[i], 1);
    oracle.add(pr, dtype);
  }

  DeviceKvCache dcache(cache);
  DeviceTensor dq(q), dcu(hcu);
  for (FusedKernel kernel : kernels) {
    if (!kernel_runs(kernel, d, dtype)) continue;
    check_gpu_call(what + kernel_str(kernel), oracle, cpu_out, cpu_lse, outs,
                   [&](TensorView out, TensorView lse) {
                     PrefillArgs g;
                     g.q = dq;
                     g.cu_seqlens_q = dcu;
                     g.kv_cache = &dcache.view();
                     g.out = out;
                     g.lse = lse;
                     g.max_seqlen_q = longest(q_lens);
                     g.max_seqlen_kv = longest(kv_lens);
                     AttentionSpec gspec = spec;
                     gspec.backend = Backend::kFused;
                     gspec.fused_kernel = kernel;
                     prefill(gspec, g);
                   });
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// Decode of every row of `cache` (the query at position seq_lens[r] - 1) on the CPU reference and
// on the fused GPU backend with each split count (0: the heuristic), likewise. wgmma: 1 when each
// call must run the Hopper warpgroup-MMA kernel, 0 when none may, -1 either.
void check_decode(const std::string& what, const AttentionSpec& spec, const OracleKvCache& cache,
                  const HostTensor& q, std::initializer_list<int32_t> splits, int wgmma = -1,
                  std::vector<HostTensor>* outs = nullptr) {
  const int32_t hq = spec.num_q_heads, d = spec.head_dim;
  const DType dtype = q.dtype();
  const int64_t rows = cache.view().num_rows();
  HostTensor cpu_out = poisoned(dtype, {rows, hq, d});
  HostTensor cpu_lse = poisoned(DType::kF32, {rows, hq});
  DecodeArgs args;
  args.q = q;
  args.kv_cache = cache.view();
  args.out = cpu_out;
  args.lse = cpu_lse;
  AttentionSpec cpu_spec = spec;
  cpu_spec.backend = Backend::kAuto;
  ASSERT_NO_THROW(decode(cpu_spec, args)) << what;

  OracleAccumulator oracle;
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t len = seq_len_of(cache, r);
    OracleProblem pr = oracle_problem_of(spec);
    pr.q = head_values(q, r * hq * d, int64_t{hq} * d);
    pr.q_positions = {len - 1};
    pr.k = cache.dense(r, len, 0);
    pr.v = cache.dense(r, len, 1);
    oracle.add(pr, dtype);
  }

  DeviceKvCache dcache(cache);
  DeviceTensor dq(q);
  for (int32_t s : splits) {
    const std::string run = what + " splits=" + std::to_string(s);
    check_gpu_call(run, oracle, cpu_out, cpu_lse, outs, [&](TensorView out, TensorView lse) {
      DecodeArgs g;
      g.q = dq;
      g.kv_cache = dcache.view();
      g.out = out;
      g.lse = lse;
      g.num_splits = s;
      AttentionSpec gspec = spec;
      gspec.backend = Backend::kFused;
      const int64_t before = wgmma_launches();
      decode(gspec, g);
      if (wgmma >= 0) {
        EXPECT_EQ(wgmma_launches() - before, wgmma)
            << run << ": the Hopper warpgroup-MMA decode kernel "
            << (wgmma ? "did not run" : "ran");
      }
    });
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// With V one-hot (key j's V is e_{j mod D}) the output shows the set of keys a query attended:
// out[e] > 0 where some attended key j has j mod D == e, and out[e] == 0 exactly elsewhere (a
// masked key weighs 0). positions: each output row's query position. *boundary_checks counts the
// queries whose key p - W (outside the window, not a sink, its dimension held by no attended key)
// was seen excluded.
void expect_attends_exactly(const std::string& what, const HostTensor& out,
                            const std::vector<int64_t>& positions, int32_t hq, int32_t d,
                            const MaskSpec& mask, int64_t* boundary_checks) {
  int64_t wrong = 0;
  std::vector<bool> hit(static_cast<size_t>(d));
  for (size_t t = 0; t < positions.size(); ++t) {
    const int64_t p = positions[t];
    std::fill(hit.begin(), hit.end(), false);
    for (int64_t j = 0; j <= p; ++j) {
      if (oracle_mask_allows(mask, p, j)) hit[j % d] = true;
    }
    const int64_t outside = p - mask.window;
    if (outside >= 0 && outside >= mask.sink_tokens && !hit[outside % d]) ++*boundary_checks;
    for (int32_t h = 0; h < hq; ++h) {
      for (int32_t e = 0; e < d; ++e) {
        const float x = out.get((static_cast<int64_t>(t) * hq + h) * d + e);
        const bool ok = hit[e] ? x > 0.0f : x == 0.0f;
        if (!ok && wrong++ < 5) {
          ADD_FAILURE() << what << ": query at position " << p << " (row " << t << ", head " << h
                        << "), window " << mask.window << ", sinks " << mask.sink_tokens
                        << ": output dim " << e << " = " << x << ", expected "
                        << (hit[e] ? "> 0 (a key of that dim is attended)"
                                   : "0 (no key of that dim is attended)");
        }
      }
    }
  }
  EXPECT_EQ(wrong, 0) << what << ": outputs that show a key attended that is outside the window "
                      << "or a key left out that is inside it";
}

std::vector<int64_t> packed_positions(const std::vector<int32_t>& q_lens,
                                      const std::vector<int32_t>& kv_lens) {
  std::vector<int64_t> out;
  for (size_t i = 0; i < q_lens.size(); ++i) {
    for (int32_t t = 0; t < q_lens[i]; ++t) out.push_back(kv_lens[i] - q_lens[i] + t);
  }
  return out;
}

HostTensor random_q(DType dtype, int64_t tokens, int32_t hq, int32_t d, std::mt19937_64& rng) {
  HostTensor q(dtype, {tokens, hq, d});
  q.fill_uniform(rng, -1.0f, 1.0f);
  return q;
}

// append_kv of `qkv` (fused input, no bias) at `positions` of `rows` on the CPU reference and on
// the GPU (backend fused): the two caches must agree within one unit of the cache dtype.
void append_on_both(const AttentionSpec& spec, const HostTensor& qkv,
                    const std::vector<int32_t>& positions, const std::vector<int32_t>& rows,
                    OracleKvCache& cpu_cache, DeviceKvCache& gpu_cache) {
  const int64_t n = static_cast<int64_t>(positions.size());
  AttentionSpec cpu_spec = spec;
  cpu_spec.backend = Backend::kAuto;
  run_append_kv(cpu_spec, qkv, positions, rows, cpu_cache.view());
  DeviceTensor dqkv(qkv), dpos(int32_tensor(positions)), drow(int32_tensor(rows)),
      dq_out(poisoned(DType::kBF16, {n, spec.num_q_heads, spec.head_dim}));
  AppendKvArgs a;
  a.qkv = dqkv;
  a.positions = dpos;
  a.row_of_token = drow;
  a.kv_cache = gpu_cache.view();
  a.q_out = dq_out;
  AttentionSpec gspec = spec;
  gspec.backend = Backend::kFused;
  ASSERT_NO_THROW(append_kv(gspec, a));
  ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
  OracleKvCache gpu_copy = cpu_cache;
  gpu_cache.download_pool(gpu_copy);
  const UnitsReport r = compare_bytes(cpu_cache.view().dtype, gpu_copy.pool(), cpu_cache.pool());
  EXPECT_LE(r.max_units, 1.0) << "append_kv: the cache differs by " << r.max_units
                              << " units at element " << r.worst << " (gpu " << r.worst_a
                              << ", reference " << r.worst_b << ")";
}

// Writes K/V of tokens at positions [0, n) of `row` through append_kv on the CPU reference and on
// the GPU (fused): an earlier request's prompt, which later rows reuse. The two caches must agree
// within one unit of the cache dtype, as every forward step below checks again.
void append_prompt(const AttentionSpec& spec, OracleKvCache& cpu_cache, DeviceKvCache& gpu_cache,
                   int32_t row, int32_t n, std::mt19937_64& rng, const std::string& what) {
  SCOPED_TRACE(what);
  HostTensor qkv(DType::kBF16,
                 {n, int64_t{spec.num_q_heads + 2 * spec.num_kv_heads} * spec.head_dim});
  qkv.fill_uniform(rng, -2.0f, 2.0f);
  std::vector<int32_t> positions(n), rows(n, row);
  for (int32_t i = 0; i < n; ++i) positions[i] = i;
  append_on_both(spec, qkv, positions, rows, cpu_cache, gpu_cache);
}

AttentionSpec rope_spec(int32_t hq, int32_t hkv, int32_t d) {
  AttentionSpec spec = plain_spec(hq, hkv, d);
  spec.rope.style = RopeStyle::kGptNeox;
  return spec;
}

// Whether forward()'s context attention and decode take the fused kernels for `spec` and this
// cache dtype (forward() falls back to the vanilla kernels silently where they do not), and
// whether spec.fused_kernel runs here. Says why not.
bool forward_fused_runs(const AttentionSpec& spec, DType kv_dtype) {
  detail::PrefillProblem pp;
  pp.device = Device::cuda(0);
  pp.dtype = DType::kBF16;
  pp.kv_dtype = kv_dtype;
  pp.paged = true;
  const std::string why = cuda::fused_prefill_unsupported(spec, pp);
  if (!why.empty()) {
    std::printf("[ SKIPPED  ] forward's fused prefill: %s\n", why.c_str());
    return false;
  }
  return kernel_runs(spec.fused_kernel, spec.head_dim, DType::kBF16) &&
         decode_runs(spec, DType::kBF16, kv_dtype);
}

// ---- fp8 cache with prefix reuse ----------------------------------------------------------------

// A prompt's K/V quantized into an fp8 cache by append_kv, then reused: two more rows point their
// first block-table entries at the prompt's blocks (three and two whole blocks) and add their own
// chunks after the shared prefix, all three in one forward() call (the chunks attend over the
// shared fp8 blocks and their own new ones), then decode steps over the shared prefixes, heuristic
// and forced splits. Per-tensor and per-head scales, both context-attention kernels; the caches
// and every output against the CPU reference and the fp64 oracle (run_forward_step).
TEST(BugClass, Fp8KvWithPrefixReuseMatchesReference) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() ^ 0xB0C1A55);
  const int32_t hq = 8, hkv = 2, d = 128, tpb = 16, rows = 3, blocks_per_row = 6;
  for (bool per_head : {false, true}) {
    for (FusedKernel kernel : {FusedKernel::kPortable, FusedKernel::kHopper}) {
      AttentionSpec spec = rope_spec(hq, hkv, d);
      spec.fused_kernel = kernel;
      if (!forward_fused_runs(spec, DType::kFp8E4M3)) continue;
      const std::string what = std::string("fp8 prefix reuse ") +
                               (per_head ? "per-head" : "per-tensor") + kernel_str(kernel);
      OracleKvCache cpu_cache =
          OracleKvCache::paged(DType::kFp8E4M3, hkv, d, tpb, rows, blocks_per_row, rng);
      // qkv in [-2, 2] rotated: |K|, |V| < 3.
      set_random_scales(cpu_cache, per_head, 3.0, rng);
      for (int32_t b = 0; b < 3; ++b) cpu_cache.block_id(1, b) = cpu_cache.block_id(0, b);
      for (int32_t b = 0; b < 2; ++b) cpu_cache.block_id(2, b) = cpu_cache.block_id(0, b);
      DeviceKvCache gpu_cache(cpu_cache);
      append_prompt(spec, cpu_cache, gpu_cache, 0, 3 * tpb, rng, what + " prompt");
      if (HasFatalFailure()) return;
      // Row 0 continues its prompt; rows 1 and 2 reuse 48 and 32 of its tokens.
      Step chunks;
      chunks.context_past = {3 * tpb, 3 * tpb, 2 * tpb};
      chunks.context_len = {5, 20, 33};
      run_forward_step(spec, Backend::kFused, chunks, cpu_cache, gpu_cache, rng,
                       what + " chunks after the shared prefix");
      if (HasFatalFailure()) return;
      int32_t splits = 0;
      for (const std::vector<int32_t>& past :
           {std::vector<int32_t>{53, 68, 65}, std::vector<int32_t>{54, 69, 66}}) {
        Step step;
        step.generation_past = past;
        step.num_splits = splits;
        run_forward_step(spec, Backend::kFused, step, cpu_cache, gpu_cache, rng,
                         what + " decode splits=" + std::to_string(splits));
        if (HasFatalFailure()) return;
        splits = 3;
      }
    }
  }
}

// ---- K/V scales applied -------------------------------------------------------------------------

// Scales of each cache dtype that leave values in [-1, 1] unsaturated, and 100x that.
double small_scale(DType dtype) {
  switch (dtype) {
    case DType::kInt8:
      return 0.012;  // |x| <= 1.41 (a rotated K of append_kv): codes <= 118
    case DType::kFp8E4M3:
      return 0.004;  // codes <= 353
    default:
      return 0.05;
  }
}

// K and V scales of one call: per tensor (K s, V 100 s), or per KV head 100x apart between the two
// heads, the other way round for V (K {s, 100 s}, V {100 s, s}). A kernel that ignores a scale,
// applies one head's (or the first head's) to another, or K's to V is off by up to 100x.
void set_scales_100x(OracleKvCache& cache, DType dtype, bool per_head) {
  const float s = static_cast<float>(small_scale(dtype));
  if (per_head) {
    cache.set_scales({s, 100 * s}, {100 * s, s});
  } else {
    cache.set_scales({s}, {100 * s});
  }
}

// Every cache dtype (16-bit caches take scales too), per-tensor and per-head scales: K/V written
// by append_kv (the fused kernel's codes against the reference's, within one unit), prefill over
// the cache with each context-attention kernel, decode on the mma.sync kernels (split and not)
// and, for 16-bit caches, on the Hopper warpgroup-MMA kernel, all against the oracle over the
// dequantized values.
TEST(BugClass, KvScalesAreApplied) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() ^ 0x5CA1E5);
  const int32_t hkv = 2, d = 128, tpb = 16;
  for (DType kv : {DType::kBF16, DType::kFp8E4M3, DType::kInt8}) {
    for (bool per_head : {false, true}) {
      const std::string what =
          std::string(dtype_name(kv)) + (per_head ? " per-head" : " per-tensor") + " scales";
      SCOPED_TRACE(what);
      // append_kv: qkv in [-1, 1] without bias, rotated.
      {
        const AttentionSpec spec = rope_spec(8, hkv, d);
        OracleKvCache cpu_cache = OracleKvCache::paged(kv, hkv, d, tpb, 2, 4, rng);
        set_scales_100x(cpu_cache, kv, per_head);
        DeviceKvCache gpu_cache(cpu_cache);
        const int32_t n = 37;
        HostTensor qkv(DType::kBF16, {n, int64_t{8 + 2 * hkv} * d});
        qkv.fill_uniform(rng, -1.0f, 1.0f);
        std::vector<int32_t> positions, row_of;
        for (int32_t i = 0; i < n; ++i) {
          positions.push_back(i < 20 ? i : 3 + (i - 20));  // row 0: 0..19, row 1: 3..19
          row_of.push_back(i < 20 ? 0 : 1);
        }
        append_on_both(spec, qkv, positions, row_of, cpu_cache, gpu_cache);
        if (HasFatalFailure()) return;
      }
      // Prefill and decode over a cache of values in [-1, 1] (stored = x / scale).
      {
        const std::vector<int32_t> kv_lens = {1, 77, 200}, q_lens = {1, 77, 37};
        OracleKvCache cache = OracleKvCache::paged(kv, hkv, d, tpb, 3, 13, rng);
        set_scales_100x(cache, kv, per_head);
        for (int64_t r = 0; r < 3; ++r) {
          fill_row(cache, r, kv_lens[r], false, rng);
          cache.set_seq_len(r, kv_lens[r]);
        }
        const AttentionSpec spec = plain_spec(8, hkv, d);
        check_paged_prefill(what + " prefill", spec, cache, random_q(DType::kBF16, 115, 8, d, rng),
                            q_lens, {FusedKernel::kPortable, FusedKernel::kHopper});
        if (HasFatalFailure()) return;
        if (decode_runs(spec, DType::kBF16, kv)) {
          check_decode(what + " decode", spec, cache, random_q(DType::kBF16, 3, 8, d, rng),
                       {1, 3, 0}, /*wgmma=*/0);
          if (HasFatalFailure()) return;
        }
      }
      // The warpgroup-MMA decode kernel (16-bit caches, groups of 16, >= SMs / 16 rows x KV heads).
      if (kv == DType::kBF16 && wgmma_decode_available()) {
        const int32_t rows = 12;
        OracleKvCache cache = OracleKvCache::paged(kv, hkv, d, tpb, rows, 40, rng);
        set_scales_100x(cache, kv, per_head);
        std::uniform_int_distribution<int32_t> len_of(1, 640);
        for (int64_t r = 0; r < rows; ++r) {
          const int32_t len = r == 0 ? 640 : len_of(rng);
          fill_row(cache, r, len, false, rng);
          cache.set_seq_len(r, len);
        }
        const AttentionSpec spec = plain_spec(32, hkv, d);
        check_decode(what + " decode (warpgroup MMA)", spec, cache,
                     random_q(DType::kBF16, rows, 32, d, rng), {1, 0}, /*wgmma=*/1);
        if (HasFatalFailure()) return;
      } else if (kv == DType::kBF16) {
        std::printf(
            "[ SKIPPED  ] the warpgroup-MMA decode kernel needs an H100 / H200 and 90a code\n");
      }
    }
  }
}

// ---- sliding window -----------------------------------------------------------------------------

// Window W attends p - W < j <= p (W keys, the query's own included) plus the sinks j < S. With V
// one-hot (e_{j mod D}) every output row shows which keys were attended: the key at p - W + 1 is
// in, the key at p - W is out, checked exactly (expect_attends_exactly) next to the bound against
// the oracle. Windows of 1, 2, around the key tiles of 64 and 128 and past D = 128, with sinks:
// packed prefill and prefill over a paged bf16 / fp8 cache with each context-attention kernel,
// decode over a paged bf16 / fp8 cache and a cyclic cache, split and not.
TEST(BugClass, SlidingWindowIsLeftInclusive) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() ^ 0x5117D);
  const int32_t hq = 2, hkv = 1, d = 128, tpb = 16;
  const std::pair<int32_t, int32_t> windows[] = {{1, 0},   {2, 0},  {17, 0},  {63, 0},
                                                 {64, 0},  {65, 0}, {127, 0}, {128, 0},
                                                 {129, 0}, {17, 4}, {100, 70}};
  for (const auto& [w, s] : windows) {
    const MaskSpec mask = window_of(w, s);
    const AttentionSpec spec = plain_spec(hq, hkv, d, mask);
    const std::string what = "W=" + std::to_string(w) + " S=" + std::to_string(s);
    SCOPED_TRACE(what);
    const std::vector<int32_t> q_lens = {300, 37}, kv_lens = {300, 260};
    const std::vector<int64_t> positions = packed_positions(q_lens, kv_lens);
    // Packed prefill.
    {
      PackedBatch b = packed_batch(DType::kBF16, hq, hkv, d, q_lens, kv_lens, rng);
      make_v_one_hot(b);
      std::vector<HostTensor> outs;
      check_packed_prefill(what + " packed", spec, b,
                           {FusedKernel::kPortable, FusedKernel::kHopper}, &outs);
      if (HasFatalFailure()) return;
      for (const HostTensor& out : outs) {
        int64_t boundary = 0;
        expect_attends_exactly(what + " packed", out, positions, hq, d, mask, &boundary);
        if (w < d) EXPECT_GT(boundary, 0) << "no query whose excluded key p - W could be seen";
      }
    }
    // Paged prefill and decode over 16-bit and fp8 caches (V scale 1/256: one-hot codes of 256).
    for (DType kv : {DType::kBF16, DType::kFp8E4M3}) {
      const std::string cache_what = what + " " + dtype_name(kv);
      OracleKvCache cache = OracleKvCache::paged(kv, hkv, d, tpb, 2, 19, rng);
      if (kv == DType::kFp8E4M3) cache.set_scales({1.0f / 128}, {1.0f / 256});
      for (int64_t r = 0; r < 2; ++r) {
        fill_row(cache, r, kv_lens[r], true, rng);
        cache.set_seq_len(r, kv_lens[r]);
      }
      std::vector<HostTensor> outs;
      check_paged_prefill(cache_what + " paged prefill", spec, cache,
                          random_q(DType::kBF16, 337, hq, d, rng), q_lens,
                          {FusedKernel::kPortable, FusedKernel::kHopper}, &outs);
      if (HasFatalFailure()) return;
      for (const HostTensor& out : outs) {
        int64_t boundary = 0;
        expect_attends_exactly(cache_what + " paged prefill", out, positions, hq, d, mask,
                               &boundary);
        if (w < d) EXPECT_GT(boundary, 0) << "no query whose excluded key p - W could be seen";
      }
    }
    // Decode: rows whose query sits just before, at and after the window's end, and past a tile.
    std::vector<int32_t> lens;
    for (int32_t len : {1, w - 1, w, w + 1, w + 2, w + 63, w + 64, w + 65, 2 * w + 1, 300}) {
      if (len >= 1 && std::find(lens.begin(), lens.end(), len) == lens.end()) lens.push_back(len);
    }
    const int32_t rows = static_cast<int32_t>(lens.size());
    std::vector<int64_t> decode_positions;
    for (int32_t len : lens) decode_positions.push_back(len - 1);
    for (int layout = 0; layout < 3; ++layout) {  // paged bf16, paged fp8, cyclic bf16
      const DType kv = layout == 1 ? DType::kFp8E4M3 : DType::kBF16;
      const bool cyclic = layout == 2;
      const std::string cache_what =
          what + " decode " + dtype_name(kv) + (cyclic ? " cyclic" : " paged");
      if (!decode_runs(spec, DType::kBF16, kv)) continue;
      const int32_t window_slots = cyclic ? cyclic_window_slots(w, tpb) : 0;
      const int32_t slots = cyclic ? s + window_slots : 300;
      OracleKvCache cache =
          OracleKvCache::paged(kv, hkv, d, tpb, rows, (slots + tpb - 1) / tpb, rng);
      if (kv == DType::kFp8E4M3) cache.set_scales({1.0f / 128}, {1.0f / 256});
      if (cyclic) cache.make_cyclic(window_slots, s);
      for (int32_t r = 0; r < rows; ++r) {
        fill_row(cache, r, lens[r], true, rng);
        cache.set_seq_len(r, lens[r]);
      }
      std::vector<HostTensor> outs;
      check_decode(cache_what, spec, cache, random_q(DType::kBF16, rows, hq, d, rng), {1, 3, 0}, -1,
                   &outs);
      if (HasFatalFailure()) return;
      for (const HostTensor& out : outs) {
        int64_t boundary = 0;
        expect_attends_exactly(cache_what, out, decode_positions, hq, d, mask, &boundary);
        if (w < d) EXPECT_GT(boundary, 0) << "no row whose excluded key p - W could be seen";
      }
    }
  }
}

// ---- head_dim 256 -------------------------------------------------------------------------------

// head_dim 256 through the public entry points: packed prefill with the kernel the call's own
// choice picks (fused_kernel auto: the portable kernel at <= 512 keys under a mask, the sm90
// kernel above) and each kernel forced, causal / no mask / window, bf16 and f16; prefill over
// paged bf16 / fp8 / int8 caches with each kernel; decode over them (split and not); and forward()
// at head_dim 256 over each cache dtype (append_kv, chunks after cached tokens, decode rows in the
// same batch) with each context-attention kernel.
TEST(BugClass, HeadDim256Paths) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() ^ 0x256);
  const int32_t d = 256, hq = 4, hkv = 2;
  struct Packed {
    DType dtype;
    MaskSpec mask;
    std::vector<int32_t> q_lens, kv_lens;
  };
  MaskSpec causal, none;
  none.kind = MaskKind::kNone;
  const Packed packed[] = {
      {DType::kBF16, causal, {200, 1, 129}, {200, 77, 129}},   // <= 512 keys: auto = portable
      {DType::kBF16, causal, {300, 1, 129}, {300, 700, 129}},  // > 512 keys: auto = sm90
      {DType::kBF16, none, {150, 64}, {150, 97}},
      {DType::kBF16, window_of(100, 4), {300, 33}, {300, 600}},
      {DType::kF16, causal, {129, 65}, {129, 600}},
  };
  for (const Packed& c : packed) {
    const std::string what = std::string("D=256 packed ") + dtype_name(c.dtype) +
                             " mask=" + mask_name(c.mask.kind) +
                             " max_kv=" + std::to_string(longest(c.kv_lens));
    check_packed_prefill(what, plain_spec(hq, hkv, d, c.mask),
                         packed_batch(c.dtype, hq, hkv, d, c.q_lens, c.kv_lens, rng),
                         {FusedKernel::kAuto, FusedKernel::kPortable, FusedKernel::kHopper});
    if (HasFatalFailure()) return;
  }
  for (DType kv : {DType::kBF16, DType::kFp8E4M3, DType::kInt8}) {
    for (int32_t page : {16, 64}) {
      const bool per_head = page == 64;
      const std::string what = std::string("D=256 ") + dtype_name(kv) +
                               " page=" + std::to_string(page) +
                               (per_head ? " per-head" : " per-tensor");
      const std::vector<int32_t> kv_lens = {1, 129, 333}, q_lens = {1, 129, 70};
      OracleKvCache cache = OracleKvCache::paged(kv, hkv, d, page, 3, (333 + page - 1) / page, rng);
      set_random_scales(cache, per_head, 1.05, rng);
      for (int64_t r = 0; r < 3; ++r) {
        fill_row(cache, r, kv_lens[r], false, rng);
        cache.set_seq_len(r, kv_lens[r]);
      }
      const AttentionSpec spec = plain_spec(hq, hkv, d);
      check_paged_prefill(what + " prefill", spec, cache, random_q(DType::kBF16, 200, hq, d, rng),
                          q_lens,
                          {FusedKernel::kAuto, FusedKernel::kPortable, FusedKernel::kHopper});
      if (HasFatalFailure()) return;
      if (decode_runs(spec, DType::kBF16, kv)) {
        check_decode(what + " decode", spec, cache, random_q(DType::kBF16, 3, hq, d, rng), {1, 0});
        if (HasFatalFailure()) return;
      }
    }
  }
  for (DType kv : {DType::kBF16, DType::kFp8E4M3, DType::kInt8}) {
    for (FusedKernel kernel : {FusedKernel::kPortable, FusedKernel::kHopper}) {
      AttentionSpec spec = rope_spec(hq, hkv, d);
      spec.fused_kernel = kernel;
      if (!forward_fused_runs(spec, kv)) continue;
      const std::string what = std::string("D=256 forward ") + dtype_name(kv) + kernel_str(kernel);
      OracleKvCache cpu_cache = OracleKvCache::paged(kv, hkv, d, 16, 2, 8, rng);
      set_random_scales(cpu_cache, kv == DType::kInt8, 3.0, rng);
      DeviceKvCache gpu_cache(cpu_cache);
      Step prompts;
      prompts.context_past = {0, 0};
      prompts.context_len = {70, 1};
      run_forward_step(spec, Backend::kFused, prompts, cpu_cache, gpu_cache, rng,
                       what + " prompts");
      if (HasFatalFailure()) return;
      Step mixed;  // a chunk after 70 cached tokens, and row 1's first decode step
      mixed.context_past = {70};
      mixed.context_len = {30};
      mixed.generation_past = {1};
      run_forward_step(spec, Backend::kFused, mixed, cpu_cache, gpu_cache, rng,
                       what + " chunk + decode");
      if (HasFatalFailure()) return;
      Step decode_rows;
      decode_rows.generation_past = {100, 2};
      decode_rows.num_splits = 3;
      run_forward_step(spec, Backend::kFused, decode_rows, cpu_cache, gpu_cache, rng,
                       what + " decode");
      if (HasFatalFailure()) return;
    }
  }
}

// ---- a row's result does not depend on the batch ------------------------------------------------

double max_rows_diff(const HostTensor& alone, const HostTensor& batch, int64_t first_element) {
  double m = 0.0;
  for (int64_t i = 0; i < alone.numel(); ++i) {
    m = std::max(m, std::fabs(static_cast<double>(alone.get(i)) - batch.get(first_element + i)));
  }
  return m;
}

int sm_count() {
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

std::string prefill_choice(const AttentionSpec& spec, DType kv_dtype, bool paged, int32_t seqlen) {
  detail::PrefillProblem p;
  p.device = Device::cuda(0);
  p.dtype = DType::kBF16;
  p.kv_dtype = kv_dtype;
  p.paged = paged;
  return cuda::prefill::prefill_kernel_choice(spec, p, seqlen);
}

// Fills every row of `cache` (row `row` with row_len keys, the others with 1 .. max_other), then
// decodes row `row` alone (a copy of it, the heuristic's splits; no warpgroup-MMA kernel) and in
// the batch (wgmma_in_batch: check_decode's expectation), both against the oracle; prints how far
// the row's two outputs are apart.
void check_decode_alone_and_in_batch(const std::string& what, const AttentionSpec& spec,
                                     OracleKvCache& cache, int32_t row, int32_t row_len,
                                     int32_t max_other, int wgmma_in_batch, std::mt19937_64& rng) {
  const int64_t rows = cache.view().num_rows();
  std::uniform_int_distribution<int32_t> len_of(1, max_other);
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t len = r == row ? row_len : len_of(rng);
    fill_row(cache, r, len, false, rng);
    cache.set_seq_len(r, len);
  }
  const int64_t per_row = int64_t{spec.num_q_heads} * spec.head_dim;
  const HostTensor q = random_q(DType::kBF16, rows, spec.num_q_heads, spec.head_dim, rng);
  const HostTensor q_row =
      elements_of(q, row * per_row, per_row, {1, spec.num_q_heads, spec.head_dim});
  std::vector<HostTensor> a, b;
  check_decode(what + " alone", spec, row_copy(cache, row, rng), q_row, {0}, 0, &a);
  check_decode(what + " in a batch", spec, cache, q, {0}, wgmma_in_batch, &b);
  if (::testing::Test::HasFatalFailure()) return;
  if (!a.empty() && !b.empty()) {
    std::printf("[bug class] %s: max |alone - in batch| = %g\n", what.c_str(),
                max_rows_diff(a[0], b[0], row * per_row));
  }
}

// One row computed alone and inside batches that make the call take another kernel, each against
// the oracle and the CPU reference within the bound of docs/testing.md (the default mode is not
// bitwise batch-invariant; the largest difference between the two is printed):
// - packed prefill at head_dim 256 under fused_kernel auto: alone (300 keys) the portable kernel,
//   next to a 600-key sequence the sm90 kernel (asserted through the selector);
// - packed and paged prefill on the portable kernel at head_dim 128: alone the 64-row tile, in a
//   batch of twice the SMs' worth of 128-row CTAs the 128-row 4-warp tile (asserted likewise
//   where the build holds both tiles: prefill_kernel_choice answers for one sequence, here one of
//   the batch's CTA count);
// - decode of GQA 32/2 at head_dim 128: alone the mma.sync kernel with the heuristic's splits, in a
//   batch of 12 rows the warpgroup-MMA kernel on an H100 / H200 (asserted by its launch count);
// - decode over an fp8 cache, 8 KV heads of 1 query head: alone split on the 2-CTA kernel, among
//   64 rows unsplit on the 4-CTA kernel.
TEST(BugClass, ResultDoesNotDependOnTheBatch) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() ^ 0xBA7C4);
  const int sms = sm_count();
  ASSERT_GT(sms, 0);
  // Packed prefill, head_dim 256, the kernel chosen by max_seqlen_kv.
  {
    // 3 query heads a KV head: no GQA packing, which would take the sm90 kernel at any length.
    const AttentionSpec spec = plain_spec(6, 2, 256);
    const PackedBatch batch =
        packed_batch(DType::kBF16, 6, 2, 256, {600, 300, 5, 1}, {600, 300, 5, 550}, rng);
    const PackedBatch alone = sequence_of(batch, 1);
    if (kernel_runs(FusedKernel::kHopper, 256, DType::kBF16) &&
        kernel_runs(FusedKernel::kPortable, 256, DType::kBF16)) {
      EXPECT_NE(prefill_choice(spec, DType::kBF16, false, 300),
                prefill_choice(spec, DType::kBF16, false, 600))
          << "the batch no longer takes another kernel than the row alone";
    }
    std::vector<HostTensor> a, b;
    check_packed_prefill("D=256 alone", spec, alone, {FusedKernel::kAuto}, &a);
    check_packed_prefill("D=256 in a batch", spec, batch, {FusedKernel::kAuto}, &b);
    if (HasFatalFailure()) return;
    if (!a.empty() && !b.empty()) {
      std::printf("[bug class] D=256 prefill: max |alone - in batch| = %g\n",
                  max_rows_diff(a[0], b[0], int64_t{batch.cu_q[1]} * 6 * 256));
    }
  }
  // Packed and paged prefill on the portable kernel, head_dim 128, the tile chosen by the grid.
  {
    const std::vector<PrefillTile> tiles = cuda::prefill::runnable_tiles(128, DType::kBF16, 0);
    const auto tile_runs = [&](PrefillTile t) {
      return std::find(tiles.begin(), tiles.end(), t) != tiles.end();
    };
    AttentionSpec spec = plain_spec(8, 2, 128);
    spec.fused_kernel = FusedKernel::kPortable;
    const int32_t n = 129, seqs = (2 * sms + 15) / 16 + 1;  // 2 blocks of 128 rows x 8 heads each
    const int32_t row = seqs / 2;
    const std::vector<int32_t> lens(seqs, n);
    for (bool paged : {false, true}) {
      const std::string what = std::string("D=128 portable ") + (paged ? "paged" : "packed");
      const std::string one = prefill_choice(spec, DType::kBF16, paged, n);
      const std::string many = prefill_choice(spec, DType::kBF16, paged, seqs * 256);
      std::printf("[bug class] %s: alone %s, in a batch of %d %s\n", what.c_str(), one.c_str(),
                  seqs, many.c_str());
      // Both tiles are in full builds (a kernel subset may hold one portable tile only).
      if (tile_runs(PrefillTile::kM64) && tile_runs(PrefillTile::kM128W4)) {
        EXPECT_NE(one, many) << what << ": the batch no longer takes another tile than the row";
      }
      std::vector<HostTensor> a, b;
      if (!paged) {
        const PackedBatch batch = packed_batch(DType::kBF16, 8, 2, 128, lens, lens, rng);
        check_packed_prefill(what + " alone", spec, sequence_of(batch, row),
                             {FusedKernel::kPortable}, &a);
        check_packed_prefill(what + " in a batch", spec, batch, {FusedKernel::kPortable}, &b);
      } else {
        OracleKvCache cache = OracleKvCache::paged(DType::kBF16, 2, 128, 16, seqs, 9, rng);
        for (int32_t r = 0; r < seqs; ++r) {
          fill_row(cache, r, n, false, rng);
          cache.set_seq_len(r, n);
        }
        const HostTensor q = random_q(DType::kBF16, int64_t{seqs} * n, 8, 128, rng);
        const HostTensor q_row =
            elements_of(q, int64_t{row} * n * 8 * 128, int64_t{n} * 8 * 128, {n, 8, 128});
        check_paged_prefill(what + " alone", spec, row_copy(cache, row, rng), q_row, {n},
                            {FusedKernel::kPortable}, &a);
        check_paged_prefill(what + " in a batch", spec, cache, q, lens, {FusedKernel::kPortable},
                            &b);
      }
      if (HasFatalFailure()) return;
      if (!a.empty() && !b.empty()) {
        std::printf("[bug class] %s: max |alone - in batch| = %g\n", what.c_str(),
                    max_rows_diff(a[0], b[0], int64_t{row} * n * 8 * 128));
      }
    }
  }
  // Decode: GQA 32/2 alone (mma.sync, split by the heuristic) and among 12 rows (warpgroup MMA).
  {
    const AttentionSpec spec = plain_spec(32, 2, 128);
    OracleKvCache cache = OracleKvCache::paged(DType::kBF16, 2, 128, 16, 12, 94, rng);
    check_decode_alone_and_in_batch("GQA 32/2 decode", spec, cache, 3, 1500, 700,
                                    wgmma_decode_available() ? 1 : -1, rng);
    if (HasFatalFailure()) return;
  }
  // Decode over an fp8 cache: 1 row (split, 2 CTAs an SM) and 64 rows x 8 KV heads (4 CTAs an SM).
  {
    const AttentionSpec spec = plain_spec(8, 8, 128);
    if (!decode_runs(spec, DType::kBF16, DType::kFp8E4M3)) return;
    OracleKvCache cache = OracleKvCache::paged(DType::kFp8E4M3, 8, 128, 32, 64, 63, rng);
    set_random_scales(cache, true, 1.05, rng);
    check_decode_alone_and_in_batch("fp8 decode", spec, cache, 17, 2000, 200, 0, rng);
  }
}

// ---- int8 cache ---------------------------------------------------------------------------------

// An int8 cache written by append_kv and read by every attention path forward() takes: prompts and
// chunks after cached tokens (prefill over the int8 pages with each context-attention kernel), a
// batch of a chunk and a decode row, decode steps (heuristic and forced splits); per-tensor and
// per-head scales, pages of 16 and 64 tokens. The caches within one code of the reference's, the
// outputs against the oracle over the dequantized codes and the CPU reference (run_forward_step).
TEST(BugClass, Int8KvIsNotGarbage) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() ^ 0x1E78);
  const int32_t hq = 8, hkv = 2, d = 128;
  for (bool per_head : {false, true}) {
    for (FusedKernel kernel : {FusedKernel::kPortable, FusedKernel::kHopper}) {
      AttentionSpec spec = rope_spec(hq, hkv, d);
      spec.fused_kernel = kernel;
      if (!forward_fused_runs(spec, DType::kInt8)) continue;
      const int32_t tpb = per_head ? 64 : 16;
      const std::string what = std::string("int8 ") + (per_head ? "per-head" : "per-tensor") +
                               " page=" + std::to_string(tpb) + kernel_str(kernel);
      OracleKvCache cpu_cache =
          OracleKvCache::paged(DType::kInt8, hkv, d, tpb, 2, (300 + tpb - 1) / tpb, rng);
      set_random_scales(cpu_cache, per_head, 3.0, rng);  // |K|, |V| < 3 (qkv in [-2, 2], rotated)
      DeviceKvCache gpu_cache(cpu_cache);
      Step prompts;
      prompts.context_past = {0, 0};
      prompts.context_len = {40, 77};
      run_forward_step(spec, Backend::kFused, prompts, cpu_cache, gpu_cache, rng,
                       what + " prompts");
      if (HasFatalFailure()) return;
      Step chunks;
      chunks.context_past = {40, 77};
      chunks.context_len = {150, 1};
      run_forward_step(spec, Backend::kFused, chunks, cpu_cache, gpu_cache, rng, what + " chunks");
      if (HasFatalFailure()) return;
      Step mixed;
      mixed.context_past = {190};
      mixed.context_len = {9};
      mixed.generation_past = {78};
      run_forward_step(spec, Backend::kFused, mixed, cpu_cache, gpu_cache, rng,
                       what + " chunk + decode");
      if (HasFatalFailure()) return;
      int32_t splits = 0;
      for (const std::vector<int32_t>& past :
           {std::vector<int32_t>{199, 79}, std::vector<int32_t>{200, 80}}) {
        Step step;
        step.generation_past = past;
        step.num_splits = splits;
        run_forward_step(spec, Backend::kFused, step, cpu_cache, gpu_cache, rng,
                         what + " decode splits=" + std::to_string(splits));
        if (HasFatalFailure()) return;
        splits = 3;
      }
    }
  }
}

}  // namespace
}  // namespace attnkit::test
