// Host dispatch of the prefill kernel family: runtime values -> template arguments in one place
// (find_launcher), the support check that `backend=fused`, `auto` and `attnkit info` share, the
// tile heuristic, and the PrefillParams of packed, paged and dense calls.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/kv_access.h"
#include "cuda/common/cuda_status.h"
#include "cuda/common/device_fault.h"
#include "cuda/common/host_upload.h"
#include "cuda/common/stream_buffer.h"
#include "cuda/prefill/prefill_api.h"
#include "cuda/prefill/prefill_build_set.h"
#include "cuda/prefill/prefill_launch.h"
#include "cuda/prefill/prefill_skip_stats.h"
#include "cuda/prefill/prefill_sm90.h"
#include "cuda/prefill/prefill_sm90_traits.h"
#include "cuda/prefill/prefill_traits.h"
#include "cuda/sage/sage_quant_launch.h"

namespace attnkit::cuda::prefill {

const char* prefill_tile_name(PrefillTile tile) {
  switch (tile) {
    case PrefillTile::kM128:
      return "m128";
    case PrefillTile::kM64:
      return "m64";
    case PrefillTile::kM128W4:
      return "m128w4";
    case PrefillTile::kM128W4N128:
      return "m128w4n128";
    case PrefillTile::kSm90:
      return "sm90";
  }
  return "?";
}

namespace {

using Launcher = void (*)(const PrefillParams&, cudaStream_t);

constexpr int kHeadDims[] = {64, 80, 96, 128, 256};

template <int D, PrefillTile kTile, DType kDT>
Launcher launcher_for(bool masked, bool quant_kv, bool paged, bool runs, bool skip_dead, bool split,
                      bool skip_softmax) {
  if constexpr (tile_compiled(D, kTile, kDT)) {
    // skip_softmax: the kSkipSoftmax kernels (packed 16-bit K/V; prefill_unsupported).
    if (skip_softmax) {
      if (paged || quant_kv) return nullptr;
      constexpr bool kSw = swizzle_default(D);
      return masked ? &launch_prefill<D, kTile, kDT, true, false, false, kSw, false, false, false,
                                      true>
                    : &launch_prefill<D, kTile, kDT, false, false, false, kSw, false, false, false,
                                      true>;
    }
    // split: the packed unmasked head_dim 256 kM64 kernel with split warps (uses_split_warps).
    if constexpr (D == 256 && kTile == PrefillTile::kM64) {
      if (split && !masked && !paged && !quant_kv) {
        return &launch_prefill<D, kTile, kDT, false, false, false, true, false, false, true>;
      }
    }
    // skip_dead: the packed causal kM128W4 kernels with dead-block skip (head_dim 64 and 128).
    if constexpr (kTile == PrefillTile::kM128W4 && (D == 64 || D == 128)) {
      if (skip_dead) {
        return &launch_prefill<D, kTile, kDT, true, false, false, swizzle_default(D), false, true>;
      }
    }
    // runs: the kRunsOnly paged kernels (no per-chunk slot copy) where runs_compiled() has them.
    if constexpr (runs_compiled(D)) {
      constexpr bool kSw = swizzle_default(D);
      if (runs && quant_kv) {
        return masked ? &launch_prefill<D, kTile, kDT, true, true, true, kSw, true>
                      : &launch_prefill<D, kTile, kDT, false, true, true, kSw, true>;
      }
      if (runs) {
        return masked ? &launch_prefill<D, kTile, kDT, true, false, true, kSw, true>
                      : &launch_prefill<D, kTile, kDT, false, false, true, kSw, true>;
      }
    }
    if (quant_kv) {
      return masked ? &launch_prefill<D, kTile, kDT, true, true, true>
                    : &launch_prefill<D, kTile, kDT, false, true, true>;
    }
    if (paged) {
      return masked ? &launch_prefill<D, kTile, kDT, true, false, true>
                    : &launch_prefill<D, kTile, kDT, false, false, true>;
    }
    return masked ? &launch_prefill<D, kTile, kDT, true, false, false>
                  : &launch_prefill<D, kTile, kDT, false, false, false>;
  } else {
    return nullptr;
  }
}

template <int D, DType kDT>
Launcher launcher_for(PrefillTile tile, bool masked, bool quant_kv, bool paged, bool runs,
                      bool skip_dead, bool split, bool skip_softmax) {
  switch (tile) {
    case PrefillTile::kM128:
      return launcher_for<D, PrefillTile::kM128, kDT>(masked, quant_kv, paged, runs, skip_dead,
                                                      split, skip_softmax);
    case PrefillTile::kM64:
      return launcher_for<D, PrefillTile::kM64, kDT>(masked, quant_kv, paged, runs, skip_dead,
                                                     split, skip_softmax);
    case PrefillTile::kM128W4:
      return launcher_for<D, PrefillTile::kM128W4, kDT>(masked, quant_kv, paged, runs, skip_dead,
                                                        split, skip_softmax);
    case PrefillTile::kM128W4N128:
      return launcher_for<D, PrefillTile::kM128W4N128, kDT>(masked, quant_kv, paged, runs,
                                                            skip_dead, split, skip_softmax);
    case PrefillTile::kSm90:
      return nullptr;  // run_sm90
  }
  return nullptr;
}

template <DType kDT>
Launcher launcher_for(int head_dim, PrefillTile tile, bool masked, bool quant_kv, bool paged,
                      bool runs, bool skip_dead, bool split, bool skip_softmax) {
  switch (head_dim) {
    case 64:
      return launcher_for<64, kDT>(tile, masked, quant_kv, paged, runs, skip_dead, split,
                                   skip_softmax);
    case 80:
      return launcher_for<80, kDT>(tile, masked, quant_kv, paged, runs, skip_dead, split,
                                   skip_softmax);
    case 96:
      return launcher_for<96, kDT>(tile, masked, quant_kv, paged, runs, skip_dead, split,
                                   skip_softmax);
    case 128:
      return launcher_for<128, kDT>(tile, masked, quant_kv, paged, runs, skip_dead, split,
                                    skip_softmax);
    case 256:
      return launcher_for<256, kDT>(tile, masked, quant_kv, paged, runs, skip_dead, split,
                                    skip_softmax);
    default:
      return nullptr;
  }
}

// The one place where runtime values become template arguments. runs: a paged cache with a block
// table and no cyclic window (the kRunsOnly kernels). skip_dead: a packed causal call that takes
// the dead-block-skip kernel (see skips_dead_blocks). split: a packed head_dim 256 call that takes
// the split-warp kernel (see uses_split_warps). skip_softmax: the skip-softmax kernel (it takes
// precedence over skip_dead and split, which it does not combine with).
Launcher find_launcher(int head_dim, PrefillTile tile, DType dtype, bool masked, bool quant_kv,
                       bool paged, bool runs = false, bool skip_dead = false, bool split = false,
                       bool skip_softmax = false) {
  if (dtype == DType::kBF16) {
    return launcher_for<DType::kBF16>(head_dim, tile, masked, quant_kv, paged, runs, skip_dead,
                                      split, skip_softmax);
  }
  if (dtype == DType::kF16) {
    return launcher_for<DType::kF16>(head_dim, tile, masked, quant_kv, paged, runs, skip_dead,
                                     split, skip_softmax);
  }
  return nullptr;
}

// Longest key range for which causal calls take the tiles and kernels below.
constexpr int32_t kShortCausalKeys = 4096;

// The packed causal kM128W4 kernel with interleaved row blocks and dead-block skip
// (kSkipDeadBlocks, prefill_kernel.cuh): +5-10% at 512 and 1k keys (head_dim 64 and 128), +2% at
// 2k, even at 4k, and -1 to -1.5% from 8k at head_dim 128 (docs/prefill_design.md). Whether a
// packed causal call on tile kM128W4 takes it: head_dim 64 always, head_dim 128 up to
// kShortCausalKeys keys.
bool skips_dead_blocks(int head_dim, PrefillTile tile, bool masked, bool paged,
                       int32_t max_seqlen_kv) {
  if (!masked || paged || tile != PrefillTile::kM128W4) return false;
  return head_dim == 64 || (head_dim == 128 && max_seqlen_kv <= kShortCausalKeys);
}

// The packed unmasked head_dim 256 kM64 kernel with split warps (kSplitWarps, prefill_kernel.cuh):
// pairs of warps share 32 query rows, S by key halves, O by dim halves, so every K/V fragment read
// from smem feeds two MMA row blocks: +2.5-4% from 512 to 16k keys. Causal lost 3-6%, so masked
// calls keep the plain kernel. The split kernel needs kSplitSmemBytes (105.5 KB; the plain 96 KB
// also fit the 99 KB of sm86 / sm89).
bool uses_split_warps(int head_dim, PrefillTile tile, bool masked, bool paged, int smem_optin) {
  return head_dim == 256 && tile == PrefillTile::kM64 && !masked && !paged &&
         PrefillTraits<256, PrefillTile::kM64>::kSplitSmemBytes <= smem_optin;
}

template <int D>
int smem_bytes_for(PrefillTile tile, bool quant_kv) {
  switch (tile) {
    case PrefillTile::kM128:
      return PrefillTraits<D, PrefillTile::kM128>::smem_bytes(quant_kv);
    case PrefillTile::kM64:
      return PrefillTraits<D, PrefillTile::kM64>::smem_bytes(quant_kv);
    case PrefillTile::kM128W4:
      return PrefillTraits<D, PrefillTile::kM128W4>::smem_bytes(quant_kv);
    case PrefillTile::kM128W4N128:
      return PrefillTraits<D, PrefillTile::kM128W4N128>::smem_bytes(quant_kv);
    case PrefillTile::kSm90:
      return sm90_smem_bytes(D, /*masked=*/false);  // the larger of the two key tiles
  }
  return 0;
}

struct DeviceLimits {
  bool ok = false;
  int cc_major = 0, cc_minor = 0;
  int smem_optin = 0;
  int smem_per_sm = 0;
  int sm_count = 0;
};

DeviceLimits device_limits(int ordinal) {
  DeviceLimits d;
  if (cudaDeviceGetAttribute(&d.cc_major, cudaDevAttrComputeCapabilityMajor, ordinal) !=
          cudaSuccess ||
      cudaDeviceGetAttribute(&d.cc_minor, cudaDevAttrComputeCapabilityMinor, ordinal) !=
          cudaSuccess ||
      cudaDeviceGetAttribute(&d.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, ordinal) !=
          cudaSuccess ||
      cudaDeviceGetAttribute(&d.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor,
                             ordinal) != cudaSuccess ||
      cudaDeviceGetAttribute(&d.sm_count, cudaDevAttrMultiProcessorCount, ordinal) != cudaSuccess) {
    cudaGetLastError();
    return d;
  }
  d.ok = true;
  return d;
}

bool is_8bit(DType dtype) { return dtype == DType::kFp8E4M3 || dtype == DType::kInt8; }

// What the kernel family needs of a call, shared by prefill() and dense().
struct CallShape {
  int device = 0;
  int head_dim = 0;
  DType dtype = DType::kBF16;
  DType kv_dtype = DType::kBF16;
  bool paged = false;
};

std::string unsupported(const AttentionSpec& spec, const CallShape& c) {
  using detail::concat;
  if (c.dtype == DType::kFp8E4M3) {
    // The FP8 kernel alone serves fp8 q; what else it needs is sm90_unsupported's to say.
    if (c.kv_dtype != DType::kFp8E4M3) {
      return concat("fp8_e4m3 q with ", dtype_name(c.kv_dtype),
                    " k / v: the FP8 kernel reads fp8_e4m3 k / v or an fp8_e4m3 kv_cache");
    }
    if (!sm90_kernels_compiled(c.head_dim, c.dtype)) {
      return concat("fp8_e4m3 q with head_dim ", c.head_dim,
                    ": the FP8 kernel serves head_dim 128 and 256 and is not compiled for this one "
                    "in this build");
    }
    if (spec.alibi && spec.num_q_heads > kMaxAlibiHeads) {
      return concat("alibi with ", spec.num_q_heads,
                    " query heads: the fused prefill takes at most ", kMaxAlibiHeads);
    }
    return "";
  }
  if (c.dtype != DType::kBF16 && c.dtype != DType::kF16) {
    return concat("q dtype ", dtype_name(c.dtype), ": the fused prefill takes bf16 or f16");
  }
  if (std::find(std::begin(kHeadDims), std::end(kHeadDims), c.head_dim) == std::end(kHeadDims)) {
    return concat("head_dim ", c.head_dim, ": the fused prefill serves 64, 80, 96, 128 and 256");
  }
  const std::vector<PrefillTile> tiles = compiled_tiles(c.head_dim, c.dtype);
  if (tiles.empty()) {
    return concat("head_dim ", c.head_dim, " with ", dtype_name(c.dtype),
                  ": not compiled in this build (ATTNKIT_KERNEL_SUBSET)");
  }
  const bool quant_kv = c.paged && is_8bit(c.kv_dtype);
  if (c.kv_dtype != c.dtype && !quant_kv) {
    return concat("kv dtype ", dtype_name(c.kv_dtype), " with q dtype ", dtype_name(c.dtype),
                  ": the fused prefill reads K/V of the q dtype, or a paged fp8_e4m3 / int8 cache");
  }
  if (spec.alibi && spec.num_q_heads > kMaxAlibiHeads) {
    return concat("alibi with ", spec.num_q_heads, " query heads: the fused prefill takes at most ",
                  kMaxAlibiHeads);
  }
  const DeviceLimits dev = device_limits(c.device);
  if (!dev.ok) return concat("no CUDA device ", c.device, " visible");
  if (dev.cc_major < 8) {
    return concat("compute capability ", dev.cc_major, ".", dev.cc_minor,
                  ": the fused prefill needs sm80 or newer");
  }
  // At least one tile must fit the device (sm80: 163 KB); pick_tile uses only the ones that do.
  // The sm90 kernel, where compiled, serves on top of the mma.sync tiles, never instead of them.
  int least = 0;
  for (PrefillTile tile : tiles) {
    if (tile == PrefillTile::kSm90) continue;
    const int need = prefill_smem_bytes(c.head_dim, tile, quant_kv);
    if (need <= dev.smem_optin) return "";
    least = least == 0 ? need : std::min(least, need);
  }
  return concat("head_dim ", c.head_dim, ": the smallest prefill tile needs ", least,
                " bytes of shared memory per block; the device allows ", dev.smem_optin);
}

// The portable tiles (docs/prefill_design.md): once the grid of 128-row CTAs fills every SM, the
// 4-warp 128-row tiles win (two CTAs per SM, each smem fragment feeds two MMA row blocks):
// kM128W4N128 at head_dim 64 (+1-3% over kM128W4), kM128W4 at 128 (also over an 8-bit cache). The
// 8-warp kM128 lost to them by 10-25%; it stays for head_dim 80/96 and the kernel subset. head_dim
// 256 builds kM64 only. A grid smaller than the GPU takes kM64's extra CTAs. Causal head_dim 64
// with packed K/V and at most kShortCausalKeys keys per sequence takes kM128W4 (64 keys, with the
// dead-block skip): a CTA there visits few 128-key tiles and the diagonal one is half masked
// (+0.4-4% over kM128W4N128 up to 4k). Paged calls keep kM128W4N128.
PrefillTile choose_tile(const std::vector<PrefillTile>& tiles, int64_t ctas_m128, int sm_count,
                        bool masked, int32_t max_seqlen_kv) {
  if (tiles.size() == 1) return tiles[0];
  auto has = [&](PrefillTile t) { return std::find(tiles.begin(), tiles.end(), t) != tiles.end(); };
  if (ctas_m128 >= sm_count) {
    if (masked && max_seqlen_kv <= kShortCausalKeys && has(PrefillTile::kM128W4N128) &&
        has(PrefillTile::kM128W4)) {
      return PrefillTile::kM128W4;
    }
    for (PrefillTile t : {PrefillTile::kM128W4N128, PrefillTile::kM128W4}) {
      if (has(t)) return t;
    }
  }
  return has(PrefillTile::kM64) ? PrefillTile::kM64 : tiles[0];
}

// Where auto prefers the portable kernel on Hopper: short sequences whose key tiles are few, so
// the sm90 kernel's per-work-item cost (Q load, the first S and the last P V without overlap) is
// not amortized. H200, bf16, 16k tokens, same run (TFLOP/s, sm90 vs portable): D=64 512 256 vs 275,
// causal 512 / 1k / 2k 147 / 210 / 257 vs 171 / 223 / 266 (4k: 296 vs 297, 8k 337 vs 318); D=256
// causal 512 197 vs 208 (1k 292 vs 265). Every other row of the grid is faster on sm90
// (docs/performance.md).
// Whether the sm90 kernel packs a GQA group's heads into its blocks (PrefillParams::q_pack_log2)
// when not forced: the group is a power of two that divides the block's bm rows, there is no ALiBi
// (one slope a head: a tile's rows would need one each), and packing computes fewer rows than one
// head a block, ceil(q G / bm) < G ceil(q / bm): blocks of short sequences that one head leaves
// part empty (chunked prefill, speculative verification, short GQA prompts).
bool sm90_packable(int64_t group, bool alibi, int bm) {
  return group > 1 && (group & (group - 1)) == 0 && bm % group == 0 && !alibi;
}
bool sm90_packs(int64_t group, bool alibi, int bm, int32_t max_seqlen_q) {
  const int64_t q = max_seqlen_q;
  return sm90_packable(group, alibi, bm) && (q * group + bm - 1) / bm < group * ((q + bm - 1) / bm);
}

bool sm90_preferred(int head_dim, bool masked, int32_t max_seqlen_kv) {
  if (head_dim == 64) return max_seqlen_kv > (masked ? 2048 : 512);
  if (head_dim == 256 && masked) return max_seqlen_kv > 512;
  return true;
}

// The kernel a call runs. sm90_reason: "" when the sm90 kernel can serve the call (else why
// not); it is preferred wherever it can, and a forced kSm90 it cannot serve raises with the reason.
// `packs`: the sm90 kernel would pack the call's GQA group (sm90_packs).
PrefillTile pick_tile(const CallShape& c, std::optional<PrefillTile> forced, int32_t batch,
                      int32_t max_seqlen_q, int32_t heads, bool masked, int32_t max_seqlen_kv,
                      bool packs, const std::string& sm90_reason, FusedKernel choice) {
  const bool quant_kv = c.paged && is_8bit(c.kv_dtype);
  if (c.dtype == DType::kFp8E4M3) {
    // fp8 q has one kernel: a forced portable tile or an unservable call raises.
    ATTNKIT_CHECK(!forced || *forced == PrefillTile::kSm90, "prefill: tile ",
                  prefill_tile_name(*forced), " does not take fp8_e4m3 q (the FP8 kernel is sm90)");
    ATTNKIT_CHECK(sm90_reason.empty(),
                  "prefill: the FP8 kernel cannot serve this call: ", sm90_reason);
    return PrefillTile::kSm90;
  }
  const DeviceLimits dev = device_limits(c.device);
  std::vector<PrefillTile> tiles;
  for (PrefillTile t : compiled_tiles(c.head_dim, c.dtype)) {
    if (t == PrefillTile::kSm90) continue;
    if (prefill_smem_bytes(c.head_dim, t, quant_kv) <= dev.smem_optin) tiles.push_back(t);
  }
  ATTNKIT_CHECK(!tiles.empty(), "prefill: no tile for head_dim ", c.head_dim,
                " fits the device's shared memory (", dev.smem_optin, " bytes per block)");
  if (forced) {
    if (*forced == PrefillTile::kSm90) {
      ATTNKIT_CHECK(sm90_reason.empty(),
                    "prefill: the sm90 kernel cannot serve this call: ", sm90_reason);
      return *forced;
    }
    ATTNKIT_CHECK(std::find(tiles.begin(), tiles.end(), *forced) != tiles.end(), "prefill: tile ",
                  prefill_tile_name(*forced), " is not compiled for head_dim ", c.head_dim, " and ",
                  dtype_name(c.dtype), ", or does not fit this device's shared memory");
    return *forced;
  }
  if (choice == FusedKernel::kHopper) {
    ATTNKIT_CHECK(sm90_reason.empty(),
                  "spec.fused_kernel 'hopper': the sm90 kernel cannot serve "
                  "this call: ",
                  sm90_reason);
    return PrefillTile::kSm90;
  }
  // 8-bit caches: the sm90 kernel widens them in its producer warpgroup (gathered loads), which
  // ran at 77-92 TFLOP/s against the portable kernel's 233-269 (H200, D=128 causal paged64 fp8,
  // 2k / 8k): auto keeps them on the portable kernel until they are read natively in fp8. A call
  // the sm90 kernel packs runs there at any length (D=128, 8 query heads a KV head, 16k tokens:
  // 16-token prompts 1.8 -> 10.7 TFLOP/s, 64-token 26 -> 44 against one head a block).
  if (choice == FusedKernel::kAuto && sm90_reason.empty() && !quant_kv &&
      (packs || sm90_preferred(c.head_dim, masked, max_seqlen_kv))) {
    return PrefillTile::kSm90;
  }
  const int64_t ctas = static_cast<int64_t>(batch) * heads * ((max_seqlen_q + 127) / 128);
  return choose_tile(tiles, ctas, dev.sm_count, masked && !c.paged, max_seqlen_kv);
}

// The CTA order's section size (both schedulers; H200 measurements):
// without a mask, sections of about one resident wave (ceil(resident CTAs / query blocks) pairs)
// read each K/V tile from DRAM once (D=256 S=512: 1.12 GB -> 0.20 GB, +16%). Under a causal mask
// a CTA's work grows with its query block and a heavy block started late stretches the tail:
// sections of 4 waves, and none at all (the old order, heaviest blocks of every pair first)
// once a resident wave of that order already holds >= 4 query blocks of each pair (few pairs).
// The persistent sm90 kernel: sections of one wave without a mask (D=128, 16k tokens, TFLOP/s
// against the unsectioned order: S=512 328 -> 367, 2k 454 -> 558, 16k 585 -> 655); under a
// causal mask 4-wave sections up to 8 query blocks (S=512 214 -> 228) and the unsectioned order
// beyond, where its static round robin balances the CTAs better (2k 379 vs 372, 4k 474 vs 456).
void set_schedule(PrefillParams& prm, const CallShape& c, PrefillTile tile, bool masked,
                  bool quant_kv, int forced_section_pairs) {
  const int64_t pairs = static_cast<int64_t>(prm.batch) * (prm.num_q_heads >> prm.q_pack_log2);
  int64_t section = forced_section_pairs;
  if (section <= 0) {
    const DeviceLimits dev = device_limits(c.device);
    const int smem = prefill_smem_bytes(c.head_dim, tile, quant_kv);
    // Resident CTAs per SM: shared memory, and registers at the 255-per-thread bound.
    const int by_smem = std::max(1, dev.smem_per_sm / (smem + 1024));
    const int by_regs = std::max(1, 65536 / (prefill_threads(tile) * 255));
    const int64_t resident = static_cast<int64_t>(dev.sm_count) * std::min(by_smem, by_regs);
    const int64_t waves = masked ? 4 : 1;
    section = (resident * waves + prm.num_m_blocks - 1) / prm.num_m_blocks;
    if (masked && 4 * pairs <= resident) section = pairs;
    if (masked && tile == PrefillTile::kSm90 && prm.num_m_blocks > 8) section = pairs;
  }
  prm.section_pairs = static_cast<int32_t>(std::clamp<int64_t>(section, 1, pairs));
}

// The sm90 kernel's GQA packing of a call (PrefillParams::q_pack_log2): log2 of the group where
// sm90_packs, else 0. Forced (tests): true packs or raises, false never packs.
int q_pack_log2(const PrefillParams& prm, int bm, int32_t max_seqlen_q,
                std::optional<bool> forced) {
  const int64_t g = prm.group_size;
  if (forced) {
    ATTNKIT_CHECK(!*forced || sm90_packable(g, prm.alibi, bm),
                  "prefill: the sm90 kernel packs the heads of a GQA group of a power of two that "
                  "divides its ",
                  bm, "-row blocks, without ALiBi; got group ", g, prm.alibi ? " with ALiBi" : "");
    if (!*forced) return 0;
  } else if (!sm90_packs(g, prm.alibi, bm, max_seqlen_q)) {
    return 0;
  }
  int log2 = 0;
  while ((int64_t{1} << log2) < g) ++log2;
  return log2;
}

// The kernel moves 16-byte chunks: rows must start 16-byte aligned and the last dim be dense.
void check_rows_16b(const TensorView& t, const char* name) {
  ATTNKIT_CHECK(t.strides[t.ndim - 1] == 1, name,
                ": the fused prefill needs a unit stride in the last dimension, got strides of ",
                t.shape_str());
  ATTNKIT_CHECK(reinterpret_cast<uintptr_t>(t.data) % 16 == 0, name,
                ": the fused prefill needs 16-byte aligned data");
  const int64_t per_16b = 16 / static_cast<int64_t>(dtype_size(t.dtype));
  for (int d = 0; d < t.ndim - 1; ++d) {
    ATTNKIT_CHECK(t.strides[d] % per_16b == 0, name, ": the fused prefill needs strides that are ",
                  "multiples of ", per_16b, " elements (16 bytes), got stride ", t.strides[d],
                  " in dim ", d);
  }
}

// The FP8 kernel's descale of a [1] / [B, Hkv] tensor (PrefillArgs::q_descale) or of a cache
// scale ([1] / [Hkv]).
Descale descale_of(const TensorView& t, bool cache_scale) {
  Descale d;
  if (!t.defined()) return d;
  d.ptr = static_cast<const float*>(t.data);
  if (cache_scale) {
    d.head_stride = t.numel() > 1 ? 1 : 0;
  } else if (t.ndim == 2) {
    d.batch_stride = static_cast<int32_t>(t.strides[0]);
    d.head_stride = 1;
  }
  return d;
}

void fill_mods(const AttentionSpec& spec, PrefillParams& prm) {
  prm.softmax_scale = static_cast<float>(spec.effective_scale());
  prm.softcap = static_cast<float>(spec.logit_softcap);
  prm.alibi = spec.alibi;
  if (spec.alibi) {
    const std::vector<float> slopes =
        spec.alibi_slopes.empty() ? default_alibi_slopes(spec.num_q_heads) : spec.alibi_slopes;
    for (int h = 0; h < spec.num_q_heads; ++h) prm.alibi_slopes[h] = slopes[h];
  }
}

Sm90Call sm90_call(const CallShape& c, const AttentionSpec& spec, bool masked, int forced_ctas) {
  const DeviceLimits dev = device_limits(c.device);
  Sm90Call call;
  call.cc_major = dev.cc_major;
  call.cc_minor = dev.cc_minor;
  call.smem_optin = dev.smem_optin;
  call.sm_count = dev.sm_count;
  call.head_dim = spec.head_dim;
  call.dtype = c.dtype;
  call.masked = masked;
  call.forced_ctas = forced_ctas;
  return call;
}

// Skip-softmax of one call (docs/diffusion.md): active when the spec sets it, its gate is open at
// the call's timestep and lambda > 0; otherwise the call is the plain one, on the kernel the plain
// call picks, bit for bit.
struct SkipPolicy {
  bool active = false;
  float log2_lambda = 0.f;  // log2(lambda); with per_kv_len, log2(lambda x kv_len)
  // prefill() with target_sparsity: lambda = a exp(b s) / kv_len of each sequence, which the
  // kernels derive from the sequence's length (the host does not read the device lengths).
  bool per_kv_len = false;
};

// dense_kv_len: dense() (every sequence has these keys), or nullopt for prefill().
SkipPolicy skip_policy(const AttentionSpec& spec, double timestep,
                       std::optional<int64_t> dense_kv_len) {
  SkipPolicy policy;
  if (!spec.skip_softmax || !spec.skip_softmax->active_at(timestep)) return policy;
  const SkipSoftmaxSpec& s = *spec.skip_softmax;
  if (!dense_kv_len && s.target_sparsity) {
    policy.active = true;
    policy.per_kv_len = true;
    policy.log2_lambda = static_cast<float>(
        std::log2(*s.calibration_a) + *s.calibration_b * *s.target_sparsity * 1.4426950408889634);
    return policy;
  }
  const double lambda = s.lambda(dense_kv_len.value_or(0));
  // lambda 0 never skips (ln 0 = -inf): the plain call. A dense call without keys visits no tile.
  policy.active = lambda > 0.0 && dense_kv_len.value_or(1) > 0;
  if (policy.active) policy.log2_lambda = static_cast<float>(std::log2(lambda));
  return policy;
}

// Why the sm90 kernel cannot serve a skip-softmax call of `spec` ("" when it can).
std::string sm90_skip_reason(Sm90Call call, const AttentionSpec& spec, bool prefill_call) {
  call.skip = true;
  std::string why = sm90_unsupported(call);
  if (why.empty() && prefill_call && spec.skip_softmax && spec.skip_softmax->target_sparsity) {
    why =
        "skip_softmax target_sparsity in prefill(): lambda = a exp(b s) / kv_len differs between "
        "sequences, and the sm90 kernel takes one lambda a call";
  }
  return why;
}

// The skip_stats buffer of a prefill() call: int64 [4] (SkipStats), or nullptr.
int64_t* skip_stats_of(const PrefillArgs& args) {
  return args.skip_stats.defined() ? static_cast<int64_t*>(args.skip_stats.data) : nullptr;
}

}  // namespace

int prefill_block_m(PrefillTile tile, int head_dim) {
  if (tile == PrefillTile::kSm90) return sm90_block_m(head_dim);
  return tile == PrefillTile::kM64 ? 64 : 128;
}
int prefill_block_n(PrefillTile tile, int head_dim, bool masked) {
  if (tile == PrefillTile::kSm90) return sm90_block_n(head_dim, masked);
  return tile == PrefillTile::kM128W4N128 ? 128 : 64;
}
int prefill_threads(PrefillTile tile) {
  if (tile == PrefillTile::kSm90) return 384;
  return tile == PrefillTile::kM128 ? 256 : 128;
}

int prefill_smem_bytes(int head_dim, PrefillTile tile, bool quant_kv) {
  switch (head_dim) {
    case 64:
      return smem_bytes_for<64>(tile, quant_kv);
    case 80:
      return smem_bytes_for<80>(tile, quant_kv);
    case 96:
      return smem_bytes_for<96>(tile, quant_kv);
    case 128:
      return smem_bytes_for<128>(tile, quant_kv);
    case 256:
      return smem_bytes_for<256>(tile, quant_kv);
    default:
      return 0;
  }
}

std::vector<PrefillTile> compiled_tiles(int head_dim, DType dtype) {
  std::vector<PrefillTile> tiles;
  for (PrefillTile tile : kAllPrefillTiles) {
    if (find_launcher(head_dim, tile, dtype, false, false, false) != nullptr) tiles.push_back(tile);
  }
  if (sm90_kernels_compiled(head_dim, dtype)) tiles.push_back(PrefillTile::kSm90);
  return tiles;
}

std::vector<PrefillTile> runnable_tiles(int head_dim, DType dtype, int device) {
  const DeviceLimits dev = device_limits(device);
  AttentionSpec spec;
  spec.head_dim = head_dim;
  const Sm90Call call = sm90_call({device, head_dim, dtype, dtype, false}, spec, false, 0);
  std::vector<PrefillTile> tiles;
  for (PrefillTile tile : compiled_tiles(head_dim, dtype)) {
    const bool runs = tile == PrefillTile::kSm90
                          ? sm90_unsupported(call).empty()
                          : prefill_smem_bytes(head_dim, tile, false) <= dev.smem_optin;
    if (runs) tiles.push_back(tile);
  }
  return tiles;
}

namespace {
std::string sage_unsupported(const AttentionSpec& spec, DType dtype, int device, bool masked);
}  // namespace

std::string prefill_unsupported(const AttentionSpec& spec, const detail::PrefillProblem& p) {
  if (spec.quant) {
    if (spec.skip_softmax)
      return "skip_softmax with quant (SAGE): the SAGE kernels do not skip tiles";
    return sage_unsupported(spec, p.dtype, p.device.index, spec.mask.kind != MaskKind::kNone);
  }
  const CallShape shape{p.device.index, spec.head_dim, p.dtype, p.kv_dtype, p.paged};
  if (spec.skip_softmax) {
    if (p.paged) {
      return "skip_softmax over a KV cache: the fused prefill skips tiles of packed k / v only";
    }
    if (p.dtype == DType::kFp8E4M3) {
      return "skip_softmax with fp8_e4m3 q: the FP8 kernel does not skip tiles";
    }
    if (spec.fused_kernel == FusedKernel::kHopper) {
      const std::string why =
          sm90_skip_reason(sm90_call(shape, spec, spec.mask.kind != MaskKind::kNone, 0), spec,
                           /*prefill_call=*/true);
      if (!why.empty()) {
        return "skip_softmax with fused_kernel 'hopper': " + why +
               " (fused_kernel 'auto' or 'portable' runs it on the portable kernel)";
      }
    }
  }
  const std::string why = unsupported(spec, shape);
  if (!why.empty() || p.dtype != DType::kFp8E4M3) return why;
  // fp8 q: the FP8 kernel's device and build needs (the tensors' strides are run_prefill's).
  return sm90_unsupported(sm90_call(shape, spec, spec.mask.kind != MaskKind::kNone, 0));
}

namespace {

// The sm90 call of a SAGE call: the Q K^T codes' dtype, the SAGE kernels (masked: causal).
Sm90Call sage_call(const AttentionSpec& spec, int device, bool masked, int forced_ctas) {
  Sm90Call call =
      sm90_call({device, spec.head_dim, spec.quant->dtype_qk, spec.quant->dtype_qk, false}, spec,
                masked, forced_ctas);
  call.sage = true;
  return call;
}

std::string sage_unsupported(const AttentionSpec& spec, DType dtype, int device, bool masked) {
  using detail::concat;
  if (dtype != DType::kBF16 && dtype != DType::kF16) {
    return concat("quant (SAGE) with ", dtype_name(dtype),
                  " inputs: the quantize pass reads bf16 or f16");
  }
  if (spec.fused_kernel == FusedKernel::kPortable) {
    return "quant (SAGE) with fused_kernel 'portable': the SAGE kernels are sm90 (Hopper) kernels";
  }
  if (spec.alibi) return "quant (SAGE) with alibi: the SAGE kernels add no position bias";
  const DeviceLimits dev = device_limits(device);
  if (!dev.ok) return concat("no CUDA device ", device, " visible");
  const std::string why = sm90_unsupported(sage_call(spec, device, masked, 0));
  return why.empty() ? "" : "quant (SAGE): " + why;
}

// The output, LSE and shape fields of a dense call's PrefillParams ([B, S, H, D] tensors), shared
// by the plain and the SAGE path.
void fill_dense_common(PrefillParams& prm, const AttentionSpec& spec, const DenseArgs& args,
                       const detail::DenseProblem& p, int block_m) {
  prm.out = args.out.data;
  prm.o_batch_stride = args.out.strides[0];
  prm.o_tok_stride = args.out.strides[1];
  prm.o_head_stride = args.out.strides[2];
  if (args.lse.defined()) {
    prm.lse = static_cast<float*>(args.lse.data);
    prm.lse_batch_stride = args.lse.strides[0];
    prm.lse_tok_stride = args.lse.strides[1];
    prm.lse_head_stride = args.lse.strides[2];
  }
  prm.seqlen_q = p.seqlen_q;
  prm.seqlen_kv = p.seqlen_kv;
  prm.batch = p.batch;
  prm.num_q_heads = spec.num_q_heads;
  prm.num_kv_heads = spec.num_kv_heads;
  prm.group_size = spec.group_size();
  fill_mods(spec, prm);
  prm.num_m_blocks = (p.seqlen_q + block_m - 1) / block_m;
}

int32_t log2_of(int32_t pow2) {
  int32_t shift = 0;
  while ((1 << shift) < pow2) ++shift;
  return shift;
}

// The quantize pass (sage_quant.cu) of qa's inputs into a per-call workspace, then the SAGE kernel
// over its codes, scales and V^T (docs/diffusion.md). prm holds the call's outputs, shape,
// sequences and schedule; the codes' pointers and strides are filled here. Packed calls (cu_seqlens
// in qa) take the codes as [total, H, D], dense ones as [B, S, H, D].
void run_sage(const AttentionSpec& spec, sage::SageQuantArgs qa, PrefillParams prm, bool masked,
              int device, int forced_ctas, cudaStream_t stream, const char* what) {
  const size_t bytes = sage::sage_workspace_bytes(qa.shape);
  StreamBuffer workspace(bytes, stream, what);
  qa.workspace = workspace.get();
  qa.workspace_bytes = bytes;
  const sage::SageQuantized codes = sage::launch_sage_quantize(qa, stream);

  const SageQuantSpec& quant = *spec.quant;
  const DType qk = quant.dtype_qk;
  const int64_t hq = spec.num_q_heads, hkv = spec.num_kv_heads, dim = spec.head_dim;
  const bool packed = qa.cu_seqlens_q != nullptr;
  const TensorView q_codes = packed
                                 ? TensorView(codes.q, qk, {qa.shape.total_q, hq, dim})
                                 : TensorView(codes.q, qk, {qa.shape.batch, qa.seqlen_q, hq, dim});
  const TensorView k_codes =
      packed ? TensorView(codes.k, qk, {qa.shape.total_kv, hkv, dim})
             : TensorView(codes.k, qk, {qa.shape.batch, qa.seqlen_kv, hkv, dim});
  prm.q = codes.q;
  prm.q_batch_stride = packed ? 0 : qa.seqlen_q * hq * dim;
  prm.q_tok_stride = hq * dim;
  prm.q_head_stride = dim;
  prm.k = codes.k;
  prm.k_batch_stride = packed ? 0 : qa.seqlen_kv * hkv * dim;
  prm.k_tok_stride = hkv * dim;
  prm.k_head_stride = dim;
  prm.v = codes.v_t;  // not read: the kernel loads V^T through its map
  prm.out_f16 = qa.input_dtype == DType::kF16;

  Sm90Call call = sage_call(spec, device, masked, forced_ctas);
  call.q = &q_codes;
  call.k = &k_codes;
  call.v_t = codes.v_t;
  call.v_t_stride = codes.v_t_stride;
  call.sage_scales.q_scale = codes.q_scale;
  call.sage_scales.k_scale = codes.k_scale;
  call.sage_scales.v_scale = codes.v_scale;
  call.sage_scales.q_scale_stride = codes.q_scale_stride;
  call.sage_scales.k_scale_stride = codes.k_scale_stride;
  call.sage_scales.q_block_shift = log2_of(quant.q_block_size);
  call.sage_scales.k_block_shift = log2_of(quant.k_block_size);
  run_sm90(prm, call, stream);
}

sage::SageQuantShape sage_shape(const AttentionSpec& spec, int32_t batch, int64_t total_q,
                                int64_t total_kv) {
  sage::SageQuantShape shape;
  shape.batch = batch;
  shape.total_q = total_q;
  shape.total_kv = total_kv;
  shape.num_q_heads = spec.num_q_heads;
  shape.num_kv_heads = spec.num_kv_heads;
  shape.head_dim = spec.head_dim;
  shape.quant = *spec.quant;
  return shape;
}

// A [.., tokens, H, D] input of the pass: element strides (packed: no batch stride).
sage::SageInput sage_input(const TensorView& t) {
  return t.ndim == 4 ? sage::SageInput{t.data, t.strides[0], t.strides[1], t.strides[2]}
                     : sage::SageInput{t.data, 0, t.strides[0], t.strides[1]};
}

// dense() with quant: sequence b of the pass is batch element b.
void run_dense_sage(const AttentionSpec& spec, const DenseArgs& args, const detail::DenseProblem& p,
                    void* stream, int forced_section_pairs, int forced_ctas) {
  if (p.batch == 0 || p.seqlen_q == 0) return;
  check_rows_16b(args.out, "out");
  sage::SageQuantArgs qa;
  qa.shape =
      sage_shape(spec, p.batch, int64_t{p.batch} * p.seqlen_q, int64_t{p.batch} * p.seqlen_kv);
  qa.input_dtype = p.dtype;
  qa.q = sage_input(args.q);
  qa.k = sage_input(args.k);
  qa.v = sage_input(args.v);
  qa.seqlen_q = p.seqlen_q;
  qa.seqlen_kv = p.seqlen_kv;
  qa.op = Op::kDense;
  PrefillParams prm;
  fill_dense_common(prm, spec, args, p, sm90_block_m(spec.head_dim));
  set_schedule(prm, {p.device.index, spec.head_dim, p.dtype, p.dtype, false}, PrefillTile::kSm90,
               false, false, forced_section_pairs);
  run_sage(spec, qa, prm, /*masked=*/false, p.device.index, forced_ctas, as_cuda_stream(stream),
           "dense: cudaMallocAsync of the SAGE workspace");
}

}  // namespace

std::string dense_unsupported(const AttentionSpec& spec, const detail::DenseProblem& p) {
  if (spec.skip_softmax) {
    if (spec.quant) return "skip_softmax with quant (SAGE): the SAGE kernels do not skip tiles";
    if (spec.fused_kernel == FusedKernel::kHopper) {
      const std::string why =
          sm90_skip_reason(sm90_call({p.device.index, spec.head_dim, p.dtype, p.dtype, false}, spec,
                                     /*masked=*/false, 0),
                           spec, /*prefill_call=*/false);
      if (!why.empty()) return "skip_softmax with fused_kernel 'hopper': " + why;
    }
  }
  if (spec.alibi) return "alibi: the fused dense kernel has no position encoding";
  if (spec.quant) return sage_unsupported(spec, p.dtype, p.device.index, /*masked=*/false);
  return unsupported(spec, {p.device.index, spec.head_dim, p.dtype, p.dtype, false});
}

namespace {
// `prefill_call`: a prefill call (dense calls do not pack GQA groups). A spec with skip_softmax
// is taken as skipping (its gate open).
std::string choice_name(const AttentionSpec& spec, const CallShape& shape, bool masked,
                        int32_t seqlen, bool prefill_call) {
  try {
    const Sm90Call call = sm90_call(shape, spec, masked, 0);
    const bool skip = spec.skip_softmax.has_value();
    const bool packs =
        prefill_call && !skip &&
        sm90_packs(spec.group_size(), spec.alibi, sm90_block_m(spec.head_dim), seqlen);
    const std::string sm90_reason =
        skip ? sm90_skip_reason(call, spec, prefill_call) : sm90_unsupported(call);
    return prefill_tile_name(pick_tile(shape, std::nullopt, 1, seqlen, spec.num_q_heads, masked,
                                       seqlen, packs, sm90_reason, spec.fused_kernel));
  } catch (const Error&) {
    return "";
  }
}
}  // namespace

std::string prefill_kernel_choice(const AttentionSpec& spec, const detail::PrefillProblem& p,
                                  int32_t seqlen) {
  if (!prefill_unsupported(spec, p).empty()) return "";
  if (spec.quant) return spec.quant->dtype_qk == DType::kInt8 ? "sm90 sage int8" : "sm90 sage fp8";
  return choice_name(spec, {p.device.index, spec.head_dim, p.dtype, p.kv_dtype, p.paged},
                     spec.mask.kind != MaskKind::kNone, seqlen, /*prefill_call=*/true);
}

std::string dense_kernel_choice(const AttentionSpec& spec, const detail::DenseProblem& p,
                                int32_t seqlen) {
  if (!dense_unsupported(spec, p).empty()) return "";
  if (spec.quant) return spec.quant->dtype_qk == DType::kInt8 ? "sm90 sage int8" : "sm90 sage fp8";
  return choice_name(spec, {p.device.index, spec.head_dim, p.dtype, p.dtype, false}, false, seqlen,
                     /*prefill_call=*/false);
}

void run_prefill(const AttentionSpec& spec, const PrefillArgs& args,
                 const detail::PrefillProblem& p, void* stream,
                 std::optional<PrefillTile> forced_tile, int forced_section_pairs, int forced_ctas,
                 std::optional<bool> forced_q_pack) {
  const CallShape shape{p.device.index, spec.head_dim, p.dtype, p.kv_dtype, p.paged};
  const std::string why = prefill_unsupported(spec, p);
  ATTNKIT_CHECK(why.empty(), "prefill: backend 'fused' cannot serve this call: ", why);
  int64_t* const stats = skip_stats_of(args);
  if (p.batch == 0 || p.total_q == 0 || p.max_seqlen_q == 0) {
    // No query, no tile: SkipStats of zeros.
    if (stats != nullptr) {
      check_cuda(cudaMemsetAsync(stats, 0, sizeof(SkipStats), as_cuda_stream(stream)),
                 "prefill: zeroing skip_stats");
    }
    return;
  }

  PrefillParams prm;
  check_rows_16b(args.q, "q");
  check_rows_16b(args.out, "out");
  prm.q = args.q.data;
  prm.q_tok_stride = args.q.strides[0];
  prm.q_head_stride = args.q.strides[1];
  prm.out = args.out.data;
  prm.o_tok_stride = args.out.strides[0];
  prm.o_head_stride = args.out.strides[1];
  if (args.lse.defined()) {
    prm.lse = static_cast<float*>(args.lse.data);
    prm.lse_tok_stride = args.lse.strides[0];
    prm.lse_head_stride = args.lse.strides[1];
  }
  prm.cu_seqlens_q = static_cast<const int32_t*>(args.cu_seqlens_q.data);
  // The kernels compare cu_seqlens with these extents and the paged lengths / block ids with the
  // cache's layout (num_blocks, table_cols), and record a bad value here (docs/safety.md).
  prm.total_q = static_cast<int32_t>(p.total_q);
  prm.total_kv = static_cast<int32_t>(p.total_kv);
  prm.fault = fault_site(Op::kPrefill);
  const bool quant_kv = p.paged && is_8bit(p.kv_dtype);
  if (p.paged) {
    const KvCacheView& cache = *args.kv_cache;
    const int eb = static_cast<int>(dtype_size(cache.dtype));
    ATTNKIT_CHECK(reinterpret_cast<uintptr_t>(cache.k_base) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(cache.v_base) % 16 == 0 &&
                      cache.block_stride_bytes % 16 == 0 && (cache.head_dim * eb) % 16 == 0,
                  "kv_cache: the fused prefill needs 16-byte aligned k_base, v_base, "
                  "block_stride_bytes and rows (head_dim * element size)");
    prm.paged = true;
    prm.kv = detail::make_kv_layout(cache);
    prm.kv_seq_lens = static_cast<const int32_t*>(cache.seq_lens.data);
    prm.kv_is_int8 = cache.dtype == DType::kInt8;
    if (cache.paged) {
      while ((1 << prm.kv_page_shift) < cache.tokens_per_block) ++prm.kv_page_shift;
    }
    if (cache.k_scale.defined()) {
      prm.k_scale = static_cast<const float*>(cache.k_scale.data);
      prm.k_scale_per_head = cache.k_scale.numel() > 1;
    }
    if (cache.v_scale.defined()) {
      prm.v_scale = static_cast<const float*>(cache.v_scale.data);
      prm.v_scale_per_head = cache.v_scale.numel() > 1;
    }
    prm.k_descale = descale_of(cache.k_scale, true);
    prm.v_descale = descale_of(cache.v_scale, true);
  } else {
    check_rows_16b(args.k, "k");
    check_rows_16b(args.v, "v");
    prm.k = args.k.data;
    prm.v = args.v.data;
    prm.k_tok_stride = args.k.strides[0];
    prm.k_head_stride = args.k.strides[1];
    prm.v_tok_stride = args.v.strides[0];
    prm.v_head_stride = args.v.strides[1];
    prm.cu_seqlens_kv = static_cast<const int32_t*>(args.cu_seqlens_kv.data);
    prm.k_descale = descale_of(args.k_descale, false);
    prm.v_descale = descale_of(args.v_descale, false);
  }
  prm.q_descale = descale_of(args.q_descale, false);
  prm.out_f16 = p.out_dtype == DType::kF16;
  prm.batch = p.batch;
  prm.num_q_heads = spec.num_q_heads;
  prm.num_kv_heads = spec.num_kv_heads;
  prm.group_size = spec.group_size();
  fill_mods(spec, prm);
  const bool masked = spec.mask.kind != MaskKind::kNone;
  if (spec.mask.kind == MaskKind::kSlidingWindow) {
    prm.window = spec.mask.window;
    prm.sink_tokens = spec.mask.sink_tokens;
  }
  if (spec.quant) {
    // SAGE over packed k / v under mask none or causal (validate_prefill): each sequence
    // quantized on its own, one head a work item (no GQA packing).
    ATTNKIT_CHECK(!forced_tile || *forced_tile == PrefillTile::kSm90,
                  "prefill: quant (SAGE) runs on the sm90 kernel only");
    sage::SageQuantArgs qa;
    qa.shape = sage_shape(spec, p.batch, p.total_q, p.total_kv);
    qa.input_dtype = p.dtype;
    qa.q = sage_input(args.q);
    qa.k = sage_input(args.k);
    qa.v = sage_input(args.v);
    qa.cu_seqlens_q = prm.cu_seqlens_q;
    qa.cu_seqlens_kv = prm.cu_seqlens_kv;
    qa.seqlen_q = p.max_seqlen_q;
    qa.seqlen_kv = p.max_seqlen_kv;
    qa.op = Op::kPrefill;
    const int bm = sm90_block_m(spec.head_dim);
    prm.num_m_blocks = static_cast<int32_t>((int64_t{p.max_seqlen_q} + bm - 1) / bm);
    set_schedule(prm, shape, PrefillTile::kSm90, masked, false, forced_section_pairs);
    if (stats != nullptr) {
      write_skip_stats(prm, masked, /*count_tiles=*/true, 64,
                       sm90_block_n(spec.head_dim, masked, /*fp8=*/true), stats,
                       as_cuda_stream(stream));
    }
    run_sage(spec, qa, prm, masked, p.device.index, forced_ctas, as_cuda_stream(stream),
             "prefill: cudaMallocAsync of the SAGE workspace");
    return;
  }
  Sm90Call call = sm90_call(shape, spec, masked, forced_ctas);
  call.q = &args.q;
  if (p.paged) {
    call.cache = args.kv_cache;
  } else {
    call.k = &args.k;
    call.v = &args.v;
  }
  // Skip-softmax: the sm90 kernel skips unmasked calls of one lambda; causal calls and per-sequence
  // lambdas take the portable kernel (auto and portable; a forced hopper raised above). The skip
  // tile holds one head's rows: no GQA packing.
  const SkipPolicy skip = skip_policy(spec, args.timestep, std::nullopt);
  const std::string sm90_reason =
      skip.active ? sm90_skip_reason(call, spec, /*prefill_call=*/true) : sm90_unsupported(call);
  call.skip = skip.active;
  call.skip_log2_lambda = skip.log2_lambda;
  ATTNKIT_CHECK(
      !skip.active || !forced_q_pack || !*forced_q_pack,
      "prefill: GQA packing does not combine with skip-softmax (a skip tile is one head's)");
  const PrefillTile tile = pick_tile(
      shape, forced_tile, p.batch, p.max_seqlen_q, prm.num_q_heads, masked, p.max_seqlen_kv,
      !skip.active &&
          sm90_packs(prm.group_size, prm.alibi, sm90_block_m(spec.head_dim), p.max_seqlen_q),
      sm90_reason, spec.fused_kernel);
  const int bm = prefill_block_m(tile, spec.head_dim);
  ATTNKIT_CHECK(!forced_q_pack || !*forced_q_pack || tile == PrefillTile::kSm90,
                "prefill: GQA packing is a mode of the sm90 kernel");
  if (tile == PrefillTile::kSm90) {
    prm.q_pack_log2 =
        q_pack_log2(prm, bm, p.max_seqlen_q, skip.active ? std::optional(false) : forced_q_pack);
  }
  prm.num_m_blocks = static_cast<int32_t>(
      ((static_cast<int64_t>(p.max_seqlen_q) << prm.q_pack_log2) + bm - 1) / bm);
  set_schedule(prm, shape, tile, masked, quant_kv, forced_section_pairs);
  if (skip.active) {
    prm.skip_log2_lambda = skip.log2_lambda;
    prm.skip_per_kv_len = skip.per_kv_len;
    prm.skip_counts = reinterpret_cast<unsigned long long*>(stats);
    call.skip_counts = prm.skip_counts;
  }
  // The statistics' tile: one consumer warpgroup's 64 rows of the sm90 kernel, the portable
  // kernel's CTA tile. A skipping kernel adds its counts to the zeros written here; otherwise the
  // visited tiles are counted from the device lengths.
  if (stats != nullptr) {
    write_skip_stats(
        prm, masked, /*count_tiles=*/!skip.active, tile == PrefillTile::kSm90 ? 64 : bm,
        prefill_block_n(tile, spec.head_dim, masked || skip.active), stats, as_cuda_stream(stream));
  }
  if (tile == PrefillTile::kSm90) {
    run_sm90(prm, call, as_cuda_stream(stream));
    return;
  }
  ATTNKIT_CHECK(p.batch <= 65535, "cu_seqlens_q: the fused prefill takes at most 65535 sequences, ",
                "got ", p.batch);
  ATTNKIT_CHECK(prm.num_m_blocks <= 65535, "max_seqlen_q: the fused prefill takes at most ",
                65535 * bm, " queries per sequence, got ", p.max_seqlen_q);
  const bool runs = p.paged && prm.kv.block_table != nullptr && prm.kv.window_slots == 0;
  const bool skip_dead = skips_dead_blocks(spec.head_dim, tile, masked, p.paged, p.max_seqlen_kv);
  const bool split = uses_split_warps(spec.head_dim, tile, masked, p.paged,
                                      device_limits(p.device.index).smem_optin);
  const Launcher launch = find_launcher(spec.head_dim, tile, p.dtype, masked, quant_kv, p.paged,
                                        runs, skip_dead, split, skip.active);
  ATTNKIT_CHECK(launch != nullptr, "prefill: no fused kernel for head_dim ", spec.head_dim);
  launch(prm, as_cuda_stream(stream));
}

namespace {

// The skip statistics of a fused dense call (DenseArgs::stats on the host, DenseArgs::skip_stats
// on the device). A skipping kernel adds its counts [tiles visited, tiles skipped] to device
// counters: skip_stats' own memory (zeroed first; no host synchronization) or, for host stats
// alone, a stream-ordered scratch pair that finish() copies back after synchronizing the stream.
// A call that skips nothing knows its counts on the host: {tiles_total, 0}.
class DenseSkipCounts {
 public:
  DenseSkipCounts(const DenseArgs& args, void* stream, int64_t tiles_total, bool kernel_counts)
      : args_(args), stream_(as_cuda_stream(stream)), total_(tiles_total) {
    if (!kernel_counts || (args.stats == nullptr && !args.skip_stats.defined())) return;
    if (args.skip_stats.defined()) {
      counts_ = static_cast<unsigned long long*>(args.skip_stats.data);
    } else {
      owned_.allocate(2 * sizeof(unsigned long long), stream_, "dense: skip statistics scratch");
      counts_ = static_cast<unsigned long long*>(owned_.get());
    }
    check_cuda(cudaMemsetAsync(counts_, 0, 2 * sizeof(unsigned long long), stream_),
               "dense: zeroing the skip statistics");
  }
  DenseSkipCounts(const DenseSkipCounts&) = delete;
  DenseSkipCounts& operator=(const DenseSkipCounts&) = delete;

