// Reference append_kv: bias, RoPE (in double, src/core/rope.h), K/V written into the cache with
// stored = round(float(x) / scale), rotated Q to q_out. The biased and rotated values are kept
// in double and rounded once, to the destination dtype.
#include <vector>

#include "core/rope.h"
#include "reference/ref_common.h"
#include "reference/reference.h"

namespace attnkit::reference {
namespace internal {
namespace {

enum Section : int32_t { kQ = 0, kK = 1, kV = 2 };

// One head of the fused or separate input, plus its bias, as doubles.
class QkvInput {
 public:
  QkvInput(const AttentionSpec& spec, const AppendKvArgs& args)
      : args_(args), hq_(spec.num_q_heads), hkv_(spec.num_kv_heads), d_(spec.head_dim) {}

  void load(int64_t token, Section section, int32_t head, double* out) const {
    const int32_t first_head = section == kQ ? 0 : section == kK ? hq_ : hq_ + hkv_;
    const int64_t column0 = static_cast<int64_t>(first_head + head) * d_;
    if (args_.qkv.defined()) {
      const TensorView& t = args_.qkv;
      for (int32_t d = 0; d < d_; ++d) {
        out[d] = detail::load_as_float(t.data, t.dtype, detail::offset_of(t, {token, column0 + d}));
      }
    } else {
      load_head(section == kQ ? args_.q : section == kK ? args_.k : args_.v, token, head, out);
    }
    if (args_.qkv_bias.defined()) {
      const TensorView& b = args_.qkv_bias;
      for (int32_t d = 0; d < d_; ++d) {
        out[d] += detail::load_as_float(b.data, b.dtype, (column0 + d) * b.strides[0]);
      }
    }
  }

 private:
  const AppendKvArgs& args_;
  int32_t hq_, hkv_, d_;
};

// Writes x / scale rounded to the cache dtype (fp8 / int8 saturate).
void store_cache_head(uint8_t* ptr, DType dtype, float scale, const double* x, int32_t head_dim) {
  for (int32_t d = 0; d < head_dim; ++d) {
    const float value = static_cast<float>(x[d]);
    switch (dtype) {
      case DType::kFp8E4M3:
        ptr[d] = numerics::quantize_fp8_e4m3(value, scale);
        break;
      case DType::kInt8:
        reinterpret_cast<int8_t*>(ptr)[d] = numerics::quantize_int8(value, scale);
        break;
      default:
        detail::store_from_float(ptr, dtype, d, value / scale);
        break;
    }
  }
}

}  // namespace

void append_kv_impl(const AttentionSpec& spec, const AppendKvArgs& args) {
  const detail::RopeParams rope = detail::make_rope_params(spec);
  const detail::KvLayout layout = detail::make_kv_layout(args.kv_cache);
  const KvCacheView& cache = args.kv_cache;
  const QkvInput input(spec, args);
  const int32_t head_dim = spec.head_dim;
  const int64_t num_tokens = args.positions.shape[0];
  std::vector<double> x(static_cast<size_t>(head_dim));

  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t position = index_at(args.positions, t);
    const int64_t row = index_at(args.row_of_token, t);
    for (int32_t h = 0; h < spec.num_q_heads; ++h) {
      input.load(t, kQ, h, x.data());
      detail::rope_rotate_head<double>(rope, position, x.data());
      store_row(args.q_out, TensorView(), t, h, x.data(), 0.0);
    }
    for (int32_t h = 0; h < spec.num_kv_heads; ++h) {
      input.load(t, kK, h, x.data());
      detail::rope_rotate_head<double>(rope, position, x.data());
      store_cache_head(layout.k_ptr(row, position, h), cache.dtype, kv_scale(cache.k_scale, h),
                       x.data(), head_dim);
      input.load(t, kV, h, x.data());
      store_cache_head(layout.v_ptr(row, position, h), cache.dtype, kv_scale(cache.v_scale, h),
                       x.data(), head_dim);
    }
  }
}

}  // namespace internal

void append_kv(const AttentionSpec& spec, const AppendKvArgs& args,
               const detail::AppendKvProblem&) {
  internal::append_kv_impl(spec, args);
}

}  // namespace attnkit::reference
