// Reference append_kv: RoPE against hand-computed values and an independent formula (styles,
// scalings, partial rotary_dim), bias, fused == separate inputs, and quantized caches (stored
// bytes, attention over the quantized cache == attention over the dequantized values).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "common/reference_oracle.h"
#include "common/test_util.h"
#include "core/rope.h"

namespace attnkit::test {
namespace {

AttentionSpec rope_spec(int32_t hq, int32_t hkv, int32_t d, RopeStyle style, int32_t rotary_dim) {
  AttentionSpec spec;
  spec.num_q_heads = hq;
  spec.num_kv_heads = hkv;
  spec.head_dim = d;
  spec.rope.style = style;
  spec.rope.rotary_dim = rotary_dim;
  return spec;
}

TEST(ReferenceRope, HandComputedTinyCase) {
  // D = 8, base 10000: inv_freq = 10000^(-2i/8) = 1, 0.1, 0.01, 0.001; position 3.
  const double angle[4] = {3.0, 0.3, 0.03, 0.003};
  const double x[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<double> qkv_values;
  for (int part = 0; part < 3; ++part) qkv_values.insert(qkv_values.end(), x, x + 8);
  // bf16 input (the unquantized cache takes the input dtype); 1..8 are exact in bf16.
  HostTensor qkv = tensor_from(DType::kBF16, {1, 24}, qkv_values);
  std::mt19937_64 rng(test_seed());

  // GPT-NeoX: pairs (i, i + 4).
  {
    OracleKvCache cache = OracleKvCache::paged(DType::kBF16, 1, 8, 8, 1, 1, rng);
    const HostTensor q =
        run_append_kv(rope_spec(1, 1, 8, RopeStyle::kGptNeox, 0), qkv, {3}, {0}, cache.view());
    for (int i = 0; i < 4; ++i) {
      const double c = std::cos(angle[i]), s = std::sin(angle[i]);
      const double want_a = x[i] * c - x[i + 4] * s, want_b = x[i + 4] * c + x[i] * s;
      EXPECT_NEAR(q.get(i), want_a, rounding_bound(DType::kBF16, want_a)) << i;
      EXPECT_NEAR(q.get(i + 4), want_b, rounding_bound(DType::kBF16, want_b)) << i;
      // K is stored rotated (bf16), V as it is.
      EXPECT_EQ(cache.read(0, 3, 0, i, 0), rounded_to(DType::kBF16, {want_a})[0]);
      EXPECT_EQ(cache.read(0, 3, 0, i + 4, 1), x[i + 4]);
    }
  }
  // GPT-J: pairs (2i, 2i + 1).
  {
    OracleKvCache cache = OracleKvCache::paged(DType::kBF16, 1, 8, 8, 1, 1, rng);
    const HostTensor q =
        run_append_kv(rope_spec(1, 1, 8, RopeStyle::kGptJ, 0), qkv, {3}, {0}, cache.view());
    for (int i = 0; i < 4; ++i) {
      const double c = std::cos(angle[i]), s = std::sin(angle[i]);
      const double want_a = x[2 * i] * c - x[2 * i + 1] * s;
      const double want_b = x[2 * i + 1] * c + x[2 * i] * s;
      EXPECT_NEAR(q.get(2 * i), want_a, rounding_bound(DType::kBF16, want_a)) << i;
      EXPECT_NEAR(q.get(2 * i + 1), want_b, rounding_bound(DType::kBF16, want_b)) << i;
    }
  }
  // rotary_dim 4 (NeoX): inv_freq = 1, 0.01 on pairs (0, 2), (1, 3); dims 4..7 pass through.
  {
    OracleKvCache cache = OracleKvCache::paged(DType::kBF16, 1, 8, 8, 1, 1, rng);
    const HostTensor q =
        run_append_kv(rope_spec(1, 1, 8, RopeStyle::kGptNeox, 4), qkv, {3}, {0}, cache.view());
    const double a4[2] = {3.0, 0.03};
    for (int i = 0; i < 2; ++i) {
      const double c = std::cos(a4[i]), s = std::sin(a4[i]);
      const double want_a = x[i] * c - x[i + 2] * s, want_b = x[i + 2] * c + x[i] * s;
      EXPECT_NEAR(q.get(i), want_a, rounding_bound(DType::kBF16, want_a)) << i;
      EXPECT_NEAR(q.get(i + 2), want_b, rounding_bound(DType::kBF16, want_b)) << i;
    }
    for (int i = 4; i < 8; ++i) EXPECT_EQ(q.get(i), x[i]) << i;
  }
  // Linear scaling by 2 at position 6 equals no scaling at position 3.
  {
    OracleKvCache cache = OracleKvCache::paged(DType::kBF16, 1, 8, 8, 1, 1, rng);
    AttentionSpec spec = rope_spec(1, 1, 8, RopeStyle::kGptNeox, 0);
    const HostTensor plain = run_append_kv(spec, qkv, {3}, {0}, cache.view());
    spec.rope.scaling = RopeScaling::kLinear;
    spec.rope.factor = 2.0;
    const HostTensor scaled = run_append_kv(spec, qkv, {6}, {0}, cache.view());
    EXPECT_EQ(max_abs_diff(plain.to_double(), scaled.to_double()), 0.0);
  }
}

// The test's own RoPE frequency (HF transformers' formulas).
double expected_inv_freq(const RopeSpec& r, int rotary_dim, int i) {
  double inv = 1.0 / std::pow(r.base, 2.0 * i / rotary_dim);
  if (r.scaling == RopeScaling::kLinear) return inv / r.factor;
  if (r.scaling == RopeScaling::kLlama3) {
    const double wavelen = 2 * M_PI / inv;
    const double low_wavelen = r.original_max_position / r.low_freq_factor;
    const double high_wavelen = r.original_max_position / r.high_freq_factor;
    if (wavelen < high_wavelen) return inv;
    if (wavelen > low_wavelen) return inv / r.factor;
    const double smooth = (r.original_max_position / wavelen - r.low_freq_factor) /
                          (r.high_freq_factor - r.low_freq_factor);
    return (1 - smooth) * inv / r.factor + smooth * inv;
  }
  return inv;
}

std::vector<double> expected_rotation(const RopeSpec& r, int d, int rotary_dim, int64_t position,
                                      std::vector<double> x) {
  const int half = rotary_dim / 2;
  for (int i = 0; i < half; ++i) {
    const double angle = position * expected_inv_freq(r, rotary_dim, i);
    const int a = r.style == RopeStyle::kGptJ ? 2 * i : i;
    const int b = r.style == RopeStyle::kGptJ ? 2 * i + 1 : i + half;
    const double xa = x[a], xb = x[b];
    x[a] = xa * std::cos(angle) - xb * std::sin(angle);
    x[b] = xb * std::cos(angle) + xa * std::sin(angle);
  }
  (void)d;
  return x;
}

TEST(ReferenceRope, MatchesIndependentFormulaForStylesScalingsAndRotaryDims) {
  std::mt19937_64 rng(test_seed());
  const int32_t hq = 2, hkv = 1, d = 32, n = 6, width = (hq + 2 * hkv) * d;
  std::uniform_int_distribution<int32_t> pick_pos(0, 499);
  for (RopeStyle style : {RopeStyle::kGptNeox, RopeStyle::kGptJ}) {
    for (RopeScaling scaling : {RopeScaling::kNone, RopeScaling::kLinear, RopeScaling::kLlama3}) {
      for (int32_t rotary_dim : {d, d / 2}) {
        SCOPED_TRACE(::testing::Message()
                     << "style " << static_cast<int>(style) << " scaling "
                     << static_cast<int>(scaling) << " rotary_dim " << rotary_dim);
        AttentionSpec spec = rope_spec(hq, hkv, d, style, rotary_dim == d ? 0 : rotary_dim);
        spec.rope.scaling = scaling;
        spec.rope.base = 10000.0;
        spec.rope.factor = scaling == RopeScaling::kLinear ? 4.0 : 8.0;
        spec.rope.original_max_position = 64;  // puts frequencies in all three llama3 regions
        if (scaling == RopeScaling::kLlama3) {
          int region[3] = {0, 0, 0};
          for (int i = 0; i < rotary_dim / 2; ++i) {
            const double wavelen = 2 * M_PI * std::pow(10000.0, 2.0 * i / rotary_dim);
            region[wavelen < 16 ? 0 : wavelen > 64 ? 2 : 1]++;
          }
          ASSERT_TRUE(region[0] && region[1] && region[2]) << "test should cover all regions";
        }
        // f16 input and cache (an unquantized cache takes the input dtype).
        const std::vector<double> input =
            rounded_to(DType::kF16, random_values(rng, n * width, -1, 1));
        const std::vector<double> bias_values =
            rounded_to(DType::kF16, random_values(rng, width, -0.5, 0.5));
        HostTensor qkv = tensor_from(DType::kF16, {n, width}, input);
        HostTensor bias = tensor_from(DType::kF16, {width}, bias_values);
        std::vector<int32_t> positions(n), rows(n, 0);
        // Distinct positions (one slot each) spread over 0 .. 3000.
        for (int32_t t = 0; t < n; ++t) positions[t] = 500 * t + pick_pos(rng);
        // A contiguous f16 cache big enough for every position.
        OracleKvCache cache = OracleKvCache::contiguous(DType::kF16, hkv, d, 1, 3001);
        const HostTensor q = run_append_kv(spec, qkv, positions, rows, cache.view(), &bias);
        for (int32_t t = 0; t < n; ++t) {
          for (int32_t h = 0; h < hq + hkv; ++h) {
            std::vector<double> x(d);
            for (int32_t e = 0; e < d; ++e)
              x[e] = input[t * width + h * d + e] + bias_values[h * d + e];
            const std::vector<double> want =
                expected_rotation(spec.rope, d, rotary_dim, positions[t], x);
            for (int32_t e = 0; e < d; ++e) {
              if (h < hq) {
                ASSERT_NEAR(q.get((t * hq + h) * d + e), want[e],
                            rounding_bound(DType::kF16, want[e]))
                    << t << " " << h << " " << e;
              } else {
                const double k = cache.read(0, positions[t], h - hq, e, 0);
                ASSERT_NEAR(k, want[e], rounding_bound(DType::kF16, want[e]))
                    << "K token " << t << " d " << e;
              }
            }
          }
        }
      }
    }
  }
}

TEST(ReferenceRope, FloatFormulaAgreesWithDouble) {
  AttentionSpec spec = rope_spec(1, 1, 128, RopeStyle::kGptNeox, 0);
  spec.rope.base = 500000.0;
  for (RopeScaling scaling : {RopeScaling::kNone, RopeScaling::kLinear, RopeScaling::kLlama3}) {
    spec.rope.scaling = scaling;
    spec.rope.factor = 8.0;
    const detail::RopeParams r = detail::make_rope_params(spec);
    for (int32_t i = 0; i < 64; ++i) {
      const double want = detail::rope_inv_freq<double>(r, i);
      EXPECT_NEAR(detail::rope_inv_freq<float>(r, i), want, std::fabs(want) * 2e-6) << i;
      EXPECT_NEAR(want, expected_inv_freq(spec.rope, 128, i), std::fabs(want) * 1e-12) << i;
      float cf, sf;
      double cd, sd;
      detail::rope_cos_sin<float>(r, 1000, i, &cf, &sf);
      detail::rope_cos_sin<double>(r, 1000, i, &cd, &sd);
      EXPECT_NEAR(cf, cd, 2e-4);
      EXPECT_NEAR(sf, sd, 2e-4);
    }
  }
}

TEST(ReferenceAppendKv, FusedEqualsSeparateInputsWithBias) {
  std::mt19937_64 rng(test_seed());
  const int32_t hq = 4, hkv = 2, d = 16, n = 5, width = (hq + 2 * hkv) * d;
  AttentionSpec spec = rope_spec(hq, hkv, d, RopeStyle::kGptJ, 0);
  HostTensor qkv(DType::kBF16, {n, width}), bias(DType::kBF16, {width});
  qkv.fill_uniform(rng, -1, 1);
  bias.fill_uniform(rng, -1, 1);
  HostTensor q(DType::kBF16, {n, hq, d}), k(DType::kBF16, {n, hkv, d}),
      v(DType::kBF16, {n, hkv, d});
  for (int32_t t = 0; t < n; ++t) {
    for (int32_t c = 0; c < width; ++c) {
      const float x = qkv.get(t * width + c);
      const int32_t head = c / d, e = c % d;
      if (head < hq) {
        q.set((t * hq + head) * d + e, x);
      } else if (head < hq + hkv) {
        k.set((t * hkv + head - hq) * d + e, x);
      } else {
        v.set((t * hkv + head - hq - hkv) * d + e, x);
      }
    }
  }
  const std::vector<int32_t> positions = {0, 1, 2, 9, 4}, rows = {0, 0, 0, 1, 1};
  // The fused call writes a cache of each layout, the separate one the same cache in the other
  // layout: moved back, its bytes equal the fused call's.
  for (KvCacheLayout layout : kBothLayouts) {
    SCOPED_TRACE(kv_layout_name(layout));
    OracleKvCache fused_cache = OracleKvCache::paged(DType::kBF16, hkv, d, 8, 2, 2, rng, layout);
    OracleKvCache separate_cache = fused_cache.relaid(other_layout(layout));
    const HostTensor q_fused = run_append_kv(spec, qkv, positions, rows, fused_cache.view(), &bias);

    HostTensor q_out(DType::kBF16, {n, hq, d});
    q_out.fill(NAN);
    HostTensor pos = int32_tensor(positions), row = int32_tensor(rows);
    AppendKvArgs args;
    args.q = q;
    args.k = k;
    args.v = v;
    args.qkv_bias = bias;
    args.positions = pos;
    args.row_of_token = row;
    args.kv_cache = separate_cache.view();
    args.q_out = q_out;
    call::append_kv(spec, args);

    EXPECT_FALSE(any_nan(q_fused.to_double()));
    EXPECT_EQ(q_fused.bytes(), q_out.bytes());
    EXPECT_EQ(fused_cache.pool().bytes(), separate_cache.relaid(layout).pool().bytes());
    // The bias is applied: V of token 3 is v + bias rounded to bf16.
    for (int32_t e = 0; e < d; ++e) {
      const double want =
          rounded_to(DType::kBF16, {static_cast<double>(v.get((3 * hkv + 1) * d + e)) +
                                    bias.get((hq + hkv + 1) * d + e)})[0];
      EXPECT_EQ(fused_cache.read(1, 9, 1, e, 1), want) << e;
      EXPECT_EQ(separate_cache.read(1, 9, 1, e, 1), want) << e;
    }
  }
}

// K/V quantized into fp8 / int8 caches with per-tensor or per-head scales: the stored bytes are
// numerics::quantize of the biased, rotated value, and attention over the quantized cache equals
// attention over the dequantized values.
TEST(ReferenceAppendKv, QuantizedCachesStoreQuantizedValuesAndAttendOverThem) {
  std::mt19937_64 rng(test_seed());
  const int32_t h = 2, d = 16, n = 13, width = 3 * h * d, tpb = 8;
  for (KvCacheLayout layout : kBothLayouts)
    for (DType kv_dtype : {DType::kFp8E4M3, DType::kInt8}) {
      for (bool per_head : {false, true}) {
        SCOPED_TRACE(::testing::Message() << kv_layout_name(layout) << " " << dtype_name(kv_dtype)
                                          << (per_head ? " per-head" : " per-tensor"));
        AttentionSpec spec = rope_spec(h, h, d, RopeStyle::kGptNeox, 0);
        // K part == Q part (and the same bias), so q_out is exactly the rotated K.
        std::vector<double> input = rounded_to(DType::kF32, random_values(rng, n * width, -2, 2));
        std::vector<double> bias_values =
            rounded_to(DType::kF32, random_values(rng, width, -0.5, 0.5));
        for (int32_t t = 0; t < n; ++t) {
          for (int32_t c = 0; c < h * d; ++c) input[t * width + h * d + c] = input[t * width + c];
        }
        for (int32_t c = 0; c < h * d; ++c) bias_values[h * d + c] = bias_values[c];
        HostTensor qkv = tensor_from(DType::kF32, {n, width}, input);
        HostTensor bias = tensor_from(DType::kF32, {width}, bias_values);
        OracleKvCache cache = OracleKvCache::paged(kv_dtype, h, d, tpb, 1, 2, rng, layout);
        const float qmax = kv_dtype == DType::kInt8 ? 127.0f : 448.0f;
        if (per_head) {
          cache.set_scales({3.0f / qmax, 2.0f / qmax}, {2.5f / qmax, 4.0f / qmax});
        } else {
          cache.set_scales({2.5f / qmax}, {3.0f / qmax});
        }
        std::vector<int32_t> positions(n), rows(n, 0);
        for (int32_t t = 0; t < n; ++t) positions[t] = t;
        const HostTensor q = run_append_kv(spec, qkv, positions, rows, cache.view(), &bias);
        cache.set_seq_len(0, n);
        for (int32_t t = 0; t < n; ++t) {
          for (int32_t head = 0; head < h; ++head) {
            const float ks = cache.scale(0, head), vs = cache.scale(1, head);
            for (int32_t e = 0; e < d; ++e) {
              const float k_value = q.get((t * h + head) * d + e);
              const float v_value = static_cast<float>(input[t * width + 2 * h * d + head * d + e] +
                                                       bias_values[2 * h * d + head * d + e]);
              const uint8_t want_k =
                  kv_dtype == DType::kInt8
                      ? static_cast<uint8_t>(numerics::quantize_int8(k_value, ks))
                      : numerics::quantize_fp8_e4m3(k_value, ks);
              const uint8_t want_v =
                  kv_dtype == DType::kInt8
                      ? static_cast<uint8_t>(numerics::quantize_int8(v_value, vs))
                      : numerics::quantize_fp8_e4m3(v_value, vs);
              ASSERT_EQ(cache.byte_at(cache.element_index(0, t, head, e, 0)), want_k)
                  << "K token " << t << " head " << head << " d " << e;
              ASSERT_EQ(cache.byte_at(cache.element_index(0, t, head, e, 1)), want_v)
                  << "V token " << t << " head " << head << " d " << e;
            }
          }
        }
        // Causal prefill of all tokens over the quantized cache, against the oracle over the
        // dequantized values.
        const KvCacheView view = cache.view();
        HostTensor out(DType::kF32, {n, h, d}), lse(DType::kF32, {n, h});
        out.fill(NAN);
        lse.fill(NAN);
        HostTensor cu = int32_tensor({0, n});
        PrefillArgs args;
        args.q = q;
        args.cu_seqlens_q = cu;
        args.kv_cache = &view;
        args.out = out;
        args.lse = lse;
        call::prefill(spec, args);
        OracleProblem pr;
        pr.num_q_heads = h;
        pr.num_kv_heads = h;
        pr.head_dim = d;
        pr.q = q.to_double();
        pr.k = cache.dense(0, n, 0);
        pr.v = cache.dense(0, n, 1);
        for (int32_t t = 0; t < n; ++t) pr.q_positions.push_back(t);
        pr.mask = spec.mask;
        const OracleResult ref = brute_force_attention(pr);
        EXPECT_LE(max_abs_diff(out.to_double(), ref.out), 1e-5);
        EXPECT_LE(max_abs_diff(lse.to_double(), ref.lse), 1e-5);
      }
    }
}

}  // namespace
}  // namespace attnkit::test
