// attnkit calibrate without the GPU: readers, the reference sweep, the fit, the report
// (calibrate.h).
#include "calibrate.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <sstream>

#include "attnkit/types.h"
#include "core/numerics.h"
#include "reference/dense_ref.h"

namespace attnkit::tools::calibrate {
namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("calibrate: " + path + ": cannot be opened");
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

int64_t element_count(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Little-endian values of `bytes` per element, widened to float.
std::vector<float> widen(const char* raw, int64_t count, const std::string& kind,
                         const std::string& what) {
  std::vector<float> out(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    if (kind == "f4") {
      std::memcpy(&out[i], raw + 4 * i, 4);
    } else if (kind == "f8") {
      double x;
      std::memcpy(&x, raw + 8 * i, 8);
      out[i] = static_cast<float>(x);
    } else {
      uint16_t h;
      std::memcpy(&h, raw + 2 * i, 2);
      out[i] = kind == "f2" ? numerics::f16_bits_to_float(h) : numerics::bf16_bits_to_float(h);
    }
  }
  for (float x : out) {
    if (!std::isfinite(x)) throw Error("calibrate: " + what + " holds a non-finite value");
  }
  return out;
}

int element_bytes(const std::string& kind) { return kind == "f8" ? 8 : kind == "f4" ? 4 : 2; }

// The value of `key` in a .npy header, a Python dict literal.
std::string npy_field(const std::string& header, const std::string& key, const std::string& path) {
  const size_t at = header.find("'" + key + "'");
  if (at == std::string::npos) throw Error("calibrate: " + path + ": npy header has no " + key);
  size_t pos = header.find(':', at);
  if (pos == std::string::npos) throw Error("calibrate: " + path + ": malformed npy header");
  ++pos;
  while (pos < header.size() && header[pos] == ' ') ++pos;
  const char open = header[pos];
  const char close = open == '(' ? ')' : open == '\'' ? '\'' : ',';
  const size_t end = header.find(close, pos + 1);
  if (end == std::string::npos) throw Error("calibrate: " + path + ": malformed npy header");
  return header.substr(open == '(' || open == '\'' ? pos + 1 : pos,
                       end - (open == '(' || open == '\'' ? pos + 1 : pos));
}

void check_4d(const HostArray& x, const std::string& what) {
  if (x.shape.size() != 4) {
    throw Error("calibrate: " + what + " must be [B, S, H, D], got " +
                std::to_string(x.shape.size()) + " dimensions");
  }
}

}  // namespace

HostArray read_npy(const std::string& path) {
  const std::string bytes = read_file(path);
  if (bytes.size() < 10 || bytes.compare(0, 6, "\x93NUMPY") != 0) {
    throw Error("calibrate: " + path + ": not a .npy file");
  }
  const int major = static_cast<unsigned char>(bytes[6]);
  size_t header_len = 0, offset = 0;
  if (major == 1) {
    header_len = static_cast<unsigned char>(bytes[8]) | static_cast<unsigned char>(bytes[9]) << 8;
    offset = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) throw Error("calibrate: " + path + ": truncated .npy header");
    for (int i = 0; i < 4; ++i)
      header_len |= size_t{static_cast<unsigned char>(bytes[8 + i])} << (8 * i);
    offset = 12;
  } else {
    throw Error("calibrate: " + path + ": npy format version " + std::to_string(major) +
                " (accepted: 1, 2, 3)");
  }
  if (bytes.size() < offset + header_len) {
    throw Error("calibrate: " + path + ": truncated .npy header");
  }
  const std::string header = bytes.substr(offset, header_len);
  const std::string descr = npy_field(header, "descr", path);
  if (descr != "<f2" && descr != "<f4" && descr != "<f8") {
    throw Error("calibrate: " + path + ": dtype '" + descr +
                "' (accepted: little-endian float16, float32, float64)");
  }
  if (npy_field(header, "fortran_order", path).find("False") == std::string::npos) {
    throw Error("calibrate: " + path + ": Fortran order (accepted: C order)");
  }
  HostArray x;
  std::stringstream dims(npy_field(header, "shape", path));
  std::string item;
  while (std::getline(dims, item, ',')) {
    if (item.find_first_not_of(' ') == std::string::npos) continue;
    x.shape.push_back(std::stoll(item));
  }
  const int64_t count = element_count(x.shape);
  const std::string kind = descr.substr(1);
  const size_t data_at = offset + header_len;
  if (bytes.size() - data_at < static_cast<size_t>(count) * element_bytes(kind)) {
    throw Error("calibrate: " + path + ": truncated data");
  }
  x.data = widen(bytes.data() + data_at, count, kind, path);
  return x;
}

