// The CUDA half of the replay engine (replay_device.cu): the synthetic activations generated on
// the device, bit-identical to the host's (replay_activations.h). Only in CUDA builds.
#pragma once

#include <cstdint>

namespace attnkit::tools {

/// Widest activation row the kernel takes: the base row is staged in shared memory.
constexpr int64_t kMaxDeviceActivationWidth = 96 * 1024;

/// Enqueues on `stream` (a cudaStream_t) the activations of `num_tokens` tokens for `layers`
/// layers: out[l][t][i] = replay_act::layer_element(row_key(seed_key, tokens[t], positions[t]),
/// l, width, i), bf16 bits. tokens, positions (int32 [num_tokens]) and out (uint16 [layers,
/// num_tokens, width]) are device memory. Throws attnkit::Error when the launch fails or width
/// is outside [1, kMaxDeviceActivationWidth].
void generate_activations_cuda(const int32_t* tokens, const int32_t* positions, int64_t num_tokens,
                               int32_t layers, int64_t width, uint64_t seed_key, uint16_t* out,
                               void* stream);

}  // namespace attnkit::tools
