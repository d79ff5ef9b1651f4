// GPU test helpers: device copies of HostTensors and of paged caches, guarded device buffers, the
// skip-without-GPU guard, CUDA error checks.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "attnkit/kv_cache.h"
#include "common/test_util.h"

#define ATTNKIT_CUDA_OK(expr)                                                        \
  do {                                                                               \
    const cudaError_t status_ = (expr);                                              \
    ASSERT_EQ(status_, cudaSuccess) << #expr << ": " << cudaGetErrorString(status_); \
  } while (0)

// Every gpu test starts with this: without a GPU it skips with a visible message.
#define ATTNKIT_SKIP_WITHOUT_GPU()                                            \
  do {                                                                        \
    if (!::attnkit::test::gpu_available())                                    \
      GTEST_SKIP() << "no CUDA device visible: gpu test skipped (label gpu)"; \
  } while (0)

namespace attnkit::test {

inline bool gpu_available() {
  static const bool available = [] {
    int count = 0;
    const bool ok = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
    cudaGetLastError();
    return ok;
  }();
  return available;
}

// A device copy of a HostTensor with the same dtype, shape and strides (contiguous). The
// allocation holds 16 bytes past the tensor that are never written: memcheck does not see a read
// of them, initcheck reports it (a kernel reading past its tensor's end).
class DeviceTensor {
 public:
  DeviceTensor() = default;
  explicit DeviceTensor(const HostTensor& host) : view_(host.view()) {
    bytes_ = static_cast<size_t>(host.numel()) * dtype_size(host.dtype());
    if (cudaMalloc(&view_.data, bytes_ + 16) != cudaSuccess) {
      std::fprintf(stderr, "cudaMalloc of %zu bytes failed\n", bytes_);
      std::abort();
    }
    view_.device = Device::cuda(0);
    upload(host);
  }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  DeviceTensor(DeviceTensor&& other) noexcept { *this = std::move(other); }
  DeviceTensor& operator=(DeviceTensor&& other) noexcept {
    std::swap(view_, other.view_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  ~DeviceTensor() {
    if (view_.data) cudaFree(view_.data);
  }

  void upload(const HostTensor& host) {
    cudaMemcpy(view_.data, host.view().data, bytes_, cudaMemcpyHostToDevice);
  }
  // Copies the device contents into `host` (same shape and dtype).
  void download(HostTensor& host) const {
    cudaMemcpy(host.view().data, view_.data, bytes_, cudaMemcpyDeviceToHost);
  }
  TensorView view() const { return view_; }
  operator TensorView() const { return view_; }  // NOLINT: convenient in argument structs
  void* data() const { return view_.data; }
  size_t bytes() const { return bytes_; }

 private:
  TensorView view_;
  size_t bytes_ = 0;
};

// A device copy of the host tensor `t` (any shape, contiguous) kept in `storage`; an undefined
// tensor stays undefined.
inline TensorView device_copy(const TensorView& t, DeviceTensor& storage) {
  if (!t.defined()) return TensorView();
  HostTensor copy(t.dtype, std::vector<int64_t>(t.shape.begin(), t.shape.begin() + t.ndim));
  std::memcpy(copy.view().data, t.data, static_cast<size_t>(copy.numel()) * dtype_size(t.dtype));
  storage = DeviceTensor(copy);
  return storage.view();
}

// A paged cache on cuda:0 over `pool`, laid out [num_blocks, 2, Hkv, T, D] (each block's K, then
// its V); the caller adds the block table, seq_lens and scales.
inline KvCacheView paged_cache_view(void* pool, DType dtype, int32_t num_blocks, int32_t hkv,
                                    int32_t tokens_per_block, int32_t head_dim) {
  KvCacheView view;
  const int64_t half =
      int64_t{hkv} * tokens_per_block * head_dim * static_cast<int64_t>(dtype_size(dtype));
  view.k_base = pool;
  view.v_base = static_cast<uint8_t*>(pool) + half;
  view.block_stride_bytes = 2 * half;
  view.num_blocks = num_blocks;
  view.dtype = dtype;
  view.device = Device::cuda(0);
  view.num_kv_heads = hkv;
  view.tokens_per_block = tokens_per_block;
  view.head_dim = head_dim;
  view.paged = true;
  return view;
}

// Device bytes between two guard bands of kSentinel bytes, so that a write outside them is seen.
class GuardedDeviceBuffer {
 public:
  static constexpr uint8_t kSentinel = 0xA5;

  // `content` uploaded between guard bands of at least guard_bytes each (rounded up to 256).
  GuardedDeviceBuffer(const std::vector<uint8_t>& content, int64_t guard_bytes)
      : bytes_(static_cast<int64_t>(content.size())), guard_((guard_bytes + 255) / 256 * 256) {
    const size_t total = static_cast<size_t>(bytes_ + 2 * guard_);
    if (cudaMalloc(&buffer_, total) != cudaSuccess) {
      std::fprintf(stderr, "cudaMalloc of %zu bytes failed\n", total);
      std::abort();
    }
    cudaMemset(buffer_, kSentinel, total);
    cudaMemcpy(buffer_ + guard_, content.data(), content.size(), cudaMemcpyHostToDevice);
  }
  GuardedDeviceBuffer(const GuardedDeviceBuffer&) = delete;
  GuardedDeviceBuffer& operator=(const GuardedDeviceBuffer&) = delete;
  ~GuardedDeviceBuffer() { cudaFree(buffer_); }

  uint8_t* data() const { return buffer_ + guard_; }

  // The content's bytes now; a failure (naming `what`) for every guard byte that changed.
  std::vector<uint8_t> download_checking_guards(const std::string& what) const {
    std::vector<uint8_t> all(static_cast<size_t>(bytes_ + 2 * guard_));
    cudaMemcpy(all.data(), buffer_, all.size(), cudaMemcpyDeviceToHost);
    int64_t before = 0, after = 0;
    for (int64_t i = 0; i < guard_; ++i) {
      before += all[i] != kSentinel;
      after += all[guard_ + bytes_ + i] != kSentinel;
    }
    EXPECT_EQ(before, 0) << what << ": bytes written before the buffer";
    EXPECT_EQ(after, 0) << what << ": bytes written after the buffer";
    return std::vector<uint8_t>(all.begin() + guard_, all.begin() + guard_ + bytes_);
  }

 private:
  int64_t bytes_, guard_;
  uint8_t* buffer_ = nullptr;
};

}  // namespace attnkit::test
