// The FP8 context FMHA (fp8 e4m3 q / k / v on the sm90 kernel) against two host computations in
// fp64 over the dequantized inputs (code x descale):
//   exact:  softmax(scale q.k) v, what the quantized inputs mean;
//   naive:  the same with P rounded to e4m3 as the kernel rounds it (256 exp(s - max), the row's
//           final max) and the output rounded to its dtype: the error any kernel of this
//           quantization has.
// Tolerance (docs/testing.md, FP8): max|out - exact| <= 2 * max|naive - exact| + 1e-3. The kernel
// rounds P against the running max of its tile rather than the final one, which changes which
// values round up, not how far (one e4m3 step, relative).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "common/test_util.h"
#include "core/numerics.h"
#include "core/problem.h"
#include "cuda/prefill/prefill_api.h"
#include "gpu/gpu_case_util.h"
#include "gpu/gpu_util.h"

namespace attnkit::test {
namespace {

using cuda::prefill::PrefillTile;

enum class Scales { kNone, kPerTensor, kPerHead };

struct Fp8Case {
  int head_dim = 128;
  int hq = 4;
  int hkv = 4;
  MaskSpec mask{};
  bool alibi = false;
  double softcap = 0.0;
  std::vector<int> q_lens;
  std::vector<int> kv_lens;  // empty: equal to q_lens
  bool paged = false;
  int page = 64;
  Scales scales = Scales::kPerHead;
  DType out_dtype = DType::kBF16;
  std::optional<bool> q_pack;

