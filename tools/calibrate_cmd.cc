// `attnkit calibrate SAMPLE...`: sweeps the skip-softmax threshold lambda over sample Q / K / V
// tensors (one sample per diffusion timestep), measures the tile sparsity and the output error
// against dense attention, fits lambda = a exp(b s) / kv_len in log space and prints (or writes)
// the report whose "calibration" object a config's skip_softmax.target_sparsity takes
// (docs/diffusion.md, "Calibration"). The sweep runs on the GPU (dense() on the fused kernels,
// their own tiles) where this build has CUDA and a device is visible, else on the CPU reference.
#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/info.h"
#include "attnkit/types.h"
#include "calibrate.h"
#include "commands.h"

#if defined(ATTNKIT_WITH_CUDA)
#include <cuda_runtime.h>

#include "bench_session.h"
#include "core/numerics.h"
#endif

namespace attnkit::tools {
namespace {

using calibrate::Sample;
using calibrate::SampleResult;
using calibrate::SweepOptions;
using calibrate::SweepPoint;

struct CalibrateOptions {
  std::vector<std::string> samples;
  std::vector<double> timesteps;
  std::vector<double> lambdas;
  double lambda_min = 1e-6;
  double lambda_max = 1.0;
  int points = 13;
  int32_t block_m = 128;
  int32_t block_n = 128;
  int32_t query_tiles = 0;
  double softmax_scale = 0.0;
  std::string backend = "auto";
  std::optional<double> target_sparsity;
  std::string output;
  bool json = false;
};

#if defined(ATTNKIT_WITH_CUDA)
// bf16 copy of a sample tensor on the device.
DeviceBuffer upload_bf16(const calibrate::HostArray& x) {
  std::vector<uint16_t> bits(x.data.size());
  for (size_t i = 0; i < bits.size(); ++i) bits[i] = numerics::float_to_bf16_bits(x.data[i]);
  return upload(bits.data(), bits.size() * sizeof(uint16_t));
}

TensorView view4(const DeviceBuffer& buffer, const std::vector<int64_t>& s) {
  return TensorView(buffer.get(), DType::kBF16, {s[0], s[1], s[2], s[3]}, Device::cuda(0));
}

// The sweep through dense() on the fused kernels: bf16 operands, the kernel's own tiles (returned
// in block_m / block_n), the error against the same kernel without skipping.
std::vector<SweepPoint> sweep_cuda(const Sample& sample, const CalibrateOptions& o,
                                   int32_t& block_m, int32_t& block_n) {
  const auto& qs = sample.q.shape;
  AttentionSpec spec;
  spec.num_q_heads = static_cast<int32_t>(qs[2]);
  spec.num_kv_heads = static_cast<int32_t>(sample.k.shape[2]);
  spec.head_dim = static_cast<int32_t>(qs[3]);
  spec.softmax_scale = o.softmax_scale;
  spec.mask.kind = MaskKind::kNone;
  spec.backend = Backend::kFused;
  const DeviceBuffer q = upload_bf16(sample.q), k = upload_bf16(sample.k),
                     v = upload_bf16(sample.v);
  const DeviceBuffer out(sample.q.data.size() * sizeof(uint16_t));
  const size_t count = sample.q.data.size();
  auto run = [&](std::optional<double> lambda, DenseStats* stats) {
    AttentionSpec s = spec;
    if (lambda) {
      SkipSoftmaxSpec skip;
      skip.threshold = *lambda;
      s.skip_softmax = skip;
    }
    DenseArgs args;
    args.q = view4(q, sample.q.shape);
    args.k = view4(k, sample.k.shape);
    args.v = view4(v, sample.v.shape);
    args.out = view4(out, sample.q.shape);
    args.stats = stats;
    dense(s, args);
    std::vector<uint16_t> bits(count);
    if (cudaMemcpy(bits.data(), out.get(), count * sizeof(uint16_t), cudaMemcpyDeviceToHost) !=
        cudaSuccess) {
      throw Error("calibrate: reading the output back from the GPU failed");
    }
    std::vector<double> values(count);
    for (size_t i = 0; i < count; ++i) values[i] = numerics::bf16_bits_to_float(bits[i]);
    return values;
  };
  const std::vector<double> plain = run(std::nullopt, nullptr);
  double ref2 = 0.0;
  for (double x : plain) ref2 += x * x;
  std::vector<SweepPoint> points;
  for (double lambda : o.lambdas) {
    DenseStats stats;
    const std::vector<double> got = run(lambda, &stats);
    SweepPoint p;
    p.lambda = lambda;
    p.tiles_total = stats.tiles_total;
    p.tiles_skipped = stats.tiles_skipped;
    block_m = stats.block_m;
    block_n = stats.block_n;
    double err2 = 0.0, dot = 0.0, norm2 = 0.0;
    for (size_t i = 0; i < count; ++i) {
      const double diff = got[i] - plain[i];
      err2 += diff * diff;
      dot += got[i] * plain[i];
      norm2 += got[i] * got[i];
      p.max_abs_error = std::max(p.max_abs_error, std::fabs(diff));
    }
    p.rel_l2_error = ref2 > 0.0 ? std::sqrt(err2 / ref2) : 0.0;
    p.cos_sim = ref2 > 0.0 && norm2 > 0.0 ? dot / std::sqrt(ref2 * norm2) : 0.0;
    points.push_back(p);
  }
  return points;
}
#endif

bool use_cuda(const std::string& backend) {
  if (backend == "reference") return false;
  const bool available = built_with_cuda() && !cuda_devices().empty();
  if (backend == "cuda" && !available) {
    throw Error("calibrate: --backend cuda: " +
                std::string(built_with_cuda() ? "no CUDA device is visible"
                                              : "this build has no CUDA backend"));
  }
  return available;
}

void run_calibrate(CalibrateOptions o) {
  if (!o.timesteps.empty() && o.timesteps.size() != o.samples.size()) {
    throw Error("calibrate: --timesteps: " + std::to_string(o.timesteps.size()) + " values for " +
                std::to_string(o.samples.size()) + " samples (accepted: one a sample, or none)");
  }
  if (o.lambdas.empty()) o.lambdas = calibrate::log_spaced(o.lambda_min, o.lambda_max, o.points);
  for (double l : o.lambdas) {
    if (!(l > 0.0) || !std::isfinite(l)) {
      throw Error("calibrate: --lambdas: got " + std::to_string(l) +
                  "; accepted: finite numbers > 0");
    }
  }
  if (o.target_sparsity && !(*o.target_sparsity >= 0.0 && *o.target_sparsity <= 1.0)) {
    throw Error("calibrate: --target-sparsity: got " + std::to_string(*o.target_sparsity) +
                "; accepted: a number in [0, 1]");
  }
  const bool cuda = use_cuda(o.backend);
  SweepOptions sweep;
  sweep.lambdas = o.lambdas;
  sweep.block_m = o.block_m;
  sweep.block_n = o.block_n;
  sweep.query_tiles = o.query_tiles;
  sweep.softmax_scale = o.softmax_scale;
  int32_t block_m = o.block_m, block_n = o.block_n;
  std::vector<SampleResult> results;
  std::vector<calibrate::Observation> observations;
  for (size_t i = 0; i < o.samples.size(); ++i) {
    Sample sample = calibrate::load_sample(o.samples[i]);
    if (!o.timesteps.empty()) sample.timestep = o.timesteps[i];
    SampleResult r;
    r.name = sample.name;
    r.timestep = sample.timestep;
    r.q_shape = sample.q.shape;
    r.k_shape = sample.k.shape;
#if defined(ATTNKIT_WITH_CUDA)
    r.points =
        cuda ? sweep_cuda(sample, o, block_m, block_n) : calibrate::sweep_reference(sample, sweep);
#else
    r.points = calibrate::sweep_reference(sample, sweep);
#endif
    for (const SweepPoint& p : r.points) {
      observations.push_back({p.lambda, p.sparsity(), sample.k.shape[1]});
    }
    results.push_back(std::move(r));
  }
  const calibrate::Fit fit = calibrate::fit_curve(observations);
  const calibrate::ordered_json report = calibrate::report_json(
      fit, results, cuda ? "cuda" : "reference", block_m, block_n, o.target_sparsity);
  if (!o.output.empty()) {
    std::ofstream file(o.output);
    file << report.dump(2) << "\n";
    if (!file) throw Error("calibrate: --output " + o.output + ": cannot be written");
  }
  if (o.json) {
    std::printf("%s\n", report.dump(2).c_str());
    return;
  }
  std::printf("skip-softmax calibration (%s, tiles %d x %d, key tiles walked last to first)\n",
              cuda ? "GPU, the fused kernel's tiles" : "CPU reference", block_m, block_n);
  std::printf("%-32s %9s %12s %9s %12s %10s\n", "sample", "timestep", "lambda", "sparsity",
              "rel_l2_err", "cos_sim");
  for (const SampleResult& r : results) {
    for (const SweepPoint& p : r.points) {
      const std::string t = r.timestep ? std::to_string(*r.timestep) : "-";
      std::printf("%-32s %9s %12.4g %8.1f%% %12.3e %10.6f\n", r.name.c_str(), t.c_str(), p.lambda,
                  100.0 * p.sparsity(), p.rel_l2_error, p.cos_sim);
    }
  }
  std::printf("fit: lambda = %.6g * exp(%.6g * s) / kv_len (%d points, rms residual %.3g in ln)\n",
              fit.a, fit.b, fit.points, fit.rms_log_residual);
  std::printf("config: \"calibration\": {\"a\": %.9g, \"b\": %.9g}\n", fit.a, fit.b);
}

}  // namespace

void register_calibrate_command(CLI::App& app) {
  auto o = std::make_shared<CalibrateOptions>();
  CLI::App* cmd = app.add_subcommand(
      "calibrate",
      "Fit the skip-softmax calibration curve lambda = a exp(b s) / kv_len on sample Q/K/V");
  cmd->add_option("samples", o->samples,
                  "Samples: .safetensors files with tensors q, k, v, or directories with q.npy, "
                  "k.npy, v.npy; q [B, Sq, Hq, D], k / v [B, Skv, Hkv, D]; one a timestep")
      ->required();
  cmd->add_option("--timesteps", o->timesteps, "The normalized timestep of each sample (reported)")
      ->delimiter(',');
  cmd->add_option("--lambdas", o->lambdas, "The lambdas to sweep (default: log-spaced)")
      ->delimiter(',');
  cmd->add_option("--lambda-min", o->lambda_min, "Smallest lambda of the log-spaced sweep");
  cmd->add_option("--lambda-max", o->lambda_max, "Largest lambda of the log-spaced sweep");
  cmd->add_option("--points", o->points, "Lambdas of the log-spaced sweep")
      ->check(CLI::Range(2, 1000));
  cmd->add_option("--block-m", o->block_m,
                  "Query rows of a skip tile on the CPU reference (the GPU uses its kernel's)")
      ->check(CLI::IsMember({16, 32, 64, 128, 256}));
  cmd->add_option("--block-n", o->block_n, "Keys of a skip tile on the CPU reference")
      ->check(CLI::IsMember({16, 32, 64, 128, 256}));
  cmd->add_option("--query-tiles", o->query_tiles,
                  "Query tiles per (batch, head) the CPU reference walks, evenly spaced (0: all)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--softmax-scale", o->softmax_scale, "Softmax scale (0: 1 / sqrt(head_dim))");
  cmd->add_option("--backend", o->backend, "auto (the GPU where present), reference (CPU) or cuda")
      ->check(CLI::IsMember({"auto", "reference", "cuda"}));
  cmd->add_option("--target-sparsity", o->target_sparsity,
                  "Also write a skip_softmax object for this target sparsity");
  cmd->add_option("--output", o->output, "Write the JSON report to this file");
  cmd->add_flag("--json", o->json, "Print the JSON report instead of the table");
  cmd->callback([o] { run_calibrate(*o); });
}

}  // namespace attnkit::tools
