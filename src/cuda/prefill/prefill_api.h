// Host entry of the portable prefill kernel family: the support check, the tile heuristic and the
// runs behind cuda::fused_prefill / cuda::fused_dense. The same function (select_kernel) answers
// "is this supported" and picks the instantiation, so the two never disagree.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "core/problem.h"
#include "cuda/prefill/prefill_params.h"

namespace attnkit::cuda::prefill {

// "" when the fused prefill serves the call, else why not.
std::string prefill_unsupported(const AttentionSpec& spec, const detail::PrefillProblem& p);
std::string dense_unsupported(const AttentionSpec& spec, const detail::DenseProblem& p);

// The kernel (prefill_tile_name) the fused backend runs for the call shape of `p` with sequences
// of `seqlen` tokens on p's device; "" where the fused prefill / dense does not serve it. The same
// selector as run_prefill / run_dense: what `attnkit info` shows.
std::string prefill_kernel_choice(const AttentionSpec& spec, const detail::PrefillProblem& p,
                                  int32_t seqlen);
std::string dense_kernel_choice(const AttentionSpec& spec, const detail::DenseProblem& p,
                                int32_t seqlen);

// Tiles compiled into this build for (head_dim, dtype); empty when none.
std::vector<PrefillTile> compiled_tiles(int head_dim, DType dtype);

// Tiles this build compiles for (head_dim, dtype) that the device can run (its compute
// capability and shared memory): what tests force.
std::vector<PrefillTile> runnable_tiles(int head_dim, DType dtype, int device);

// Runs a validated call. `forced_tile` overrides the heuristic (tests force every tile); a tile
// that is not compiled for the head_dim, or that the device or the call's layout cannot run,
// raises. `forced_section_pairs` > 0 overrides the CTA order's section size
// (PrefillParams::section_pairs), `forced_ctas` > 0 the sm90 kernel's persistent grid (tests:
// uneven sections, more work items than CTAs), `forced_q_pack` the sm90 kernel's GQA packing
// (PrefillParams::q_pack_log2; true on a call it cannot pack raises).
void run_prefill(const AttentionSpec& spec, const PrefillArgs& args,
                 const detail::PrefillProblem& p, void* stream,
                 std::optional<PrefillTile> forced_tile = std::nullopt,
                 int forced_section_pairs = 0, int forced_ctas = 0,
                 std::optional<bool> forced_q_pack = std::nullopt);
void run_dense(const AttentionSpec& spec, const DenseArgs& args, const detail::DenseProblem& p,
               void* stream, std::optional<PrefillTile> forced_tile = std::nullopt,
               int forced_section_pairs = 0, int forced_ctas = 0);

}  // namespace attnkit::cuda::prefill
