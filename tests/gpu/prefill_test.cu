// The fused prefill (context FMHA) kernels against an independent fp64 loop on the host (small and
// medium cases) and against a plain fp32 GPU kernel of this file (batches up to 8k tokens).
// Tolerance (docs/testing.md): max|out - ref64| <= 2 * max|naive - ref64| + 1e-3, where the naive
// same-precision result is taken as ref64 rounded to the output dtype: the smallest error any
// same-precision kernel can have, so the bound is at least as strict as the rule.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "attnkit/attention.h"
#include "common/test_util.h"
#include "core/kv_access.h"
#include "core/numerics.h"
#include "core/problem.h"
#include "cuda/cuda_backend.h"
#include "cuda/prefill/prefill_api.h"
#include "cuda/prefill/prefill_launch.h"
#include "cuda/prefill/prefill_sm90.h"
#include "gpu/gpu_case_util.h"
#include "gpu/gpu_util.h"

namespace attnkit::test {
namespace {

using cuda::prefill::PrefillTile;

enum class KvSource { kPacked, kPaged };

struct Case {
  DType dtype = DType::kBF16;
  int head_dim = 128;
  int hq = 4;
  int hkv = 4;
  MaskSpec mask{};
  bool alibi = false;
  double softcap = 0.0;
  std::vector<int> q_lens;
  std::vector<int> kv_lens;  // empty: equal to q_lens
  KvSource source = KvSource::kPacked;
  int page = 16;
  KvCacheLayout layout = KvCacheLayout::kHND;  // paged: blocks [Hkv, T, D] or [T, Hkv, D]
  bool contiguous = false;  // paged source without a table: row b is block b (T: its capacity)
  DType kv_dtype = DType::kBF16;  // paged only: q dtype, fp8_e4m3 or int8
  bool per_head_scales = false;
  std::optional<PrefillTile> tile;
  int section_pairs = 0;       // > 0: forced CTA-order section size (run_prefill)
  int ctas = 0;                // > 0: forced persistent grid of the sm90 kernel (run_prefill)
  std::optional<bool> q_pack;  // forced GQA packing of the sm90 kernel (run_prefill)
  bool with_lse = true;

  std::string str() const {
    std::ostringstream s;
    s << dtype_name(dtype) << " D=" << head_dim << " Hq=" << hq << " Hkv=" << hkv
      << " mask=" << mask_name(mask.kind) << " W=" << mask.window << " sinks=" << mask.sink_tokens
      << " alibi=" << alibi << " softcap=" << softcap
      << (source == KvSource::kPaged ? " paged page=" : " packed")
      << (source == KvSource::kPaged ? std::to_string(page) : std::string())
      << (source == KvSource::kPaged ? std::string(" ") + kv_layout_name(layout) : std::string())
      << (contiguous ? " contiguous" : "") << " kv=" << dtype_name(kv_dtype)
      << " tile=" << (tile ? cuda::prefill::prefill_tile_name(*tile) : "auto")
      << " section=" << section_pairs << " ctas=" << ctas
      << " q_pack=" << (q_pack ? (*q_pack ? "on" : "off") : "auto") << " q_lens=";
    for (int n : q_lens) s << n << ",";
    s << " kv_lens=";
    for (int n : kv_lens) s << n << ",";
    return s.str();
  }
};

double round_to(DType dtype, double x) {
  const float f = static_cast<float>(x);
  return dtype == DType::kBF16 ? numerics::bf16_bits_to_float(numerics::float_to_bf16_bits(f))
                               : numerics::f16_bits_to_float(numerics::float_to_f16_bits(f));
}

// Host data of one case: Q, and K/V either packed or in a paged pool, with accessors that return
// the exact values the kernel must use (dequantized with the cache scales).
struct Problem {
  Case c;
  int batch = 0;
  std::vector<int> cu_q, cu_kv;
  HostTensor q, k, v;  // packed
  HostTensor pool;     // paged: [num_blocks, 2, Hkv, T, D] (HND) or [num_blocks, 2, T, Hkv, D]
  HostTensor block_table, seq_lens, k_scale, v_scale;
  detail::KvLayout host_layout;
  int num_blocks = 0, max_blocks = 0;

