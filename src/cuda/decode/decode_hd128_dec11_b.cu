// EXPERIMENT (dec11, removed before merge): 8-bit head_dim 128 variants of ATTNKIT_EXP_DEC11
// (64 80 81 at 4 CTAs per SM), in an object of their own so that they compile in parallel.
#include "cuda/decode/decode_dispatch.cuh"

namespace attnkit::cuda::decode_detail {

template <typename QTag, typename Kv, int kCtas, int kExp>
void launch_dec11_exp(const DecodeParams& p, dim3 grid, cudaStream_t stream) {
  using T = DecodeTraits<128, QTag, Kv, 8, kCtas, DecodePipe::kSwizzledHalves,
                         decode_default_keys_per_warp(128, Kv::kBytes, 8), kExp>;
  launch_kernel_instance<T, DecodeLogits::kPlain>(p, grid, stream);
}

template void launch_dec11_exp<Bf16Tag, KvFp8E4M3, 4, 64>(const DecodeParams&, dim3, cudaStream_t);
template void launch_dec11_exp<Bf16Tag, KvInt8, 4, 64>(const DecodeParams&, dim3, cudaStream_t);
template void launch_dec11_exp<F16Tag, KvFp8E4M3, 4, 64>(const DecodeParams&, dim3, cudaStream_t);
template void launch_dec11_exp<F16Tag, KvInt8, 4, 64>(const DecodeParams&, dim3, cudaStream_t);
template void launch_dec11_exp<Bf16Tag, KvFp8E4M3, 4, 80>(const DecodeParams&, dim3, cudaStream_t);
template void launch_dec11_exp<Bf16Tag, KvInt8, 4, 80>(const DecodeParams&, dim3, cudaStream_t);
template void launch_dec11_exp<F16Tag, KvFp8E4M3, 4, 80>(const DecodeParams&, dim3, cudaStream_t);
template void launch_dec11_exp<F16Tag, KvInt8, 4, 80>(const DecodeParams&, dim3, cudaStream_t);
template void launch_dec11_exp<Bf16Tag, KvFp8E4M3, 4, 81>(const DecodeParams&, dim3, cudaStream_t);
template void launch_dec11_exp<Bf16Tag, KvInt8, 4, 81>(const DecodeParams&, dim3, cudaStream_t);
template void launch_dec11_exp<F16Tag, KvFp8E4M3, 4, 81>(const DecodeParams&, dim3, cudaStream_t);
template void launch_dec11_exp<F16Tag, KvInt8, 4, 81>(const DecodeParams&, dim3, cudaStream_t);

}  // namespace attnkit::cuda::decode_detail
