// `attnkit info`: version, build options, devices, and the support matrix of each backend. The
// matrix comes from attnkit::unsupported_reason(), the same code that dispatch consults.
#include <cstdio>
#include <string>
#include <vector>

#include "attnkit/attnkit.h"
#include "commands.h"

namespace attnkit::tools {
namespace {

void print_matrix(const Device& device) {
  const std::vector<Op> ops = {Op::kPrefill, Op::kDecode, Op::kAppendKv, Op::kForward, Op::kDense};
  const std::vector<Backend> backends =
      device.is_cpu() ? std::vector<Backend>{Backend::kVanilla}
                      : std::vector<Backend>{Backend::kFused, Backend::kVanilla};
  const std::vector<int32_t> head_dims = {64, 80, 96, 128, 256};
  struct DTypes {
    DType q, kv;
  };
  const std::vector<DTypes> dtypes = {{DType::kBF16, DType::kBF16},
                                      {DType::kF16, DType::kF16},
                                      {DType::kBF16, DType::kFp8E4M3},
                                      {DType::kBF16, DType::kInt8}};
  std::printf(
      "\nsupport matrix on %s (y = served; prefill and dense on the fused backend name the kernel "
      "of a 4096-token call: sm90 or a portable tile; otherwise the reason)\n",
      device.str().c_str());
  std::printf("%-9s %-13s %-16s", "backend", "op", "q / kv dtype");
  for (int32_t d : head_dims) std::printf(" D=%-4d", d);
  std::printf("\n");
  for (Backend backend : backends) {
    for (Op op : ops) {
      for (const DTypes& dt : dtypes) {
        const bool kv_matters =
            op == Op::kDecode || op == Op::kAppendKv || op == Op::kForward || op == Op::kPrefill;
        if (!kv_matters && dt.kv != dt.q) continue;
        std::vector<std::string> reasons;
        std::printf("%-9s %-13s %-16s", backend_name(backend), op_name(op),
                    (std::string(dtype_name(dt.q)) + " / " + dtype_name(dt.kv)).c_str());
        for (int32_t d : head_dims) {
          SupportQuery query{op, backend, device, dt.q, dt.kv, d};
          const std::string reason = unsupported_reason(query);
          // The fused context attention names its kernel (sm90 or a portable tile).
          const std::string kernel =
              backend == Backend::kFused && reason.empty() ? selected_kernel(query) : std::string();
          std::printf(" %-6s", reason.empty() ? (kernel.empty() ? "y" : kernel.c_str()) : "-");
          if (!reason.empty() && (reasons.empty() || reasons.back() != reason)) {
            reasons.push_back(reason);
          }
        }
        for (const std::string& reason : reasons) std::printf("  [%s]", reason.c_str());
        std::printf("\n");
      }
    }
  }
}

void run_info() {
  std::printf("attnkit %s\n", version());
  std::printf("CUDA backend: %s", built_with_cuda() ? "built" : "not built");
  if (built_with_cuda()) std::printf(" (architectures %s)", cuda_architectures().c_str());
  std::printf("\n");
  const std::vector<DeviceInfo> devices = cuda_devices();
  if (devices.empty()) {
    std::printf("CUDA devices: none visible (CPU tensors run on the reference backend)\n");
  }
  for (const DeviceInfo& d : devices) {
    std::printf("cuda:%d  %s  sm_%d%d  %d SMs  %.1f GiB  L2 %.0f MB\n", d.ordinal, d.name.c_str(),
                d.cc_major, d.cc_minor, d.sm_count, d.total_memory / 1073741824.0,
                d.l2_bytes / 1048576.0);
  }
  print_matrix(Device::cpu());
  for (const DeviceInfo& d : devices) print_matrix(Device::cuda(d.ordinal));
}

}  // namespace

void register_info_command(CLI::App& app) {
  CLI::App* info = app.add_subcommand("info", "version, build options, devices, support matrix");
  info->callback(run_info);
}

}  // namespace attnkit::tools
