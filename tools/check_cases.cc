// The randomized cases of `attnkit check`.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attnkit.h"
#include "check_support.h"

namespace attnkit::tools {

namespace {

// Brute-force fp64 masked attention over packed sequences (the CPU oracle): materializes every
// logit with an explicit mask predicate, independent of the reference backend's code.
std::vector<double> brute_force_prefill(const AttentionSpec& spec, Tensor& q, Tensor& k, Tensor& v,
                                        const std::vector<int32_t>& cu_q,
                                        const std::vector<int32_t>& cu_kv) {
  const int Hq = spec.num_q_heads, Hkv = spec.num_kv_heads, D = spec.head_dim;
  const std::vector<double> qd = q.read(Device::cpu()), kd = k.read(Device::cpu()),
                            vd = v.read(Device::cpu());
  const std::vector<float> slopes =
      spec.alibi ? (spec.alibi_slopes.empty() ? default_alibi_slopes(Hq) : spec.alibi_slopes)
                 : std::vector<float>();
  std::vector<double> out(qd.size(), 0.0);
  for (size_t s = 0; s + 1 < cu_q.size(); ++s) {
    const int nq = cu_q[s + 1] - cu_q[s], nk = cu_kv[s + 1] - cu_kv[s];
    for (int i = 0; i < nq; ++i) {
      const int64_t p = nk - nq + i;
      for (int h = 0; h < Hq; ++h) {
        const int hk = h / (Hq / Hkv);
        std::vector<double> logit(nk);
        std::vector<bool> keep(nk);
        double peak = -INFINITY;
        for (int j = 0; j < nk; ++j) {
          double x = 0;
          for (int d = 0; d < D; ++d) {
            x += qd[((cu_q[s] + i) * Hq + h) * D + d] * kd[((cu_kv[s] + j) * Hkv + hk) * D + d];
          }
          x *= spec.effective_scale();
          if (spec.logit_softcap > 0) x = spec.logit_softcap * std::tanh(x / spec.logit_softcap);
          if (spec.alibi) x += slopes[h] * static_cast<double>(j - p);
          switch (spec.mask.kind) {
            case MaskKind::kNone:
              keep[j] = true;
              break;
            case MaskKind::kCausal:
              keep[j] = j <= p;
              break;
            case MaskKind::kSlidingWindow:
              keep[j] = j <= p && (j > p - spec.mask.window || j < spec.mask.sink_tokens);
              break;
          }
          logit[j] = x;
          if (keep[j]) peak = std::max(peak, x);
        }
        double sum = 0;
        std::vector<double> acc(D, 0.0);
        for (int j = 0; j < nk; ++j) {
          if (!keep[j]) continue;
          const double w = std::exp(logit[j] - peak);
          sum += w;
          for (int d = 0; d < D; ++d) acc[d] += w * vd[((cu_kv[s] + j) * Hkv + hk) * D + d];
        }
        for (int d = 0; d < D; ++d) {
          out[((cu_q[s] + i) * Hq + h) * D + d] = sum > 0 ? acc[d] / sum : 0.0;
        }
      }
    }
  }
  return out;
}

std::vector<int32_t> prefix_sums(const std::vector<int32_t>& lengths) {
  std::vector<int32_t> cu(lengths.size() + 1, 0);
  for (size_t i = 0; i < lengths.size(); ++i) cu[i + 1] = cu[i] + lengths[i];
  return cu;
}

Tensor int_tensor(const std::vector<int32_t>& values) {
  Tensor t(DType::kInt32, {static_cast<int64_t>(values.size())});
  std::copy(values.begin(), values.end(), t.ints());
  return t;
}

// Packed varlen prefill with fresh random data; the oracle is the brute force above.
Case prefill_case(std::string name, AttentionSpec spec, DType dtype, uint64_t seed) {
  auto rng = std::make_shared<std::mt19937_64>(seed);
  std::vector<int32_t> q_lens = {1, 37, 64}, kv_lens = q_lens;
  if (spec.mask.kind == MaskKind::kNone) kv_lens = {5, 80, 64};  // cross attention shapes
  struct Data {
    Tensor q, k, v, cu_q, cu_kv;
    std::vector<int32_t> cq, ckv;
  };
  auto data = std::make_shared<Data>();
  data->cq = prefix_sums(q_lens);
  data->ckv = prefix_sums(kv_lens);
  const int64_t tq = data->cq.back(), tk = data->ckv.back();
  data->q = Tensor(dtype, {tq, spec.num_q_heads, spec.head_dim});
  data->k = Tensor(dtype, {tk, spec.num_kv_heads, spec.head_dim});
  data->v = Tensor(dtype, {tk, spec.num_kv_heads, spec.head_dim});
  data->q.fill_uniform(*rng, -1, 1);
  data->k.fill_uniform(*rng, -1, 1);
  data->v.fill_uniform(*rng, -1, 1);
  data->cu_q = int_tensor(data->cq);
  data->cu_kv = int_tensor(data->ckv);
  const int32_t max_q = *std::max_element(q_lens.begin(), q_lens.end());
  const int32_t max_kv = *std::max_element(kv_lens.begin(), kv_lens.end());
  Case c;
  c.name = std::move(name);
  c.dtype = dtype;
  c.run = [=](const Target& target) {
    AttentionSpec s = spec;
    s.backend = target.backend;
    Tensor out(dtype, {tq, spec.num_q_heads, spec.head_dim});
    out.fill(NAN);
    PrefillArgs args;
    args.q = data->q.on(target.device);
    args.k = data->k.on(target.device);
    args.v = data->v.on(target.device);
    args.cu_seqlens_q = data->cu_q.on(target.device);
    args.cu_seqlens_kv = data->cu_kv.on(target.device);
    args.out = out.on(target.device);
    args.max_seqlen_q = max_q;
    args.max_seqlen_kv = max_kv;
    prefill(s, args);
    synchronize(target.device);
    return out.read(target.device);
  };
  c.cpu_oracle = [=] {
    return brute_force_prefill(spec, data->q, data->k, data->v, data->cq, data->ckv);
  };
  return c;
}

AttentionSpec base_spec(int32_t hq, int32_t hkv, int32_t d) {
  AttentionSpec spec;
  spec.num_q_heads = hq;
  spec.num_kv_heads = hkv;
  spec.head_dim = d;
  return spec;
}

// Decode over a paged cache of random contents, blocks [Hkv, T, D] (HND) or [T, Hkv, D] (NHD); the
// CPU oracle is a paged prefill with one query per row (decode == the last row of prefill).
Case decode_case(std::string name, DType kv_dtype, int32_t tokens_per_block, uint64_t seed,
                 KvCacheLayout layout = KvCacheLayout::kHND) {
  auto rng = std::make_shared<std::mt19937_64>(seed);
  const AttentionSpec spec = base_spec(8, 2, 128);
  const DType dtype = DType::kBF16;
  const std::vector<int32_t> lens = {1, 17, 200, 333};
  const int32_t rows = static_cast<int32_t>(lens.size());
  const int32_t max_blocks = (333 + tokens_per_block - 1) / tokens_per_block;
  const int32_t num_blocks = rows * max_blocks + 3;
  struct Data {
    Tensor pool, table, lens, k_scale, v_scale, q;
    KvCacheLayout layout = KvCacheLayout::kHND;
    KvCacheView view(const Device& device) {
      KvCacheView kv;
      const bool nhd = layout == KvCacheLayout::kNHD;
      kv.layout = layout;
      const TensorView p = pool.on(device);
      kv.k_base = p.data;
      kv.v_base = static_cast<uint8_t*>(p.data) + p.strides[1] * dtype_size(p.dtype);
      kv.block_stride_bytes = p.strides[0] * static_cast<int64_t>(dtype_size(p.dtype));
      kv.num_blocks = static_cast<int32_t>(p.shape[0]);
      kv.dtype = p.dtype;
      kv.device = device;
      kv.num_kv_heads = static_cast<int32_t>(p.shape[nhd ? 3 : 2]);
      kv.tokens_per_block = static_cast<int32_t>(p.shape[nhd ? 2 : 3]);
      kv.head_dim = static_cast<int32_t>(p.shape[4]);
      kv.block_table = table.on(device);
      kv.seq_lens = lens.on(device);
      if (k_scale.numel()) {
        kv.k_scale = k_scale.on(device);
        kv.v_scale = v_scale.on(device);
      }
      return kv;
    }
  };
  auto data = std::make_shared<Data>();
  data->layout = layout;
  data->pool = layout == KvCacheLayout::kNHD
                   ? Tensor(kv_dtype, {num_blocks, 2, tokens_per_block, spec.num_kv_heads, 128})
                   : Tensor(kv_dtype, {num_blocks, 2, spec.num_kv_heads, tokens_per_block, 128});
  const bool quantized = kv_dtype == DType::kFp8E4M3 || kv_dtype == DType::kInt8;
  data->pool.fill_uniform(*rng, quantized ? -100.f : -1.f, quantized ? 100.f : 1.f);
  if (quantized) {
    data->k_scale = Tensor(DType::kF32, {spec.num_kv_heads});
    data->v_scale = Tensor(DType::kF32, {1});
    data->k_scale.fill_uniform(*rng, 0.005f, 0.02f);
    data->v_scale.fill_uniform(*rng, 0.005f, 0.02f);
  }
  std::vector<int32_t> block_ids(num_blocks);
  std::iota(block_ids.begin(), block_ids.end(), 0);
  std::shuffle(block_ids.begin(), block_ids.end(), *rng);
  data->table = Tensor(DType::kInt32, {rows, max_blocks});
  for (int64_t i = 0; i < rows * max_blocks; ++i) data->table.ints()[i] = block_ids[i];
  data->lens = int_tensor(lens);
  data->q = Tensor(dtype, {rows, spec.num_q_heads, 128});
  data->q.fill_uniform(*rng, -1, 1);
  Case c;
  c.name = std::move(name);
  c.dtype = dtype;
  c.run = [=](const Target& target) {
    AttentionSpec s = spec;
    s.backend = target.backend;
    Tensor out(dtype, {rows, spec.num_q_heads, 128});
    out.fill(NAN);
    DecodeArgs args;
    args.q = data->q.on(target.device);
    args.kv_cache = data->view(target.device);
    args.out = out.on(target.device);
    decode(s, args);
    synchronize(target.device);
    return out.read(target.device);
  };
  c.cpu_oracle = [=] {
    Tensor out(dtype, {rows, spec.num_q_heads, 128});
    out.fill(NAN);
    const KvCacheView kv = data->view(Device::cpu());
    Tensor cu = int_tensor(prefix_sums(std::vector<int32_t>(rows, 1)));
    PrefillArgs args;
    args.q = data->q.on(Device::cpu());
    args.cu_seqlens_q = cu.on(Device::cpu());
    args.kv_cache = &kv;
    args.out = out.on(Device::cpu());
    prefill(spec, args);
    return out.read(Device::cpu());
  };
  return c;
}

// dense() over [B, S, H, D]; the CPU oracle is varlen prefill with mask none on the same data.
Case dense_case(std::string name, uint64_t seed) {
  auto rng = std::make_shared<std::mt19937_64>(seed);
  AttentionSpec spec = base_spec(4, 4, 64);
  spec.mask.kind = MaskKind::kNone;
  const DType dtype = DType::kBF16;
  const int64_t B = 2, Sq = 70, Skv = 150;
  auto q = std::make_shared<Tensor>(dtype, std::vector<int64_t>{B, Sq, 4, 64});
  auto k = std::make_shared<Tensor>(dtype, std::vector<int64_t>{B, Skv, 4, 64});
  auto v = std::make_shared<Tensor>(dtype, std::vector<int64_t>{B, Skv, 4, 64});
  q->fill_uniform(*rng, -1, 1);
  k->fill_uniform(*rng, -1, 1);
  v->fill_uniform(*rng, -1, 1);
  Case c;
  c.name = std::move(name);
  c.dtype = dtype;
  c.run = [=](const Target& target) {
    AttentionSpec s = spec;
    s.backend = target.backend;
    Tensor out(dtype, {B, Sq, 4, 64});
    out.fill(NAN);
    DenseArgs args;
    args.q = q->on(target.device);
    args.k = k->on(target.device);
    args.v = v->on(target.device);
    args.out = out.on(target.device);
    dense(s, args);
    synchronize(target.device);
    return out.read(target.device);
  };
  c.cpu_oracle = [=] {
    Tensor out(dtype, {B * Sq, 4, 64});
    out.fill(NAN);
    Tensor cu_q = int_tensor({0, static_cast<int32_t>(Sq), static_cast<int32_t>(2 * Sq)});
    Tensor cu_kv = int_tensor({0, static_cast<int32_t>(Skv), static_cast<int32_t>(2 * Skv)});
    PrefillArgs args;
    TensorView qv = q->on(Device::cpu()), kv = k->on(Device::cpu()), vv = v->on(Device::cpu());
    args.q = TensorView(qv.data, dtype, {B * Sq, 4, 64});
    args.k = TensorView(kv.data, dtype, {B * Skv, 4, 64});
    args.v = TensorView(vv.data, dtype, {B * Skv, 4, 64});
    args.cu_seqlens_q = cu_q.on(Device::cpu());
    args.cu_seqlens_kv = cu_kv.on(Device::cpu());
    args.out = out.on(Device::cpu());
    prefill(spec, args);
    return out.read(Device::cpu());
  };
  return c;
}

}  // namespace

std::vector<Case> make_cases(uint64_t seed) {
  std::vector<Case> cases;
  uint64_t n = 0;
  for (int32_t d : {64, 128}) {
    AttentionSpec causal = base_spec(8, 2, d);
    cases.push_back(prefill_case("prefill causal GQA D=" + std::to_string(d), causal, DType::kBF16,
                                 seed + n++));
  }
  {
    AttentionSpec window = base_spec(4, 4, 128);
    window.mask = {MaskKind::kSlidingWindow, 16, 4};
    cases.push_back(prefill_case("prefill window16+sinks4", window, DType::kF16, seed + n++));
  }
  {
    AttentionSpec cross = base_spec(8, 1, 128);
    cross.mask.kind = MaskKind::kNone;
    cases.push_back(prefill_case("prefill cross MQA", cross, DType::kBF16, seed + n++));
  }
  {
    AttentionSpec alibi = base_spec(12, 12, 64);
    alibi.alibi = true;
    alibi.logit_softcap = 30.0;
    cases.push_back(prefill_case("prefill alibi+softcap H=12", alibi, DType::kBF16, seed + n++));
  }
  cases.push_back(decode_case("decode paged bf16 page16", DType::kBF16, 16, seed + n++));
  cases.push_back(decode_case("decode paged fp8 page32", DType::kFp8E4M3, 32, seed + n++));
  cases.push_back(decode_case("decode paged int8 page64", DType::kInt8, 64, seed + n++));
  cases.push_back(decode_case("decode paged bf16 page16 NHD", DType::kBF16, 16, seed + n++,
                              KvCacheLayout::kNHD));
  cases.push_back(dense_case("dense B=2 70x150", seed + n++));
  return cases;
}

}  // namespace attnkit::tools
