// Compile-time tile shapes of the portable (mma.sync, sm80+) prefill kernel. All tile choices
// live here, as constexpr functions of (head_dim, PrefillTile).
#pragma once

#include "cuda/prefill/prefill_params.h"

namespace attnkit::cuda::prefill {

// Whether (head_dim, tile) has a kernel at all (before the build subset is applied).
constexpr bool tile_exists(int head_dim, PrefillTile tile) {
  switch (head_dim) {
    case 64:
    case 128:
      return true;  // all three tiles
    case 80:
    case 96:
      return tile == PrefillTile::kM128;
    case 256:
      // 64 rows keep O (128 floats per thread) and the smem within an sm80 CTA.
      return tile == PrefillTile::kM64;
    default:
      return false;
  }
}

template <int kHeadDim_, PrefillTile kTile_>
struct PrefillTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr PrefillTile kTile = kTile_;
  static constexpr int kBlockM = kTile == PrefillTile::kM64 ? 64 : 128;
  // Every warp owns kMAtoms blocks of 16 query rows (MMA row blocks).
  static constexpr int kMAtoms = kTile == PrefillTile::kM128W4 ? 2 : 1;
  static constexpr int kRowsPerWarp = 16 * kMAtoms;
  static constexpr int kWarps = kBlockM / kRowsPerWarp;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockN = kHeadDim >= 256 ? 32 : 64;
  static constexpr int kStages = kHeadDim <= 64 ? 3 : 2;
  // Q stays in registers (one ldmatrix per CTA) up to D = 128; D = 256 re-reads it from smem.
  static constexpr bool kQInRegs = kHeadDim <= 128 && kMAtoms == 1;
  // Shared-memory rows are padded by 16 bytes: 8 consecutive rows then start in 8 different
  // 16-byte bank groups, so ldmatrix is conflict-free for every head_dim (80 and 96 included,
  // which an XOR swizzle over 8 chunks does not cover).
  static constexpr int kRowBytes = kHeadDim * 2 + 16;
  static constexpr int kChunksPerRow = kHeadDim / 8;  // 16-byte chunks of 16-bit elements
  static constexpr int kNTiles = kBlockN / 8;         // n8 tiles of S
  static constexpr int kDTiles = kHeadDim / 8;        // n8 tiles of O
  static constexpr int kKSteps = kHeadDim / 16;       // k16 steps of Q K^T

  static constexpr int kQBytes = kBlockM * kRowBytes;
  static constexpr int kKvTileBytes = kBlockN * kRowBytes;  // one K (or V) tile
  // 8-bit caches land raw (kBlockN x D bytes) and are widened into one K and one V tile.
  static constexpr int kRawTileBytes = kBlockN * kHeadDim;
  static constexpr int kLutBytes = 256 * 2;

  static constexpr int smem_bytes(bool quant_kv) {
    return quant_kv ? kQBytes + 2 * kStages * kRawTileBytes + 2 * kKvTileBytes + kLutBytes
                    : kQBytes + 2 * kStages * kKvTileBytes;
  }
};

}  // namespace attnkit::cuda::prefill
