#include "attnkit/spec.h"

#include <cmath>

#include "core/check.h"

namespace attnkit {
namespace {

// An upper bound keeps per-head tables (ALiBi slopes) small for any accepted spec.
constexpr int32_t kMaxQueryHeads = 1 << 16;

}  // namespace

const char* backend_name(Backend backend) {
  switch (backend) {
    case Backend::kAuto:
      return "auto";
    case Backend::kFused:
      return "fused";
    case Backend::kVanilla:
      return "vanilla";
  }
  return "?";
}

const char* fused_kernel_name(FusedKernel kernel) {
  switch (kernel) {
    case FusedKernel::kAuto:
      return "auto";
    case FusedKernel::kPortable:
      return "portable";
    case FusedKernel::kHopper:
      return "hopper";
  }
  return "?";
}

const char* mask_name(MaskKind mask) {
  switch (mask) {
    case MaskKind::kNone:
      return "none";
    case MaskKind::kCausal:
      return "causal";
    case MaskKind::kSlidingWindow:
      return "sliding_window";
  }
  return "?";
}

double SkipSoftmaxSpec::lambda(int64_t kv_len) const {
  if (threshold) return *threshold;
  if (target_sparsity && calibration_a && calibration_b && kv_len > 0) {
    return *calibration_a * std::exp(*calibration_b * *target_sparsity) /
           static_cast<double>(kv_len);
  }
  return 0.0;
}

bool SkipSoftmaxSpec::active_at(double timestep) const {
  return disabled_until_timestep == 0.0 || timestep <= disabled_until_timestep;
}

double AttentionSpec::effective_scale() const {
  return softmax_scale != 0.0 ? softmax_scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
}

void AttentionSpec::validate() const {
  using detail::fail;
  ATTNKIT_CHECK(num_q_heads >= 1 && num_q_heads <= kMaxQueryHeads,
                "spec.num_q_heads: must be in [1, ", kMaxQueryHeads, "], got ", num_q_heads);
  ATTNKIT_CHECK(num_kv_heads >= 1, "spec.num_kv_heads: must be >= 1, got ", num_kv_heads);
  ATTNKIT_CHECK(num_q_heads % num_kv_heads == 0, "spec.num_kv_heads: must divide num_q_heads (",
                num_q_heads, "), got ", num_kv_heads);
  ATTNKIT_CHECK(head_dim >= 8 && head_dim <= 512 && head_dim % 8 == 0,
                "spec.head_dim: must be a multiple of 8 in [8, 512], got ", head_dim);
  ATTNKIT_CHECK(std::isfinite(softmax_scale) && softmax_scale >= 0.0,
                "spec.softmax_scale: must be finite and >= 0 (0 = 1/sqrt(head_dim)), got ",
                softmax_scale);
  // Enum fields are plain bytes to a caller (or a binding): only the named values are accepted.
  ATTNKIT_CHECK(mask.kind == MaskKind::kNone || mask.kind == MaskKind::kCausal ||
                    mask.kind == MaskKind::kSlidingWindow,
                "spec.mask.kind: accepted none, causal or sliding_window, got value ",
                static_cast<int>(mask.kind));
  ATTNKIT_CHECK(
      backend == Backend::kAuto || backend == Backend::kFused || backend == Backend::kVanilla,
      "spec.backend: accepted auto, fused or vanilla, got value ", static_cast<int>(backend));
  ATTNKIT_CHECK(rope.style == RopeStyle::kNone || rope.style == RopeStyle::kGptNeox ||
                    rope.style == RopeStyle::kGptJ,
                "spec.rope.style: accepted none, gpt_neox or gptj, got value ",
                static_cast<int>(rope.style));
  ATTNKIT_CHECK(rope.scaling == RopeScaling::kNone || rope.scaling == RopeScaling::kLinear ||
                    rope.scaling == RopeScaling::kLlama3,
                "spec.rope.scaling: accepted none, linear or llama3, got value ",
                static_cast<int>(rope.scaling));
  switch (mask.kind) {
    case MaskKind::kSlidingWindow:
      ATTNKIT_CHECK(mask.window >= 1, "spec.mask.window: must be >= 1 for a sliding window, got ",
                    mask.window);
      ATTNKIT_CHECK(mask.sink_tokens >= 0, "spec.mask.sink_tokens: must be >= 0, got ",
                    mask.sink_tokens);
      break;
    case MaskKind::kNone:
    case MaskKind::kCausal:
      ATTNKIT_CHECK(mask.window == 0 && mask.sink_tokens == 0, "spec.mask: window (", mask.window,
                    ") and sink_tokens (", mask.sink_tokens,
                    ") are accepted only with the sliding_window mask, the mask is ",
                    mask_name(mask.kind));
      break;
  }
  if (rope.style != RopeStyle::kNone) {
    const int32_t rd = effective_rotary_dim();
    ATTNKIT_CHECK(rd >= 2 && rd <= head_dim && rd % 2 == 0,
                  "spec.rope.rotary_dim: must be even and in [2, head_dim=", head_dim,
                  "] (0 = head_dim), got ", rope.rotary_dim);
    ATTNKIT_CHECK(std::isfinite(rope.base) && rope.base > 1.0,
                  "spec.rope.base: must be finite and > 1, got ", rope.base);
    if (rope.scaling != RopeScaling::kNone) {
      ATTNKIT_CHECK(std::isfinite(rope.factor) && rope.factor > 0.0,
                    "spec.rope.factor: must be finite and > 0, got ", rope.factor);
    }
    if (rope.scaling == RopeScaling::kLlama3) {
      ATTNKIT_CHECK(std::isfinite(rope.low_freq_factor) && std::isfinite(rope.high_freq_factor) &&
                        rope.low_freq_factor > 0.0 && rope.high_freq_factor > rope.low_freq_factor,
                    "spec.rope: llama3 needs 0 < low_freq_factor < high_freq_factor, got ",
                    rope.low_freq_factor, " and ", rope.high_freq_factor);
      ATTNKIT_CHECK(rope.original_max_position >= 1,
                    "spec.rope.original_max_position: must be >= 1, got ",
                    rope.original_max_position);
    }
  }
  if (!alibi_slopes.empty()) {
    ATTNKIT_CHECK(alibi, "spec.alibi_slopes: given but spec.alibi is false");
    ATTNKIT_CHECK(static_cast<int32_t>(alibi_slopes.size()) == num_q_heads,
                  "spec.alibi_slopes: needs num_q_heads=", num_q_heads, " values, got ",
                  alibi_slopes.size());
    for (float slope : alibi_slopes) {
      ATTNKIT_CHECK(std::isfinite(slope), "spec.alibi_slopes: values must be finite, got ", slope);
    }
  }
  ATTNKIT_CHECK(std::isfinite(logit_softcap) && logit_softcap >= 0.0,
                "spec.logit_softcap: must be finite and >= 0 (0 = off), got ", logit_softcap);
  if (skip_softmax) {
    const SkipSoftmaxSpec& s = *skip_softmax;
    ATTNKIT_CHECK(s.threshold.has_value() != s.target_sparsity.has_value(),
                  "spec.skip_softmax: exactly one of threshold and target_sparsity is accepted");
    if (s.threshold) {
      ATTNKIT_CHECK(std::isfinite(*s.threshold) && *s.threshold >= 0.0,
                    "spec.skip_softmax.threshold: must be finite and >= 0, got ", *s.threshold);
    } else {
      ATTNKIT_CHECK(std::isfinite(*s.target_sparsity) && *s.target_sparsity >= 0.0 &&
                        *s.target_sparsity <= 1.0,
                    "spec.skip_softmax.target_sparsity: must be in [0, 1], got ",
                    *s.target_sparsity);
      ATTNKIT_CHECK(s.calibration_a && s.calibration_b && std::isfinite(*s.calibration_a) &&
                        std::isfinite(*s.calibration_b) && *s.calibration_a > 0.0,
                    "spec.skip_softmax: target_sparsity needs a calibration curve with finite a > "
                    "0 and finite b");
    }
    ATTNKIT_CHECK(std::isfinite(s.disabled_until_timestep) && s.disabled_until_timestep >= 0.0 &&
                      s.disabled_until_timestep <= 1.0,
                  "spec.skip_softmax.disabled_until_timestep: must be in [0, 1], got ",
                  s.disabled_until_timestep);
  }
  if (quant) {
    ATTNKIT_CHECK(quant->dtype_qk == DType::kInt8 || quant->dtype_qk == DType::kFp8E4M3,
                  "spec.quant.dtype_qk: accepted int8 or fp8_e4m3, got ",
                  dtype_name(quant->dtype_qk));
    for (int32_t size : {quant->q_block_size, quant->k_block_size}) {
      ATTNKIT_CHECK(size == 1 || size == 4 || size == 16,
                    "spec.quant: q_block_size and k_block_size accept 1, 4 or 16, got ", size);
    }
  }
}

std::vector<float> default_alibi_slopes(int32_t num_heads) {
  ATTNKIT_CHECK(num_heads >= 1 && num_heads <= kMaxQueryHeads,
                "default_alibi_slopes: num_heads: must be in [1, ", kMaxQueryHeads, "], got ",
                num_heads);
  std::vector<float> slopes(static_cast<size_t>(num_heads));
  int32_t m = 1;
  while (m * 2 <= num_heads) m *= 2;
  for (int32_t h = 0; h < num_heads; ++h) {
    const double exponent = h < m ? -8.0 * (h + 1) / m : -4.0 * (2 * (h - m) + 1) / m;
    slopes[h] = static_cast<float>(std::exp2(exponent));
  }
  return slopes;
}

}  // namespace attnkit
