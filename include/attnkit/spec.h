// AttentionSpec: the static description of one attention layer (heads, mask, position encoding,
// KV-cache element type, backend and the diffusion options). docs/semantics.md defines the
// semantics of every field.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "attnkit/types.h"

namespace attnkit {

// Which implementation runs a call. kAuto: the fused CUDA kernels where they support the call,
// else the vanilla backend. An explicit kFused or kVanilla that cannot serve the call raises.
enum class Backend : uint8_t { kAuto, kFused, kVanilla };
const char* backend_name(Backend backend);  // "auto", "fused", "vanilla"

// Which fused kernel family runs the context attention of prefill(), dense() and forward() on a
// CUDA tensor (as FlashInfer's fa2 / fa3 backends):
//   kAuto:     the Hopper warpgroup kernel on an H100 / H200 wherever it serves the call, else the
//              portable one;
//   kPortable: the mma.sync kernel of sm80 and newer (A/B comparisons, bit-for-bit continuity);
//   kHopper:   the sm90 warpgroup kernel; a call it cannot serve (another GPU, head_dim 80 / 96)
//              raises, naming why.
enum class FusedKernel : uint8_t { kAuto, kPortable, kHopper };
const char* fused_kernel_name(FusedKernel kernel);  // "auto", "portable", "hopper"

enum class MaskKind : uint8_t {
  kNone,           // every key (encoder, diffusion, cross attention)
  kCausal,         // key positions j <= p
  kSlidingWindow,  // p - window < j <= p, plus keys j < sink_tokens
};
const char* mask_name(MaskKind mask);

struct MaskSpec {
  MaskKind kind = MaskKind::kCausal;
  int32_t window = 0;       // kSlidingWindow only: W >= 1 keys including the query itself
  int32_t sink_tokens = 0;  // kSlidingWindow only: keys j < sink_tokens are always attended
};

enum class RopeStyle : uint8_t {
  kNone,
  kGptNeox,  // rotates pairs (i, i + rotary_dim / 2)
  kGptJ,     // rotates pairs (2i, 2i + 1)
};
enum class RopeScaling : uint8_t { kNone, kLinear, kLlama3 };

struct RopeSpec {
  RopeStyle style = RopeStyle::kNone;
  int32_t rotary_dim = 0;  // 0 means head_dim; even, <= head_dim
  double base = 10000.0;   // inv_freq[i] = base^(-2i / rotary_dim)
  RopeScaling scaling = RopeScaling::kNone;
  double factor = 1.0;  // linear: positions / factor; llama3: the scaling factor
  // llama3 only (the values of Llama 3.1 by default).
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int32_t original_max_position = 8192;
};

// Skip-softmax sparsity (BLASST): a tile of block_m query rows x block_n keys is skipped when
// for every row tile_max - running_max < ln(lambda).
struct SkipSoftmaxSpec {
  // Exactly one of threshold / target_sparsity is set.
  std::optional<double> threshold;        // lambda itself, >= 0; 0 never skips
  std::optional<double> target_sparsity;  // s in [0, 1]; lambda = a * exp(b * s) / kv_len
  std::optional<double> calibration_a;    // required with target_sparsity
  std::optional<double> calibration_b;
  // Skipping is active only when the call's normalized timestep t <= disabled_until_timestep;
  // 0 disables the gate (always active).
  double disabled_until_timestep = 0.0;

  // lambda for a call with kv_len keys.
  double lambda(int64_t kv_len) const;
  // Whether skipping is active for a call at normalized timestep t in [0, 1].
  bool active_at(double timestep) const;
};

// SAGE quantization of Q, K (int8 or fp8 per block of tokens) and V (fp8 per channel).
struct SageQuantSpec {
  DType dtype_qk = DType::kInt8;  // kInt8 or kFp8E4M3
  int32_t q_block_size = 1;       // tokens per Q scale: 1, 4 or 16
  int32_t k_block_size = 16;      // tokens per K scale: 1, 4 or 16
};

struct AttentionSpec {
  int32_t num_q_heads = 0;     // 1 .. 65536
  int32_t num_kv_heads = 0;    // divides num_q_heads (MHA: equal, GQA: fewer, MQA: 1)
  int32_t head_dim = 0;        // 64, 80, 96, 128, 256 (the reference takes any multiple of 8)
  double softmax_scale = 0.0;  // 0 means 1 / sqrt(head_dim)
  MaskSpec mask{};
  RopeSpec rope{};                  // applied by append_kv() and forward()
  bool alibi = false;               // add slope_h * (j - p_i) to the scaled logit
  std::vector<float> alibi_slopes;  // [num_q_heads]; empty means the default slopes
  double logit_softcap = 0.0;       // > 0: logit = cap * tanh(logit / cap)
  Backend backend = Backend::kAuto;
  FusedKernel fused_kernel = FusedKernel::kAuto;  // context attention on the fused backend
  std::optional<SkipSoftmaxSpec> skip_softmax;    // dense() and prefill() (none / causal mask)
  std::optional<SageQuantSpec> quant;             // dense() only

  double effective_scale() const;
  int32_t effective_rotary_dim() const { return rope.rotary_dim ? rope.rotary_dim : head_dim; }
  int32_t group_size() const { return num_q_heads / num_kv_heads; }

  // Throws Error naming the field when the spec is inconsistent.
  void validate() const;
};

// Default ALiBi slopes for n heads (docs/semantics.md), including non-powers of two; n in
// [1, 65536] (the range of spec.num_q_heads), else Error.
std::vector<float> default_alibi_slopes(int32_t num_heads);

}  // namespace attnkit
