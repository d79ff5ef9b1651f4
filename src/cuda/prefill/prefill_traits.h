// Compile-time tile shapes of the portable (mma.sync, sm80+) prefill kernel. All its tile choices
// live here, as constexpr functions of (head_dim, PrefillTile); the sm90 kernel's are in
// prefill_sm90_traits.h.
#pragma once

#include "cuda/prefill/prefill_params.h"

namespace attnkit::cuda::prefill {

// Whether (head_dim, tile) has a kernel at all (before the build subset is applied).
constexpr bool tile_exists(int head_dim, PrefillTile tile) {
  if (tile == PrefillTile::kSm90) return false;  // not an mma.sync tile (prefill_sm90_traits.h)
  switch (head_dim) {
    case 64:
      return true;  // every tile
    case 128:
      // 32 rows x 128 keys per warp would need 256 accumulator registers.
      return tile != PrefillTile::kM128W4N128;
    case 80:
    case 96:
      return tile == PrefillTile::kM128;
    case 256:
      // 16 rows per warp keep O at 128 floats per thread. Two independent 4-warp CTAs per SM
      // beat FA2's one 8-warp 128x64 CTA (kM128) by 10% on H200, and a kM128 with a two-stage
      // K+V ring (192 KB) lost 10% at S = 512 (docs/prefill_design.md), so only kM64 is built.
      return tile == PrefillTile::kM64;
    default:
      return false;
  }
}

// Shared-memory rows of 64, 128 or 256 elements (whole 128-byte lines) are XOR-swizzled: 16-byte
// chunk c of row r lives at chunk c ^ (r % 8) of its 8-chunk line, so the 8 rows of an ldmatrix
// phase hit 8 different bank groups and a 512-byte cp.async row covers 4 segments, not the 5 of
// a padded row. head_dim 80 and 96 (not a whole line) keep a 16-byte row padding.
constexpr bool swizzle_default(int head_dim) {
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
}

template <int kHeadDim_, PrefillTile kTile_, bool kSwizzle_ = swizzle_default(kHeadDim_)>
struct PrefillTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr PrefillTile kTile = kTile_;
  static constexpr bool kSwizzle = kSwizzle_;
  static_assert(!kSwizzle || kHeadDim % 64 == 0, "the swizzle needs whole 128-byte rows");
  static constexpr int kBlockM = kTile == PrefillTile::kM64 ? 64 : 128;
  // Every warp owns kMAtoms blocks of 16 query rows (MMA row blocks).
  static constexpr int kMAtoms =
      kTile == PrefillTile::kM128W4 || kTile == PrefillTile::kM128W4N128 ? 2 : 1;
  static constexpr int kRowsPerWarp = 16 * kMAtoms;
  static constexpr int kWarps = kBlockM / kRowsPerWarp;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockN = kTile == PrefillTile::kM128W4N128 ? 128 : 64;
  // head_dim 256 holds one K and one V buffer, overlapped as in FA2: V(j) loads under
  // S = Q K(j)^T and K(j+1) under O += P V(j). That fits 64 keys (and 2 CTAs of kM64 per sm90 SM);
  // smaller head dims keep a kStages ring of K+V that hides a whole iteration.
  static constexpr bool kOverlapKv = kHeadDim >= 256;
  static constexpr int kStages = kOverlapKv ? 1 : (kHeadDim <= 64 && kBlockN == 64 ? 3 : 2);
  static constexpr int kMinBlocksPerSm = kWarps == 8 ? 1 : 2;
  static constexpr int kNTiles = kBlockN / 8;    // n8 tiles of S
  static constexpr int kDTiles = kHeadDim / 8;   // n8 tiles of O
  static constexpr int kKSteps = kHeadDim / 16;  // k16 steps of Q K^T
  // Q stays in registers (one ldmatrix per CTA) when its fragments take at most 32 registers;
  // else (D = 256, or 32 rows per warp at D = 128) it is re-read from smem every tile.
  static constexpr bool kQInRegs =
      kKSteps * 4 * kMAtoms <= 32 && (kNTiles + kDTiles) * 4 * kMAtoms <= 128;
  // Padded rows: 8 consecutive rows start in 8 different 16-byte bank groups.
  static constexpr int kRowBytes = kSwizzle ? kHeadDim * 2 : kHeadDim * 2 + 16;
  // Byte offset of 16-byte chunk `ch` of smem row `r` (Q, K, V and the O staging rows).
  static constexpr int offset(int r, int ch) {
    return r * kRowBytes + (kSwizzle ? (ch ^ (r & 7)) : ch) * 16;
  }
  static constexpr int kChunksPerRow = kHeadDim / 8;  // 16-byte chunks of 16-bit elements

  static constexpr int kQBytes = kBlockM * kRowBytes;
  static constexpr int kKvTileBytes = kBlockN * kRowBytes;  // one K (or V) tile
  // 8-bit caches land raw (kBlockN x D bytes, one stage: the next tile loads while this one is
  // computed) and are widened into one K and one V tile.
  static constexpr int kRawTileBytes = kBlockN * kHeadDim;
  static constexpr int kLutBytes = 256 * 2;

  static constexpr int smem_bytes(bool quant_kv) {
    return quant_kv ? kQBytes + 2 * kKvTileBytes + 2 * kRawTileBytes + kLutBytes
                    : kQBytes + 2 * kStages * kKvTileBytes;
  }
  // Split warps (head_dim 256, packed, no mask; prefill_kernel.cuh): P rows of kBlockN 16-bit
  // values padded by 16 bytes (8 rows at one column hit 8 bank groups), then 2 x kBlockM floats
  // of row statistics.
  static constexpr int kPRowBytes = 2 * kBlockN + 16;
  static constexpr int kSplitSmemBytes = smem_bytes(false) + kBlockM * kPRowBytes + 2 * kBlockM * 4;
};

}  // namespace attnkit::cuda::prefill
