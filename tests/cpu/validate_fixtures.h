// Builders of valid CPU calls for the validation tests (validate_*_test.cc), and the check that
// a rejected call throws attnkit::Error naming the argument and leaves every output untouched.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "common/test_util.h"

namespace attnkit::test {

// The spec the fixtures are built for: GQA 4/2, D = 16.
inline AttentionSpec small_spec(MaskKind mask = MaskKind::kCausal) {
  AttentionSpec spec;
  spec.num_q_heads = 4;
  spec.num_kv_heads = 2;
  spec.head_dim = 16;
  spec.mask.kind = mask;
  return spec;
}

inline std::mt19937_64& fixture_rng() {
  static std::mt19937_64 rng(test_seed());
  return rng;
}

// An owning tensor filled with random values (inputs) or NaN poison (outputs).
inline std::unique_ptr<HostTensor> make_input(DType dtype, std::initializer_list<int64_t> shape) {
  auto t = std::make_unique<HostTensor>(dtype, shape);
  t->fill_uniform(fixture_rng(), -1.0f, 1.0f);
  return t;
}
inline std::unique_ptr<HostTensor> make_output(DType dtype, std::initializer_list<int64_t> shape) {
  auto t = std::make_unique<HostTensor>(dtype, shape);
  t->fill(NAN);
  return t;
}
inline std::unique_ptr<HostTensor> make_i32(const std::vector<int32_t>& values,
                                            std::initializer_list<int64_t> shape) {
  auto t = std::make_unique<HostTensor>(DType::kInt32, shape);
  EXPECT_EQ(static_cast<int64_t>(values.size()), t->numel());
  std::memcpy(t->data<int32_t>(), values.data(), values.size() * sizeof(int32_t));
  return t;
}

// A paged cache [num_blocks, 2 (K, V), Hkv, T, D] with one block-table row per entry of
// seq_lens. Row r owns distinct blocks for the slots it holds; the rest of its row is -1.
struct CacheFixture {
  std::unique_ptr<HostTensor> pool, block_table, seq_lens, k_scale, v_scale;
  KvCacheView view;

  CacheFixture(const std::vector<int32_t>& lens, DType dtype = DType::kBF16,
               int32_t tokens_per_block = 8, int32_t max_blocks = 4, int32_t num_blocks = 20) {
    const AttentionSpec spec = small_spec();
    const int64_t rows = static_cast<int64_t>(lens.size());
    pool = std::make_unique<HostTensor>(
        dtype, std::initializer_list<int64_t>{num_blocks, 2, spec.num_kv_heads, tokens_per_block,
                                              spec.head_dim});
    pool->fill_uniform(fixture_rng(), -1.0f, 1.0f);
    std::vector<int32_t> table(static_cast<size_t>(rows * max_blocks), -1);
    int32_t next = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t used = (lens[r] + tokens_per_block - 1) / tokens_per_block;
      for (int64_t j = 0; j < used && j < max_blocks; ++j) table[r * max_blocks + j] = next++;
    }
    block_table = make_i32(table, {rows, max_blocks});
    seq_lens = make_i32(lens, {rows});
    const int64_t block_bytes = int64_t{spec.num_kv_heads} * tokens_per_block * spec.head_dim *
                                static_cast<int64_t>(dtype_size(dtype));
    view.k_base = pool->data<uint8_t>();
    view.v_base = pool->data<uint8_t>() + block_bytes;
    view.block_stride_bytes = 2 * block_bytes;
    view.num_blocks = num_blocks;
    view.dtype = dtype;
    view.num_kv_heads = spec.num_kv_heads;
    view.tokens_per_block = tokens_per_block;
    view.head_dim = spec.head_dim;
    view.block_table = *block_table;
    view.seq_lens = *seq_lens;
    if (dtype == DType::kFp8E4M3 || dtype == DType::kInt8) {
      k_scale = std::make_unique<HostTensor>(DType::kF32, std::initializer_list<int64_t>{1});
      k_scale->fill(0.5f);
      v_scale = std::make_unique<HostTensor>(DType::kF32,
                                             std::initializer_list<int64_t>{spec.num_kv_heads});
      v_scale->fill(0.25f);
      view.k_scale = *k_scale;
      view.v_scale = *v_scale;
    }
  }
  int32_t& table_at(int64_t row, int64_t index) {
    return block_table->data<int32_t>()[row * block_table->view().shape[1] + index];
  }
};

// The same view on a pretend CUDA device with 16-byte aligned fake addresses: validation never
// dereferences device pointers, so device-side rules can be tested without a GPU.
inline TensorView fake_cuda(TensorView t, uintptr_t address = 0x10000) {
  if (!t.defined()) return t;
  t.data = reinterpret_cast<void*>(address);
  t.device = Device::cuda(0);
  return t;
}
inline KvCacheView fake_cuda(KvCacheView c) {
  c.device = Device::cuda(0);
  c.k_base = reinterpret_cast<void*>(0x100000);
  c.v_base = reinterpret_cast<void*>(0x100000 + c.block_stride_bytes / 2);
  c.block_table = fake_cuda(c.block_table, 0x200000);
  c.seq_lens = fake_cuda(c.seq_lens, 0x300000);
  c.k_scale = fake_cuda(c.k_scale, 0x400000);
  c.v_scale = fake_cuda(c.v_scale, 0x500000);
  return c;
}

// A view with one dimension's stride replaced.
inline TensorView with_stride(TensorView t, int dim, int64_t stride) {
  t.strides[dim] = stride;
  return t;
}
inline TensorView with_dtype(TensorView t, DType dtype) {
  t.dtype = dtype;
  return t;
}
inline TensorView with_device(TensorView t, Device device) {
  t.device = device;
  return t;
}

// Runs `call`, which must throw attnkit::Error whose message contains `needle` (e.g.
// "decode: kv_cache.block_table:"), and checks that none of `outputs` changed.
template <typename Call>
void expect_rejected(Call&& call, const std::string& needle,
                     const std::vector<const HostTensor*>& outputs = {}) {
  std::vector<std::vector<uint8_t>> before;
  for (const HostTensor* t : outputs) before.push_back(t->bytes());
  try {
    call();
    ADD_FAILURE() << "the call was accepted; expected attnkit::Error containing '" << needle << "'";
  } catch (const Error& e) {
    if (std::getenv("ATTNKIT_PRINT_ERRORS")) std::printf("    [error] %s\n", e.what());
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message '" << e.what() << "' does not contain '" << needle << "'";
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected attnkit::Error, got another exception: " << e.what();
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    EXPECT_TRUE(outputs[i]->bytes() == before[i]) << "output " << i << " was written";
  }
}

}  // namespace attnkit::test
