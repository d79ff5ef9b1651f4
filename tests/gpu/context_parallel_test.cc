// Context parallelism on CUDA: ring_prefill and sharded_decode with the fused kernels, against
// the fp64 oracle and the single-GPU call.
//
// - InProcess*: R = 2, 4, 8 ranks as threads on one GPU, each with its own compute stream, over
//   the in-process transport (cudaMemcpyAsync on each rank's communication stream, ordered by
//   events). NCCL refuses two ranks of one communicator on one GPU ("duplicate GPU"), so this is
//   how the whole algorithm, its streams and events run on a single GPU.
// - Nccl*: a one-rank NCCL communicator (send / receive to itself, all-gather), and, when two or
//   more GPUs are visible, one rank per GPU over NCCL.
//
// The bound (docs/context_parallel.md): partials and merges are rounded to bf16, once per block
// and once per merge, each by at most half an ulp of a value bounded by max |v| = 1:
//   max |out - ref64| <= 2 * max |naive_same_precision - ref64| + 1e-3 + 4 R * 2^-9.
#include "attnkit/context_parallel.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/cp_test_util.h"
#include "common/reference_oracle.h"
#include "gpu/gpu_case_util.h"
#include "gpu/gpu_util.h"

namespace attnkit::test {
namespace {

void cuda_or_throw(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw Error(std::string(what) + ": " + cudaGetErrorString(status));
  }
}

// A copy of a host tensor on cuda:`device` (DeviceTensor serves cuda:0 only).
class DeviceCopy {
 public:
  DeviceCopy() = default;
  DeviceCopy(const TensorView& host, int device) : view_(host), device_(device) {
    bytes_ = static_cast<size_t>(host.numel()) * dtype_size(host.dtype);
    cuda_or_throw(cudaSetDevice(device), "cudaSetDevice");
    cuda_or_throw(cudaMalloc(&view_.data, bytes_ + 16), "cudaMalloc");
    cuda_or_throw(cudaMemcpy(view_.data, host.data, bytes_, cudaMemcpyHostToDevice), "cudaMemcpy");
    view_.device = Device::cuda(device);
  }
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;
  DeviceCopy(DeviceCopy&& other) noexcept { *this = std::move(other); }
  DeviceCopy& operator=(DeviceCopy&& other) noexcept {
    std::swap(view_, other.view_);
    std::swap(bytes_, other.bytes_);
    std::swap(device_, other.device_);
    return *this;
  }
  ~DeviceCopy() {
    if (view_.data != nullptr) {
      cudaSetDevice(device_);
      cudaFree(view_.data);
    }
  }
  TensorView view() const { return view_; }
  operator TensorView() const { return view_; }  // NOLINT: convenient in argument structs
  HostTensor download(const HostTensor& like) const {
    HostTensor host = like;
    cudaSetDevice(device_);
    cuda_or_throw(cudaMemcpy(host.view().data, view_.data, bytes_, cudaMemcpyDeviceToHost),
                  "cudaMemcpy");
    return host;
  }

