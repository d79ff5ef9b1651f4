// `attnkit calibrate` without a GPU: the fit of lambda = a exp(b s) / kv_len on synthetic
// observations (exact and noisy), the .npy / .safetensors readers, the reference sweep on
// diffusion-like samples (sparsity grows with lambda, error with sparsity), and the program end to
// end: its report's skip_softmax object is accepted by AttentionConfig.
#include "calibrate.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "attnkit/config.h"
#include "attnkit/types.h"
#include "common/diffusion_like_data.h"
#include "common/test_util.h"
#include "core/numerics.h"

namespace attnkit::tools::calibrate {
namespace {

namespace fs = std::filesystem;

fs::path temp_dir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() /
                       ("attnkit_calibrate_" + name + "_" + std::to_string(test::test_seed()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

TEST(CalibrateFit, RecoversTheCurveFromExactPoints) {
  std::mt19937_64 rng(test::test_seed());
  std::uniform_real_distribution<double> a_dist(0.5, 500.0), b_dist(-2.0, 8.0), s_dist(0.02, 0.98);
  const double a = a_dist(rng), b = b_dist(rng);
  std::vector<Observation> obs;
  for (int i = 0; i < 12; ++i) {
    const double s = s_dist(rng);
    const int64_t kv_len = i % 2 ? 4096 : 1000;  // two sequence lengths: lambda scales with 1/kv
    obs.push_back({a * std::exp(b * s) / static_cast<double>(kv_len), s, kv_len});
  }
  // Points that skip nothing or everything carry no information and are left out.
  obs.push_back({1e-9, 0.0, 1000});
  obs.push_back({1e9, 1.0, 1000});
  const Fit fit = fit_curve(obs);
  EXPECT_EQ(fit.points, 12);
  EXPECT_NEAR(fit.a, a, 1e-9 * a);
  EXPECT_NEAR(fit.b, b, 1e-9 * (1.0 + std::fabs(b)));
  EXPECT_LT(fit.rms_log_residual, 1e-9);
}

TEST(CalibrateFit, NoisyPointsFitInLogSpace) {
  std::mt19937_64 rng(test::test_seed() + 1);
  std::normal_distribution<double> noise(0.0, 0.05);
  const double a = 30.0, b = 4.0;
  std::vector<Observation> obs;
  for (int i = 1; i < 200; ++i) {
    const double s = i / 200.0;
    obs.push_back({a * std::exp(b * s + noise(rng)) / 2048.0, s, 2048});
  }
  const Fit fit = fit_curve(obs);
  EXPECT_NEAR(std::log(fit.a), std::log(a), 0.05);
  EXPECT_NEAR(fit.b, b, 0.1);
  EXPECT_NEAR(fit.rms_log_residual, 0.05, 0.015);
}

TEST(CalibrateFit, TooFewUsablePointsRaise) {
  const std::vector<Observation> saturated = {{1e-3, 0.0, 100}, {1.0, 1.0, 100}, {0.1, 0.5, 100}};
  EXPECT_THROW(fit_curve(saturated), Error);
  const std::vector<Observation> same_s = {{0.1, 0.5, 100}, {0.2, 0.5, 100}};
  EXPECT_THROW(fit_curve(same_s), Error);
  EXPECT_THROW(log_spaced(1.0, 0.5, 4), Error);
  const std::vector<double> l = log_spaced(1e-4, 1.0, 5);
  ASSERT_EQ(l.size(), 5u);
  EXPECT_NEAR(l[2], 1e-2, 1e-15);
}

TEST(CalibrateRead, NpyRoundTripAndFormats) {
  const fs::path dir = temp_dir("npy");
  HostArray x{{2, 3, 1, 4}, {}};
  std::mt19937_64 rng(test::test_seed() + 2);
  std::uniform_real_distribution<float> u(-3.f, 3.f);
  for (int i = 0; i < 24; ++i) x.data.push_back(u(rng));
  write_npy((dir / "x.npy").string(), x);
  const HostArray y = read_npy((dir / "x.npy").string());
  EXPECT_EQ(y.shape, x.shape);
  EXPECT_EQ(y.data, x.data);
  // A float16 file written by hand (format 1.0, the header padded to 64 bytes).
  std::string header = "{'descr': '<f2', 'fortran_order': False, 'shape': (3,), }";
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::ofstream f((dir / "h.npy").string(), std::ios::binary);
  f.write("\x93NUMPY\x01\x00", 8);
  const char len[2] = {static_cast<char>(header.size()), 0};
  f.write(len, 2);
  f << header;
  for (float v : {1.5f, -2.0f, 0.25f}) {
    const uint16_t h = numerics::float_to_f16_bits(v);
    f.write(reinterpret_cast<const char*>(&h), 2);
  }
  f.close();
  const HostArray h = read_npy((dir / "h.npy").string());
  EXPECT_EQ(h.shape, std::vector<int64_t>{3});
  EXPECT_EQ(h.data, (std::vector<float>{1.5f, -2.0f, 0.25f}));
  // Not an npy file, a big-endian dtype.
  std::ofstream((dir / "bad.npy").string()) << "hello";
  EXPECT_THROW(read_npy((dir / "bad.npy").string()), Error);
  std::string be = header;
  be.replace(be.find("<f2"), 3, ">f4");
  std::ofstream g((dir / "be.npy").string(), std::ios::binary);
  g.write("\x93NUMPY\x01\x00", 8);
  g.write(len, 2);
  g << be;
  g.close();
  EXPECT_THROW(read_npy((dir / "be.npy").string()), Error);
  fs::remove_all(dir);
}

TEST(CalibrateRead, SafetensorsTensorsByName) {
  const fs::path dir = temp_dir("st");
  // Two tensors: "q" bf16 [2, 2] and "k" f32 [3].
  const std::vector<float> qv = {1.0f, -0.5f, 2.0f, 0.125f}, kv = {3.0f, 4.5f, -1.0f};
  std::string data;
  for (float v : qv) {
    const uint16_t b = numerics::float_to_bf16_bits(v);
    data.append(reinterpret_cast<const char*>(&b), 2);
  }
  for (float v : kv) data.append(reinterpret_cast<const char*>(&v), 4);
  const std::string header =
      R"({"__metadata__": {"step": "7"}, "q": {"dtype": "BF16", "shape": [2, 2], )"
      R"("data_offsets": [0, 8]}, "k": {"dtype": "F32", "shape": [3], "data_offsets": [8, 20]}})";
  std::ofstream f((dir / "s.safetensors").string(), std::ios::binary);
  const uint64_t n = header.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f << header << data;
  f.close();
  const HostArray q = read_safetensors((dir / "s.safetensors").string(), "q");
  EXPECT_EQ(q.shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(q.data, qv);
  EXPECT_EQ(read_safetensors((dir / "s.safetensors").string(), "k").data, kv);
  EXPECT_THROW(read_safetensors((dir / "s.safetensors").string(), "v"), Error);
  fs::remove_all(dir);
}

// A diffusion-like sample as q.npy / k.npy / v.npy in `dir`.
void write_sample(const fs::path& dir, int64_t s, int64_t h, int64_t d, uint64_t salt) {
  test::HostTensor q(DType::kF32, {1, s, h, d}), k(DType::kF32, {1, s, h, d}),
      v(DType::kF32, {1, s, h, d});
  std::mt19937_64 rng(test::test_seed() + salt);
  test::fill_diffusion_like(q, k, v, rng);
  fs::create_directories(dir);
  for (const auto& [name, t] : {std::pair{"q", &q}, std::pair{"k", &k}, std::pair{"v", &v}}) {
    HostArray a{{1, s, h, d}, std::vector<float>(t->data<float>(), t->data<float>() + t->numel())};
    write_npy((dir / (std::string(name) + ".npy")).string(), a);
  }
}

TEST(CalibrateSweep, SparsityAndErrorGrowWithLambda) {
  const fs::path dir = temp_dir("sweep");
  write_sample(dir / "t0", 256, 2, 64, 3);
  const Sample sample = load_sample((dir / "t0").string());
  SweepOptions o;
  o.lambdas = {1e-12, 1e-4, 1e-2, 1e-1, 0.9};
  o.block_m = 32;
  o.block_n = 32;
  const std::vector<SweepPoint> points = sweep_reference(sample, o);
  ASSERT_EQ(points.size(), o.lambdas.size());
  for (const SweepPoint& p : points) {
    EXPECT_EQ(p.tiles_total, 2 * 8 * 8);
    EXPECT_LE(p.cos_sim, 1.0 + 1e-12);
    // Nothing skipped: the plain walk exactly.
    if (p.tiles_skipped == 0) EXPECT_EQ(p.rel_l2_error, 0.0);
  }
  // (Decisions are not nested in lambda: a skipped tile leaves the running maximum lower for the
  // next ones. The ends of the sweep are far enough apart to compare.)
  EXPECT_EQ(points.front().tiles_skipped, 0);
  EXPECT_GT(points.back().sparsity(), 0.3);
  EXPECT_GT(points.back().rel_l2_error, 1e-3);
  EXPECT_LT(points.back().cos_sim, 1.0);
  // Four of the eight query tiles, evenly spaced: half the tiles.
  o.query_tiles = 4;
  EXPECT_EQ(sweep_reference(sample, o)[0].tiles_total, 2 * 4 * 8);
  fs::remove_all(dir);
}

#ifdef ATTNKIT_PROGRAM
TEST(CalibrateCommand, ReportFeedsAConfig) {
  const fs::path dir = temp_dir("cmd");
  write_sample(dir / "t9", 256, 2, 64, 4);
  write_sample(dir / "t5", 256, 2, 64, 5);
  const std::string report = (dir / "report.json").string();
  const std::string cmd = std::string(ATTNKIT_PROGRAM) + " calibrate " + (dir / "t9").string() +
                          " " + (dir / "t5").string() +
                          " --timesteps 0.9,0.5 --backend reference --block-m 32 --block-n 32 "
                          "--lambda-min 1e-4 --lambda-max 0.5 --points 9 --target-sparsity 0.5 "
                          "--json --output " +
                          report + " > " + (dir / "stdout.json").string();
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(report);
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_GT(j["calibration"]["a"].get<double>(), 0.0);
  EXPECT_GT(j["calibration"]["b"].get<double>(), 0.0);  // more skipping needs a larger lambda
  EXPECT_EQ(j["samples"].size(), 2u);
  EXPECT_EQ(j["samples"][1]["timestep"].get<double>(), 0.5);
  EXPECT_EQ(j["samples"][0]["sweep"].size(), 9u);
  EXPECT_EQ(j["tiles"]["block_m"].get<int>(), 32);
  // The skip_softmax object is a valid config entry with the fitted curve.
  const std::string config_text =
      nlohmann::json{{"default", {{"skip_softmax", j["skip_softmax"]}}}}.dump();
  const AttentionConfig config = AttentionConfig::from_json(config_text);
  SkipSoftmaxSpec skip = *config.resolve("self").skip_softmax;
  EXPECT_EQ(skip.target_sparsity, 0.5);
  EXPECT_EQ(skip.calibration_a, j["calibration"]["a"].get<double>());
  // At a sparsity the sweep measured (its middle point), the curve gives a lambda inside the
  // swept range.
  skip.target_sparsity = j["samples"][0]["sweep"][4]["sparsity"].get<double>();
  ASSERT_GT(*skip.target_sparsity, 0.0);
  const double lambda = skip.lambda(256);
  EXPECT_GT(lambda, 1e-4);
  EXPECT_LT(lambda, 0.5);
  // Bad arguments exit 1 with a message.
  const std::string bad = std::string(ATTNKIT_PROGRAM) + " calibrate " + (dir / "t9").string() +
                          " --timesteps 0.9,0.5 --backend reference 2> " +
                          (dir / "err.txt").string();
  EXPECT_NE(std::system(bad.c_str()), 0);
  std::ifstream err((dir / "err.txt").string());
  const std::string message{std::istreambuf_iterator<char>(err), std::istreambuf_iterator<char>()};
  EXPECT_NE(message.find("--timesteps"), std::string::npos) << message;
  fs::remove_all(dir);
}
#endif

}  // namespace
}  // namespace attnkit::tools::calibrate
