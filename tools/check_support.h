// Host/device tensors and targets for `attnkit check` and the benchmarks.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attnkit.h"

namespace attnkit::tools {

// The name the program prints for a backend on a device (info, check, replay): "reference" on the
// CPU, whatever backend was asked for (host tensors run on the reference under "auto" and
// "vanilla"), the backend's name on a CUDA device.
std::string backend_label(const Device& device, Backend backend);

struct Target {
  Device device;
  Backend backend;
  std::string label() const;  // "reference", "cuda:0 vanilla", "cuda:0 fused"
};

// A host tensor with an optional device mirror (allocated on first use of a CUDA device).
class Tensor {
 public:
  Tensor() = default;
  Tensor(DType dtype, std::vector<int64_t> shape);
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  Tensor(Tensor&& other) noexcept;
  Tensor& operator=(Tensor&& other) noexcept;
  ~Tensor();

  DType dtype() const { return view_.dtype; }
  int64_t numel() const { return view_.numel(); }
  float get(int64_t i) const;
  void set(int64_t i, float value);
  void fill(float value);
  void fill_uniform(std::mt19937_64& rng, float lo, float hi);
  int32_t* ints() { return static_cast<int32_t*>(view_.data); }

  // The view on `device`: the host data, or a device copy uploaded now.
  TensorView on(const Device& device);
  // Values as double, read from `device` (downloaded from the device copy for CUDA).
  std::vector<double> read(const Device& device);

 private:
  std::vector<uint8_t> host_;
  TensorView view_;
  void* device_data_ = nullptr;
  int device_ordinal_ = -1;
};

// One randomized case of `attnkit check`: `run` executes the op on a target and returns its
// output (on the CPU target that is the reference itself); `cpu_oracle` gives an independent
// answer on the CPU (a brute force or an equivalent call).
struct Case {
  std::string name;
  DType dtype;
  std::function<std::vector<double>(const Target&)> run;
  std::function<std::vector<double>()> cpu_oracle;
};
std::vector<Case> make_cases(uint64_t seed);  // check_cases.cc

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b);
void synchronize(const Device& device);

}  // namespace attnkit::tools