HostArray read_safetensors(const std::string& path, const std::string& name) {
  const std::string bytes = read_file(path);
  if (bytes.size() < 8) throw Error("calibrate: " + path + ": not a .safetensors file");
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i)
    header_len |= uint64_t{static_cast<unsigned char>(bytes[i])} << (8 * i);
  if (header_len > bytes.size() - 8) throw Error("calibrate: " + path + ": truncated header");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.substr(8, header_len));
  } catch (const nlohmann::json::exception& e) {
    throw Error("calibrate: " + path + ": invalid safetensors header (" + e.what() + ")");
  }
  if (!header.is_object() || !header.contains(name)) {
    throw Error("calibrate: " + path + ": no tensor named '" + name + "'");
  }
  const nlohmann::json& entry = header[name];
  try {
    const std::string dtype = entry.at("dtype").get<std::string>();
    const std::string kind = dtype == "F16"    ? "f2"
                             : dtype == "BF16" ? "bf"
                             : dtype == "F32"  ? "f4"
                             : dtype == "F64"  ? "f8"
                                               : "";
    if (kind.empty()) {
      throw Error("calibrate: " + path + ": tensor '" + name + "' has dtype " + dtype +
                  " (accepted: F16, BF16, F32, F64)");
    }
    HostArray x;
    x.shape = entry.at("shape").get<std::vector<int64_t>>();
    const std::vector<uint64_t> offsets = entry.at("data_offsets").get<std::vector<uint64_t>>();
    if (offsets.size() != 2) {
      throw Error("calibrate: " + path + ": tensor '" + name + "' has bad data_offsets");
    }
    const uint64_t begin = 8 + header_len + offsets[0], end = 8 + header_len + offsets[1];
    const int64_t count = element_count(x.shape);
    if (end < begin || end > bytes.size() ||
        end - begin != static_cast<uint64_t>(count) * element_bytes(kind)) {
      throw Error("calibrate: " + path + ": tensor '" + name + "' has bad data_offsets");
    }
    x.data = widen(bytes.data() + begin, count, kind, path + " (" + name + ")");
    return x;
  } catch (const nlohmann::json::exception& e) {
    throw Error("calibrate: " + path + ": tensor '" + name + "': " + e.what());
  }
}

void write_npy(const std::string& path, const HostArray& x) {
  std::string shape = "(";
  for (int64_t d : x.shape) shape += std::to_string(d) + ", ";
  shape += ")";
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape + ", }";
  // Version 1.0: the data starts at a multiple of 64 bytes, the header ends with a newline.
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::ofstream out(path, std::ios::binary);
  if (!out) throw Error("calibrate: " + path + ": cannot be written");
  out.write("\x93NUMPY\x01\x00", 8);
  const char len[2] = {static_cast<char>(header.size() & 0xff),
                       static_cast<char>(header.size() >> 8)};
  out.write(len, 2);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(reinterpret_cast<const char*>(x.data.data()),
            static_cast<std::streamsize>(x.data.size() * sizeof(float)));
}

Sample load_sample(const std::string& path) {
  Sample s;
  s.name = path;
  if (std::filesystem::is_directory(path)) {
    const std::filesystem::path dir(path);
    s.q = read_npy((dir / "q.npy").string());
    s.k = read_npy((dir / "k.npy").string());
    s.v = read_npy((dir / "v.npy").string());
  } else if (path.size() > 12 && path.compare(path.size() - 12, 12, ".safetensors") == 0) {
    s.q = read_safetensors(path, "q");
    s.k = read_safetensors(path, "k");
    s.v = read_safetensors(path, "v");
  } else {
    throw Error("calibrate: sample " + path +
                ": expected a .safetensors file (tensors q, k, v) or a directory with q.npy, k.npy "
                "and v.npy");
  }
  check_4d(s.q, path + ": q");
  check_4d(s.k, path + ": k");
  check_4d(s.v, path + ": v");
  const auto& q = s.q.shape;
  const auto& k = s.k.shape;
  if (k != s.v.shape || k[0] != q[0] || k[3] != q[3] || k[2] <= 0 || q[2] % k[2] != 0) {
    throw Error("calibrate: " + path +
                ": expected q [B, Sq, Hq, D], k and v [B, Skv, Hkv, D] with Hkv dividing Hq");
  }
  return s;
}

