// Helpers of the context-parallel tests (cpu and gpu): ranks run as threads, and packed tensors
// are sharded by a plan's row map and put back.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "attnkit/context_parallel.h"
#include "attnkit/kv_cache_manager.h"
#include "common/test_util.h"
#include "core/numerics.h"

namespace attnkit::test {

// Runs fn(rank) on world_size threads at once (the in-process collectives need every rank) and
// rethrows the first exception any rank threw.
inline void run_ranks(int32_t world_size, const std::function<void(int32_t)>& fn) {
  std::vector<std::thread> threads;
  std::exception_ptr first;
  std::mutex mutex;
  for (int32_t r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        const std::lock_guard<std::mutex> lock(mutex);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

// rows[i] of `global` ([N, ...] contiguous) as a new contiguous tensor [rows.size(), ...].
inline HostTensor gather_rows(const HostTensor& global, const std::vector<int32_t>& rows) {
  const TensorView g = global.view();
  std::vector<int64_t> shape(g.shape.begin(), g.shape.begin() + g.ndim);
  const int64_t row_bytes =
      static_cast<int64_t>(dtype_size(g.dtype)) * (shape[0] ? global.numel() / shape[0] : 0);
  shape[0] = static_cast<int64_t>(rows.size());
  HostTensor local(g.dtype, shape);
  for (size_t i = 0; i < rows.size(); ++i) {
    std::memcpy(static_cast<uint8_t*>(local.view().data) + i * row_bytes,
                static_cast<const uint8_t*>(g.data) + rows[i] * row_bytes, row_bytes);
  }
  return local;
}

// The inverse: global[rows[i]] = local[i].
inline void scatter_rows(const HostTensor& local, const std::vector<int32_t>& rows,
                         HostTensor& global) {
  const TensorView g = global.view();
  const int64_t row_bytes =
      static_cast<int64_t>(dtype_size(g.dtype)) * (g.shape[0] ? global.numel() / g.shape[0] : 0);
  for (size_t i = 0; i < rows.size(); ++i) {
    std::memcpy(static_cast<uint8_t*>(g.data) + rows[i] * row_bytes,
                static_cast<const uint8_t*>(local.view().data) + i * row_bytes, row_bytes);
  }
}

inline std::vector<int32_t> cu_seqlens_of(const std::vector<int32_t>& lengths) {
  std::vector<int32_t> cu{0};
  for (const int32_t n : lengths) cu.push_back(cu.back() + n);
  return cu;
}

// Writes K and V ([Hkv, D] each, float) of the token at `local` position of `seq` into a bf16
// pool of one layer ([num_blocks, 1, 2, Hkv, T, D]) of `manager`, in host memory.
inline void write_kv_bf16(const KvCacheManager& manager, SeqId seq, int64_t local, int32_t hkv,
                          int32_t tokens_per_block, int32_t head_dim, const float* k,
                          const float* v) {
  const int32_t block = manager.blocks(seq)[local / tokens_per_block];
  auto* pool = static_cast<uint16_t*>(manager.pool_data());
  const int64_t block_elems = manager.block_bytes() / 2;
  const int64_t slot = local % tokens_per_block;
  for (int kv = 0; kv < 2; ++kv) {
    for (int32_t h = 0; h < hkv; ++h) {
      for (int32_t d = 0; d < head_dim; ++d) {
        const int64_t at = block * block_elems +
                           ((int64_t{kv} * hkv + h) * tokens_per_block + slot) * head_dim + d;
        pool[at] = numerics::float_to_bf16_bits((kv == 0 ? k : v)[h * head_dim + d]);
      }
    }
  }
}

}  // namespace attnkit::test
