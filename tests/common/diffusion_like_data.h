// Q, K, V of [B, S, H, D] with the structure of diffusion self-attention, so that skip-softmax
// has tiles to skip (on Gaussian data no 64 x 128 tile ever qualifies: docs/diffusion.md). The
// model, per batch entry and head:
//   q_i = a u(i) + c g + noise,    k_j = a u(j) + h_j g + noise,    v_j ~ U(-1, 1)
// - u(p): 2 r sinusoid features of the token position p (frequencies 2 pi f / S, f = 1 .. r):
//   u(i) . u(j) = sum_f cos(2 pi f (i - j) / S), a shared low-rank positional part that peaks on
//   the diagonal and makes attention local, as image / video tokens attend to their neighbours;
// - g: one shared unit direction; h_j = heavy for `heavy_keys` random keys (0 for the others):
//   a few keys every query attends to;
// - noise: Gaussian, `noise` per element.
// The features sit in the first 2 r + 1 of the D dims (the rest hold noise only). With the
// defaults and softmax scale 1/sqrt(D), the diagonal's logits lie about 12 natural units above
// those of keys half the sequence away.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "attnkit/attention.h"
#include "common/test_util.h"

namespace attnkit::test {

struct DiffusionLikeData {
  int rank = 4;           // r: frequency pairs of the positional part
  float positional = 0;   // a; 0: chosen so that a^2 r / sqrt(D) = 12
  float query_heavy = 1;  // c
  float heavy = 6;        // h_j of the heavy keys
  int heavy_keys = 4;
  float noise = 0.5f;
};

// Fills q [B, Sq, Hq, D], k and v [B, Skv, Hkv, D] (any 16- or 32-bit float dtype; values are
// rounded to it). Query positions are scaled to the key positions (Sq != Skv: cross attention on
// a resampled grid).
inline void fill_diffusion_like(HostTensor& q, HostTensor& k, HostTensor& v, std::mt19937_64& rng,
                                const DiffusionLikeData& m = {}) {
  const TensorView qv = q.view(), kv = k.view();
  const int64_t batch = qv.shape[0], sq = qv.shape[1], hq = qv.shape[2], dim = qv.shape[3];
  const int64_t skv = kv.shape[1], hkv = kv.shape[2];
  const float a = m.positional > 0.f
                      ? m.positional
                      : std::sqrt(12.f * std::sqrt(static_cast<float>(dim)) / m.rank);
  const int64_t features = 2 * m.rank;
  std::normal_distribution<float> gauss(0.f, m.noise);
  const double two_pi = 6.283185307179586;
  auto feature = [&](double pos, int64_t f) {
    const double w = two_pi * static_cast<double>(f / 2 + 1) / static_cast<double>(skv);
    return static_cast<float>(f % 2 == 0 ? std::cos(w * pos) : std::sin(w * pos));
  };
  std::uniform_int_distribution<int64_t> pick(0, skv - 1);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < hkv; ++h) {
      std::vector<float> heavy(static_cast<size_t>(skv), 0.f);
      for (int i = 0; i < m.heavy_keys; ++i) heavy[static_cast<size_t>(pick(rng))] = m.heavy;
      for (int64_t j = 0; j < skv; ++j) {
        const int64_t base = ((b * skv + j) * hkv + h) * dim;
        for (int64_t d = 0; d < dim; ++d) {
          float x = gauss(rng);
          if (d < features) x += a * feature(static_cast<double>(j), d);
          if (d == features) x += heavy[static_cast<size_t>(j)];
          k.set(base + d, x);
          v.set(base + d, std::uniform_real_distribution<float>(-1.f, 1.f)(rng));
        }
      }
    }
    for (int64_t h = 0; h < hq; ++h) {
      for (int64_t i = 0; i < sq; ++i) {
        const double pos =
            static_cast<double>(i) * static_cast<double>(skv) / static_cast<double>(sq);
        const int64_t base = ((b * sq + i) * hq + h) * dim;
        for (int64_t d = 0; d < dim; ++d) {
          float x = gauss(rng);
          if (d < features) x += a * feature(pos, d);
          if (d == features) x += m.query_heavy;
          q.set(base + d, x);
        }
      }
    }
  }
}

