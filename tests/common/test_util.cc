#include "common/test_util.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "core/element.h"

namespace attnkit::test {

HostTensor::HostTensor(DType dtype, std::initializer_list<int64_t> shape)
    : HostTensor(dtype, std::vector<int64_t>(shape)) {}

HostTensor::HostTensor(DType dtype, const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  storage_.assign(static_cast<size_t>(n) * dtype_size(dtype) + 16, 0);
  view_.data = storage_.data();
  view_.dtype = dtype;
  view_.ndim = static_cast<int>(shape.size());
  int64_t stride = 1;
  for (int d = view_.ndim - 1; d >= 0; --d) {
    view_.shape[d] = shape[d];
    view_.strides[d] = stride;
    stride *= shape[d];
  }
}

HostTensor::HostTensor(const HostTensor& other) : storage_(other.storage_), view_(other.view_) {
  if (view_.data) view_.data = storage_.data();
}

HostTensor& HostTensor::operator=(const HostTensor& other) {
  if (this != &other) {
    storage_ = other.storage_;
    view_ = other.view_;
    if (view_.data) view_.data = storage_.data();
  }
  return *this;
}

float HostTensor::get(int64_t flat) const {
  return detail::load_as_float(view_.data, view_.dtype, flat);
}
void HostTensor::set(int64_t flat, float value) {
  detail::store_from_float(view_.data, view_.dtype, flat, value);
}

std::vector<double> HostTensor::to_double() const {
  std::vector<double> out(static_cast<size_t>(numel()));
  for (int64_t i = 0; i < numel(); ++i) out[i] = get(i);
  return out;
}

void HostTensor::fill(float value) {
  for (int64_t i = 0; i < numel(); ++i) set(i, value);
}

void HostTensor::fill_uniform(std::mt19937_64& rng, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  for (int64_t i = 0; i < numel(); ++i) set(i, dist(rng));
}

uint64_t test_seed() {
  static const uint64_t seed = []() -> uint64_t {
    if (const char* env = std::getenv("ATTNKIT_TEST_SEED")) return std::strtoull(env, nullptr, 10);
    const uint64_t s = std::random_device{}();
    std::fprintf(stderr, "[attnkit] test seed %llu (set ATTNKIT_TEST_SEED to replay)\n",
                 static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

bool small_test_scale() {
  static const bool small = [] {
    const char* env = std::getenv("ATTNKIT_TEST_SCALE");
    const std::string value = env != nullptr ? env : "";
    if (value.empty() || value == "full") return false;
    if (value == "small") {
      std::fprintf(stderr, "[attnkit] ATTNKIT_TEST_SCALE=small: large cases run scaled down\n");
      return true;
    }
    std::fprintf(stderr, "ATTNKIT_TEST_SCALE: accepted full (or unset) and small, got '%s'\n", env);
    std::exit(2);
  }();
  return small;
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0.0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double d = std::fabs(a[i] - b[i]);
    if (std::isnan(d)) return INFINITY;
    m = std::max(m, d);
  }
  return a.size() == b.size() ? m : INFINITY;
}

bool any_nan(const std::vector<double>& a) {
  for (double x : a) {
    if (std::isnan(x)) return true;
  }
  return false;
}

ProgramResult run_program(const std::string& program, const std::string& args) {
  // Outputs go to files named after the process and a counter: tests run in parallel processes.
  static int runs = 0;
  const std::string stem =
      (std::filesystem::temp_directory_path() /
       ("attnkit_run_" + std::to_string(::getpid()) + "_" + std::to_string(runs++)))
          .string();
  const std::string out_path = stem + ".out", err_path = stem + ".err";
  const std::string command =
      "'" + program + "' " + args + " >'" + out_path + "' 2>'" + err_path + "'";
  const int raw = std::system(command.c_str());
  ProgramResult result;
  result.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  auto slurp = [](const std::string& path) {
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  };
  result.out = slurp(out_path);
  result.err = slurp(err_path);
  std::filesystem::remove(out_path);
  std::filesystem::remove(err_path);
  return result;
}

}  // namespace attnkit::test
