// Reference dense(): [B, S, H, D] attention without a mask, with skip-softmax (BLASST) and SAGE
// quantization, as docs/diffusion.md specifies. Every path runs the same tile-faithful online
// softmax in fp64, so skip decisions match a kernel that uses the same block_m x block_n tiles,
// and a call in which nothing is skipped is bit-identical to the plain path.
#include "reference/dense_ref.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/check.h"
#include "core/element.h"
#include "core/sage_quant.h"
#include "reference/reference.h"

namespace attnkit::reference {

SageRows sage_quantize_rows(const std::vector<float>& x, int64_t rows, int32_t dim,
                            int32_t block_rows, DType dtype) {
  SageRows result;
  result.values.resize(static_cast<size_t>(rows * dim));
  result.row_scale.resize(static_cast<size_t>(rows));
  for (int64_t r0 = 0; r0 < rows; r0 += block_rows) {
    const int64_t r1 = std::min<int64_t>(rows, r0 + block_rows);
    float amax = 0.0f;
    for (int64_t i = r0 * dim; i < r1 * dim; ++i) amax = std::max(amax, std::fabs(x[i]));
    const bool int8 = dtype == DType::kInt8;
    const float scale = int8 ? sage::int8_block_scale(amax) : sage::fp8_block_scale(amax);
    for (int64_t i = r0 * dim; i < r1 * dim; ++i) {
      result.values[i] =
          int8 ? static_cast<double>(sage::quantize_int8(x[i], scale))
               : static_cast<double>(sage::fp8_value(sage::quantize_fp8(x[i], scale)));
    }
    for (int64_t r = r0; r < r1; ++r) result.row_scale[r] = scale;
  }
  return result;
}

std::vector<float> sage_channel_mean(const std::vector<float>& x, int64_t rows, int32_t dim) {
  std::vector<float> mean(static_cast<size_t>(dim), 0.0f);
  if (rows == 0) return mean;
  for (int32_t d = 0; d < dim; ++d) {
    double sum = 0.0;
    for (int64_t r = 0; r < rows; ++r) sum += x[r * dim + d];
    mean[d] = static_cast<float>(sum / static_cast<double>(rows));
  }
  return mean;
}

SageColumns sage_quantize_v(const std::vector<float>& x, int64_t rows, int32_t dim) {
  SageColumns result;
  result.values.resize(static_cast<size_t>(rows * dim));
  result.channel_scale.resize(static_cast<size_t>(dim));
  for (int32_t d = 0; d < dim; ++d) {
    float amax = 0.0f;
    for (int64_t r = 0; r < rows; ++r) amax = std::max(amax, std::fabs(x[r * dim + d]));
    const float scale = sage::fp8_block_scale(amax);
    result.channel_scale[d] = scale;
    for (int64_t r = 0; r < rows; ++r) {
      result.values[r * dim + d] = sage::fp8_value(sage::quantize_fp8(x[r * dim + d], scale));
    }
  }
  return result;
}

int64_t visited_key_tiles(const DenseTileRule& rule, int64_t m0, int64_t rows, int64_t skv) {
  const int64_t key_end = rule.causal ? std::min(skv, rule.q_pos0 + m0 + rows) : skv;
  return key_end > 0 ? (key_end + rule.block_n - 1) / rule.block_n : 0;
}

DenseTileCounts dense_attend_head(const double* q, const float* q_scale, const double* k,
                                  const float* k_scale, const double* v, const float* v_scale,
                                  int64_t sq, int64_t skv, int32_t dim, const DenseTileRule& rule,
                                  double* out, double* lse, detail::InterruptPoll* poll_interrupt) {
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  const double p_scale = rule.quantize_p ? static_cast<double>(sage::kPScale) : 1.0;
  DenseTileCounts counts;
  std::vector<double> scores, tile_max, row_max, row_sum, acc;
  for (int64_t m0 = 0; m0 < sq; m0 += rule.block_m) {
    const int64_t rows = std::min<int64_t>(rule.block_m, sq - m0);
    row_max.assign(rows, kNegInf);
    row_sum.assign(rows, 0.0);
    acc.assign(static_cast<size_t>(rows * dim), 0.0);
    const int64_t num_tiles = visited_key_tiles(rule, m0, rows, skv);
    for (int64_t t = 0; t < num_tiles; ++t) {
      const int64_t n0 = (rule.last_tile_first ? num_tiles - 1 - t : t) * rule.block_n;
      const int64_t cols = std::min<int64_t>(rule.block_n, skv - n0);
      if (poll_interrupt != nullptr) (*poll_interrupt)();
      ++counts.total;
      // Q*K^T runs for every tile, skipped or not: the skip test needs the tile's row maxima.
      scores.assign(static_cast<size_t>(rows * cols), 0.0);
      tile_max.assign(rows, kNegInf);
      for (int64_t r = 0; r < rows; ++r) {
        const double* qr = q + (m0 + r) * dim;
        const int64_t position = rule.q_pos0 + m0 + r;
        for (int64_t c = 0; c < cols; ++c) {
          if (rule.causal && n0 + c > position) {
            scores[r * cols + c] = kNegInf;
            continue;
          }
          const double* kc = k + (n0 + c) * dim;
          double dot = 0.0;
          for (int32_t d = 0; d < dim; ++d) dot += qr[d] * kc[d];
          double s = dot * q_scale[m0 + r] * k_scale[n0 + c] * rule.softmax_scale;
          if (rule.logit_softcap > 0.0) s = rule.logit_softcap * std::tanh(s / rule.logit_softcap);
          if (rule.alibi_slope != 0.0) {
            s += rule.alibi_slope * static_cast<double>(n0 + c - position);
          }
          scores[r * cols + c] = s;
          tile_max[r] = std::max(tile_max[r], s);
        }
      }
      if (rule.skip) {
        // The first tile never skips: row_max is -inf there, so the difference is +inf. A row
        // without an attended key in the tile (tile_max -inf: the causal mask) does not vote.
        bool skip = true;
        for (int64_t r = 0; r < rows && skip; ++r) {
          skip = tile_max[r] == kNegInf || tile_max[r] - row_max[r] < rule.log_lambda;
        }
        if (skip) {
          ++counts.skipped;
          continue;
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const double new_max = std::max(row_max[r], tile_max[r]);
        if (new_max == kNegInf) continue;  // no key of this row so far: nothing to add
        const double correction = std::exp(row_max[r] - new_max);  // exp(-inf) = 0 at the start
        row_sum[r] *= correction;
        double* acc_r = acc.data() + r * dim;
        for (int32_t d = 0; d < dim; ++d) acc_r[d] *= correction;
        for (int64_t c = 0; c < cols; ++c) {
          const double p = std::exp(scores[r * cols + c] - new_max);
          row_sum[r] += p;  // the sum keeps the unquantized p, also under SAGE
          const double pv =
              rule.quantize_p ? sage::fp8_value(sage::quantize_p(static_cast<float>(p))) : p;
          const double* vc = v + (n0 + c) * dim;
          for (int32_t d = 0; d < dim; ++d) acc_r[d] += pv * vc[d];
        }
        row_max[r] = new_max;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      double* out_r = out + (m0 + r) * dim;
      if (row_sum[r] > 0.0) {
        const double denom = row_sum[r] * p_scale;
        for (int32_t d = 0; d < dim; ++d) out_r[d] = acc[r * dim + d] * v_scale[d] / denom;
        lse[m0 + r] = row_max[r] + std::log(row_sum[r]);
      } else {
        std::fill(out_r, out_r + dim, 0.0);
        lse[m0 + r] = kNegInf;
      }
    }
  }
  return counts;
}

namespace {

// Rows [s, D] of one (batch, head) of a [B, S, H, D] tensor, as float.
std::vector<float> load_head(const TensorView& t, int64_t batch, int64_t seqlen, int64_t head,
                             int32_t dim) {
  std::vector<float> rows(static_cast<size_t>(seqlen * dim));
  for (int64_t s = 0; s < seqlen; ++s) {
    for (int32_t d = 0; d < dim; ++d) {
      rows[s * dim + d] =
          detail::load_as_float(t.data, t.dtype, detail::offset_of(t, {batch, s, head, d}));
    }
  }
  return rows;
}

// Rows without quantization: the values themselves, every scale 1.
SageRows unquantized(const std::vector<float>& x, int64_t rows) {
  return {std::vector<double>(x.begin(), x.end()), std::vector<float>(rows, 1.0f)};
}

}  // namespace

void dense(const AttentionSpec& spec, const DenseArgs& args, const detail::DenseProblem& p) {
  ATTNKIT_CHECK(args.block_m >= 1 && args.block_n >= 1,
                "dense: block_m and block_n must be >= 1, got ", args.block_m, " and ",
                args.block_n);
  const int32_t dim = spec.head_dim;
  const int64_t sq = p.seqlen_q;
  const int64_t skv = p.seqlen_kv;

  DenseTileRule rule;
  rule.block_m = args.block_m;
  rule.block_n = args.block_n;
  rule.softmax_scale = spec.effective_scale();
  rule.logit_softcap = spec.logit_softcap;
  if (spec.skip_softmax && spec.skip_softmax->active_at(args.timestep)) {
    const double lambda = spec.skip_softmax->lambda(skv);
    rule.skip = lambda > 0.0;  // lambda 0 never skips (ln 0 = -inf)
    rule.log_lambda = rule.skip ? std::log(lambda) : 0.0;
  }
  const bool sage = spec.quant.has_value();
  rule.quantize_p = sage;

  DenseTileCounts counts;
  detail::InterruptPoll poll_interrupt("dense");
  std::vector<double> out_head(static_cast<size_t>(sq * dim));
  std::vector<double> lse_head(static_cast<size_t>(sq));
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int32_t hk = 0; hk < spec.num_kv_heads; ++hk) {
      std::vector<float> k_rows = load_head(args.k, b, skv, hk, dim);
      const std::vector<float> v_rows = load_head(args.v, b, skv, hk, dim);
      SageRows k_head;
      std::vector<double> v_values;
      std::vector<float> v_scale(static_cast<size_t>(dim), 1.0f);
      if (sage) {
        // Smoothing shifts every score of a row by the same q . mean: the softmax is unchanged,
        // while the quantized range of K shrinks to its spread around the mean.
        const std::vector<float> mean = sage_channel_mean(k_rows, skv, dim);
        for (int64_t i = 0; i < skv * dim; ++i) k_rows[i] -= mean[i % dim];
        k_head =
            sage_quantize_rows(k_rows, skv, dim, spec.quant->k_block_size, spec.quant->dtype_qk);
        SageColumns vq = sage_quantize_v(v_rows, skv, dim);
        v_values = std::move(vq.values);
        v_scale = std::move(vq.channel_scale);
      } else {
        k_head = unquantized(k_rows, skv);
        v_values.assign(v_rows.begin(), v_rows.end());
      }
      for (int32_t g = 0; g < spec.group_size(); ++g) {
        const int32_t hq = hk * spec.group_size() + g;
        const std::vector<float> q_rows = load_head(args.q, b, sq, hq, dim);
        const SageRows q_head = sage ? sage_quantize_rows(q_rows, sq, dim, spec.quant->q_block_size,
                                                          spec.quant->dtype_qk)
                                     : unquantized(q_rows, sq);
        const DenseTileCounts head_counts =
            dense_attend_head(q_head.values.data(), q_head.row_scale.data(), k_head.values.data(),
                              k_head.row_scale.data(), v_values.data(), v_scale.data(), sq, skv,
                              dim, rule, out_head.data(), lse_head.data(), &poll_interrupt);
        counts.total += head_counts.total;
        counts.skipped += head_counts.skipped;
        for (int64_t s = 0; s < sq; ++s) {
          for (int32_t d = 0; d < dim; ++d) {
            detail::store_from_float(args.out.data, args.out.dtype,
                                     detail::offset_of(args.out, {b, s, hq, d}),
                                     static_cast<float>(out_head[s * dim + d]));
          }
          if (p.has_lse) {
            detail::store_from_float(args.lse.data, DType::kF32,
                                     detail::offset_of(args.lse, {b, s, hq}),
                                     static_cast<float>(lse_head[s]));
          }
        }
      }
    }
  }
  if (args.stats) *args.stats = {counts.total, counts.skipped, args.block_m, args.block_n};
  if (args.skip_stats.defined()) {
    int64_t* dst = static_cast<int64_t*>(args.skip_stats.data);
    dst[0] = counts.total;
    dst[args.skip_stats.strides[0]] = counts.skipped;
  }
}

}  // namespace attnkit::reference
