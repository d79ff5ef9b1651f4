#include "check_support.h"

#include <cmath>
#include <cstring>
#include <utility>

#include "core/check.h"
#include "core/element.h"

#if defined(ATTNKIT_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace attnkit::tools {

std::string backend_label(const Device& device, Backend backend) {
  return device.is_cpu() ? "reference" : backend_name(backend);
}

std::string Target::label() const {
  if (device.is_cpu()) return backend_label(device, backend);
  return device.str() + " " + backend_label(device, backend);
}

Tensor::Tensor(DType dtype, std::vector<int64_t> shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  host_.assign(static_cast<size_t>(n) * dtype_size(dtype) + 16, 0);
  view_.data = host_.data();
  view_.dtype = dtype;
  view_.ndim = static_cast<int>(shape.size());
  int64_t stride = 1;
  for (int d = view_.ndim - 1; d >= 0; --d) {
    view_.shape[d] = shape[d];
    view_.strides[d] = stride;
    stride *= shape[d];
  }
}

Tensor::Tensor(Tensor&& other) noexcept { *this = std::move(other); }

Tensor& Tensor::operator=(Tensor&& other) noexcept {
  std::swap(host_, other.host_);
  std::swap(view_, other.view_);
  std::swap(device_data_, other.device_data_);
  std::swap(device_ordinal_, other.device_ordinal_);
  return *this;
}

Tensor::~Tensor() {
#if defined(ATTNKIT_WITH_CUDA)
  if (device_data_) cudaFree(device_data_);
#endif
}

float Tensor::get(int64_t i) const { return detail::load_as_float(view_.data, view_.dtype, i); }
void Tensor::set(int64_t i, float value) {
  detail::store_from_float(view_.data, view_.dtype, i, value);
}
void Tensor::fill(float value) {
  for (int64_t i = 0; i < numel(); ++i) set(i, value);
}
void Tensor::fill_uniform(std::mt19937_64& rng, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  for (int64_t i = 0; i < numel(); ++i) set(i, dist(rng));
}

TensorView Tensor::on(const Device& device) {
  if (device.is_cpu()) return view_;
#if defined(ATTNKIT_WITH_CUDA)
  const size_t bytes = host_.size();
  if (!device_data_) {
    cudaSetDevice(device.index);
    ATTNKIT_CHECK(cudaMalloc(&device_data_, bytes) == cudaSuccess, "check: cudaMalloc of ", bytes,
                  " bytes failed");
    device_ordinal_ = device.index;
  }
  ATTNKIT_CHECK(
      cudaMemcpy(device_data_, host_.data(), bytes, cudaMemcpyHostToDevice) == cudaSuccess,
      "check: upload failed");
  TensorView view = view_;
  view.data = device_data_;
  view.device = device;
  return view;
#else
  detail::fail("check: built without CUDA");
#endif
}

std::vector<double> Tensor::read(const Device& device) {
#if defined(ATTNKIT_WITH_CUDA)
  if (device.is_cuda()) {
    ATTNKIT_CHECK(device_data_ != nullptr, "check: tensor has no device copy");
    ATTNKIT_CHECK(
        cudaMemcpy(host_.data(), device_data_, host_.size(), cudaMemcpyDeviceToHost) == cudaSuccess,
        "check: download failed: ", cudaGetErrorString(cudaGetLastError()));
  }
#endif
  (void)device;
  std::vector<double> out(static_cast<size_t>(numel()));
  for (int64_t i = 0; i < numel(); ++i) out[i] = get(i);
  return out;
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return INFINITY;
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(a[i] - b[i]);
    if (std::isnan(d)) return INFINITY;
    m = std::max(m, d);
  }
  return m;
}

void synchronize(const Device& device) {
#if defined(ATTNKIT_WITH_CUDA)
  if (device.is_cuda()) {
    const cudaError_t status = cudaDeviceSynchronize();
    ATTNKIT_CHECK(status == cudaSuccess, "check: CUDA error: ", cudaGetErrorString(status));
  }
#endif
  (void)device;
}

}  // namespace attnkit::tools