  unsigned long long* device_counts() const { return counts_; }

  // After the launch: the statistics of tiles of block_m x block_n.
  void finish(int block_m, int block_n) {
    unsigned long long host[2] = {static_cast<unsigned long long>(total_), 0};
    if (counts_ == nullptr && args_.skip_stats.defined()) {
      int32_t words[4];
      std::memcpy(words, host, sizeof(host));
      upload_int32_async(words, 4, static_cast<int32_t*>(args_.skip_stats.data), stream_);
    }
    if (args_.stats == nullptr) return;
    if (counts_ != nullptr) {
      check_cuda(cudaMemcpyAsync(host, counts_, sizeof(host), cudaMemcpyDeviceToHost, stream_),
                 "dense: reading the skip statistics");
      check_cuda(cudaStreamSynchronize(stream_), "dense: reading the skip statistics");
    }
    args_.stats->tiles_total = static_cast<int64_t>(host[0]);
    args_.stats->tiles_skipped = static_cast<int64_t>(host[1]);
    args_.stats->block_m = block_m;
    args_.stats->block_n = block_n;
  }

 private:
  const DenseArgs& args_;
  cudaStream_t stream_;
  int64_t total_;
  unsigned long long* counts_ = nullptr;
  StreamBuffer owned_;  // counts_ when the caller gave no skip_stats
};

}  // namespace

void run_dense(const AttentionSpec& spec, const DenseArgs& args, const detail::DenseProblem& p,
               void* stream, std::optional<PrefillTile> forced_tile, int forced_section_pairs,
               int forced_ctas) {
  const std::string why = dense_unsupported(spec, p);
  ATTNKIT_CHECK(why.empty(), "dense: backend 'fused' cannot serve this call: ", why);
  // SAGE: the quantize pass and a SAGE kernel. Without keys there is nothing to quantize: the
  // plain kernel writes the zeros and -inf LSE of rows that attend no key.
  if (spec.quant && p.seqlen_kv > 0) {
    ATTNKIT_CHECK(!forced_tile || *forced_tile == PrefillTile::kSm90,
                  "dense: quant (SAGE) runs on the sm90 kernel only");
    // No tile is skipped: the statistics count every sm90 tile of the call.
    const int bn = sm90_block_n(spec.head_dim, false, true);
    const int64_t tiles = static_cast<int64_t>(p.batch) * spec.num_q_heads *
                          ((p.seqlen_q + 63) / 64) * ((p.seqlen_kv + bn - 1) / bn);
    DenseSkipCounts counts(args, stream, tiles, /*kernel_counts=*/false);
    run_dense_sage(spec, args, p, stream, forced_section_pairs, forced_ctas);
    counts.finish(64, bn);
    return;
  }
  const CallShape shape{p.device.index, spec.head_dim, p.dtype, p.dtype, false};
  Sm90Call call = sm90_call(shape, spec, /*masked=*/false, forced_ctas);
  call.q = &args.q;
  call.k = &args.k;
  call.v = &args.v;
  // Skip-softmax runs on the sm90 kernel where it serves the call, else on the portable one.
  const SkipPolicy skip_plan = skip_policy(spec, args.timestep, p.seqlen_kv);
  const bool skip = skip_plan.active;
  const std::string sm90_reason =
      skip ? sm90_skip_reason(call, spec, /*prefill_call=*/false) : sm90_unsupported(call);
  call.skip = skip;
  call.skip_log2_lambda = skip_plan.log2_lambda;
  const PrefillTile tile =
      pick_tile(shape, forced_tile, p.batch, p.seqlen_q, spec.num_q_heads,
                /*masked=*/false, p.seqlen_kv, /*packs=*/false, sm90_reason, spec.fused_kernel);
  const int bm = prefill_block_m(tile, spec.head_dim);
  // The tiles the statistics count: the skip tile of the sm90 kernel is one consumer warpgroup's
  // 64 rows; the portable kernel's is its CTA tile.
  const int stats_bm = tile == PrefillTile::kSm90 ? 64 : bm;
  // (The sm90 skip kernels take the masked calls' narrower key tiles.)
  const int stats_bn = prefill_block_n(tile, spec.head_dim, /*masked=*/skip);
  const int64_t tiles_total = static_cast<int64_t>(p.batch) * spec.num_q_heads *
                              ((p.seqlen_q + stats_bm - 1) / stats_bm) *
                              ((p.seqlen_kv + stats_bn - 1) / stats_bn);
  DenseSkipCounts counts(args, stream, tiles_total, skip && p.seqlen_q > 0);
  call.skip_counts = counts.device_counts();
  if (p.batch == 0 || p.seqlen_q == 0) {
    counts.finish(stats_bm, stats_bn);
    return;
  }
  ATTNKIT_CHECK(tile == PrefillTile::kSm90 || p.batch <= 65535,
                "q: the fused dense kernel takes at most 65535 batch entries, got ", p.batch);

  PrefillParams prm;
  check_rows_16b(args.q, "q");
  check_rows_16b(args.k, "k");
  check_rows_16b(args.v, "v");
  check_rows_16b(args.out, "out");
  prm.q = args.q.data;
  prm.q_batch_stride = args.q.strides[0];
  prm.q_tok_stride = args.q.strides[1];
  prm.q_head_stride = args.q.strides[2];
  prm.k = args.k.data;
  prm.v = args.v.data;
  prm.k_batch_stride = args.k.strides[0];
  prm.k_tok_stride = args.k.strides[1];
  prm.k_head_stride = args.k.strides[2];
  prm.v_batch_stride = args.v.strides[0];
  prm.v_tok_stride = args.v.strides[1];
  prm.v_head_stride = args.v.strides[2];
  fill_dense_common(prm, spec, args, p, bm);
  set_schedule(prm, shape, tile, false, false, forced_section_pairs);
  if (tile == PrefillTile::kSm90) {
    run_sm90(prm, call, as_cuda_stream(stream));
    counts.finish(stats_bm, stats_bn);
    return;
  }
  prm.skip_log2_lambda = skip_plan.log2_lambda;
  prm.skip_counts = counts.device_counts();
  ATTNKIT_CHECK(prm.num_m_blocks <= 65535, "q: the fused dense kernel takes at most ", 65535 * bm,
                " queries per sequence, got ", p.seqlen_q);
  const bool split = !skip && uses_split_warps(spec.head_dim, tile, false, false,
                                               device_limits(p.device.index).smem_optin);
  const Launcher launch =
      find_launcher(spec.head_dim, tile, p.dtype, false, false, false, false, false, split, skip);
  ATTNKIT_CHECK(launch != nullptr, "dense: no fused kernel for head_dim ", spec.head_dim);
  launch(prm, as_cuda_stream(stream));
  counts.finish(stats_bm, stats_bn);
}

}  // namespace attnkit::cuda::prefill
