// The replay's activations on the device (replay_device.h). One CTA per token (grid-stride): its
// base row is hashed once into shared memory, then written out rotated for every layer, so the
// work is one hash per element of a token and the stores of all layers are coalesced.
#include <cuda_runtime.h>

#include <algorithm>

#include "core/check.h"
#include "replay_activations.h"
#include "replay_device.h"

namespace attnkit::tools {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 16384;

struct ActivationParams {
  const int32_t* tokens;
  const int32_t* positions;
  uint16_t* out;
  int64_t num_tokens;
  int64_t width;
  uint64_t seed_key;
  int32_t layers;
};

__global__ void activations_kernel(const __grid_constant__ ActivationParams p) {
  extern __shared__ uint16_t base[];
  for (int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    const uint64_t key = replay_act::row_key(p.seed_key, p.tokens[t], p.positions[t]);
    for (int64_t i = threadIdx.x; i < p.width; i += blockDim.x) {
      base[i] = replay_act::base_element(key, i);
    }
    __syncthreads();
    for (int32_t l = 0; l < p.layers; ++l) {
      const int64_t shift = replay_act::layer_shift(l, p.width);
      uint16_t* row = p.out + (static_cast<int64_t>(l) * p.num_tokens + t) * p.width;
      for (int64_t i = threadIdx.x; i < p.width; i += blockDim.x) {
        const int64_t j = i + shift;
        row[i] = base[j >= p.width ? j - p.width : j];
      }
    }
    __syncthreads();  // the next token overwrites base
  }
}

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    detail::fail("replay: ", what, " failed: ", cudaGetErrorString(status));
}

}  // namespace

void generate_activations_cuda(const int32_t* tokens, const int32_t* positions, int64_t num_tokens,
                               int32_t layers, int64_t width, uint64_t seed_key, uint16_t* out,
                               void* stream) {
  ATTNKIT_CHECK(width >= 1 && width <= kMaxDeviceActivationWidth,
                "replay: an activation row of (Hq + 2 Hkv) * D = ", width,
                " elements is outside what the device generator takes (1 .. ",
                kMaxDeviceActivationWidth, ")");
  if (num_tokens <= 0 || layers <= 0) return;
  const size_t smem = static_cast<size_t>(width) * sizeof(uint16_t);
  if (smem > 48 * 1024) {
    check(cudaFuncSetAttribute(activations_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(smem)),
          "cudaFuncSetAttribute (activation kernel shared memory)");
  }
  const ActivationParams params{tokens, positions, out, num_tokens, width, seed_key, layers};
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(num_tokens, kMaxBlocks));
  activations_kernel<<<blocks, kThreads, smem, static_cast<cudaStream_t>(stream)>>>(params);
  check(cudaGetLastError(), "the activation kernel's launch");
}

}  // namespace attnkit::tools
