// ring_prefill(): ring attention over the zig-zag plan (docs/context_parallel.md).
//
// At step t the rank holds the K/V shard of rank (rank - t) mod R. While it computes the blocks
// of that shard on `stream`, the communication stream sends the shard on to rank + 1 and receives
// the next one from rank - 1 into the other of two ring buffers. Event E (recorded on `stream` at
// the start of step t) keeps the receive behind the computation of step t - 1, which read the
// buffer it overwrites; event C (recorded on the communication stream) keeps step t + 1 behind
// the receive. Each block is one prefill() over all sequences (the block's kind is the same for
// every sequence: it depends on the chunk indices only) and its partial (O, LSE) is merged into
// its Q slot's result with merge_states().
#include <string>
#include <vector>

#include "attnkit/context_parallel.h"
#include "core/problem.h"
#include "core/validate_util.h"
#include "cp/cp_common.h"
#include "cp/device_ops.h"
#include "cuda/cuda_backend.h"

namespace attnkit::cp {
namespace {

using attnkit::detail::Access;
using attnkit::detail::Dim;
using attnkit::detail::Validator;

// One operation of the schedule, in the order it runs.
struct Operation {
  int32_t step = 0;
  bool is_merge = false;
  const AttentionSpec* spec = nullptr;  // prefill: the block's spec (mask none or causal)
  PrefillArgs prefill;
  MergeStatesArgs merge;
};

void check_args(const Validator& v, const AttentionSpec& spec, const ZigzagPlan& plan,
                const RingPrefillArgs& args, const Communicator* comm, int32_t world_size,
                int32_t rank) {
  spec.validate();
  v.check(plan.world_size() == world_size, "plan", "was made for world_size ", plan.world_size(),
          " but ",
          comm ? "the communicator has " + std::to_string(world_size) + " ranks"
               : std::string("there is no communicator (a group of one rank)"));
  v.check(spec.mask.kind == MaskKind::kCausal || spec.mask.kind == MaskKind::kNone, "spec.mask",
          "ring_prefill supports the causal mask and none, got ", mask_name(spec.mask.kind),
          " (a window needs the absolute positions the per-block calls do not see)");
  v.check(!spec.alibi, "spec.alibi",
          "ALiBi is not supported by ring_prefill (its bias needs the absolute positions the "
          "per-block calls do not see)");
  attnkit::detail::check_no_dense_only_options(v, spec);

  const int32_t hq = spec.num_q_heads, hkv = spec.num_kv_heads, d = spec.head_dim;
  const int64_t local = plan.local_tokens(rank);
  v.expect_given(args.q, "q");
  v.expect_float_dtype(args.q, "q");
  const Device device = args.q.device;
  if (comm != nullptr) {
    v.check(device == comm->device(), "q", "must be on the communicator's device ",
            comm->device().str(), ", got ", device.str());
  }
  const DType dtype = args.q.dtype;
  const Dim rows("plan.local_tokens(rank)", local);
  v.expect_tensor(args.q, "q", {dtype}, {rows, Dim("Hq", hq), Dim("D", d)}, device, Access::kInput);
  for (const auto& [t, name] : {std::pair{&args.k, "k"}, std::pair{&args.v, "v"}}) {
    v.expect_given(*t, name);
    v.expect_tensor(*t, name, {dtype}, {rows, Dim("Hkv", hkv), Dim("D", d)}, device, Access::kInput,
                    "the dtype of q");
    v.check(t->is_contiguous(), name,
            "must be contiguous (the shard is sent as bytes), got strides [", t->strides[0], ", ",
            t->strides[1], ", ", t->strides[2], "]");
  }
  v.expect_given(args.out, "out");
  v.expect_tensor(args.out, "out", {dtype}, {rows, Dim("Hq", hq), Dim("D", d)}, device,
                  Access::kOutput, "the dtype of q");
  if (args.lse.defined()) {
    v.expect_tensor(args.lse, "lse", {DType::kF32}, {rows, Dim("Hq", hq)}, device,
                    Access::kSmallOutput);
  }
}

// Every call of the schedule goes through the entry points' own validation (and, for an explicit
// fused backend, the kernels' support check) before the first transfer, so that a call the
// entry points would reject throws on every rank before any rank waits on another.
void prevalidate(const Validator& v, const std::vector<Operation>& ops) {
  for (const Operation& op : ops) {
    if (op.is_merge) {
      attnkit::detail::validate_merge_states(op.merge);
      continue;
    }
    const attnkit::detail::PrefillProblem p =
        attnkit::detail::validate_prefill(*op.spec, op.prefill);
    if (op.spec->backend != Backend::kFused) continue;
    v.check(p.device.is_cuda(), "spec.backend",
            "'fused' needs CUDA tensors; the tensors are on cpu (accepted on cpu: 'auto' or "
            "'vanilla')");
    const std::string reason = cuda::fused_prefill_unsupported(*op.spec, p);
    v.check(reason.empty(), "spec.backend", "'fused' cannot serve a block of this call: ", reason);
  }
}

}  // namespace

void ring_prefill(const AttentionSpec& spec, const ZigzagPlan& plan, const RingPrefillArgs& args,
                  const Options& options, Stream stream) {
  const Validator v("ring_prefill");
  Communicator* comm = options.comm;
  const int32_t world = comm ? comm->world_size() : 1;
  const int32_t rank = comm ? comm->rank() : 0;
  check_args(v, spec, plan, args, comm, world, rank);

  const Device device = args.q.device;
  const DType dtype = args.q.dtype;
  const int32_t hq = spec.num_q_heads, hkv = spec.num_kv_heads, d = spec.head_dim;
  const int64_t elt = static_cast<int64_t>(dtype_size(dtype));
  const int64_t kv_row_bytes = int64_t{hkv} * d * elt;
  const int64_t local = plan.local_tokens(rank);
  const int32_t slots = plan.num_slots();
  const int32_t batch = plan.num_sequences();
  const bool causal = spec.mask.kind == MaskKind::kCausal;
  const std::vector<RingStep> schedule = ring_schedule(world, rank, causal);

  int64_t max_slot = 0;
  for (int32_t s = 0; s < slots; ++s) max_slot = std::max(max_slot, plan.slot_tokens(rank, s));

  // Scratch: the two ring buffers (K and V), the accumulator's scratch state, an lse for the
  // result when the caller wants none, one partial, and the slot cu_seqlens of every rank.
  const auto layout = [&](attnkit::cp::detail::ScratchLayout& s) {
    struct Pieces {
      uint8_t* ring_k[2]{};
      uint8_t* ring_v[2]{};
      uint8_t *acc_out, *acc_lse, *own_lse, *part_out, *part_lse, *cu;
    } p{};
    if (world > 1) {
      for (int i = 0; i < 2; ++i) {
        p.ring_k[i] = s.take(plan.max_local_tokens() * kv_row_bytes);
        p.ring_v[i] = s.take(plan.max_local_tokens() * kv_row_bytes);
      }
    }
    p.acc_out = s.take(local * hq * d * elt);
    p.acc_lse = s.take(local * hq * 4);
    p.own_lse = s.take(args.lse.defined() ? 0 : local * hq * 4);
    p.part_out = s.take(max_slot * hq * d * elt);
    p.part_lse = s.take(max_slot * hq * 4);
    p.cu = s.take(int64_t{world} * slots * (batch + 1) * 4);
    return p;
  };
  attnkit::cp::detail::ScratchLayout sizing;
  layout(sizing);
  attnkit::cp::detail::DeviceBuffer scratch(device, sizing.bytes(), stream);
  attnkit::cp::detail::ScratchLayout placed(scratch.data());
  const auto pieces = layout(placed);

  // cu_seqlens of slot s of rank q at cu + (q * slots + s) * (B + 1).
  std::vector<int32_t> host_cu;
  for (int32_t q = 0; q < world; ++q) {
    for (int32_t s = 0; s < slots; ++s) {
      const std::vector<int32_t> cu = plan.slot_cu_seqlens(q, s);
      host_cu.insert(host_cu.end(), cu.begin(), cu.end());
    }
  }
  int32_t* cu_base = reinterpret_cast<int32_t*>(pieces.cu);
  const auto cu_view = [&](int32_t q, int32_t s) {
    return TensorView(cu_base + (int64_t{q} * slots + s) * (batch + 1), DType::kInt32, {batch + 1},
                      device);
  };
  const auto kv_in_hand = [&](int32_t step, const TensorView& user, uint8_t* const ring[2]) {
    const int32_t source = schedule[step].kv_rank;
    if (step == 0) return user;
    return TensorView(ring[(step - 1) % 2], dtype, {plan.local_tokens(source), hkv, d}, device);
  };

  // The merge chain of each Q slot over the blocks that have work.
  const attnkit::cp::detail::State final_all{
      args.out, args.lse.defined()
                    ? args.lse
                    : attnkit::cp::detail::lse_view(pieces.own_lse, local, hq, device)};
  const attnkit::cp::detail::State scratch_all{
      attnkit::cp::detail::contiguous_view(pieces.acc_out, dtype, local, hq, d, device),
      attnkit::cp::detail::lse_view(pieces.acc_lse, local, hq, device)};
  const auto has_work = [&](int32_t step, const RingBlock& b) {
    return plan.slot_tokens(rank, b.q_slot) > 0 &&
           plan.slot_tokens(schedule[step].kv_rank, b.kv_slot) > 0;
  };
  std::vector<attnkit::cp::detail::MergeChain> chains;
  for (int32_t s = 0; s < slots; ++s) {
    int32_t count = 0;
    for (int32_t t = 0; t < world; ++t) {
      for (const RingBlock& b : schedule[t].blocks) count += b.q_slot == s && has_work(t, b);
    }
    const int64_t first = plan.slot_offset(rank, s), n = plan.slot_tokens(rank, s);
    const auto slice = [&](const attnkit::cp::detail::State& st) {
      return attnkit::cp::detail::State{attnkit::cp::detail::row_slice(st.out, first, n),
                                        attnkit::cp::detail::row_slice(st.lse, first, n)};
    };
    chains.emplace_back(slice(final_all), slice(scratch_all), count);
  }

  AttentionSpec full_spec = spec;
  full_spec.mask = MaskSpec{MaskKind::kNone, 0, 0};
  std::vector<Operation> ops;
  std::vector<int32_t> merged(static_cast<size_t>(slots), 0);
  for (int32_t t = 0; t < world; ++t) {
    const int32_t source = schedule[t].kv_rank;
    const TensorView k = kv_in_hand(t, args.k, pieces.ring_k);
    const TensorView vv = kv_in_hand(t, args.v, pieces.ring_v);
    for (const RingBlock& b : schedule[t].blocks) {
      if (!has_work(t, b)) continue;
      const attnkit::cp::detail::MergeChain& chain = chains[b.q_slot];
      const int32_t m = merged[b.q_slot]++;
      const int64_t q_first = plan.slot_offset(rank, b.q_slot);
      const int64_t q_count = plan.slot_tokens(rank, b.q_slot);
      const attnkit::cp::detail::State partial{
          attnkit::cp::detail::contiguous_view(pieces.part_out, dtype, q_count, hq, d, device),
          attnkit::cp::detail::lse_view(pieces.part_lse, q_count, hq, device)};
      const attnkit::cp::detail::State target = m == 0 ? chain.location(0) : partial;
      Operation op;
      op.step = t;
      op.spec = b.kind == BlockKind::kCausalDiagonal ? &spec : &full_spec;
      PrefillArgs& pa = op.prefill;
      pa.q = attnkit::cp::detail::row_slice(args.q, q_first, q_count);
      pa.cu_seqlens_q = cu_view(rank, b.q_slot);
      pa.k = attnkit::cp::detail::row_slice(k, plan.slot_offset(source, b.kv_slot),
                                            plan.slot_tokens(source, b.kv_slot));
      pa.v = attnkit::cp::detail::row_slice(vv, plan.slot_offset(source, b.kv_slot),
                                            plan.slot_tokens(source, b.kv_slot));
      pa.cu_seqlens_kv = cu_view(source, b.kv_slot);
      pa.out = target.out;
      pa.lse = target.lse;
      pa.max_seqlen_q = plan.slot_max_seqlen(rank, b.q_slot);
      pa.max_seqlen_kv = plan.slot_max_seqlen(source, b.kv_slot);
      pa.checked = args.checked;
      ops.push_back(op);
      if (m > 0) {
        Operation merge;
        merge.step = t;
        merge.is_merge = true;
        merge.merge = chain.merge(m, chain.location(m - 1), partial, args.checked);
        ops.push_back(merge);
      }
    }
  }
  for (int32_t s = 0; s < slots; ++s) {
    ATTNKIT_CHECK(plan.slot_tokens(rank, s) == 0 || merged[s] > 0,
                  "ring_prefill: internal error: slot ", s, " of rank ", rank,
                  " has queries but no block");
  }

  // The slot cu_seqlens must be in place before the prefill validation reads them (CPU).
  attnkit::cp::detail::upload_int32(device, host_cu.data(), static_cast<int64_t>(host_cu.size()),
                                    cu_base, stream);
  prevalidate(v, ops);

  const Stream comm_stream = comm && comm->comm_stream() ? comm->comm_stream() : stream;
  attnkit::cp::detail::DeviceEvent compute_ready(device), received(device);
  size_t next_op = 0;
  for (int32_t t = 0; t < world; ++t) {
    if (t + 1 < world) {
      const int32_t source = schedule[t].kv_rank, next = schedule[t + 1].kv_rank;
      const int64_t send_bytes = plan.local_tokens(source) * kv_row_bytes;
      const int64_t recv_bytes = plan.local_tokens(next) * kv_row_bytes;
      const RingTransfer transfers[2] = {
          {kv_in_hand(t, args.k, pieces.ring_k).data, send_bytes, pieces.ring_k[t % 2], recv_bytes},
          {kv_in_hand(t, args.v, pieces.ring_v).data, send_bytes, pieces.ring_v[t % 2],
           recv_bytes}};
      compute_ready.record(stream);
      compute_ready.make_wait(comm_stream, device);
      comm->ring_exchange(transfers, comm_stream);
      received.record(comm_stream);
    }
    for (; next_op < ops.size() && ops[next_op].step == t; ++next_op) {
      const Operation& op = ops[next_op];
      if (op.is_merge) {
        merge_states(op.merge, stream);
      } else {
        prefill(*op.spec, op.prefill, stream);
      }
    }
    if (t + 1 < world) received.make_wait(stream, device);
  }
}

}  // namespace attnkit::cp