// One sequence of a packed prefill batch: its queries are the last q_len of its kv_len positions
// (bottom-right aligned).
struct PackedSeq {
  int32_t q_len = 0, kv_len = 0;
};

// Packed prefill inputs of diffusion-like structure: each sequence's kv_len positions filled by
// fill_diffusion_like (Sq = Skv), its queries the last q_len of them.
// The packed-mode PrefillArgs over q, k, v and their cu_seqlens (host or device views), with the
// longest lengths as bounds, writing `out`.
inline PrefillArgs packed_prefill_args(const TensorView& q, const TensorView& k,
                                       const TensorView& v, const TensorView& cu_q,
                                       const TensorView& cu_kv, int32_t max_q, int32_t max_kv,
                                       const TensorView& out) {
  PrefillArgs a;
  a.q = q;
  a.k = k;
  a.v = v;
  a.cu_seqlens_q = cu_q;
  a.cu_seqlens_kv = cu_kv;
  a.out = out;
  a.max_seqlen_q = max_q;
  a.max_seqlen_kv = max_kv;
  return a;
}

struct PackedDiffusionLike {
  std::vector<PackedSeq> seqs;
  int32_t hq = 0, hkv = 0, dim = 0;
  int32_t max_q = 0, max_kv = 0;
  HostTensor q, k, v;      // [total_q, Hq, D], [total_kv, Hkv, D]
  HostTensor cu_q, cu_kv;  // int32 [B + 1]

  // The packed-mode PrefillArgs of these tensors, writing `out`.
  PrefillArgs args(const TensorView& out) const {
    return packed_prefill_args(q, k, v, cu_q, cu_kv, max_q, max_kv, out);
  }
};

inline PackedDiffusionLike make_packed_diffusion_like(const std::vector<PackedSeq>& seqs,
                                                      int32_t hq, int32_t hkv, int32_t dim,
                                                      DType dtype, std::mt19937_64& rng) {
  PackedDiffusionLike in;
  in.seqs = seqs;
  in.hq = hq;
  in.hkv = hkv;
  in.dim = dim;
  int64_t total_q = 0, total_kv = 0;
  for (const PackedSeq& s : seqs) {
    total_q += s.q_len;
    total_kv += s.kv_len;
    in.max_q = std::max(in.max_q, s.q_len);
    in.max_kv = std::max(in.max_kv, s.kv_len);
  }
  const int64_t n = static_cast<int64_t>(seqs.size());
  in.q = HostTensor(dtype, {total_q, hq, dim});
  in.k = HostTensor(dtype, {total_kv, hkv, dim});
  in.v = HostTensor(dtype, {total_kv, hkv, dim});
  in.cu_q = HostTensor(DType::kInt32, {n + 1});
  in.cu_kv = HostTensor(DType::kInt32, {n + 1});
  int64_t q0 = 0, k0 = 0;
  in.cu_q.data<int32_t>()[0] = in.cu_kv.data<int32_t>()[0] = 0;
  for (int64_t i = 0; i < n; ++i) {
    const PackedSeq& s = seqs[i];
    HostTensor q(dtype, {1, s.kv_len, hq, dim}), k(dtype, {1, s.kv_len, hkv, dim}),
        v(dtype, {1, s.kv_len, hkv, dim});
    fill_diffusion_like(q, k, v, rng);
    const int64_t first = int64_t{s.kv_len - s.q_len} * hq * dim;
    for (int64_t e = 0; e < int64_t{s.q_len} * hq * dim; ++e) {
      in.q.set(q0 * hq * dim + e, q.get(first + e));
    }
    for (int64_t e = 0; e < int64_t{s.kv_len} * hkv * dim; ++e) {
      in.k.set(k0 * hkv * dim + e, k.get(e));
      in.v.set(k0 * hkv * dim + e, v.get(e));
    }
    q0 += s.q_len;
    k0 += s.kv_len;
    in.cu_q.data<int32_t>()[i + 1] = static_cast<int32_t>(q0);
    in.cu_kv.data<int32_t>()[i + 1] = static_cast<int32_t>(k0);
  }
  return in;
}

}  // namespace attnkit::test
