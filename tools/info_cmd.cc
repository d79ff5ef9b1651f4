// `attnkit info`: version, build options, devices, and the support matrix of each backend. The
// matrix comes from attnkit::unsupported_reason(), the same code that dispatch consults. `--json`
// prints the same content as one JSON document.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "attnkit/attnkit.h"
#include "check_support.h"
#include "commands.h"

namespace attnkit::tools {
namespace {

const std::vector<int32_t> kHeadDims = {64, 80, 96, 128, 256};

// One line of the matrix: a backend, op and dtype pair over every head_dim of kHeadDims.
struct MatrixRow {
  std::string backend, op, q_dtype, kv_dtype;
  // Per head_dim: "" = not served (reason says why), else "y" or the kernel the fused backend runs.
  std::vector<std::string> served, reasons;
};

std::vector<MatrixRow> support_matrix(const Device& device) {
  const std::vector<Op> ops = {Op::kPrefill, Op::kDecode, Op::kAppendKv, Op::kForward, Op::kDense};
  const std::vector<Backend> backends =
      device.is_cpu() ? std::vector<Backend>{Backend::kVanilla}
                      : std::vector<Backend>{Backend::kFused, Backend::kVanilla};
  struct DTypes {
    DType q, kv;
  };
  const std::vector<DTypes> dtypes = {{DType::kBF16, DType::kBF16},
                                      {DType::kF16, DType::kF16},
                                      {DType::kBF16, DType::kFp8E4M3},
                                      {DType::kBF16, DType::kInt8}};
  std::vector<MatrixRow> rows;
  for (Backend backend : backends) {
    for (Op op : ops) {
      for (const DTypes& dt : dtypes) {
        const bool kv_matters =
            op == Op::kDecode || op == Op::kAppendKv || op == Op::kForward || op == Op::kPrefill;
        if (!kv_matters && dt.kv != dt.q) continue;
        MatrixRow row{backend_label(device, backend), op_name(op), dtype_name(dt.q),
                      dtype_name(dt.kv)};
        for (int32_t d : kHeadDims) {
          SupportQuery query{op, backend, device, dt.q, dt.kv, d};
          const std::string reason = unsupported_reason(query);
          // The fused context attention names its kernel (sm90 or a portable tile).
          const std::string kernel =
              backend == Backend::kFused && reason.empty() ? selected_kernel(query) : std::string();
          row.served.push_back(reason.empty() ? (kernel.empty() ? "y" : kernel) : "");
          row.reasons.push_back(reason);
        }
        rows.push_back(row);
      }
    }
  }
  return rows;
}

std::vector<Device> matrix_devices(const std::vector<DeviceInfo>& gpus) {
  std::vector<Device> devices = {Device::cpu()};
  for (const DeviceInfo& d : gpus) devices.push_back(Device::cuda(d.ordinal));
  return devices;
}

void print_matrix(const Device& device) {
  std::printf(
      "\nsupport matrix on %s (y = served; prefill and dense on the fused backend name the kernel "
      "of a 4096-token call: sm90 or a portable tile; otherwise the reason)\n",
      device.str().c_str());
  std::printf("%-9s %-13s %-16s", "backend", "op", "q / kv dtype");
  for (int32_t d : kHeadDims) std::printf(" D=%-4d", d);
  std::printf("\n");
  for (const MatrixRow& row : support_matrix(device)) {
    std::printf("%-9s %-13s %-16s", row.backend.c_str(), row.op.c_str(),
                (row.q_dtype + " / " + row.kv_dtype).c_str());
    std::vector<std::string> reasons;  // each distinct reason once, in head_dim order
    for (size_t i = 0; i < row.served.size(); ++i) {
      std::printf(" %-6s", row.served[i].empty() ? "-" : row.served[i].c_str());
      const std::string& reason = row.reasons[i];
      if (!reason.empty() && (reasons.empty() || reasons.back() != reason)) {
        reasons.push_back(reason);
      }
    }
    for (const std::string& reason : reasons) std::printf("  [%s]", reason.c_str());
    std::printf("\n");
  }
}

void print_text() {
  std::printf("attnkit %s\n", version());
  std::printf("CUDA backend: %s", built_with_cuda() ? "built" : "not built");
  if (built_with_cuda()) std::printf(" (architectures %s)", cuda_architectures().c_str());
  std::printf("\n");
  const std::vector<DeviceInfo> gpus = cuda_devices();
  if (gpus.empty()) {
    std::printf("CUDA devices: none visible (CPU tensors run on the reference backend)\n");
  }
  for (const DeviceInfo& d : gpus) {
    std::printf("cuda:%d  %s  sm_%d%d  %d SMs  %.1f GiB  L2 %.0f MB\n", d.ordinal, d.name.c_str(),
                d.cc_major, d.cc_minor, d.sm_count, d.total_memory / 1073741824.0,
                d.l2_bytes / 1048576.0);
  }
  for (const Device& device : matrix_devices(gpus)) print_matrix(device);
}

// The JSON form: {"version", "cuda": {"built", "architectures"}, "devices": [...],
// "support": [{"device", "backend", "op", "q_dtype", "kv_dtype", "head_dim", "served",
// "kernel"?, "reason"?}, ...]}, one support entry per matrix cell.
nlohmann::json info_json() {
  nlohmann::json j;
  j["version"] = version();
  j["cuda"] = {{"built", built_with_cuda()}, {"architectures", cuda_architectures()}};
  const std::vector<DeviceInfo> gpus = cuda_devices();
  j["devices"] = nlohmann::json::array();
  for (const DeviceInfo& d : gpus) {
    j["devices"].push_back(
        {{"device", Device::cuda(d.ordinal).str()},
         {"name", d.name},
         {"compute_capability", std::to_string(d.cc_major) + "." + std::to_string(d.cc_minor)},
         {"sm_count", d.sm_count},
         {"total_memory_bytes", d.total_memory},
         {"l2_bytes", d.l2_bytes}});
  }
  j["support"] = nlohmann::json::array();
  for (const Device& device : matrix_devices(gpus)) {
    for (const MatrixRow& row : support_matrix(device)) {
      for (size_t i = 0; i < kHeadDims.size(); ++i) {
        nlohmann::json cell = {{"device", device.str()},
                               {"backend", row.backend},
                               {"op", row.op},
                               {"q_dtype", row.q_dtype},
                               {"kv_dtype", row.kv_dtype},
                               {"head_dim", kHeadDims[i]},
                               {"served", !row.served[i].empty()}};
        if (!row.served[i].empty() && row.served[i] != "y") cell["kernel"] = row.served[i];
        if (!row.reasons[i].empty()) cell["reason"] = row.reasons[i];
        j["support"].push_back(cell);
      }
    }
  }
  return j;
}

}  // namespace

void register_info_command(CLI::App& app) {
  CLI::App* info = app.add_subcommand("info", "version, build options, devices, support matrix");
  static bool json = false;
  info->add_flag("--json", json, "print the same as one JSON document on stdout");
  info->callback([] {
    if (json) {
      std::printf("%s\n", info_json().dump(2).c_str());
    } else {
      print_text();
    }
  });
}

}  // namespace attnkit::tools
