// Pieces of the reference dense() (docs/diffusion.md) that tests of the CUDA diffusion kernels
// reuse: the SAGE quantization of one head's rows, and the tile-faithful online softmax.
#pragma once

#include <cstdint>
#include <vector>

#include "attnkit/types.h"
#include "core/interrupt_poll.h"

namespace attnkit::reference {

// Rows of one head after SAGE quantization. `values` holds the codes as numbers (the int8
// integer, or the fp8 e4m3 value); row r's real value is values[r] * row_scale[r].
struct SageRows {
  std::vector<double> values;    // [rows, dim]
  std::vector<float> row_scale;  // [rows]: the scale of the block that holds row r
};

// Quantizes x [rows, dim] per block of block_rows consecutive rows (the last block may be short)
// to dtype (kInt8: scale = amax / 127; kFp8E4M3: scale = amax / 448; all-zero block: scale 1).
SageRows sage_quantize_rows(const std::vector<float>& x, int64_t rows, int32_t dim,
                            int32_t block_rows, DType dtype);

// K smoothing: the per-channel mean of x [rows, dim] over the rows, summed in fp64 and rounded
// to float. Smoothed K is x - mean in float32.
std::vector<float> sage_channel_mean(const std::vector<float>& x, int64_t rows, int32_t dim);

// V: fp8 e4m3 per channel, scale = channel amax over the rows / 448 (all-zero channel: 1).
struct SageColumns {
  std::vector<double> values;        // [rows, dim]: fp8 values
  std::vector<float> channel_scale;  // [dim]
};
SageColumns sage_quantize_v(const std::vector<float>& x, int64_t rows, int32_t dim);

// The tile-faithful online softmax of one head (docs/diffusion.md, "Algorithm"), for dense() and
// for prefill() with skip-softmax.
struct DenseTileRule {
  int32_t block_m = 128;
  int32_t block_n = 128;
  double softmax_scale = 1.0;
  double logit_softcap = 0.0;  // > 0: cap * tanh(s / cap)
  bool skip = false;           // skip-softmax active for this call
  double log_lambda = 0.0;     // ln(lambda), used when skip
  bool quantize_p = false;     // SAGE: P*V uses fp8(p * 448)
  // The order the key tiles of a query tile are walked in (it decides which tiles skip): first to
  // last (dense() on the reference), or last to first, the order of the fused kernels (the
  // partial last tile, or under a causal mask the diagonal, comes first).
  bool last_tile_first = false;
  // prefill(): query row i sits at position q_pos0 + i (bottom-right aligned); `causal` masks the
  // keys j > position, and a query tile visits the key tiles up to its last row's position;
  // alibi_slope adds slope * (j - position) after the soft-cap. A row that attends no key of a
  // tile does not vote on it.
  bool causal = false;
  int64_t q_pos0 = 0;
  double alibi_slope = 0.0;
};

// The key tiles of block_n keys that query rows [m0, m0 + rows) visit under `rule` (skv keys).
int64_t visited_key_tiles(const DenseTileRule& rule, int64_t m0, int64_t rows, int64_t skv);

struct DenseTileCounts {
  int64_t total = 0;
  int64_t skipped = 0;
};

// Operands of one (batch, q head): q [sq, dim] with q_scale [sq]; k, v [skv, dim] with k_scale
// [skv] and v_scale [dim] (all scales 1 without SAGE). Writes out [sq, dim] and lse [sq]
// (natural log; rows without keys: zeros and -inf). `poll_interrupt`, when given, is polled once
// per tile (include/attnkit/interrupt.h).
DenseTileCounts dense_attend_head(const double* q, const float* q_scale, const double* k,
                                  const float* k_scale, const double* v, const float* v_scale,
                                  int64_t sq, int64_t skv, int32_t dim, const DenseTileRule& rule,
                                  double* out, double* lse,
                                  detail::InterruptPoll* poll_interrupt = nullptr);

}  // namespace attnkit::reference
