// EXPERIMENT (dec11, removed before merge): the 8-bit head_dim 128 variants of ATTNKIT_EXP_DEC11
// at 2 CTAs per SM, in an object of their own so that they compile in parallel.
#include "cuda/decode/decode_dispatch.cuh"

namespace attnkit::cuda::decode_detail {

template <typename QTag, typename Kv, int kCtas>
bool launch_dec11(const DecodeParams& p, dim3 grid, cudaStream_t stream) {
  auto run = [&](auto exp) {
    using T = DecodeTraits<128, QTag, Kv, 8, kCtas, DecodePipe::kSwizzledHalves, 32,
                           decltype(exp)::value>;
    launch_kernel_instance<T, DecodeLogits::kPlain>(p, grid, stream);
    return true;
  };
  switch (decode_exp_dec11()) {
    case 1:
      return run(std::integral_constant<int, 1>{});
    case 2:
      return run(std::integral_constant<int, 2>{});
    case 3:
      return run(std::integral_constant<int, 3>{});
    case 6:
      return run(std::integral_constant<int, 6>{});
    case 10:  // 14 units of 8 KB with or without the combine's word: quarters
      return run(std::integral_constant<int, 2>{});
  }
  return false;
}

template bool launch_dec11<Bf16Tag, KvFp8E4M3, 2>(const DecodeParams&, dim3, cudaStream_t);
template bool launch_dec11<Bf16Tag, KvInt8, 2>(const DecodeParams&, dim3, cudaStream_t);
template bool launch_dec11<F16Tag, KvFp8E4M3, 2>(const DecodeParams&, dim3, cudaStream_t);
template bool launch_dec11<F16Tag, KvInt8, 2>(const DecodeParams&, dim3, cudaStream_t);

}  // namespace attnkit::cuda::decode_detail
