// The synthetic QKV activations of `attnkit replay` (docs/replay.md): one function of (token id,
// position, layer, seed) that the host engine (replay_engine.cc) and the CUDA kernel
// (replay_device.cu) both call, so a GPU replay generates its activations on the device with the
// same bits as the host (ReplayGpu.DeviceActivationsMatchHostBits tests it).
//
// Why the bits agree: the hash is integer arithmetic; 2u - 1 is exact in double (u is a multiple
// of 2^-53 in [0, 1)); the conversions to float and then to bf16 round to nearest even on both
// sides (IEEE casts, numerics::float_to_bf16_bits). No transcendental or fused operation whose
// rounding could differ between compilers is involved.
#pragma once

#include <cstdint>

#include "core/numerics.h"

namespace attnkit::tools::replay_act {

// splitmix64's finalizer.
ATTNKIT_HD uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

ATTNKIT_HD uint64_t seed_key(uint64_t seed) { return mix64(seed); }

// The key of one token's base row.
ATTNKIT_HD uint64_t row_key(uint64_t seed_key, int32_t token, int32_t position) {
  return mix64(seed_key ^ mix64((static_cast<uint64_t>(static_cast<uint32_t>(token)) << 32) |
                                static_cast<uint32_t>(position)));
}

// Element `index` of a base row: bf16 bits of a value uniform in [-1, 1).
ATTNKIT_HD uint16_t base_element(uint64_t row_key, int64_t index) {
  const double u =
      static_cast<double>(mix64(row_key + static_cast<uint64_t>(index)) >> 11) * 0x1.0p-53;
  return numerics::float_to_bf16_bits(static_cast<float>(2.0 * u - 1.0));
}

// Layer `layer`'s row is the base row rotated left by this many elements: one hash per element
// of a token, not per layer.
ATTNKIT_HD int64_t layer_shift(int32_t layer, int64_t width) {
  return (static_cast<int64_t>(layer) * 97) % width;
}

// Element `index` of layer `layer`'s row (width = (Hq + 2 Hkv) D).
ATTNKIT_HD uint16_t layer_element(uint64_t row_key, int32_t layer, int64_t width, int64_t index) {
  int64_t j = index + layer_shift(layer, width);
  if (j >= width) j -= width;
  return base_element(row_key, j);
}

}  // namespace attnkit::tools::replay_act