 private:
  TensorView view_;
  size_t bytes_ = 0;
  int device_ = 0;
};

// Runs each rank's call on a fresh non-blocking stream of its device, then synchronizes it.
void on_rank_stream(int device, const std::function<void(Stream)>& call) {
  cuda_or_throw(cudaSetDevice(device), "cudaSetDevice");
  cudaStream_t stream = nullptr;
  cuda_or_throw(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  call(stream);
  cuda_or_throw(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  cudaStreamDestroy(stream);
}

AttentionSpec llama_like_spec(MaskKind mask) {
  AttentionSpec spec;
  spec.num_q_heads = 8;
  spec.num_kv_heads = 2;  // GQA 4:1 as Llama-3-8B's 32 / 8
  spec.head_dim = 128;
  spec.mask = MaskSpec{mask, 0, 0};
  return spec;
}

struct Batch {
  std::vector<int32_t> cu;
  HostTensor q, k, v;
  OracleAccumulator oracle;
};

Batch random_batch(const AttentionSpec& spec, const std::vector<int32_t>& lengths,
                   std::mt19937_64& rng) {
  Batch b;
  b.cu = cu_seqlens_of(lengths);
  const int64_t total = b.cu.back();
  const int32_t hq = spec.num_q_heads, hkv = spec.num_kv_heads, d = spec.head_dim;
  b.q = HostTensor(DType::kBF16, {total, hq, d});
  b.k = HostTensor(DType::kBF16, {total, hkv, d});
  b.v = HostTensor(DType::kBF16, {total, hkv, d});
  b.q.fill_uniform(rng, -1.0f, 1.0f);
  b.k.fill_uniform(rng, -1.0f, 1.0f);
  b.v.fill_uniform(rng, -1.0f, 1.0f);
  for (size_t s = 0; s + 1 < b.cu.size(); ++s) {
    const int64_t first = b.cu[s], n = b.cu[s + 1] - b.cu[s];
    OracleProblem pr = oracle_problem_of(spec);
    pr.q = head_values(b.q, first * hq * d, n * hq * d);
    pr.k = head_values(b.k, first * hkv * d, n * hkv * d);
    pr.v = head_values(b.v, first * hkv * d, n * hkv * d);
    for (int64_t i = 0; i < n; ++i) pr.q_positions.push_back(i);
    b.oracle.add(pr, DType::kBF16);
  }
  return b;
}

struct Result {
  HostTensor out, lse;
};

Result single_gpu_prefill(const AttentionSpec& spec, const Batch& b) {
  const int64_t total = b.cu.back();
  const HostTensor out_like = poisoned(DType::kBF16, {total, spec.num_q_heads, spec.head_dim});
  const HostTensor lse_like = poisoned(DType::kF32, {total, spec.num_q_heads});
  const HostTensor cu = int32_tensor(b.cu);
  DeviceCopy q(b.q, 0), k(b.k, 0), v(b.v, 0), out(out_like, 0), lse(lse_like, 0), dcu(cu, 0);
  PrefillArgs args;
  args.q = q;
  args.k = k;
  args.v = v;
  args.cu_seqlens_q = dcu;
  args.cu_seqlens_kv = dcu;
  args.out = out;
  args.lse = lse;
  int32_t longest = 1;
  for (size_t s = 0; s + 1 < b.cu.size(); ++s) longest = std::max(longest, b.cu[s + 1] - b.cu[s]);
  args.max_seqlen_q = args.max_seqlen_kv = longest;
  prefill(spec, args);
  cuda_or_throw(cudaDeviceSynchronize(), "prefill");
  return {out.download(out_like), lse.download(lse_like)};
}

// ring_prefill with rank r on devices[r] over `group`; the outputs back in global order.
Result ring_prefill_on(const AttentionSpec& spec, const Batch& b,
                       const std::vector<std::unique_ptr<cp::Communicator>>& group,
                       const std::vector<int>& devices) {
  const int32_t world = static_cast<int32_t>(group.size());
  const cp::ZigzagPlan plan(b.cu, world);
  const int32_t hq = spec.num_q_heads, d = spec.head_dim;
  std::vector<DeviceCopy> q, k, v, out, lse;
  std::vector<HostTensor> out_like, lse_like;
  for (int32_t r = 0; r < world; ++r) {
    const std::vector<int32_t> rows = plan.global_rows(r);
    const int64_t n = plan.local_tokens(r);
    q.emplace_back(gather_rows(b.q, rows), devices[r]);
    k.emplace_back(gather_rows(b.k, rows), devices[r]);
    v.emplace_back(gather_rows(b.v, rows), devices[r]);
    out_like.push_back(poisoned(DType::kBF16, {n, hq, d}));
    lse_like.push_back(poisoned(DType::kF32, {n, hq}));
    out.emplace_back(out_like.back(), devices[r]);
    lse.emplace_back(lse_like.back(), devices[r]);
  }
  run_ranks(world, [&](int32_t r) {
    on_rank_stream(devices[r], [&](Stream stream) {
      cp::RingPrefillArgs args;
      args.q = q[r];
      args.k = k[r];
      args.v = v[r];
      args.out = out[r];
      args.lse = lse[r];
      cp::ring_prefill(spec, plan, args, {group[r].get()}, stream);
    });
  });
  const int64_t total = b.cu.back();
  Result result{poisoned(DType::kBF16, {total, hq, d}), poisoned(DType::kF32, {total, hq})};
  for (int32_t r = 0; r < world; ++r) {
    scatter_rows(out[r].download(out_like[r]), plan.global_rows(r), result.out);
    scatter_rows(lse[r].download(lse_like[r]), plan.global_rows(r), result.lse);
  }
  return result;
}

void expect_within_ring_bound(const std::string& what, const Batch& b, const Result& got,
                              int32_t world) {
  const std::vector<double> out = got.out.to_double();
  ASSERT_FALSE(any_nan(out)) << what << ": NaN in the output (rows not written?)";
  const double yardstick = max_abs_diff(b.oracle.naive_out, b.oracle.ref64_out);
  const double bound = 2 * yardstick + 1e-3 + 4.0 * world * std::ldexp(1.0, -9);
  EXPECT_LE(max_abs_diff(out, b.oracle.ref64_out), bound) << what;
  bool pattern = false;
  const double lse_error = max_abs_diff_lse(got.lse.to_double(), b.oracle.ref64_lse, &pattern);
  EXPECT_TRUE(pattern) << what << ": LSE -inf pattern differs from the oracle";
  EXPECT_LE(lse_error, 1e-3) << what << ": LSE";
}

std::vector<int32_t> uneven_lengths() {
  // Sequences around the kernels' 64- and 128-row tiles, one of one token, one empty; short
  // ones leave some ranks' chunks empty at R = 8.
  return at_test_scale(std::vector<int32_t>{700, 1, 37, 513, 0, 129, 3},
                       std::vector<int32_t>{200, 1, 37, 65, 0, 29, 3});
}

TEST(CpGpu, InProcessRingPrefillOnOneGpuMatchesOracle) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed());
  for (const MaskKind mask : {MaskKind::kCausal, MaskKind::kNone}) {
    const AttentionSpec spec = llama_like_spec(mask);
    const Batch batch = random_batch(spec, uneven_lengths(), rng);
    expect_within_ring_bound(std::string("single GPU, ") + mask_name(mask), batch,
                             single_gpu_prefill(spec, batch), 0);
    for (const int32_t world : {1, 2, 4, 8}) {
      const std::vector<Device> devices(static_cast<size_t>(world), Device::cuda(0));
      const auto group = cp::make_in_process_group(devices, 120.0);
      const Result got = ring_prefill_on(spec, batch, group, std::vector<int>(world, 0));
      expect_within_ring_bound("in-process R=" + std::to_string(world) + ", " + mask_name(mask),
                               batch, got, world);
    }
  }
}

// ---- decode ---------------------------------------------------------------------------------

constexpr int32_t kT = 16;

KvCacheManagerConfig decode_config(const AttentionSpec& spec, int32_t max_seq_len) {
  KvCacheManagerConfig c;
  c.num_kv_heads = spec.num_kv_heads;
  c.head_dim = spec.head_dim;
  c.tokens_per_block = kT;
  c.dtype = DType::kBF16;
  c.max_tokens = int64_t{max_seq_len} * 8;
  c.max_seq_len = max_seq_len;
  c.enable_prefix_reuse = false;
  return c;
}

// A host manager's pool, block tables and lengths copied to cuda:`device`.
struct DeviceCache {
  DeviceCopy pool, table, lens;
  KvBlockTables host_tables;
  KvCacheView view;
  DeviceCache(const KvCacheManager& manager, KvBlockTables tables, int device)
      : host_tables(std::move(tables)) {
    const HostTensor pool_bytes(DType::kInt8,
                                {int64_t{manager.num_blocks()} * manager.block_bytes()});
    std::memcpy(pool_bytes.view().data, manager.pool_data(),
                static_cast<size_t>(pool_bytes.numel()));
    pool = DeviceCopy(pool_bytes, device);
    table = DeviceCopy(host_tables.table_view(), device);
    lens = DeviceCopy(host_tables.seq_lens_view(), device);
    view = manager.layer_view(0, host_tables.table_view(), host_tables.seq_lens_view());
    const auto rebase = [&](void* p) {
      return static_cast<uint8_t*>(pool.view().data) +
             (static_cast<uint8_t*>(p) - static_cast<uint8_t*>(manager.pool_data()));
    };
    view.k_base = rebase(view.k_base);
    view.v_base = rebase(view.v_base);
    view.device = Device::cuda(device);
    view.block_table = table;
    view.seq_lens = lens;
  }
};

TEST(CpGpu, InProcessShardedDecodeOnOneGpuMatchesReference) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed());
  const AttentionSpec spec = llama_like_spec(MaskKind::kCausal);
  const int32_t hq = spec.num_q_heads, hkv = spec.num_kv_heads, d = spec.head_dim;
  const std::vector<int32_t> lengths =
      at_test_scale(std::vector<int32_t>{5, 3000, 200, 17}, std::vector<int32_t>{5, 700, 200, 17});
  const std::vector<SeqId> seqs{1, 2, 3, 4};
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  for (const int32_t world : {2, 4, 8}) {
    SCOPED_TRACE("world " + std::to_string(world));
    const cp::DecodeShardLayout layout{world, kT};
    KvCacheManager global(decode_config(spec, 4096));
    std::vector<std::unique_ptr<KvCacheManager>> managers;
    std::vector<cp::ShardedKvCache> shards;
    for (int32_t r = 0; r < world; ++r) {
      managers.push_back(std::make_unique<KvCacheManager>(
          decode_config(spec, static_cast<int32_t>(layout.local_length(0, 4096)))));
    }
    for (int32_t r = 0; r < world; ++r) shards.emplace_back(*managers[r], layout, r);
    for (size_t s = 0; s < seqs.size(); ++s) {
      const std::vector<int32_t> tokens(static_cast<size_t>(lengths[s]), 7);
      global.add(seqs[s], tokens);
      for (auto& shard : shards) shard.extend(seqs[s], tokens);
      for (int64_t p = 0; p < lengths[s]; ++p) {
        std::vector<float> k(hkv * d), v(hkv * d);
        for (float& x : k) x = value(rng);
        for (float& x : v) x = value(rng);
        write_kv_bf16(global, seqs[s], p, hkv, kT, d, k.data(), v.data());
        write_kv_bf16(*managers[layout.rank_of_position(p)], seqs[s], layout.local_position(p), hkv,
                      kT, d, k.data(), v.data());
      }
    }
    const int64_t rows = static_cast<int64_t>(seqs.size());
    HostTensor q(DType::kBF16, {rows, hq, d});
    q.fill_uniform(rng, -1.0f, 1.0f);
    const HostTensor out_like = poisoned(DType::kBF16, {rows, hq, d});
    const HostTensor lse_like = poisoned(DType::kF32, {rows, hq});

    // The CPU reference over the whole sequences (q read as float32: exact bf16 values).
    const KvBlockTables global_tables = global.block_tables(seqs);
    HostTensor q32(DType::kF32, {rows, hq, d}), ref(DType::kF32, {rows, hq, d}),
        ref_lse(DType::kF32, {rows, hq});
    for (int64_t i = 0; i < q.numel(); ++i) q32.set(i, q.get(i));
    DecodeArgs cpu;
    cpu.q = q32;
    cpu.kv_cache = global.layer_view(0, global_tables.table_view(), global_tables.seq_lens_view());
    cpu.out = ref;
    cpu.lse = ref_lse;
    decode(spec, cpu);

    const DeviceCache single_cache(global, global_tables, 0);
    DeviceCopy dq(q, 0), single_out(out_like, 0);
    DecodeArgs one;
    one.q = dq;
    one.kv_cache = single_cache.view;
    one.out = single_out;
    decode(spec, one);
    cuda_or_throw(cudaDeviceSynchronize(), "decode");
    const double single_error =
        max_abs_diff(single_out.download(out_like).to_double(), ref.to_double());

    std::vector<std::unique_ptr<DeviceCache>> caches;
    std::vector<DeviceCopy> outs, lses;
    for (int32_t r = 0; r < world; ++r) {
      caches.push_back(
          std::make_unique<DeviceCache>(*managers[r], shards[r].block_tables(seqs), 0));
      outs.emplace_back(out_like, 0);
      lses.emplace_back(lse_like, 0);
    }
    const std::vector<Device> devices(static_cast<size_t>(world), Device::cuda(0));
    const auto group = cp::make_in_process_group(devices, 120.0);
    run_ranks(world, [&](int32_t r) {
      on_rank_stream(0, [&](Stream stream) {
        DecodeArgs args;
        args.q = dq;
        args.kv_cache = caches[r]->view;
        args.out = outs[r];
        args.lse = lses[r];
        cp::sharded_decode(spec, args, {group[r].get()}, stream);
      });
    });
    const HostTensor out0 = outs[0].download(out_like);
    const double bound = 2 * single_error + 1e-3 + 2.0 * world * std::ldexp(1.0, -9);
    EXPECT_LE(max_abs_diff(out0.to_double(), ref.to_double()), bound);
    bool pattern = false;
    EXPECT_LE(
        max_abs_diff_lse(lses[0].download(lse_like).to_double(), ref_lse.to_double(), &pattern),
        1e-3);
    EXPECT_TRUE(pattern);
    for (int32_t r = 1; r < world; ++r) {
      EXPECT_EQ(outs[r].download(out_like).bytes(), out0.bytes()) << "rank " << r;
    }
  }
}