  double kv_at(bool is_v, int b, int j, int hk, int d) const {
    if (c.source == KvSource::kPacked) {
      const HostTensor& t = is_v ? v : k;
      return t.get((static_cast<int64_t>(cu_kv[b] + j) * c.hkv + hk) * c.head_dim + d);
    }
    const uint8_t* base = static_cast<uint8_t*>(pool.view().data);
    const uint8_t* ptr = is_v ? host_layout.v_ptr(b, j, hk, d) : host_layout.k_ptr(b, j, hk, d);
    const int64_t index = (ptr - base) / static_cast<int64_t>(dtype_size(c.kv_dtype));
    const HostTensor& scale = is_v ? v_scale : k_scale;
    const double s = scale.numel() > 1 ? scale.get(hk) : scale.get(0);
    return pool.get(index) * s;
  }
};

Problem make_problem(const Case& c, std::mt19937_64& rng) {
  Problem p;
  p.c = c;
  if (p.c.kv_lens.empty()) p.c.kv_lens = c.q_lens;
  p.batch = static_cast<int>(c.q_lens.size());
  p.cu_q.assign(1, 0);
  p.cu_kv.assign(1, 0);
  for (int b = 0; b < p.batch; ++b) {
    p.cu_q.push_back(p.cu_q.back() + c.q_lens[b]);
    p.cu_kv.push_back(p.cu_kv.back() + p.c.kv_lens[b]);
  }
  const int d = c.head_dim;
  p.q = HostTensor(c.dtype, {p.cu_q.back(), c.hq, d});
  p.q.fill_uniform(rng, -1.f, 1.f);
  if (c.source == KvSource::kPacked) {
    p.k = HostTensor(c.dtype, {p.cu_kv.back(), c.hkv, d});
    p.v = HostTensor(c.dtype, {p.cu_kv.back(), c.hkv, d});
    p.k.fill_uniform(rng, -1.f, 1.f);
    p.v.fill_uniform(rng, -1.f, 1.f);
    return p;
  }
  // Paged: blocks handed out in a random order, two spare blocks, poison everywhere unwritten.
  // Contiguous: row b in block b, the rows' capacity the longest row rounded up to 16.
  const int longest = *std::max_element(p.c.kv_lens.begin(), p.c.kv_lens.end());
  const int t = c.contiguous ? (longest + 15) / 16 * 16 : c.page;
  if (c.contiguous) {
    p.seq_lens = HostTensor(DType::kInt32, {p.batch});
    for (int b = 0; b < p.batch; ++b) p.seq_lens.data<int32_t>()[b] = p.c.kv_lens[b];
    p.num_blocks = p.batch;
    p.max_blocks = 1;
  } else {
    ShuffledBlockTable blocks = shuffled_block_table(p.c.kv_lens, t, rng);
    p.block_table = std::move(blocks.table);
    p.seq_lens = std::move(blocks.seq_lens);
    p.num_blocks = blocks.num_blocks;
    p.max_blocks = blocks.max_blocks;
  }
  p.pool = c.layout == KvCacheLayout::kNHD ? HostTensor(c.kv_dtype, {p.num_blocks, 2, t, c.hkv, d})
                                           : HostTensor(c.kv_dtype, {p.num_blocks, 2, c.hkv, t, d});
  // NaN for 16-bit and fp8 caches; int8 has none, so the largest value stands in.
  p.pool.fill(c.kv_dtype == DType::kInt8 ? 127.f : NAN);
  const bool quant = c.kv_dtype == DType::kFp8E4M3 || c.kv_dtype == DType::kInt8;
  const int scales = c.per_head_scales ? c.hkv : 1;
  p.k_scale = HostTensor(DType::kF32, {scales});
  p.v_scale = HostTensor(DType::kF32, {scales});
  p.k_scale.fill_uniform(rng, quant ? 0.004f : 0.5f, quant ? 0.02f : 1.5f);
  p.v_scale.fill_uniform(rng, quant ? 0.004f : 0.5f, quant ? 0.02f : 1.5f);
  if (c.kv_dtype == DType::kFp8E4M3) {
    // Scales that make stored values span the e4m3 range.
    for (int i = 0; i < scales; ++i) {
      p.k_scale.set(i, p.k_scale.get(i) * 4.f);
      p.v_scale.set(i, p.v_scale.get(i) * 4.f);
    }
  }
  KvCacheView view;
  view.k_base = p.pool.view().data;
  view.v_base = static_cast<uint8_t*>(p.pool.view().data) +
                static_cast<int64_t>(c.hkv) * t * d * dtype_size(c.kv_dtype);
  view.block_stride_bytes = 2LL * c.hkv * t * d * dtype_size(c.kv_dtype);
  view.num_blocks = p.num_blocks;
  view.dtype = c.kv_dtype;
  view.num_kv_heads = c.hkv;
  view.tokens_per_block = t;
  view.head_dim = d;
  view.paged = !c.contiguous;
  view.layout = c.layout;
  if (!c.contiguous) view.block_table = p.block_table.view();
  view.seq_lens = p.seq_lens.view();
  p.host_layout = detail::make_kv_layout(view);
  std::uniform_real_distribution<float> unit(-1.f, 1.f);
  std::uniform_int_distribution<int> i8(-127, 127);
  const uint8_t* base = static_cast<uint8_t*>(p.pool.view().data);
  for (int b = 0; b < p.batch; ++b) {
    for (int j = 0; j < p.c.kv_lens[b]; ++j) {
      for (int hk = 0; hk < c.hkv; ++hk) {
        for (int e = 0; e < d; ++e) {
          for (int is_v = 0; is_v < 2; ++is_v) {
            const uint8_t* ptr =
                is_v ? p.host_layout.v_ptr(b, j, hk, e) : p.host_layout.k_ptr(b, j, hk, e);
            const int64_t index = (ptr - base) / static_cast<int64_t>(dtype_size(c.kv_dtype));
            float value = unit(rng);
            if (c.kv_dtype == DType::kInt8) value = static_cast<float>(i8(rng));
            if (c.kv_dtype == DType::kFp8E4M3) value *= 200.f;
            p.pool.set(index, value);
          }
        }
      }
    }
  }
  return p;
}

// fp64 attention of docs/semantics.md over the exact input values.
void reference(const Problem& p, std::vector<double>& out, std::vector<double>& lse) {
  const Case& c = p.c;
  const int d = c.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const std::vector<float> slopes = c.alibi ? default_alibi_slopes(c.hq) : std::vector<float>();
  out.assign(static_cast<size_t>(p.cu_q.back()) * c.hq * d, 0.0);
  lse.assign(static_cast<size_t>(p.cu_q.back()) * c.hq, -INFINITY);
  std::vector<double> logits, kbuf, vbuf;
  const std::vector<double> qd = p.q.to_double();
  for (int b = 0; b < p.batch; ++b) {
    const int nq = c.q_lens[b], nkv = p.c.kv_lens[b];
    for (int hk = 0; hk < c.hkv; ++hk) {
      kbuf.assign(static_cast<size_t>(nkv) * d, 0.0);
      vbuf.assign(static_cast<size_t>(nkv) * d, 0.0);
      for (int j = 0; j < nkv; ++j)
        for (int e = 0; e < d; ++e) {
          kbuf[j * d + e] = p.kv_at(false, b, j, hk, e);
          vbuf[j * d + e] = p.kv_at(true, b, j, hk, e);
        }
      for (int h = hk * (c.hq / c.hkv); h < (hk + 1) * (c.hq / c.hkv); ++h) {
        for (int t = 0; t < nq; ++t) {
          const int pos = nkv - nq + t;
          logits.assign(nkv, -INFINITY);
          double mx = -INFINITY;
          for (int j = 0; j < nkv; ++j) {
            bool attend = true;
            if (c.mask.kind != MaskKind::kNone) attend = j <= pos;
            if (c.mask.kind == MaskKind::kSlidingWindow) {
              attend = attend && (j > pos - c.mask.window || j < c.mask.sink_tokens);
            }
            if (!attend) continue;
            double s = 0;
            const double* qrow = &qd[(static_cast<size_t>(p.cu_q[b] + t) * c.hq + h) * d];
            for (int e = 0; e < d; ++e) s += qrow[e] * kbuf[j * d + e];
            s *= scale;
            if (c.softcap > 0) s = c.softcap * std::tanh(s / c.softcap);
            if (c.alibi) s += slopes[h] * static_cast<double>(j - pos);
            logits[j] = s;
            mx = std::max(mx, s);
          }
          const size_t row = static_cast<size_t>(p.cu_q[b] + t) * c.hq + h;
          if (mx == -INFINITY) continue;
          double sum = 0;
          for (int j = 0; j < nkv; ++j) {
            if (logits[j] == -INFINITY) continue;
            const double w = std::exp(logits[j] - mx);
            sum += w;
            for (int e = 0; e < d; ++e) out[row * d + e] += w * vbuf[j * d + e];
          }
          for (int e = 0; e < d; ++e) out[row * d + e] /= sum;
          lse[row] = mx + std::log(sum);
        }
      }
    }
  }
}

AttentionSpec spec_of(const Case& c) {
  AttentionSpec spec;
  spec.num_q_heads = c.hq;
  spec.num_kv_heads = c.hkv;
  spec.head_dim = c.head_dim;
  spec.mask = c.mask;
  spec.alibi = c.alibi;
  spec.logit_softcap = c.softcap;
  spec.backend = Backend::kFused;
  return spec;
}

void expect_close(const std::vector<double>& out, const std::vector<double>& ref, DType dtype,
                  const std::string& what) {
  ASSERT_EQ(out.size(), ref.size());
  ASSERT_FALSE(any_nan(out)) << what << ": NaN in the output (unwritten or poisoned element)";
  double naive = 0.0;
  for (double r : ref) naive = std::max(naive, std::fabs(round_to(dtype, r) - r));
  const double err = max_abs_diff(out, ref);
  EXPECT_LE(err, 2 * naive + 1e-3) << what << " (naive same-precision error " << naive << ")";
}

// Runs the fused prefill on the device copy of `p` and checks out and LSE.
void run_and_check(const Case& c) {
  SCOPED_TRACE(c.str());
  std::mt19937_64 rng(test_seed() ^ std::hash<std::string>()(c.str()));
  Problem p = make_problem(c, rng);
  const int64_t total_q = p.cu_q.back();
  HostTensor cu_q(DType::kInt32, {p.batch + 1}), cu_kv(DType::kInt32, {p.batch + 1});
  for (int b = 0; b <= p.batch; ++b) {
    cu_q.data<int32_t>()[b] = p.cu_q[b];
    cu_kv.data<int32_t>()[b] = p.cu_kv[b];
  }
  HostTensor out(c.dtype, {total_q, c.hq, c.head_dim});
  HostTensor lse(DType::kF32, {total_q, c.hq});
  out.fill(NAN);
  lse.fill(NAN);

  DeviceTensor d_q(p.q), d_out(out), d_lse(lse), d_cu_q(cu_q), d_cu_kv(cu_kv);
  DeviceTensor d_k, d_v, d_pool, d_table, d_lens, d_ks, d_vs;
  KvCacheView view;
  const AttentionSpec spec = spec_of(c);
  PrefillArgs args;
  args.q = d_q;
  args.cu_seqlens_q = d_cu_q;
  args.out = d_out;
  if (c.with_lse) args.lse = d_lse;
  args.max_seqlen_q = *std::max_element(c.q_lens.begin(), c.q_lens.end());
  args.max_seqlen_kv = *std::max_element(p.c.kv_lens.begin(), p.c.kv_lens.end());
  if (c.source == KvSource::kPacked) {
    d_k = DeviceTensor(p.k);
    d_v = DeviceTensor(p.v);
    args.k = d_k;
    args.v = d_v;
    args.cu_seqlens_kv = d_cu_kv;
  } else {
    d_pool = DeviceTensor(p.pool);
    if (!c.contiguous) d_table = DeviceTensor(p.block_table);
    d_lens = DeviceTensor(p.seq_lens);
    d_ks = DeviceTensor(p.k_scale);
    d_vs = DeviceTensor(p.v_scale);
    view = paged_cache_view(d_pool.data(), c.kv_dtype, p.num_blocks, c.hkv,
                            p.host_layout.tokens_per_block, c.head_dim);
    view.layout = c.layout;
    view.paged = !c.contiguous;
    if (!c.contiguous) view.block_table = d_table;
    view.seq_lens = d_lens;
    view.k_scale = d_ks;
    view.v_scale = d_vs;
    args.kv_cache = &view;
  }
  if (c.tile || c.section_pairs > 0 || c.ctas > 0 || c.q_pack) {
    const detail::PrefillProblem problem = detail::validate_prefill(spec, args);
    cuda::prefill::run_prefill(spec, args, problem, nullptr, c.tile, c.section_pairs, c.ctas,
                               c.q_pack);
  } else {
    prefill(spec, args);
  }
  ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
  d_out.download(out);
  d_lse.download(lse);

  std::vector<double> ref_out, ref_lse;
  reference(p, ref_out, ref_lse);
  expect_close(out.to_double(), ref_out, c.dtype, "out");
  if (c.with_lse) {
    const std::vector<double> got = lse.to_double();
    for (size_t i = 0; i < got.size(); ++i) {
      if (std::isinf(ref_lse[i])) {
        ASSERT_TRUE(std::isinf(got[i]) && got[i] < 0) << "lse[" << i << "] = " << got[i];
      } else {
        ASSERT_NEAR(got[i], ref_lse[i], 2e-3 * std::max(1.0, std::fabs(ref_lse[i])))
            << "lse[" << i << "]";
      }
    }
  }
}

// A paged case over an HND cache, then over an NHD cache (blocks [T, Hkv, D]); a packed one once.
void run_and_check_layouts(Case c) {
  if (c.source != KvSource::kPaged) return run_and_check(c);
  for (KvCacheLayout layout : kBothLayouts) {
    c.layout = layout;
    run_and_check(c);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// Every kernel this build has for (head_dim, dtype) that this GPU runs: the mma.sync tiles, and
// the sm90 kernel on an H100 / H200.
std::vector<PrefillTile> tiles_for(int head_dim, DType dtype) {
  return cuda::prefill::runnable_tiles(head_dim, dtype, 0);
}

bool has_sm90(int head_dim, DType dtype) {
  const std::vector<PrefillTile> tiles = tiles_for(head_dim, dtype);
  return std::find(tiles.begin(), tiles.end(), PrefillTile::kSm90) != tiles.end();
}

bool compiled(int head_dim, DType dtype) { return !tiles_for(head_dim, dtype).empty(); }

MaskSpec mask_of(MaskKind kind, int window = 0, int sinks = 0) {
  MaskSpec m;
  m.kind = kind;
  m.window = window;
  m.sink_tokens = sinks;
  return m;
}

// ---- lengths around the tile sizes, every mask kind, every tile forced ----------------------
// ATTNKIT_TEST_SCALE=small runs the lengths as one varlen batch per kernel and mask instead of one
// call each: every sequence still starts its own query and key tiles and ends at its length.
TEST(PrefillLengths, TileBoundariesEveryTile) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  const std::vector<int> lengths = {1, 2, 31, 32, 33, 63, 64, 65, 127, 128, 129, 37, 191, 257};
  std::vector<std::vector<int>> calls;
  if (small_test_scale()) {
    calls.push_back(lengths);
  } else {
    for (int n : lengths) calls.push_back({n});
  }
  for (int d : {128, 64, 256}) {
    for (PrefillTile tile : tiles_for(d, DType::kBF16)) {
      for (MaskKind mask : {MaskKind::kCausal, MaskKind::kNone}) {
        for (const std::vector<int>& q_lens : calls) {
          Case c;
          c.head_dim = d;
          c.hq = 2;
          c.hkv = 2;
          c.mask = mask_of(mask);
          c.q_lens = q_lens;
          c.tile = tile;
          run_and_check(c);
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

// ---- CTA order: sections of every size (1 pair, uneven, one section) visit every query block ----
// ATTNKIT_TEST_SCALE=small: sections of 1 pair, of 7 (7 + 7 + 1: an uneven last section) and one
// section (1000, clamped to the 15 pairs).
TEST(PrefillSchedule, UnevenSectionsCoverEveryBlock) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  const std::vector<int> sections =
      at_test_scale<std::vector<int>>({1, 2, 4, 7, 14, 15, 1000}, {1, 7, 1000});
  for (int d : {64, 128, 256}) {
    for (PrefillTile tile : tiles_for(d, DType::kBF16)) {
      for (MaskKind mask : {MaskKind::kCausal, MaskKind::kNone}) {
        // 5 sequences x 3 query heads (GQA onto one KV head) = 15 pairs; the longest has 4
        // query blocks of 64 rows, the shortest one row.
        for (int section : sections) {
          Case c;
          c.head_dim = d;
          c.hq = 3;
          c.hkv = 1;
          c.mask = mask_of(mask);
          c.q_lens = {200, 1, 65, 129, 7};
          c.kv_lens = {230, 1, 65, 140, 64};
          c.tile = tile;
          c.section_pairs = section;
          run_and_check(c);
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

TEST(PrefillLengths, VarlenBatchWithPrefix) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  // Mixed lengths in one launch; kv_len > q_len puts the queries at the end (chunk after cache).
  for (MaskKind mask : {MaskKind::kCausal, MaskKind::kNone}) {
    Case c;
    c.hq = 4;
    c.hkv = 2;
    c.mask = mask_of(mask);
    c.q_lens = {1, 65, 300, 7, 128};
    c.kv_lens = {1, 200, 300, 77, 129};
    run_and_check(c);
    if (HasFatalFailure()) return;
  }
}

// ---- every head_dim and dtype, GQA and MQA ----------------------------------------------------
TEST(PrefillHeadDims, AllHeadDimsBothDtypesGqa) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    for (int d : {64, 80, 96, 128, 256}) {
      if (!compiled(d, dtype)) {
        std::printf("[ SKIPPED  ] head_dim %d %s not compiled in this build\n", d,
                    dtype_name(dtype));
        continue;
      }
      for (PrefillTile tile : tiles_for(d, dtype)) {
        for (int hkv : {1, 2}) {
          Case c;
          c.dtype = dtype;
          c.head_dim = d;
          c.hq = 4;
          c.hkv = hkv;
          c.mask = mask_of(MaskKind::kCausal);
          c.q_lens = {33, 129};
          c.kv_lens = {40, 129};
          c.tile = tile;
          run_and_check(c);
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

// ---- paged cache: every page size, chunked context / prefix reuse -----------------------------
TEST(PrefillPaged, EveryPageSizeChunkedContext) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  for (int page : {8, 16, 32, 64, 128}) {
    Case c;
    c.source = KvSource::kPaged;
    c.page = page;
    c.hq = 4;
    c.hkv = 2;
    c.mask = mask_of(MaskKind::kCausal);
    // Chunks after page-aligned and unaligned cached prefixes, a whole prompt, a 1-token chunk.
    c.q_lens = {64, 50, 129, 1};
    c.kv_lens = {64 + 2 * page, 50 + 3 * page + 5, 129, 300};
    run_and_check_layouts(c);
    if (HasFatalFailure()) return;
  }
}

// Every tile forced over every K/V path: 16-bit pages smaller than, equal to and larger than the
// 64-key tile (the block ids are read one tile ahead and shared across lanes), and 8-bit caches.
TEST(PrefillPaged, EveryTileEveryPageForced) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  struct Path {
    DType kv;
    int page;
  };
  const Path paths[] = {{DType::kBF16, 8},     {DType::kBF16, 32},    {DType::kBF16, 64},
                        {DType::kBF16, 128},   {DType::kFp8E4M3, 16}, {DType::kInt8, 64},
                        {DType::kFp8E4M3, 128}};
  for (int d : {64, 128, 256}) {
    for (PrefillTile tile : tiles_for(d, DType::kBF16)) {
      for (const Path& path : paths) {
        Case c;
        c.head_dim = d;
        c.source = KvSource::kPaged;
        c.kv_dtype = path.kv;
        c.page = path.page;
        c.hq = 4;
        c.hkv = 2;
        c.per_head_scales = path.page == 64;
        c.mask =
            path.page == 32 ? mask_of(MaskKind::kSlidingWindow, 70, 5) : mask_of(MaskKind::kCausal);
        c.q_lens = {130, 1, 64};
        c.kv_lens = {130 + 75, 200, 64};
        c.tile = tile;
        run_and_check_layouts(c);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// Paged row runs (each thread copies consecutive rows of one page): every page size 8..128 with
// every tile and every cache dtype, chunks after cached prefixes, sequence lengths of 1, tile - 1,
// tile, tile + 1 and odd, so runs end inside a page, pages end inside a tile, and whole runs or
// pages start past the sequence (block-table entries of -1 that must never be read).
struct PagedRun {
  DType kv;
  int page;
  MaskKind mask;
};

// The (cache dtype, page, mask) runs of RowRunsEveryPageEveryCacheEveryTile for queries of
// `dtype`. Full size: every cache dtype, page and mask (f16: pages 8, 32 and 128). Under
// ATTNKIT_TEST_SCALE=small, per kernel (head_dim, tile), each kernel instantiation (query dtype,
// 16- or 8-bit cache, mask) still runs and so does every page size (a runtime value) of every
// tile: bf16 runs each page once per cache kind with the mask alternating, the 8-bit runs also
// alternating fp8 and int8 (the two share a kernel; every pair of mask and 8-bit dtype runs); f16
// (the same copies with another query type) runs pages 8 and 128, one a mask, 16-bit, fp8 and
// int8.
std::vector<PagedRun> row_run_cases(DType dtype) {
  const MaskKind causal = MaskKind::kCausal, none = MaskKind::kNone;
  std::vector<PagedRun> runs;
  if (small_test_scale()) {
    if (dtype == DType::kF16) {
      return {{dtype, 8, causal},
              {dtype, 128, none},
              {DType::kFp8E4M3, 8, causal},
              {DType::kInt8, 128, none}};
    }
    const int pages[] = {8, 16, 32, 64, 128};
    const DType eight_bit[] = {DType::kFp8E4M3, DType::kInt8, DType::kFp8E4M3, DType::kInt8,
                               DType::kFp8E4M3};
    const MaskKind eight_bit_mask[] = {causal, none, none, causal, causal};
    for (int k = 0; k < 5; ++k) runs.push_back({dtype, pages[k], k % 2 == 0 ? causal : none});
    for (int k = 0; k < 5; ++k) runs.push_back({eight_bit[k], pages[k], eight_bit_mask[k]});
    return runs;
  }
  for (DType kv : {dtype, DType::kFp8E4M3, DType::kInt8}) {
    for (int page : {8, 16, 32, 64, 128}) {
      // f16 q: the pages at both ends and one in the middle.
      if (dtype == DType::kF16 && page != 8 && page != 32 && page != 128) continue;
      for (MaskKind mask : {causal, none}) runs.push_back({kv, page, mask});
    }
  }
  return runs;
}

TEST(PrefillPaged, RowRunsEveryPageEveryCacheEveryTile) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  // The paged kernels (row runs of 1-8 rows per thread, one block id per run) in every compiled
  // tile: runs that end past the sequence, pages smaller than a 16-row share (head_dim 256: two
  // runs per thread), padded rows (80/96), both masks, 16-bit and 8-bit caches.
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    const std::vector<PagedRun> runs = row_run_cases(dtype);
    for (int d : {128, 64, 256, 80, 96}) {
      for (PrefillTile tile : tiles_for(d, dtype)) {
        for (const PagedRun& run : runs) {
          Case c;
          c.dtype = dtype;
          c.head_dim = d;
          c.source = KvSource::kPaged;
          c.kv_dtype = run.kv;
          c.page = run.page;
          c.hq = 2;
          c.hkv = 1;
          c.per_head_scales = run.page == 16;
          c.mask = mask_of(run.mask);
          c.q_lens = {1, 63, 64, 65, 37, 1};
          c.kv_lens = {1, 63, 64 + 64, 65 + 70, 37 + 3 * run.page + 1, 129};
          c.tile = tile;
          // The layouts alternate over the runs: every tile and every cache kind meets both.
          c.layout = (&run - runs.data()) % 2 == 0 ? KvCacheLayout::kHND : KvCacheLayout::kNHD;
          run_and_check(c);
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

TEST(PrefillPaged, ChunkedEqualsWhole) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  // The last chunk of a prompt over the cache equals those rows of the whole-prompt result: both
  // are checked against the same fp64 semantics, per chunk boundary.
  for (int chunk_start : {0, 32, 64, 96, 160}) {
    Case c;
    c.source = KvSource::kPaged;
    c.page = 32;
    c.mask = mask_of(MaskKind::kCausal);
    c.q_lens = {200 - chunk_start};
    c.kv_lens = {200};
    run_and_check_layouts(c);
    if (HasFatalFailure()) return;
  }
}

// A contiguous cache (no block table: row b is block b, T its capacity) in both layouts, 16- and
// 8-bit, through the automatic kernel choice and every tile: whole key tiles a row (the sm90
// kernel's boxes), rows that end inside a tile, queries after a cached prefix.
TEST(PrefillPaged, ContiguousCacheBothLayouts) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  for (DType kv : {DType::kBF16, DType::kFp8E4M3}) {
    std::vector<std::optional<PrefillTile>> choices = {std::nullopt};
    for (PrefillTile tile : tiles_for(128, DType::kBF16)) choices.push_back(tile);
    for (const std::optional<PrefillTile>& tile : choices) {
      Case c;
      c.source = KvSource::kPaged;
      c.contiguous = true;
      c.kv_dtype = kv;
      c.hq = 4;
      c.hkv = 2;
      c.mask = mask_of(MaskKind::kCausal);
      c.q_lens = {1, 100, 37};
      c.kv_lens = {1, 300, 37 + 64};
      c.tile = tile;
      run_and_check_layouts(c);
      if (HasFatalFailure()) return;
    }
  }
}

// ---- masks and position encodings -------------------------------------------------------------
struct MaskVariant {
  MaskSpec mask;
  bool alibi;
  double softcap;
};

TEST(PrefillMasks, SlidingWindowSinksAlibiSoftcap) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  const MaskVariant variants[] = {
      {mask_of(MaskKind::kSlidingWindow, 1, 0), false, 0.0},
      {mask_of(MaskKind::kSlidingWindow, 17, 0), false, 0.0},
      {mask_of(MaskKind::kSlidingWindow, 100, 4), false, 0.0},
      {mask_of(MaskKind::kSlidingWindow, 64, 70), false, 0.0},
      {mask_of(MaskKind::kCausal), true, 0.0},
      {mask_of(MaskKind::kCausal), false, 5.0},
      {mask_of(MaskKind::kNone), true, 3.0},
      {mask_of(MaskKind::kSlidingWindow, 33, 2), true, 10.0},
  };
  for (const MaskVariant& var : variants) {
    for (KvSource source : {KvSource::kPacked, KvSource::kPaged}) {
      Case c;
      c.hq = 6;
      c.hkv = 3;
      c.mask = var.mask;
      c.alibi = var.alibi;
      c.softcap = var.softcap;
      c.source = source;
      c.q_lens = {250, 3, 129};
      c.kv_lens = {250, 90, 300};
      run_and_check(c);
      if (HasFatalFailure()) return;
    }
  }
}

// ---- kernels that run their edge tiles and interior tiles in separate copies of the tile step
// (the 128-key tile at head_dim 64, head_dim 256 masked): every mask kind and logit modifier,
// queries after a cache (kv_len > q_len), lengths that end inside a tile and on its end ---------
// ATTNKIT_TEST_SCALE=small shortens the 600- and 1000-key sequences to 384 and 640 keys (3 and 5
// key tiles of 128: still first, interior and last tiles, the diagonal among them).
TEST(PrefillMasks, EdgeAndInteriorTilesOfSplitKernels) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  const MaskVariant variants[] = {
      {mask_of(MaskKind::kCausal), false, 0.0},
      {mask_of(MaskKind::kNone), false, 0.0},
      {mask_of(MaskKind::kSlidingWindow, 100, 4), false, 0.0},
      {mask_of(MaskKind::kCausal), true, 5.0},
  };
  const std::pair<int, PrefillTile> kernels[] = {{64, PrefillTile::kM128W4N128},
                                                 {256, PrefillTile::kM64}};
  for (const auto& [d, tile] : kernels) {
    const std::vector<PrefillTile> tiles = tiles_for(d, DType::kBF16);
    if (std::find(tiles.begin(), tiles.end(), tile) == tiles.end()) continue;  // kernel subset
    for (const MaskVariant& var : variants) {
      Case c;
      c.head_dim = d;
      c.hq = 4;
      c.hkv = 2;
      c.mask = var.mask;
      c.alibi = var.alibi;
      c.softcap = var.softcap;
      c.tile = tile;
      c.q_lens = at_test_scale<std::vector<int>>({600, 1, 128, 300, 77}, {384, 1, 128, 300, 77});
      c.kv_lens =
          at_test_scale<std::vector<int>>({600, 513, 1000, 384, 640}, {384, 513, 640, 384, 640});
      run_and_check(c);
      if (HasFatalFailure()) return;
    }
  }
}

// ---- 8-bit caches: dequantized on load, scales always honoured ---------------------------------
TEST(PrefillQuantKv, Fp8AndInt8PerTensorAndPerHead) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  for (DType kv : {DType::kFp8E4M3, DType::kInt8}) {
    for (bool per_head : {false, true}) {
      for (int d : {128, 64}) {
        if (!compiled(d, DType::kBF16)) continue;
        Case c;
        c.head_dim = d;
        c.source = KvSource::kPaged;
        c.kv_dtype = kv;
        c.per_head_scales = per_head;
        c.page = 16;
        c.hq = 4;
        c.hkv = 2;
        c.mask = mask_of(MaskKind::kCausal);
        c.q_lens = {100, 1, 64};
        c.kv_lens = {164, 33, 64};  // prefix reuse: queries after cached tokens
        run_and_check_layouts(c);
        if (HasFatalFailure()) return;
      }
    }
  }
  // f16 queries over an fp8 cache, and a sliding window over int8.
  Case c;
  c.dtype = DType::kF16;
  c.source = KvSource::kPaged;
  c.kv_dtype = DType::kFp8E4M3;
  c.q_lens = {70};
  c.kv_lens = {150};
  if (compiled(128, DType::kF16)) run_and_check_layouts(c);
  // f16 queries over an int8 cache (the int8 widening differs per 16-bit type).
  c.kv_dtype = DType::kInt8;
  if (compiled(128, DType::kF16)) run_and_check_layouts(c);
  c.dtype = DType::kBF16;
  c.kv_dtype = DType::kInt8;
  c.mask = mask_of(MaskKind::kSlidingWindow, 40, 3);
  run_and_check_layouts(c);
}

// ---- large batches: a plain fp32 GPU kernel is the reference ------------------------------------
template <bool kBf16>
__device__ float to_float(uint16_t bits) {
  return kBf16 ? numerics::bf16_bits_to_float(bits) : numerics::f16_bits_to_float(bits);
}

// One thread per (query token, head): two passes over the keys in fp32.
template <bool kBf16>
__global__ void naive_prefill_f32(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                  const int* cu_q, const int* cu_kv, int batch, int hq, int hkv,
                                  int d, float scale, bool causal, float* out, float* lse) {
  const int64_t index = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int total_q = cu_q[batch];
  if (index >= static_cast<int64_t>(total_q) * hq) return;
  const int token = static_cast<int>(index / hq), h = static_cast<int>(index % hq);
  int b = 0;
  while (cu_q[b + 1] <= token) ++b;
  const int nq = cu_q[b + 1] - cu_q[b], nkv = cu_kv[b + 1] - cu_kv[b];
  const int pos = nkv - nq + (token - cu_q[b]);
  const int hk = h / (hq / hkv);
  const int end = causal ? min(nkv, pos + 1) : nkv;
  const uint16_t* qrow = q + (static_cast<int64_t>(token) * hq + h) * d;
  float mx = -INFINITY;
  for (int j = 0; j < end; ++j) {
    const uint16_t* krow = k + (static_cast<int64_t>(cu_kv[b] + j) * hkv + hk) * d;
    float s = 0.f;
    for (int e = 0; e < d; ++e) s += to_float<kBf16>(qrow[e]) * to_float<kBf16>(krow[e]);
    mx = fmaxf(mx, s * scale);
  }
  float acc[256];
  for (int e = 0; e < d; ++e) acc[e] = 0.f;
  float sum = 0.f;
  for (int j = 0; j < end; ++j) {
    const uint16_t* krow = k + (static_cast<int64_t>(cu_kv[b] + j) * hkv + hk) * d;
    const uint16_t* vrow = v + (static_cast<int64_t>(cu_kv[b] + j) * hkv + hk) * d;
    float s = 0.f;
    for (int e = 0; e < d; ++e) s += to_float<kBf16>(qrow[e]) * to_float<kBf16>(krow[e]);
    const float w = expf(s * scale - mx);
    sum += w;
    for (int e = 0; e < d; ++e) acc[e] += w * to_float<kBf16>(vrow[e]);
  }
  for (int e = 0; e < d; ++e) out[index * d + e] = sum > 0.f ? acc[e] / sum : 0.f;
  lse[index] = sum > 0.f ? mx + logf(sum) : -INFINITY;
}

// ATTNKIT_TEST_SCALE=small: sequences of up to 1024 tokens (8192 -> 1024, 4097 -> 513, 2049 ->
// 257: each still a tile multiple or one past it) under the same max_seqlen bound of 8192, which
// keeps the kernels of the full case (the plain kM128W4 causal kernel past kShortCausalKeys) and
// its grid of 64 query blocks a sequence (most of them empty), several waves of CTAs or, for the
// persistent sm90 kernel, many more work items than CTAs.
TEST(PrefillLarge, MixedBatchUpTo8kAgainstGpuFp32) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  const std::vector<int> lens = at_test_scale<std::vector<int>>(
      {1, 8192, 7, 4097, 128, 1000, 2, 2049}, {1, 1024, 7, 513, 128, 1000, 2, 257});
  for (MaskKind mask : {MaskKind::kCausal, MaskKind::kNone}) {
    for (int d : {128, 64}) {
      if (!compiled(d, DType::kBF16)) continue;
      for (PrefillTile tile : tiles_for(d, DType::kBF16)) {
        Case c;
        c.head_dim = d;
        c.hq = 4;
        c.hkv = 2;
        c.mask = mask_of(mask);
        c.q_lens = lens;
        c.tile = tile;
        SCOPED_TRACE(c.str());
        std::mt19937_64 rng(test_seed() + d + static_cast<int>(mask));
        Problem p = make_problem(c, rng);
        const int64_t total = p.cu_q.back();
        HostTensor cu(DType::kInt32, {p.batch + 1});
        for (int b = 0; b <= p.batch; ++b) cu.data<int32_t>()[b] = p.cu_q[b];
        HostTensor out(DType::kBF16, {total, c.hq, d}), lse(DType::kF32, {total, c.hq});
        out.fill(NAN);
        lse.fill(NAN);
        HostTensor ref_out(DType::kF32, {total, c.hq, d}), ref_lse(DType::kF32, {total, c.hq});
        DeviceTensor d_q(p.q), d_k(p.k), d_v(p.v), d_cu(cu), d_out(out), d_lse(lse);
        DeviceTensor d_ref(ref_out), d_ref_lse(ref_lse);
        AttentionSpec spec = spec_of(c);
        PrefillArgs args;
        args.q = d_q;
        args.k = d_k;
        args.v = d_v;
        args.cu_seqlens_q = d_cu;
        args.cu_seqlens_kv = d_cu;
        args.out = d_out;
        args.lse = d_lse;
        args.max_seqlen_q = args.max_seqlen_kv = 8192;
        const detail::PrefillProblem problem = detail::validate_prefill(spec, args);
        cuda::prefill::run_prefill(spec, args, problem, nullptr, tile);
        // The check below is for this launch: an error an earlier test left pending in this
        // program's runtime (a failed query returns it and keeps it until read) is not.
        (void)cudaGetLastError();
        const int64_t threads = total * c.hq;
        naive_prefill_f32<true><<<static_cast<unsigned>((threads + 127) / 128), 128>>>(
            static_cast<const uint16_t*>(d_q.data()), static_cast<const uint16_t*>(d_k.data()),
            static_cast<const uint16_t*>(d_v.data()), static_cast<const int*>(d_cu.data()),
            static_cast<const int*>(d_cu.data()), p.batch, c.hq, c.hkv, d,
            static_cast<float>(1.0 / std::sqrt(d)), mask == MaskKind::kCausal,
            static_cast<float*>(d_ref.data()), static_cast<float*>(d_ref_lse.data()));
        ATTNKIT_CUDA_OK(cudaGetLastError());
        ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
        d_out.download(out);
        d_lse.download(lse);
        d_ref.download(ref_out);
        d_ref_lse.download(ref_lse);
        expect_close(out.to_double(), ref_out.to_double(), DType::kBF16, "out (8k batch)");
        const std::vector<double> got = lse.to_double(), want = ref_lse.to_double();
        double lse_err = 0;
        for (size_t i = 0; i < got.size(); ++i)
          lse_err = std::max(lse_err, std::fabs(got[i] - want[i]));
        EXPECT_LE(lse_err, 2e-3 * 10) << "lse";
        if (HasFailure()) return;
      }
    }
  }
}

// ---- the sm90 kernel: its own tile and stage boundaries, the persistent scheduler -------------
// Key tiles of 80 (head_dim 256), 128 (causal), 176 (head_dim 128) and 192 (head_dim 64) keys in a
// two-stage ring: lengths one short of, at and one past 1, 2 and 3 tiles (the ring wraps at the
// third), queries after a cache, both masks.
TEST(PrefillSm90, KeyTileAndStageBoundaries) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  for (int d : {128, 64, 256}) {
    if (!has_sm90(d, DType::kBF16)) {
      std::printf("[ SKIPPED  ] no sm90 kernel for head_dim %d on this GPU / build\n", d);
      continue;
    }
    for (MaskKind mask : {MaskKind::kNone, MaskKind::kCausal}) {
      const int bn = cuda::prefill::prefill_block_n(PrefillTile::kSm90, d, mask != MaskKind::kNone);
      for (int tiles : {1, 2, 3}) {
        for (int delta : {-1, 0, 1}) {
          Case c;
          c.head_dim = d;
          c.hq = 2;
          c.hkv = 1;
          c.mask = mask_of(mask);
          const int n = tiles * bn + delta;
          c.q_lens = {n, 129, std::max(1, n - 130)};
          c.kv_lens = {n, 129 + bn, n};
          c.tile = PrefillTile::kSm90;
          run_and_check(c);
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

// More work items than CTAs (1, 3 and 7 persistent CTAs walk every item), uneven varlen batches,
// a causal batch of tiny and long sequences, sequences without queries in a block (q_len below
// the longest), queries without keys (q_len > kv_len under the causal mask: zeros, LSE -inf).
// ATTNKIT_TEST_SCALE=small: the 700-token sequence has 400 (4 query blocks; 36 work items or
// more for the 7 CTAs).
TEST(PrefillSm90, PersistentSchedulerCoversEveryItem) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  for (int d : {128, 64, 256}) {
    if (!has_sm90(d, DType::kBF16)) continue;
    for (MaskKind mask : {MaskKind::kCausal, MaskKind::kNone}) {
      // Sections of 1 pair, uneven (5 of 18 pairs), and one section.
      const std::pair<int, int> grids[] = {{1, 0}, {3, 5}, {7, 1}, {7, 1000}};
      for (const auto& [ctas, section] : grids) {
        Case c;
        c.head_dim = d;
        c.hq = 3;
        c.hkv = 1;
        c.mask = mask_of(mask);
        const int longest = at_test_scale(700, 400);
        c.q_lens = {1, longest, 2, 257, 129, 40};
        c.kv_lens = {1, longest, 90, 257, 300, 20};
        c.tile = PrefillTile::kSm90;
        c.ctas = ctas;
        c.section_pairs = section;
        run_and_check(c);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// The sm90 kernel over every K/V source at once in one batch with logit modifiers: packed GQA
// and MQA, paged 16-bit (TMA boxes per page run) and 8-bit (gathered) caches of every page size.
// ATTNKIT_TEST_SCALE=small: the 8-bit caches alternate fp8 (pages 8, 32, 128) and int8 (16, 64),
// which share the gathered path; every page and modifier still runs with a 16-bit and an 8-bit
// cache.
TEST(PrefillSm90, PagedEveryPageEveryCacheWithModifiers) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  for (int d : {128, 64, 256}) {
    if (!has_sm90(d, DType::kBF16)) continue;
    for (DType kv : {DType::kBF16, DType::kFp8E4M3, DType::kInt8}) {
      for (int page : {8, 16, 32, 64, 128}) {
        const bool fp8_page = page == 8 || page == 32 || page == 128;
        if (small_test_scale() && kv != DType::kBF16 && fp8_page != (kv == DType::kFp8E4M3)) {
          continue;
        }
        Case c;
        c.head_dim = d;
        c.source = KvSource::kPaged;
        c.kv_dtype = kv;
        c.page = page;
        c.hq = 8;
        c.hkv = 2;
        c.per_head_scales = page == 32;
        c.mask =
            page == 64 ? mask_of(MaskKind::kSlidingWindow, 150, 3) : mask_of(MaskKind::kCausal);
        c.alibi = page == 16;
        c.softcap = page == 128 ? 20.0 : 0.0;
        c.q_lens = {300, 1, 177, 64};
        c.kv_lens = {300 + 2 * page, 513, 177, 64 + page + 3};
        c.tile = PrefillTile::kSm90;
        run_and_check_layouts(c);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// GQA packing (PrefillParams::q_pack_log2): a block's rows are (token, head) pairs of one KV
// head's group. Forced on and off over groups of 2 to 16 (at 16 a token's heads span both
// warpgroups' halves of the rows), short and mixed lengths (blocks that end inside a token's heads,
// sequences of one query), queries after a cache, every mask, soft-cap, packed and paged K/V
// (16-bit and 8-bit caches) and a grid of fewer CTAs than work items.
TEST(PrefillSm90, GqaPackedMatchesFp64) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  for (int d : {128, 64, 256}) {
    if (!has_sm90(d, DType::kBF16)) continue;
    for (int group : {2, 4, 8, 16}) {
      for (bool pack : {true, false}) {
        Case c;
        c.head_dim = d;
        c.hkv = 2;
        c.hq = 2 * group;
        c.mask = group == 4   ? mask_of(MaskKind::kSlidingWindow, 40, 2)
                 : group == 8 ? mask_of(MaskKind::kNone)
                              : mask_of(MaskKind::kCausal);
        c.softcap = group == 2 ? 30.0 : 0.0;
        c.q_lens = {1, 7, 33, 100, 1, 64};
        c.kv_lens = {1, 200, 33, 357, 90, 64};
        if (group >= 8) {
          c.source = KvSource::kPaged;
          c.page = group == 8 ? 16 : 32;
          c.kv_dtype = group == 16 ? DType::kFp8E4M3 : DType::kBF16;
        }
        c.tile = PrefillTile::kSm90;
        c.q_pack = pack;
        c.ctas = group == 4 ? 3 : 0;
        run_and_check_layouts(c);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// A forced packing the kernel cannot do raises: ALiBi (one slope a head), a group that is not a
// power of two, no group at all.
TEST(PrefillSm90, GqaPackingRejectsWhatItCannotPack) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  if (!has_sm90(128, DType::kBF16)) GTEST_SKIP() << "no sm90 kernel for head_dim 128";
  const std::tuple<int, int, bool> calls[] = {{8, 2, true}, {6, 2, false}, {4, 4, false}};
  for (const auto& [hq, hkv, alibi] : calls) {
    Case c;
    c.hq = hq;
    c.hkv = hkv;
    c.alibi = alibi;
    c.mask = mask_of(MaskKind::kCausal);
    c.q_lens = {5, 9};
    c.tile = PrefillTile::kSm90;
    c.q_pack = true;
    EXPECT_THROW(run_and_check(c), Error) << hq << "/" << hkv << " alibi " << alibi;
  }
}

// ---- dense(): the plain fused path of the same kernel (mask none, fixed lengths) ---------------
// Every kernel forced (the sm90 kernel also on a grid of fewer CTAs than work items), and the
// kernel dense() picks itself; key lengths inside and past one tile.
TEST(PrefillDense, DenseMatchesFp64) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  struct Run {
    std::optional<PrefillTile> tile;
    int ctas;
  };
  for (int d : {128, 64, 256}) {
    if (!compiled(d, DType::kBF16)) continue;
    std::vector<Run> runs = {{std::nullopt, 0}};
    for (PrefillTile tile : tiles_for(d, DType::kBF16)) runs.push_back({tile, 0});
    if (has_sm90(d, DType::kBF16)) runs.push_back({PrefillTile::kSm90, 5});
    for (const Run& run : runs) {
      for (int skv : {97, 250}) {
        SCOPED_TRACE(testing::Message()
                     << "d=" << d << " skv=" << skv << " tile="
                     << (run.tile ? cuda::prefill::prefill_tile_name(*run.tile) : "auto")
                     << " ctas=" << run.ctas);
        const int batch = 2, sq = 150, hq = 4, hkv = 2;
        std::mt19937_64 rng(test_seed() + 77 + d);
        HostTensor q(DType::kBF16, {batch, sq, hq, d}), k(DType::kBF16, {batch, skv, hkv, d}),
            v(DType::kBF16, {batch, skv, hkv, d}), out(DType::kBF16, {batch, sq, hq, d}),
            lse(DType::kF32, {batch, sq, hq});
        q.fill_uniform(rng, -1.f, 1.f);
        k.fill_uniform(rng, -1.f, 1.f);
        v.fill_uniform(rng, -1.f, 1.f);
        out.fill(NAN);
        lse.fill(NAN);
        DeviceTensor d_q(q), d_k(k), d_v(v), d_out(out), d_lse(lse);
        AttentionSpec spec;
        spec.num_q_heads = hq;
        spec.num_kv_heads = hkv;
        spec.head_dim = d;
        spec.mask.kind = MaskKind::kNone;
        spec.backend = Backend::kFused;
        DenseArgs args;
        args.q = d_q;
        args.k = d_k;
        args.v = d_v;
        args.out = d_out;
        args.lse = d_lse;
        if (run.tile) {
          const detail::DenseProblem problem = detail::validate_dense(spec, args);
          cuda::prefill::run_dense(spec, args, problem, nullptr, run.tile, 0, run.ctas);
        } else {
          dense(spec, args);
        }
        ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
        d_out.download(out);
        d_lse.download(lse);
        // The same data as a packed problem for the fp64 loop.
        Problem p;
        p.c.head_dim = d;
        p.c.hq = hq;
        p.c.hkv = hkv;
        p.c.mask = mask_of(MaskKind::kNone);
        p.c.q_lens = {sq, sq};
        p.c.kv_lens = {skv, skv};
        p.batch = batch;
        p.cu_q = {0, sq, 2 * sq};
        p.cu_kv = {0, skv, 2 * skv};
        p.q = q;
        p.k = k;
        p.v = v;
        std::vector<double> ref, ref_lse;
        reference(p, ref, ref_lse);
        expect_close(out.to_double(), ref, DType::kBF16, "dense out");
        const std::vector<double> got = lse.to_double();
        for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], ref_lse[i], 2e-3) << i;
      }
    }
  }
}

// ---- the selector: the kernel dispatch runs is the one `attnkit info` names --------------------
TEST(PrefillSupport, SelectorNamesTheKernel) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  AttentionSpec spec;
  spec.num_q_heads = 32;
  spec.num_kv_heads = 8;
  spec.head_dim = 128;
  spec.mask.kind = MaskKind::kCausal;
  detail::PrefillProblem p;
  p.device = Device::cuda(0);
  if (!compiled(128, DType::kBF16)) return;
  const std::string auto_choice = cuda::prefill::prefill_kernel_choice(spec, p, 4096);
  EXPECT_EQ(auto_choice == "sm90", has_sm90(128, DType::kBF16)) << auto_choice;
  spec.fused_kernel = FusedKernel::kPortable;
  const std::string portable = cuda::prefill::prefill_kernel_choice(spec, p, 4096);
  EXPECT_FALSE(portable.empty());
  EXPECT_NE(portable, "sm90");
  // An 8-bit paged cache stays on the portable kernel under auto (docs/prefill_design.md).
  spec.fused_kernel = FusedKernel::kAuto;
  p.paged = true;
  p.kv_dtype = DType::kFp8E4M3;
  EXPECT_NE(cuda::prefill::prefill_kernel_choice(spec, p, 4096), "sm90");
  // kHopper where the sm90 kernel cannot run (head_dim 80): not served, and a call raises.
  p.paged = false;
  p.kv_dtype = DType::kBF16;
  spec.head_dim = 80;
  spec.fused_kernel = FusedKernel::kHopper;
  if (compiled(80, DType::kBF16)) {
    EXPECT_EQ(cuda::prefill::prefill_kernel_choice(spec, p, 4096), "");
    Case c;
    c.head_dim = 80;
    c.q_lens = {10};
    Problem prob;
    std::mt19937_64 rng(test_seed());
    prob = make_problem(c, rng);
    HostTensor cu(DType::kInt32, {2}), out(DType::kBF16, {10, c.hq, 80});
    cu.data<int32_t>()[0] = 0;
    cu.data<int32_t>()[1] = 10;
    out.fill(NAN);
    DeviceTensor d_q(prob.q), d_k(prob.k), d_v(prob.v), d_cu(cu), d_out(out);
    PrefillArgs args;
    args.q = d_q;
    args.k = d_k;
    args.v = d_v;
    args.cu_seqlens_q = d_cu;
    args.cu_seqlens_kv = d_cu;
    args.out = d_out;
    args.max_seqlen_q = args.max_seqlen_kv = 10;
    AttentionSpec s80 = spec_of(c);
    s80.fused_kernel = FusedKernel::kHopper;
    try {
      prefill(s80, args);
      ADD_FAILURE() << "fused_kernel hopper at head_dim 80 did not raise";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("hopper"), std::string::npos) << e.what();
    }
  }
}

// ---- what the fused path refuses, and says so ---------------------------------------------------
TEST(PrefillSupport, UnsupportedReasons) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  AttentionSpec spec;
  spec.num_q_heads = 4;
  spec.num_kv_heads = 4;
  spec.head_dim = 128;
  detail::PrefillProblem p;
  p.device = Device::cuda(0);
  p.dtype = DType::kBF16;
  p.kv_dtype = DType::kBF16;
  if (compiled(128, DType::kBF16)) EXPECT_EQ(cuda::fused_prefill_unsupported(spec, p), "");
  p.dtype = DType::kF32;
  EXPECT_NE(cuda::fused_prefill_unsupported(spec, p).find("bf16 or f16"), std::string::npos);
  p.dtype = DType::kBF16;
  spec.head_dim = 72;
  EXPECT_NE(cuda::fused_prefill_unsupported(spec, p).find("head_dim 72"), std::string::npos);
  spec.head_dim = 128;
  p.kv_dtype = DType::kFp8E4M3;  // packed fp8 K/V: only the paged cache may be 8-bit
  EXPECT_NE(cuda::fused_prefill_unsupported(spec, p), "");
  detail::DenseProblem dp;
  dp.device = Device::cuda(0);
  dp.dtype = DType::kBF16;
  spec.skip_softmax = SkipSoftmaxSpec{};
  spec.skip_softmax->threshold = 0.1;
  // Skip-softmax runs on both fused kernels: served by auto and by the forced portable kernel.
  if (compiled(128, DType::kBF16)) {
    EXPECT_EQ(cuda::fused_dense_unsupported(spec, dp), "");
    spec.fused_kernel = FusedKernel::kPortable;
    EXPECT_EQ(cuda::fused_dense_unsupported(spec, dp), "");
    spec.fused_kernel = FusedKernel::kAuto;
  }
  spec.skip_softmax.reset();
  // SAGE: the sm90 SAGE kernels at head_dim 128 where compiled; never the portable kernel, never
  // head_dim 64.
  spec.quant = SageQuantSpec{};
  if (cuda::prefill::sm90_sage_compiled(128) && has_sm90(128, DType::kBF16)) {
    EXPECT_EQ(cuda::fused_dense_unsupported(spec, dp), "");
  } else {
    EXPECT_NE(cuda::fused_dense_unsupported(spec, dp).find("quant"), std::string::npos);
  }
  spec.fused_kernel = FusedKernel::kPortable;
  EXPECT_NE(cuda::fused_dense_unsupported(spec, dp).find("quant (SAGE)"), std::string::npos);
  spec.fused_kernel = FusedKernel::kAuto;
  spec.head_dim = 64;
  EXPECT_NE(cuda::fused_dense_unsupported(spec, dp).find("quant (SAGE)"), std::string::npos);
}

}  // namespace
}  // namespace attnkit::test