std::vector<double> log_spaced(double lo, double hi, int count) {
  if (!(lo > 0.0 && hi > lo && count >= 2)) {
    throw Error("calibrate: the lambda sweep needs 0 < lambda_min < lambda_max and >= 2 points");
  }
  std::vector<double> out;
  for (int i = 0; i < count; ++i) {
    out.push_back(std::exp(std::log(lo) + (std::log(hi) - std::log(lo)) * i / (count - 1)));
  }
  return out;
}

std::vector<SweepPoint> sweep_reference(const Sample& sample, const SweepOptions& options) {
  const int64_t batch = sample.q.shape[0], sq = sample.q.shape[1], hq = sample.q.shape[2];
  const int64_t dim = sample.q.shape[3], skv = sample.k.shape[1], hkv = sample.k.shape[2];
  const int32_t d = static_cast<int32_t>(dim);
  reference::DenseTileRule rule;
  rule.block_m = options.block_m;
  rule.block_n = options.block_n;
  rule.softmax_scale = options.softmax_scale > 0.0 ? options.softmax_scale
                                                   : 1.0 / std::sqrt(static_cast<double>(dim));
  rule.last_tile_first = true;  // the fused kernels' order
  // The walked query tiles, evenly spaced.
  const int64_t q_tiles = (sq + options.block_m - 1) / options.block_m;
  std::vector<int64_t> tiles;
  const int64_t walked =
      options.query_tiles > 0 ? std::min<int64_t>(options.query_tiles, q_tiles) : q_tiles;
  for (int64_t i = 0; i < walked; ++i) {
    tiles.push_back(walked == 1 ? 0 : i * (q_tiles - 1) / (walked - 1));
  }
  std::vector<SweepPoint> points(options.lambdas.size());
  std::vector<double> err2(points.size(), 0.0), dot(points.size(), 0.0), norm2(points.size(), 0.0);
  double ref2 = 0.0;
  std::vector<double> qh, kh(static_cast<size_t>(skv * dim)), vh(kh.size());
  std::vector<double> plain, out, lse;
  const std::vector<float> ones(static_cast<size_t>(std::max(sq, std::max(skv, dim))), 1.0f);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t hk = h / (hq / hkv);
      for (int64_t j = 0; j < skv; ++j) {
        for (int64_t c = 0; c < dim; ++c) {
          const size_t at = static_cast<size_t>(((b * skv + j) * hkv + hk) * dim + c);
          kh[j * dim + c] = sample.k.data[at];
          vh[j * dim + c] = sample.v.data[at];
        }
      }
      for (int64_t t : tiles) {
        const int64_t m0 = t * options.block_m;
        const int64_t rows = std::min<int64_t>(options.block_m, sq - m0);
        qh.resize(static_cast<size_t>(rows * dim));
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t c = 0; c < dim; ++c) {
            qh[r * dim + c] =
                sample.q.data[static_cast<size_t>(((b * sq + m0 + r) * hq + h) * dim + c)];
          }
        }
        plain.resize(qh.size());
        out.resize(qh.size());
        lse.resize(static_cast<size_t>(rows));
        rule.skip = false;
        reference::dense_attend_head(qh.data(), ones.data(), kh.data(), ones.data(), vh.data(),
                                     ones.data(), rows, skv, d, rule, plain.data(), lse.data());
        for (double x : plain) ref2 += x * x;
        for (size_t i = 0; i < points.size(); ++i) {
          rule.skip = true;
          rule.log_lambda = std::log(options.lambdas[i]);
          const reference::DenseTileCounts counts = reference::dense_attend_head(
              qh.data(), ones.data(), kh.data(), ones.data(), vh.data(), ones.data(), rows, skv, d,
              rule, out.data(), lse.data());
          points[i].tiles_total += counts.total;
          points[i].tiles_skipped += counts.skipped;
          for (size_t e = 0; e < out.size(); ++e) {
            const double diff = out[e] - plain[e];
            err2[i] += diff * diff;
            dot[i] += out[e] * plain[e];
            norm2[i] += out[e] * out[e];
            points[i].max_abs_error = std::max(points[i].max_abs_error, std::fabs(diff));
          }
        }
      }
    }
  }
  for (size_t i = 0; i < points.size(); ++i) {
    points[i].lambda = options.lambdas[i];
    points[i].rel_l2_error = ref2 > 0.0 ? std::sqrt(err2[i] / ref2) : 0.0;
    points[i].cos_sim = ref2 > 0.0 && norm2[i] > 0.0 ? dot[i] / std::sqrt(ref2 * norm2[i]) : 0.0;
  }
  return points;
}