// ---- NCCL -----------------------------------------------------------------------------------

#define ATTNKIT_SKIP_WITHOUT_NCCL()                                                       \
  do {                                                                                    \
    if (!cp::nccl_available())                                                            \
      GTEST_SKIP() << "attnkit built without NCCL or libnccl.so.2 not loadable: skipped"; \
  } while (0)

// One rank: the ring neighbour is the rank itself, so ncclSend / ncclRecv in one group move the
// buffer to itself; all-gather of one rank copies.
TEST(CpGpu, NcclOneRankExchangeAndGather) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  ATTNKIT_SKIP_WITHOUT_NCCL();
  const auto comm = cp::make_nccl_communicator(cp::nccl_unique_id(), 0, 1, 0);
  EXPECT_EQ(comm->world_size(), 1);
  EXPECT_EQ(comm->device(), Device::cuda(0));
  ASSERT_NE(comm->comm_stream(), nullptr);
  std::mt19937_64 rng(test_seed());
  HostTensor data(DType::kF32, {1000}), zeros(DType::kF32, {1000});
  data.fill_uniform(rng, -1.0f, 1.0f);
  zeros.fill(0.0f);
  DeviceCopy send(data, 0), recv(zeros, 0), gathered(zeros, 0);
  const cp::RingTransfer transfer{send.view().data, 4000, recv.view().data, 4000};
  comm->ring_exchange({&transfer, 1}, comm->comm_stream());
  comm->all_gather(send.view().data, gathered.view().data, 4000, comm->comm_stream());
  cuda_or_throw(cudaStreamSynchronize(static_cast<cudaStream_t>(comm->comm_stream())), "sync");
  EXPECT_EQ(recv.download(zeros).bytes(), data.bytes());
  EXPECT_EQ(gathered.download(zeros).bytes(), data.bytes());

  // ring_prefill and sharded_decode over a group of one are the single-GPU calls, bit for bit.
  const AttentionSpec spec = llama_like_spec(MaskKind::kCausal);
  const Batch batch = random_batch(spec, {300, 17}, rng);
  const Result single = single_gpu_prefill(spec, batch);
  std::vector<std::unique_ptr<cp::Communicator>> group;
  group.push_back(cp::make_nccl_communicator(cp::nccl_unique_id(), 0, 1, 0));
  const Result ring = ring_prefill_on(spec, batch, group, {0});
  EXPECT_EQ(ring.out.bytes(), single.out.bytes());
  EXPECT_EQ(ring.lse.bytes(), single.lse.bytes());
}

