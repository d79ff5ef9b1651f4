// Compile-time shape of the Hopper (sm_90a) context FMHA (prefill_sm90_kernel.cuh): tile sizes,
// pipeline depth, warpgroup roles and the shared-memory map, as constexpr functions of head_dim
// and the mask. Host-includable, so dispatch and the support table read the same numbers.
#pragma once

namespace attnkit::cuda::prefill {

// Keys per K/V tile. The S tile (64 x kBlockN floats a consumer warpgroup) and O (64 x head_dim)
// share the consumers' 232 registers a thread; wider key tiles amortize each tile's softmax
// bookkeeping (row max shuffles, O rescale, barriers) over more keys. Causal calls take 128: the
// diagonal tile is half masked and a narrower tile wastes less of it. The skip-softmax kernels
// take the narrow tiles too: their vote and the two versions of a tile's step need registers
// that the wide tile leaves only as spills (89 LDL/STL in the D=128 consumer at 176 keys, none
// at 128).
//
// The FP8 kernels (e4m3 Q, K, V) take 128 keys: V^T, the K-major B operand of fp8 P V, holds a
// tile's keys in one 128-byte swizzled row per head dim.
constexpr int sm90_block_n(int head_dim, bool masked, bool fp8 = false) {
  if (fp8) return head_dim == 128 || head_dim == 256 ? 128 : 0;
  switch (head_dim) {
    case 64:
      return 128;  // S, P and O of 64 x 128 fit the 160 registers of three consumers
    case 128:
      return masked ? 128 : 176;
    case 256:
      return 80;  // O alone takes 128 registers a thread
    default:
      return 0;
  }
}

// Consumer warpgroups of 64 query rows each. head_dim 64 takes three (192-row blocks, as
// FlashAttention-3 does): its MMAs are half those of head_dim 128 per exponential, so the softmax
// of one warpgroup needs two others' MMAs to hide under, and its small O and S fit the 160
// registers that three consumers leave each.
constexpr int sm90_consumer_warpgroups(int head_dim) { return head_dim == 64 ? 3 : 2; }
constexpr int sm90_block_m(int head_dim) { return 64 * sm90_consumer_warpgroups(head_dim); }

// kFp8: Q, K and V are fp8 e4m3 codes (the FP8 context FMHA, docs/prefill_design.md "FP8"); the
// producer transposes each V tile in shared memory into V^T for the K-major fp8 B operand.
// kSage: the SAGE kernels (docs/diffusion.md): Q and K are the quantize pass's int8 (kInt8Qk) or
// fp8 codes with per-block scales, V its fp8 V^T with per-channel scales. They are fp8 kernels
// (P V on fp8 wgmma, 128-key tiles) whose V^T tiles come from global memory by TMA, already in
// the column order P needs (kVtGlobal): no staging ring, no transpose.
template <int kHeadDim_, bool kMasked_, bool kSkip_ = false, bool kFp8_ = false,
          bool kSage_ = false, bool kInt8Qk_ = false>
struct Sm90PrefillTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kMasked = kMasked_;
  static constexpr bool kSkip = kSkip_;
  static constexpr bool kFp8 = kFp8_ || kSage_;
  static constexpr bool kSage = kSage_;
  static constexpr bool kInt8Qk = kInt8Qk_;
  static constexpr bool kVtGlobal = kSage;
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head_dim 64, 128 or 256");
  static_assert(!kFp8 || (kHeadDim != 64 && !kSkip), "fp8: head_dim 128 or 256, no skip-softmax");
  static_assert(!kInt8Qk || kSage, "int8 Q K^T: the SAGE kernels only");
  static constexpr int kElemBytes = kFp8 ? 1 : 2;
  static constexpr int kConsumerWarpgroups = sm90_consumer_warpgroups(kHeadDim);
  static constexpr int kBlockM = sm90_block_m(kHeadDim);
  static constexpr int kBlockN = sm90_block_n(kHeadDim, kMasked || kSkip, kFp8);
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  static constexpr int kStages = 2;  // K and V rings: the next tile loads under this one's MMAs
  // Registers a thread after setmaxnreg: two consumers 40 x 128 + 232 x 256 = the 168 x 384 of
  // the launch; three 32 x 128 + 160 x 384 = 128 x 512.
  // The FP8 kernels' producer also transposes V: 56 x 128 + 224 x 256 at head_dim 128 (the
  // consumers' fp8 P takes a quarter of a 16-bit P's registers; the transpose spills nothing at
  // 56, 200+ instructions at 40). At head_dim 256, O alone takes 128 registers: 24 x 128 + 240 x
  // 256, without which ptxas serializes the consumers' wgmma (C7512).
  // The SAGE kernels' producer transposes nothing: the 16-bit kernels' 40 x 128 + 232 x 256.
  static constexpr bool kTransposesV = kFp8 && !kVtGlobal;
  static constexpr int kProducerRegs = kConsumerWarpgroups == 3  ? 32
                                       : kHeadDim == 256 && kFp8 ? 24
                                       : kTransposesV            ? 56
                                                                 : 40;
  static constexpr int kConsumerRegs = kConsumerWarpgroups == 3  ? 160
                                       : kHeadDim == 256 && kFp8 ? 240
                                       : kTransposesV            ? 224
                                                                 : 232;
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumerWarpgroups <=
                    65536 / kThreads / 8 * 8 * kThreads,
                "setmaxnreg budget");

  // Shared memory: 128-byte swizzled column blocks of 64 head dims (wgmma_sm90.cuh), 128 with
  // fp8. kFp8: V tiles land (TMA) in a staging ring of [kBlockN keys x head_dim] and are
  // transposed into the V ring as [head_dim x kBlockN keys], one 128-byte row a head dim.
  static constexpr int kColElems = 128 / kElemBytes;
  static constexpr int kColBlocks = kHeadDim / kColElems;
  static constexpr int kQColBlockBytes = kBlockM * 128;
  static constexpr int kQBytes = kColBlocks * kQColBlockBytes;
  static constexpr int kKvColBlockBytes = kBlockN * 128;
  static constexpr int kKvTileBytes = kColBlocks * kKvColBlockBytes;
  static_assert(kKvColBlockBytes % 1024 == 0, "column blocks start on the swizzle's 1024 bytes");
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kQBytes;
  static constexpr int kVOffset = kKOffset + kStages * kKvTileBytes;
  static constexpr int kVStageOffset = kVOffset + kStages * kKvTileBytes;
  static constexpr int kBarrierOffset = kVStageOffset + (kTransposesV ? kStages * kKvTileBytes : 0);
  // q_full, q_empty, then k_full, k_empty, v_full, v_empty per stage; a transposing kernel adds
  // the staging ring's vs_full, vs_empty per stage.
  static constexpr int kNumBarriers = 2 + (kTransposesV ? 6 : 4) * kStages;
  // One 32-bit word a K stage: nonzero when a block-table entry of the tile in it is not a block
  // of the pool (written by the producer before it arrives on k_full, read by the consumers).
  static constexpr int kFaultOffset = kBarrierOffset + kNumBarriers * 8;
  // + 1024: the dynamic shared memory base is aligned up to the swizzle's 1024 bytes in-kernel.
  static constexpr int kSmemBytes = kFaultOffset + 4 * kStages + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "fits the 227 KB an sm90 CTA can opt into");
};

}  // namespace attnkit::cuda::prefill
