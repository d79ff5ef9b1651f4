// Basic value types of the public API: element types, devices, non-owning tensor views, errors.
// Host-only: no CUDA types, usable from any C++20 compiler.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>

namespace attnkit {

// Every public entry point reports invalid input and unsupported requests with this exception.
// The message names the argument, the accepted values and the value that was given.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

enum class DType : uint8_t { kF32, kF16, kBF16, kFp8E4M3, kInt8, kInt32, kInt64 };

// Bytes per element.
size_t dtype_size(DType dtype);
// Lower-case name used in messages and JSON: "f32", "f16", "bf16", "fp8_e4m3", "int8", ...
const char* dtype_name(DType dtype);

enum class DeviceType : uint8_t { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;  // CUDA ordinal; 0 for the CPU

  static Device cpu() { return {DeviceType::kCPU, 0}; }
  static Device cuda(int ordinal = 0) { return {DeviceType::kCUDA, ordinal}; }
  bool is_cpu() const { return type == DeviceType::kCPU; }
  bool is_cuda() const { return type == DeviceType::kCUDA; }
  bool operator==(const Device&) const = default;
  std::string str() const;  // "cpu" or "cuda:N"
};

// A non-owning view of a strided tensor. Shapes and strides are in elements (not bytes).
// A default-constructed view (data == nullptr, ndim == 0) means "not given" for optional
// arguments.
struct TensorView {
  static constexpr int kMaxDims = 6;

  void* data = nullptr;
  DType dtype = DType::kF32;
  Device device{};
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};

  TensorView() = default;
  // Row-major contiguous view.
  TensorView(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device = {});
  // Explicit strides (in elements).
  TensorView(void* data, DType dtype, std::initializer_list<int64_t> shape,
             std::initializer_list<int64_t> strides, Device device = {});

  bool defined() const { return data != nullptr || ndim > 0; }
  // Throws Error when ndim is outside [0, kMaxDims] or the count overflows int64.
  int64_t numel() const;
  bool is_contiguous() const;  // row-major with no gaps (false for an ndim outside the view)
  int64_t size(int dim) const { return shape[dim < 0 ? dim + ndim : dim]; }
  std::string shape_str() const;  // "[2, 3, 4]"; "[ndim 9]" for an ndim outside [0, kMaxDims]

  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
};

}  // namespace attnkit