Fit fit_curve(const std::vector<Observation>& observations) {
  std::vector<std::pair<double, double>> xy;  // (s, ln(lambda kv_len))
  for (const Observation& o : observations) {
    if (o.sparsity > 0.0 && o.sparsity < 1.0 && o.lambda > 0.0 && o.kv_len > 0) {
      xy.emplace_back(o.sparsity, std::log(o.lambda * static_cast<double>(o.kv_len)));
    }
  }
  double mx = 0.0, my = 0.0;
  for (const auto& [x, y] : xy) {
    mx += x;
    my += y;
  }
  const double n = static_cast<double>(xy.size());
  if (xy.size() >= 2) {
    mx /= n;
    my /= n;
  }
  double sxx = 0.0, sxy = 0.0;
  for (const auto& [x, y] : xy) {
    sxx += (x - mx) * (x - mx);
    sxy += (x - mx) * (y - my);
  }
  if (xy.size() < 2 || !(sxx > 0.0)) {
    throw Error(
        "calibrate: fewer than two sweep points with distinct sparsities strictly between 0 and 1 "
        "(" +
        std::to_string(xy.size()) +
        " in range); widen or refine the sweep (--lambda-min, --lambda-max, --points)");
  }
  Fit fit;
  fit.b = sxy / sxx;
  fit.a = std::exp(my - fit.b * mx);
  fit.points = static_cast<int>(xy.size());
  double r2 = 0.0;
  for (const auto& [x, y] : xy) {
    const double r = y - (std::log(fit.a) + fit.b * x);
    r2 += r * r;
  }
  fit.rms_log_residual = std::sqrt(r2 / n);
  return fit;
}

ordered_json report_json(const Fit& fit, const std::vector<SampleResult>& samples,
                         const std::string& backend, int32_t block_m, int32_t block_n,
                         std::optional<double> target_sparsity) {
  ordered_json report;
  report["calibration"] = {{"a", fit.a}, {"b", fit.b}};
  if (target_sparsity) {
    report["skip_softmax"] = {{"target_sparsity", *target_sparsity},
                              {"calibration", report["calibration"]}};
  }
  report["fit"] = {{"model", "lambda = a * exp(b * s) / kv_len"},
                   {"points", fit.points},
                   {"rms_log_residual", fit.rms_log_residual}};
  report["tiles"] = {{"block_m", block_m}, {"block_n", block_n}, {"order", "last_tile_first"}};
  report["backend"] = backend;
  ordered_json list = ordered_json::array();
  for (const SampleResult& s : samples) {
    ordered_json item;
    item["name"] = s.name;
    item["timestep"] = s.timestep ? ordered_json(*s.timestep) : ordered_json(nullptr);
    item["q_shape"] = s.q_shape;
    item["k_shape"] = s.k_shape;
    ordered_json sweep = ordered_json::array();
    for (const SweepPoint& p : s.points) {
      sweep.push_back({{"lambda", p.lambda},
                       {"sparsity", p.sparsity()},
                       {"tiles_total", p.tiles_total},
                       {"tiles_skipped", p.tiles_skipped},
                       {"rel_l2_error", p.rel_l2_error},
                       {"cos_sim", p.cos_sim},
                       {"max_abs_error", p.max_abs_error}});
    }
    item["sweep"] = sweep;
    list.push_back(item);
  }
  report["samples"] = list;
  return report;
}

}  // namespace attnkit::tools::calibrate
