// The Hopper (sm_90a) context FMHA as the prefill dispatch sees it: whether it serves a call (and
// why not), its shared memory, and the run. Host-only.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "attnkit/kv_cache.h"
#include "attnkit/types.h"
#include "cuda/prefill/prefill_params.h"
#include "cuda/prefill/prefill_sm90_params.h"

namespace attnkit::cuda::prefill {

// What the sm90 path needs of a call beyond PrefillParams: the device, the tensors its TMA maps
// describe (k / v null for a paged call, cache null for a packed or dense one), the grid.
struct Sm90Call {
  int cc_major = 0, cc_minor = 0;
  int smem_optin = 0;
  int sm_count = 0;
  int head_dim = 0;
  DType dtype = DType::kBF16;
  bool masked = false;
  const TensorView* q = nullptr;
  const TensorView* k = nullptr;
  const TensorView* v = nullptr;
  const KvCacheView* cache = nullptr;
  int forced_ctas = 0;  // > 0: this many persistent CTAs (tests: more work items than CTAs)
  // Skip-softmax (unmasked calls): the kSkip kernel with log2(lambda), adding its tile counts
  // [visited, skipped] to skip_counts (device; nullptr: not counted).
  bool skip = false;
  float skip_log2_lambda = 0.f;
  unsigned long long* skip_counts = nullptr;
  // SAGE (the quantize pass's outputs; dtype int8 or fp8 e4m3, the Q K^T codes): q and k describe
  // the codes, v is not read; V^T [Hkv][D][v_t_stride] and the scales.
  bool sage = false;
  const void* v_t = nullptr;
  int64_t v_t_stride = 0;
  Sm90SageParams sage_scales;
};

// Whether this build has the sm90 kernels of (head_dim, dtype).
bool sm90_kernels_compiled(int head_dim, DType dtype);
// Whether this build has the SAGE kernels of head_dim.
bool sm90_sage_compiled(int head_dim);
// "" when the sm90 kernel serves the call, else why not.
std::string sm90_unsupported(const Sm90Call& call);
// fp8: the FP8 kernel (fp8 e4m3 q, k and v).
int sm90_smem_bytes(int head_dim, bool masked, bool fp8 = false, bool sage = false);
// Runs a call that sm90_unsupported() accepted.
void run_sm90(const PrefillParams& prm, const Sm90Call& call, cudaStream_t stream);

}  // namespace attnkit::cuda::prefill