  std::string str() const {
    std::ostringstream s;
    s << "D=" << head_dim << " Hq=" << hq << " Hkv=" << hkv << " mask=" << mask_name(mask.kind)
      << " W=" << mask.window << " sinks=" << mask.sink_tokens << " alibi=" << alibi
      << " softcap=" << softcap << (paged ? " paged page=" + std::to_string(page) : " packed")
      << " scales=" << static_cast<int>(scales) << " out=" << dtype_name(out_dtype)
      << " q_pack=" << (q_pack ? (*q_pack ? "on" : "off") : "auto") << " q_lens=";
    for (int n : q_lens) s << n << ",";
    s << " kv_lens=";
    for (int n : kv_lens) s << n << ",";
    return s.str();
  }
};

bool fp8_runs(int head_dim) {
  const std::vector<PrefillTile> tiles =
      cuda::prefill::runnable_tiles(head_dim, DType::kFp8E4M3, 0);
  return std::find(tiles.begin(), tiles.end(), PrefillTile::kSm90) != tiles.end();
}

double round_out(DType dtype, double x) {
  const float f = static_cast<float>(x);
  return dtype == DType::kF16 ? numerics::f16_bits_to_float(numerics::float_to_f16_bits(f))
                              : numerics::bf16_bits_to_float(numerics::float_to_bf16_bits(f));
}
double round_e4m3(double x) {
  return numerics::fp8_e4m3_bits_to_float(numerics::float_to_fp8_e4m3_bits(static_cast<float>(x)));
}

// A quantized problem: codes on the host, their descales, and the dequantized values (fp64).
struct Fp8Problem {
  Fp8Case c;
  int batch = 0;
  std::vector<int> cu_q, cu_kv;
  HostTensor q, k, v;                          // packed fp8 codes (k / v: packed mode)
  HostTensor q_descale, k_descale, v_descale;  // [1] or [B, Hkv]
  std::vector<double> qd, kd, vd;              // dequantized, [tokens, heads, D]
  // Paged mode: the pool ([blocks, 2, Hkv, page, D] codes), table, lengths, cache scales ([Hkv]).
  HostTensor pool, table, seq_lens, cache_k_scale, cache_v_scale;
  int num_blocks = 0;
};

// Per-(sequence, KV head) magnitudes that differ by up to 100x, so that a kernel that drops a
// descale, or reads the wrong one, fails.
float magnitude(std::mt19937_64& rng) {
  return std::pow(10.f, std::uniform_real_distribution<float>(-1.f, 1.f)(rng));
}

Fp8Problem make_problem(const Fp8Case& c, std::mt19937_64& rng) {
  Fp8Problem p;
  p.c = c;
  if (p.c.kv_lens.empty()) p.c.kv_lens = c.q_lens;
  p.batch = static_cast<int>(c.q_lens.size());
  p.cu_q.assign(1, 0);
  p.cu_kv.assign(1, 0);
  for (int b = 0; b < p.batch; ++b) {
    p.cu_q.push_back(p.cu_q.back() + c.q_lens[b]);
    p.cu_kv.push_back(p.cu_kv.back() + p.c.kv_lens[b]);
  }
  const int d = c.head_dim, g = c.hq / c.hkv;
  const bool per_head = c.scales == Scales::kPerHead;
  const std::vector<int64_t> scale_shape =
      per_head ? std::vector<int64_t>{p.batch, c.hkv} : std::vector<int64_t>{1};
  for (HostTensor* t : {&p.q_descale, &p.k_descale, &p.v_descale}) {
    *t = HostTensor(DType::kF32, scale_shape);
    for (int64_t i = 0; i < t->numel(); ++i) {
      // Codes span e4m3's range (|code| <= 448) for values of magnitude ~1-ish x magnitude.
      t->set(i, c.scales == Scales::kNone ? 1.f : magnitude(rng) / 200.f);
    }
  }
  auto scale_at = [&](const HostTensor& t, int b, int hk) {
    return static_cast<double>(per_head ? t.get(b * c.hkv + hk) : t.get(0));
  };
  std::uniform_real_distribution<float> unit(-1.f, 1.f);
  // Codes: uniform in [-code_max, code_max] (200 with descales; 2 without, values ~1).
  const float code_max = c.scales == Scales::kNone ? 2.f : 200.f;
  auto fill_packed = [&](HostTensor& t, std::vector<double>& deq, int heads,
                         const std::vector<int>& cu, const HostTensor& descale, bool is_q) {
    t = HostTensor(DType::kFp8E4M3, {cu.back(), heads, d});
    deq.assign(static_cast<size_t>(cu.back()) * heads * d, 0.0);
    for (int b = 0; b < p.batch; ++b) {
      for (int tok = cu[b]; tok < cu[b + 1]; ++tok) {
        for (int h = 0; h < heads; ++h) {
          const double s = scale_at(descale, b, is_q ? h / g : h);
          for (int e = 0; e < d; ++e) {
            const int64_t i = (static_cast<int64_t>(tok) * heads + h) * d + e;
            t.set(i, unit(rng) * code_max);
            deq[i] = t.get(i) * s;
          }
        }
      }
    }
  };
  fill_packed(p.q, p.qd, c.hq, p.cu_q, p.q_descale, true);
  if (!c.paged) {
    fill_packed(p.k, p.kd, c.hkv, p.cu_kv, p.k_descale, false);
    fill_packed(p.v, p.vd, c.hkv, p.cu_kv, p.v_descale, false);
    return p;
  }
  // Paged: blocks in a random order, spare blocks, NaN codes everywhere unwritten; per-KV-head
  // cache scales.
  const int t = c.page;
  ShuffledBlockTable blocks = shuffled_block_table(p.c.kv_lens, t, rng);
  p.num_blocks = blocks.num_blocks;
  p.pool = HostTensor(DType::kFp8E4M3, {p.num_blocks, 2, c.hkv, t, d});
  p.pool.fill(NAN);
  p.cache_k_scale = HostTensor(DType::kF32, {c.hkv});
  p.cache_v_scale = HostTensor(DType::kF32, {c.hkv});
  for (int hk = 0; hk < c.hkv; ++hk) {
    p.cache_k_scale.set(hk, magnitude(rng) / 200.f);
    p.cache_v_scale.set(hk, magnitude(rng) / 200.f);
  }
  p.kd.assign(static_cast<size_t>(p.cu_kv.back()) * c.hkv * d, 0.0);
  p.vd.assign(p.kd.size(), 0.0);
  for (int b = 0; b < p.batch; ++b) {
    for (int j = 0; j < p.c.kv_lens[b]; ++j) {
      const int64_t block = blocks.block_of(b, j, t);
      for (int hk = 0; hk < c.hkv; ++hk) {
        for (int e = 0; e < d; ++e) {
          for (int is_v = 0; is_v < 2; ++is_v) {
            const int64_t i = (((block * 2 + is_v) * c.hkv + hk) * t + j % t) * d + e;
            p.pool.set(i, unit(rng) * 200.f);
            const double s = (is_v ? p.cache_v_scale : p.cache_k_scale).get(hk);
            (is_v ? p.vd : p.kd)[((static_cast<size_t>(p.cu_kv[b]) + j) * c.hkv + hk) * d + e] =
                p.pool.get(i) * s;
          }
        }
      }
    }
  }
  p.table = std::move(blocks.table);
  p.seq_lens = std::move(blocks.seq_lens);
  return p;
}

// fp64 attention over the dequantized values; with fp8_p, P rounded as the kernel rounds it.
void reference(const Fp8Problem& p, bool fp8_p, std::vector<double>& out,
               std::vector<double>& lse) {
  const Fp8Case& c = p.c;
  const int d = c.head_dim, g = c.hq / c.hkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const std::vector<float> slopes = c.alibi ? default_alibi_slopes(c.hq) : std::vector<float>();
  out.assign(static_cast<size_t>(p.cu_q.back()) * c.hq * d, 0.0);
  lse.assign(static_cast<size_t>(p.cu_q.back()) * c.hq, -INFINITY);
  std::vector<double> logits;
  for (int b = 0; b < p.batch; ++b) {
    const int nq = c.q_lens[b], nkv = p.c.kv_lens[b];
    for (int h = 0; h < c.hq; ++h) {
      const int hk = h / g;
      for (int t = 0; t < nq; ++t) {
        const int pos = nkv - nq + t;
        const size_t row = static_cast<size_t>(p.cu_q[b] + t) * c.hq + h;
        logits.assign(nkv, -INFINITY);
        double mx = -INFINITY;
        for (int j = 0; j < nkv; ++j) {
          bool attend = c.mask.kind == MaskKind::kNone || j <= pos;
          if (c.mask.kind == MaskKind::kSlidingWindow) {
            attend = attend && (j > pos - c.mask.window || j < c.mask.sink_tokens);
          }
          if (!attend) continue;
          double s = 0;
          const double* qrow = &p.qd[row * d];
          const double* krow = &p.kd[(static_cast<size_t>(p.cu_kv[b] + j) * c.hkv + hk) * d];
          for (int e = 0; e < d; ++e) s += qrow[e] * krow[e];
          s *= scale;
          if (c.softcap > 0) s = c.softcap * std::tanh(s / c.softcap);
          if (c.alibi) s += slopes[h] * static_cast<double>(j - pos);
          logits[j] = s;
          mx = std::max(mx, s);
        }
        if (mx == -INFINITY) continue;
        double sum = 0;
        for (int j = 0; j < nkv; ++j) {
          if (logits[j] == -INFINITY) continue;
          const double w = std::exp(logits[j] - mx);
          sum += w;
          const double pw = fp8_p ? round_e4m3(256.0 * w) / 256.0 : w;
          const double* vrow = &p.vd[(static_cast<size_t>(p.cu_kv[b] + j) * c.hkv + hk) * d];
          for (int e = 0; e < d; ++e) out[row * d + e] += pw * vrow[e];
        }
        for (int e = 0; e < d; ++e) out[row * d + e] /= sum;
        lse[row] = mx + std::log(sum);
      }
    }
  }
}

AttentionSpec spec_of(const Fp8Case& c) {
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

// The device tensors of a problem and the PrefillArgs over them.
struct Fp8Run {
  DeviceTensor q, k, v, out, lse, cu_q, cu_kv, qs, ks, vs, pool, table, lens, cks, cvs;
  KvCacheView view;
  PrefillArgs args;

  Fp8Run(const Fp8Problem& p, HostTensor& out_host, HostTensor& lse_host) {
    const Fp8Case& c = p.c;
    HostTensor hcu_q(DType::kInt32, {p.batch + 1}), hcu_kv(DType::kInt32, {p.batch + 1});
    for (int b = 0; b <= p.batch; ++b) {
      hcu_q.data<int32_t>()[b] = p.cu_q[b];
      hcu_kv.data<int32_t>()[b] = p.cu_kv[b];
    }
    q = DeviceTensor(p.q);
    out = DeviceTensor(out_host);
    lse = DeviceTensor(lse_host);
    cu_q = DeviceTensor(hcu_q);
    cu_kv = DeviceTensor(hcu_kv);
    qs = DeviceTensor(p.q_descale);
    args.q = q;
    args.cu_seqlens_q = cu_q;
    args.out = out;
    args.lse = lse;
    if (c.scales != Scales::kNone) args.q_descale = qs;
    args.max_seqlen_q = *std::max_element(c.q_lens.begin(), c.q_lens.end());
    args.max_seqlen_kv = *std::max_element(p.c.kv_lens.begin(), p.c.kv_lens.end());
    if (!c.paged) {
      k = DeviceTensor(p.k);
      v = DeviceTensor(p.v);
      ks = DeviceTensor(p.k_descale);
      vs = DeviceTensor(p.v_descale);
      args.k = k;
      args.v = v;
      args.cu_seqlens_kv = cu_kv;
      if (c.scales != Scales::kNone) {
        args.k_descale = ks;
        args.v_descale = vs;
      }
      return;
    }
    pool = DeviceTensor(p.pool);
    table = DeviceTensor(p.table);
    lens = DeviceTensor(p.seq_lens);
    cks = DeviceTensor(p.cache_k_scale);
    cvs = DeviceTensor(p.cache_v_scale);
    view = paged_cache_view(pool.data(), DType::kFp8E4M3, p.num_blocks, c.hkv, c.page, c.head_dim);
    view.block_table = table;
    view.seq_lens = lens;
    view.k_scale = cks;
    view.v_scale = cvs;
    args.kv_cache = &view;
  }
};

void run_and_check(const Fp8Case& c) {
  SCOPED_TRACE(c.str());
  std::mt19937_64 rng(test_seed() ^ std::hash<std::string>()(c.str()));
  const Fp8Problem p = make_problem(c, rng);
  const int64_t total_q = p.cu_q.back();
  HostTensor out(c.out_dtype, {total_q, c.hq, c.head_dim});
  HostTensor lse(DType::kF32, {total_q, c.hq});
  out.fill(NAN);
  lse.fill(NAN);
  Fp8Run run(p, out, lse);
  const AttentionSpec spec = spec_of(c);
  if (c.q_pack) {
    const detail::PrefillProblem problem = detail::validate_prefill(spec, run.args);
    cuda::prefill::run_prefill(spec, run.args, problem, nullptr, PrefillTile::kSm90, 0, 0,
                               c.q_pack);
  } else {
    prefill(spec, run.args);
  }
  ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
  run.out.download(out);
  run.lse.download(lse);

  std::vector<double> exact, exact_lse, naive, naive_lse;
  reference(p, false, exact, exact_lse);
  reference(p, true, naive, naive_lse);
  const std::vector<double> got = out.to_double();
  ASSERT_FALSE(any_nan(got)) << "NaN in the output (unwritten or poisoned element)";
  double naive_err = 0.0;
  for (size_t i = 0; i < exact.size(); ++i) {
    naive_err = std::max(naive_err, std::fabs(round_out(c.out_dtype, naive[i]) - exact[i]));
  }
  const double err = max_abs_diff(got, exact);
  EXPECT_LE(err, 2 * naive_err + 1e-3) << "naive same-quantization error " << naive_err;
  // The output's scale: a kernel that ignores a descale is off by 0.1-10x, far past the bound.
  double largest = 0.0;
  for (double x : exact) largest = std::max(largest, std::fabs(x));
  EXPECT_LT(err, 0.1 * largest) << "error against the output's magnitude " << largest;
  const std::vector<double> got_lse = lse.to_double();
  for (size_t i = 0; i < got_lse.size(); ++i) {
    if (std::isinf(exact_lse[i])) {
      ASSERT_TRUE(std::isinf(got_lse[i]) && got_lse[i] < 0) << "lse[" << i << "]";
    } else {
      ASSERT_NEAR(got_lse[i], exact_lse[i], 2e-3 * std::max(1.0, std::fabs(exact_lse[i])))
          << "lse[" << i << "]";
    }
  }
}

TEST(PrefillFp8, PackedVarlenMasksScalesHeadDims) {
  bool ran = false;
  for (int d : {128, 256}) {
    if (!fp8_runs(d)) continue;
    ran = true;
    const std::vector<int> lens = {1, 17, 128, 129, 300, 700};
    for (MaskKind mask : {MaskKind::kNone, MaskKind::kCausal}) {
      for (Scales scales : {Scales::kNone, Scales::kPerTensor, Scales::kPerHead}) {
        Fp8Case c;
        c.head_dim = d;
        c.hq = 4;
        c.hkv = 2;
        c.mask.kind = mask;
        c.q_lens = lens;
        c.scales = scales;
        c.out_dtype = scales == Scales::kPerTensor ? DType::kF16 : DType::kBF16;
        run_and_check(c);
      }
    }
  }
  if (!ran) GTEST_SKIP() << "no FP8 kernel runs here (sm90 and a 90a build)";
}

TEST(PrefillFp8, PrefixWindowSinksAlibiSoftcapGqaPacking) {
  if (!fp8_runs(128)) GTEST_SKIP() << "no FP8 kernel runs here";
  // Chunked context: queries are the last q_len of kv_len keys (bottom-right causal).
  Fp8Case prefix;
  prefix.hq = 8;
  prefix.hkv = 2;
  prefix.mask.kind = MaskKind::kCausal;
  prefix.q_lens = {5, 200, 64};
  prefix.kv_lens = {900, 333, 64};
  run_and_check(prefix);
  for (bool pack : {false, true}) {
    Fp8Case c = prefix;
    c.q_pack = pack;
    run_and_check(c);
  }
  Fp8Case window = prefix;
  window.mask.kind = MaskKind::kSlidingWindow;
  window.mask.window = 100;
  window.mask.sink_tokens = 4;
  run_and_check(window);
  Fp8Case mods;
  mods.q_lens = {300, 129};
  mods.alibi = true;
  mods.softcap = 20.0;
  mods.mask.kind = MaskKind::kCausal;
  run_and_check(mods);
  Fp8Case d256 = mods;
  d256.head_dim = 256;
  if (fp8_runs(256)) run_and_check(d256);
}

TEST(PrefillFp8, PagedFp8CacheEveryPageChunkedContext) {
  if (!fp8_runs(128)) GTEST_SKIP() << "no FP8 kernel runs here";
  for (int page : {16, 64, 128}) {
    for (MaskKind mask : {MaskKind::kNone, MaskKind::kCausal}) {
      Fp8Case c;
      c.paged = true;
      c.page = page;
      c.hq = 4;
      c.hkv = 2;
      c.mask.kind = mask;
      c.q_lens = {1, 130, 77};
      c.kv_lens = {1, 400, 77};
      if (mask == MaskKind::kNone) c.kv_lens = {9, 400, 300};
      c.scales = Scales::kPerTensor;  // q_descale; the cache's scales are per KV head
      run_and_check(c);
    }
  }
  Fp8Case d256;
  d256.head_dim = 256;
  d256.paged = true;
  d256.q_lens = {100, 3};
  d256.kv_lens = {260, 3};
  d256.mask.kind = MaskKind::kCausal;
  if (fp8_runs(256)) run_and_check(d256);
}

TEST(PrefillFp8, LongVarlen) {
  if (!fp8_runs(128)) GTEST_SKIP() << "no FP8 kernel runs here";
  Fp8Case c;
  c.hq = 2;
  c.hkv = 1;
  c.mask.kind = MaskKind::kCausal;
  c.q_lens = small_test_scale() ? std::vector<int>{1, 300} : std::vector<int>{1, 777, 3000};
  run_and_check(c);
}

// Every rejection names the argument and writes nothing.
TEST(PrefillFp8, RejectsWhatItCannotServe) {
  if (!fp8_runs(128)) GTEST_SKIP() << "no FP8 kernel runs here";
  std::mt19937_64 rng(test_seed());
  Fp8Case c;
  c.q_lens = {40};
  const Fp8Problem p = make_problem(c, rng);
  HostTensor out(DType::kBF16, {40, c.hq, c.head_dim}), lse(DType::kF32, {40, c.hq});
  out.fill(NAN);
  lse.fill(NAN);
  const AttentionSpec spec = spec_of(c);
  {
    Fp8Run run(p, out, lse);
    // bf16 k with fp8 q
    HostTensor k16(DType::kBF16, {40, c.hkv, c.head_dim});
    k16.fill_uniform(rng, -1.f, 1.f);
    DeviceTensor dk16(k16);
    PrefillArgs a = run.args;
    a.k = dk16;
    try {
      prefill(spec, a);
      ADD_FAILURE() << "bf16 k with fp8 q accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("k"), std::string::npos) << e.what();
    }
    // A descale of the wrong shape
    HostTensor bad(DType::kF32, {3});
    bad.fill(1.f);
    DeviceTensor dbad(bad);
    a = run.args;
    a.k_descale = dbad;
    try {
      prefill(spec, a);
      ADD_FAILURE() << "k_descale of shape [3] accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("k_descale"), std::string::npos) << e.what();
    }
    // The vanilla backend has no FP8 kernel
    AttentionSpec vanilla = spec;
    vanilla.backend = Backend::kVanilla;
    try {
      prefill(vanilla, run.args);
      ADD_FAILURE() << "backend vanilla accepted fp8 q";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("fp8"), std::string::npos) << e.what();
    }
    // A portable tile forced
    const detail::PrefillProblem problem = detail::validate_prefill(spec, run.args);
    EXPECT_THROW(cuda::prefill::run_prefill(spec, run.args, problem, nullptr, PrefillTile::kM128),
                 Error);
    ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
    HostTensor got = out;
    run.out.download(got);
    for (double x : got.to_double()) ASSERT_TRUE(std::isnan(x)) << "a rejected call wrote out";
  }
  // head_dim 64 has no FP8 kernel
  Fp8Case d64 = c;
  d64.head_dim = 64;
  const Fp8Problem p64 = make_problem(d64, rng);
  HostTensor out64(DType::kBF16, {40, c.hq, 64}), lse64(DType::kF32, {40, c.hq});
  Fp8Run run64(p64, out64, lse64);
  try {
    prefill(spec_of(d64), run64.args);
    ADD_FAILURE() << "head_dim 64 fp8 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace attnkit::test
