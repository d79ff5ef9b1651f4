// Test helpers: owning host tensors, random fills, and comparisons.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "attnkit/kv_cache.h"
#include "attnkit/types.h"

namespace attnkit::test {

// An owning, contiguous host tensor.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::initializer_list<int64_t> shape);
  HostTensor(DType dtype, const std::vector<int64_t>& shape);
  // Copies own their storage (the view points at the copy's bytes); moves keep the buffer.
  HostTensor(const HostTensor& other);
  HostTensor& operator=(const HostTensor& other);
  HostTensor(HostTensor&&) noexcept = default;
  HostTensor& operator=(HostTensor&&) noexcept = default;

  TensorView view() const { return view_; }
  operator TensorView() const { return view_; }  // NOLINT: convenient in argument structs
  int64_t numel() const { return view_.numel(); }
  DType dtype() const { return view_.dtype; }

  float get(int64_t flat) const;        // element as float
  void set(int64_t flat, float value);  // rounded to the dtype
  template <typename T>
  T* data() const {
    return static_cast<T*>(view_.data);
  }
  std::vector<double> to_double() const;
  void fill(float value);                                       // e.g. NaN poison
  void fill_uniform(std::mt19937_64& rng, float lo, float hi);  // rounded to the dtype
  const std::vector<uint8_t>& bytes() const { return storage_; }

 private:
  std::vector<uint8_t> storage_;
  TensorView view_;
};

// The cache layouts the cache tests run over.
inline constexpr KvCacheLayout kBothLayouts[] = {KvCacheLayout::kHND, KvCacheLayout::kNHD};
inline KvCacheLayout other_layout(KvCacheLayout layout) {
  return layout == KvCacheLayout::kHND ? KvCacheLayout::kNHD : KvCacheLayout::kHND;
}

// A fresh seed per test run (printed so a failure can be replayed with ATTNKIT_TEST_SEED).
uint64_t test_seed();

// ATTNKIT_TEST_SCALE: unset or "full" runs every case at its full size; "small" runs the large
// cases of the gpu suite (long sequences, big batches, many repeated calls) scaled down for
// compute-sanitizer (scripts/gpu_sanitize.sh), each keeping every kernel choice, tile and stage
// boundary and fault path of its full size (the tests say what each keeps). Any other value
// stops the test program with a message.
bool small_test_scale();

// `full`, or `small` under ATTNKIT_TEST_SCALE=small.
template <typename T>
T at_test_scale(T full, T small) {
  return small_test_scale() ? small : full;
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b);
bool any_nan(const std::vector<double>& a);

// A program run through the shell: `program` (quoted here) followed by `args` (shell syntax,
// redirections included); its exit status (-1 when it did not exit) and both outputs.
struct ProgramResult {
  int status = -1;
  std::string out, err;
};
ProgramResult run_program(const std::string& program, const std::string& args);

}  // namespace attnkit::test
