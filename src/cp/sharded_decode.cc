// sharded_decode(): decode over a KV cache sharded by blocks of each sequence
// (docs/context_parallel.md). Each rank attends its own blocks, the (O, LSE) partials of every rank
// are all-gathered and merged in rank order, the same order on every rank, so that every rank holds
// the same output bits.
#include <vector>

#include "attnkit/context_parallel.h"
#include "core/problem.h"
#include "core/validate_util.h"
#include "cp/cp_common.h"
#include "cp/device_ops.h"

namespace attnkit::cp {

void sharded_decode(const AttentionSpec& spec, const DecodeArgs& args, const Options& options,
                    Stream stream) {
  Communicator* comm = options.comm;
  if (comm == nullptr) {
    decode(spec, args, stream);
    return;
  }
  const attnkit::detail::Validator v("sharded_decode");
  spec.validate();
  v.check(spec.mask.kind != MaskKind::kSlidingWindow, "spec.mask",
          "a sliding window is not supported over a sharded cache (the local positions of a "
          "rank's blocks are not the absolute positions the window needs); got ",
          mask_name(spec.mask.kind));
  v.check(!spec.alibi, "spec.alibi",
          "ALiBi is not supported over a sharded cache (its bias needs absolute positions)");
  v.check(args.beam_width == 1 && !args.cache_indirection.defined(), "beam_width",
          "beam search is not supported over a sharded cache: expected beam_width 1 and no "
          "cache_indirection, got beam_width ",
          args.beam_width, args.cache_indirection.defined() ? " and a cache_indirection" : "");
  v.expect_given(args.q, "q");
  v.check(args.q.device == comm->device(), "q", "must be on the communicator's device ",
          comm->device().str(), ", got ", args.q.device.str());
  const attnkit::detail::DecodeProblem p = attnkit::detail::validate_decode(spec, args);
  const int32_t world = comm->world_size();
  if (world == 1) {
    decode(spec, args, stream);
    return;
  }

  const Device device = p.device;
  const int64_t rows = p.num_rows;
  const int32_t hq = spec.num_q_heads, d = spec.head_dim;
  const int64_t out_bytes = rows * hq * d * static_cast<int64_t>(dtype_size(p.dtype));
  // One partial: O then LSE, each 256-byte aligned so that the gathered copies stay aligned.
  attnkit::cp::detail::ScratchLayout partial_layout;
  partial_layout.take(out_bytes);
  const int64_t lse_offset = partial_layout.bytes();
  partial_layout.take(rows * hq * 4);
  const int64_t partial_bytes = partial_layout.bytes();

  attnkit::cp::detail::ScratchLayout sizing;
  sizing.take(partial_bytes * (world + 1));
  sizing.take(out_bytes);
  sizing.take(rows * hq * 4);
  sizing.take(args.lse.defined() ? 0 : rows * hq * 4);
  attnkit::cp::detail::DeviceBuffer scratch(device, sizing.bytes(), stream);
  attnkit::cp::detail::ScratchLayout placed(scratch.data());
  uint8_t* partials = placed.take(partial_bytes * (world + 1));  // [own, gathered 0 .. R-1]
  uint8_t* acc_out = placed.take(out_bytes);
  uint8_t* acc_lse = placed.take(rows * hq * 4);
  uint8_t* own_lse = placed.take(args.lse.defined() ? 0 : rows * hq * 4);

  const auto partial = [&](int32_t index) {  // 0: this rank's, 1 + q: rank q's gathered one
    uint8_t* base = partials + index * partial_bytes;
    return attnkit::cp::detail::State{
        attnkit::cp::detail::contiguous_view(base, p.dtype, rows, hq, d, device),
        attnkit::cp::detail::lse_view(base + lse_offset, rows, hq, device)};
  };
  DecodeArgs local = args;
  local.out = partial(0).out;
  local.lse = partial(0).lse;
  attnkit::detail::validate_decode(spec, local);

  const attnkit::cp::detail::MergeChain chain(
      {args.out,
       args.lse.defined() ? args.lse : attnkit::cp::detail::lse_view(own_lse, rows, hq, device)},
      {attnkit::cp::detail::contiguous_view(acc_out, p.dtype, rows, hq, d, device),
       attnkit::cp::detail::lse_view(acc_lse, rows, hq, device)},
      world);
  std::vector<MergeStatesArgs> merges;
  for (int32_t m = 1; m < world; ++m) {
    const attnkit::cp::detail::State previous = m == 1 ? partial(1) : chain.location(m - 1);
    merges.push_back(chain.merge(m, previous, partial(1 + m), args.checked));
    attnkit::detail::validate_merge_states(merges.back());
  }

  decode(spec, local, stream);
  comm->all_gather(partials, partials + partial_bytes, partial_bytes, stream);
  for (const MergeStatesArgs& merge : merges) merge_states(merge, stream);
}

}  // namespace attnkit::cp