// One rank per visible GPU over NCCL (runs where two or more GPUs are visible).
TEST(CpGpu, NcclRingPrefillAcrossGpusMatchesOracle) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  ATTNKIT_SKIP_WITHOUT_NCCL();
  int count = 0;
  cudaGetDeviceCount(&count);
  if (count < 2) GTEST_SKIP() << "one GPU visible: the multi-GPU NCCL run needs two or more";
  std::mt19937_64 rng(test_seed());
  const cp::NcclUniqueId id = cp::nccl_unique_id();
  std::vector<std::unique_ptr<cp::Communicator>> group(static_cast<size_t>(count));
  run_ranks(count, [&](int32_t r) { group[r] = cp::make_nccl_communicator(id, r, count, r); });
  std::vector<int> devices(static_cast<size_t>(count));
  for (int r = 0; r < count; ++r) devices[r] = r;
  for (const MaskKind mask : {MaskKind::kCausal, MaskKind::kNone}) {
    const AttentionSpec spec = llama_like_spec(mask);
    const Batch batch = random_batch(spec, uneven_lengths(), rng);
    const Result got = ring_prefill_on(spec, batch, group, devices);
    expect_within_ring_bound("NCCL R=" + std::to_string(count) + ", " + mask_name(mask), batch, got,
                             count);
  }
}

}  // namespace
}  // namespace attnkit::test
