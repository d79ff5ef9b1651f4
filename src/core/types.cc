#include "attnkit/types.h"

#include <sstream>

#include "attnkit/kv_cache.h"
#include "core/check.h"

namespace attnkit {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 4;
    case DType::kF16:
      return 2;
    case DType::kBF16:
      return 2;
    case DType::kFp8E4M3:
      return 1;
    case DType::kInt8:
      return 1;
    case DType::kInt32:
      return 4;
    case DType::kInt64:
      return 8;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
    case DType::kFp8E4M3:
      return "fp8_e4m3";
    case DType::kInt8:
      return "int8";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
  }
  return "?";
}

const char* kv_layout_name(KvCacheLayout layout) {
  switch (layout) {
    case KvCacheLayout::kHND:
      return "HND";
    case KvCacheLayout::kNHD:
      return "NHD";
  }
  return "unknown";
}

std::string Device::str() const {
  return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(index);
}

TensorView::TensorView(void* data_, DType dtype_, std::initializer_list<int64_t> shape_,
                       Device device_)
    : data(data_), dtype(dtype_), device(device_), ndim(static_cast<int>(shape_.size())) {
  ATTNKIT_CHECK(shape_.size() <= kMaxDims, "TensorView: at most ", kMaxDims,
                " dimensions are accepted, got ", shape_.size());
  int i = 0;
  for (int64_t extent : shape_) shape[i++] = extent;
  // Wrapping products: a shape whose element count overflows int64 is rejected by numel() and
  // the validation, its strides are never used.
  uint64_t stride = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    strides[d] = static_cast<int64_t>(stride);
    stride *= static_cast<uint64_t>(shape[d]);
  }
}

TensorView::TensorView(void* data_, DType dtype_, std::initializer_list<int64_t> shape_,
                       std::initializer_list<int64_t> strides_, Device device_)
    : TensorView(data_, dtype_, shape_, device_) {
  ATTNKIT_CHECK(strides_.size() == shape_.size(), "TensorView: ", shape_.size(),
                " dimensions need as many strides, got ", strides_.size());
  int i = 0;
  for (int64_t stride : strides_) strides[i++] = stride;
}

int64_t TensorView::numel() const {
  ATTNKIT_CHECK(ndim >= 0 && ndim <= kMaxDims, "TensorView: ndim must be in [0, ", kMaxDims,
                "], got ", ndim);
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) {
    ATTNKIT_CHECK(!__builtin_mul_overflow(n, shape[d], &n), "TensorView: shape ", shape_str(),
                  " has more elements than int64 holds");
  }
  return n;
}

bool TensorView::is_contiguous() const {
  if (ndim < 0 || ndim > kMaxDims) return false;
  int64_t expected = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

std::string TensorView::shape_str() const {
  std::ostringstream out;
  if (ndim < 0 || ndim > kMaxDims) {
    out << "[ndim " << ndim << ']';
    return out.str();
  }
  out << '[';
  for (int d = 0; d < ndim; ++d) out << (d ? ", " : "") << shape[d];
  out << ']';
  return out.str();
}

}  // namespace attnkit
