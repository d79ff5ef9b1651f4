// RoPE frequencies and rotation (docs/semantics.md), shared by the reference backend (host, in
// double) and the CUDA kernels (device, in float) so both use one formula:
//   inv_freq[i] = base^(-2i / rotary_dim), i in [0, rotary_dim / 2), then the scaling:
//     linear: inv_freq / factor (the same as dividing the position by factor),
//     llama3: wavelength-dependent smoothing (Llama 3.1).
//   angle = position * inv_freq[i]; pair (a, b) -> (a cos - b sin, b cos + a sin).
//   GPT-NeoX pairs dims (i, i + rotary_dim / 2); GPT-J pairs (2i, 2i + 1). Dims >= rotary_dim
//   pass through.
#pragma once

#include <cmath>
#include <cstdint>

#include "attnkit/spec.h"
#include "core/numerics.h"  // ATTNKIT_HD

namespace attnkit::detail {

// Trivially copyable RoPE parameters: goes into kernel Params as it is.
struct RopeParams {
  RopeStyle style = RopeStyle::kNone;
  RopeScaling scaling = RopeScaling::kNone;
  int32_t rotary_dim = 0;  // resolved (never 0 when style != kNone)
  double base = 10000.0;
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  double original_max_position = 8192.0;
};

inline RopeParams make_rope_params(const AttentionSpec& spec) {
  RopeParams r;
  r.style = spec.rope.style;
  r.scaling = spec.rope.scaling;
  r.rotary_dim = spec.effective_rotary_dim();
  r.base = spec.rope.base;
  r.factor = spec.rope.factor;
  r.low_freq_factor = spec.rope.low_freq_factor;
  r.high_freq_factor = spec.rope.high_freq_factor;
  r.original_max_position = spec.rope.original_max_position;
  return r;
}

ATTNKIT_HD float rope_pow(float base, float exponent) { return powf(base, exponent); }
ATTNKIT_HD double rope_pow(double base, double exponent) { return pow(base, exponent); }
ATTNKIT_HD float rope_cos(float x) { return cosf(x); }
ATTNKIT_HD double rope_cos(double x) { return cos(x); }
ATTNKIT_HD float rope_sin(float x) { return sinf(x); }
ATTNKIT_HD double rope_sin(double x) { return sin(x); }

// Scaled inverse frequency of pair i (0 <= i < rotary_dim / 2), computed in Real (float on the
// device, double in the reference).
template <typename Real>
ATTNKIT_HD Real rope_inv_freq(const RopeParams& r, int32_t i) {
  Real inv_freq = rope_pow(static_cast<Real>(r.base),
                           -static_cast<Real>(2 * i) / static_cast<Real>(r.rotary_dim));
  const Real factor = static_cast<Real>(r.factor);
  if (r.scaling == RopeScaling::kLinear) return inv_freq / factor;
  if (r.scaling == RopeScaling::kLlama3) {
    const Real two_pi = static_cast<Real>(6.283185307179586476925);
    const Real original = static_cast<Real>(r.original_max_position);
    const Real low = static_cast<Real>(r.low_freq_factor);
    const Real high = static_cast<Real>(r.high_freq_factor);
    const Real wavelen = two_pi / inv_freq;
    const Real low_freq_wavelen = original / low;
    const Real high_freq_wavelen = original / high;
    if (wavelen < high_freq_wavelen) return inv_freq;
    if (wavelen > low_freq_wavelen) return inv_freq / factor;
    const Real smooth = (original / wavelen - low) / (high - low);
    return (static_cast<Real>(1) - smooth) * inv_freq / factor + smooth * inv_freq;
  }
  return inv_freq;
}

// cos and sin of position * inv_freq[i].
template <typename Real>
ATTNKIT_HD void rope_cos_sin(const RopeParams& r, int64_t position, int32_t i, Real* cos_out,
                             Real* sin_out) {
  const Real angle = static_cast<Real>(position) * rope_inv_freq<Real>(r, i);
  *cos_out = rope_cos(angle);
  *sin_out = rope_sin(angle);
}

// The two dims that pair i (0 <= i < rotary_dim / 2) rotates.
ATTNKIT_HD void rope_pair_dims(const RopeParams& r, int32_t i, int32_t* first, int32_t* second) {
  if (r.style == RopeStyle::kGptJ) {
    *first = 2 * i;
    *second = 2 * i + 1;
  } else {
    *first = i;
    *second = i + r.rotary_dim / 2;
  }
}

// Rotates one head vector x[0 .. head_dim) in place at `position` (no-op for RopeStyle::kNone).
template <typename Real>
ATTNKIT_HD void rope_rotate_head(const RopeParams& r, int64_t position, Real* x) {
  if (r.style == RopeStyle::kNone) return;
  for (int32_t i = 0; i < r.rotary_dim / 2; ++i) {
    Real c, s;
    rope_cos_sin<Real>(r, position, i, &c, &s);
    int32_t a, b;
    rope_pair_dims(r, i, &a, &b);
    const Real xa = x[a];
    const Real xb = x[b];
    x[a] = xa * c - xb * s;
    x[b] = xb * c + xa * s;
  }
}

}  // namespace attnkit::detail
