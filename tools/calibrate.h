// The parts of `attnkit calibrate` that need no GPU (docs/diffusion.md, "Calibration"): reading
// sample Q / K / V tensors (.npy, .safetensors), the lambda sweep on the CPU reference's tile walk,
// the fit of the calibration curve lambda = a exp(b s) / kv_len in log space, and the JSON report
// whose "calibration" object is the one a config's skip_softmax.target_sparsity takes. The CPU
// tests link this file (tests/cpu/calibrate_test.cc).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace attnkit::tools::calibrate {

using ordered_json = nlohmann::ordered_json;

// A dense float tensor (row-major).
struct HostArray {
  std::vector<int64_t> shape;
  std::vector<float> data;
};

// A .npy file (format 1.0 - 3.0; little-endian f2 / f4 / f8, C order). Throws Error naming the
// path and what is wrong.
HostArray read_npy(const std::string& path);
// Tensor `name` of a .safetensors file (an 8-byte header length, a JSON header, raw data; F16,
// BF16, F32 or F64).
HostArray read_safetensors(const std::string& path, const std::string& name);
// Writes x as a little-endian f4 .npy file (tests and sample dumps).
void write_npy(const std::string& path, const HostArray& x);

// One sample: the q [B, Sq, Hq, D], k and v [B, Skv, Hkv, D] of one attention call at one
// diffusion timestep.
struct Sample {
  std::string name;
  std::optional<double> timestep;
  HostArray q, k, v;
};
// `path`: a .safetensors file with tensors q, k and v, or a directory holding q.npy, k.npy and
// v.npy. Checks the shapes against each other.
Sample load_sample(const std::string& path);

struct SweepOptions {
  std::vector<double> lambdas;  // > 0
  int32_t block_m = 128;        // the tile of the skip decisions
  int32_t block_n = 128;
  double softmax_scale = 0.0;  // 0: 1 / sqrt(D)
  // Query tiles per (batch, head) walked, evenly spaced; 0: all. The keys are always all of them.
  int32_t query_tiles = 0;
};

// The result of one lambda on one sample: tile counts and the output error against the same call
// without skipping, over the walked query rows of every (batch, head).
struct SweepPoint {
  double lambda = 0.0;
  int64_t tiles_total = 0;
  int64_t tiles_skipped = 0;
  double rel_l2_error = 0.0;  // ||out - out_dense|| / ||out_dense||
  double cos_sim = 1.0;
  double max_abs_error = 0.0;
  double sparsity() const {
    return tiles_total ? static_cast<double>(tiles_skipped) / tiles_total : 0.0;
  }
};

// The sweep on the reference's tile walk (reference::dense_attend_head, the key tiles walked last
// to first as the fused kernels walk them), in fp64 on the sample's values.
std::vector<SweepPoint> sweep_reference(const Sample& sample, const SweepOptions& options);

// `count` lambdas log-spaced from lo to hi (count >= 2, 0 < lo < hi).
std::vector<double> log_spaced(double lo, double hi, int count);

struct Fit {
  double a = 0.0;
  double b = 0.0;
  int points = 0;                 // sweep points with 0 < sparsity < 1 that entered the fit
  double rms_log_residual = 0.0;  // of ln(lambda kv_len) - (ln a + b s)
};
// One observation: a lambda, the sparsity it gave and the call's kv_len.
struct Observation {
  double lambda = 0.0;
  double sparsity = 0.0;
  int64_t kv_len = 0;
};
// Least squares of ln(lambda kv_len) = ln a + b s over the observations with 0 < s < 1 (a sweep
// point that skips nothing or everything says nothing about the curve). Throws Error when fewer
// than two distinct sparsities remain.
Fit fit_curve(const std::vector<Observation>& observations);

// The sweep of one sample, for the report.
struct SampleResult {
  std::string name;
  std::optional<double> timestep;
  std::vector<int64_t> q_shape, k_shape;
  std::vector<SweepPoint> points;
};

// The report: {"calibration": {"a", "b"}, "skip_softmax" (with target_sparsity), "fit", "tiles",
// "backend", "samples": [...]} (docs/diffusion.md).
ordered_json report_json(const Fit& fit, const std::vector<SampleResult>& samples,
                         const std::string& backend, int32_t block_m, int32_t block_n,
                         std::optional<double> target_sparsity);

}  // namespace attnkit::tools::calibrate
