// `attnkit replay`: the main job. Replays a synthetic serving trace through forward() and the
// KvCacheManager, checks sampled steps against the reference, prints throughput and cache
// statistics (docs/replay.md).
#include <unistd.h>

#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "attnkit/attnkit.h"
#include "commands.h"
#include "replay_engine.h"

namespace attnkit::tools {
namespace {

struct ReplayCli {
  ReplayOptions options;
  std::string device = "auto";
  std::string backend = "auto";
  std::string kv_dtype = "bf16";
  int32_t layers = 0;
  int32_t requests = 0;
  int64_t cache_tokens = 0;
  double host_cache_mb = 0;
  bool json = false;
  bool quiet = false;
};

// Sizes for the device, for every option the user did not give: the CPU ones finish in about a
// minute on one core through the reference backend.
void apply_defaults(ReplayOptions& o, const ReplayCli& cli, const CLI::App& cmd) {
  const bool cpu = o.device.is_cpu();
  auto set = [&](const char* option, auto& field, auto cpu_value, auto gpu_value) {
    if (cmd.count(option) == 0) field = cpu ? cpu_value : gpu_value;
  };
  o.layers = cli.layers;
  o.requests = cli.requests;
  o.cache_tokens = cli.cache_tokens;
  o.host_cache_mb = cli.host_cache_mb;
  set("--layers", o.layers, 2, 32);
  set("--requests", o.requests, 40, 128);
  set("--system-prompts", o.system_prompts, 6, 8);
  set("--system-prompt-len", o.system_prompt_len, 96, 256);
  set("--min-user-len", o.min_user_len, 4, 16);
  set("--max-user-len", o.max_user_len, 128, 512);
  set("--min-output-len", o.min_output_len, 8, 16);
  set("--max-output-len", o.max_output_len, 40, 128);
  set("--max-batch-tokens", o.max_batch_tokens, 128, 2048);
  set("--cache-tokens", o.cache_tokens, int64_t{1536}, int64_t{32768});
  set("--host-cache-mb", o.host_cache_mb, 4.0, 4096.0);
  set("--check-every", o.check_every, 4, 16);
  set("--check-seqs", o.check_max_seqs, 0, 4);
}

DType parse_kv_dtype(const std::string& name) {
  static const std::map<std::string, DType> names = {{"bf16", DType::kBF16},
                                                     {"f16", DType::kF16},
                                                     {"fp8_e4m3", DType::kFp8E4M3},
                                                     {"fp8", DType::kFp8E4M3},
                                                     {"int8", DType::kInt8}};
  const auto it = names.find(name);
  if (it == names.end()) {
    throw Error("replay: --kv-dtype must be bf16, f16, fp8_e4m3 or int8, got '" + name + "'");
  }
  return it->second;
}

// The CPU runs the reference backend ("reference", the name info and check print, or "auto"); a
// CUDA device runs "auto", "fused" or "vanilla". A backend the device cannot run is an error, not
// a switch to another one; `--backend reference` with `--device auto` selects the CPU.
Backend parse_backend(const std::string& name, const std::string& device_name, Device& device) {
  if (name == "reference") {
    if (device_name == "auto") device = Device::cpu();
    if (!device.is_cpu()) {
      throw Error("replay: --backend reference runs on the CPU, got --device " + device_name);
    }
    return Backend::kVanilla;
  }
  if (name != "auto" && name != "fused" && name != "vanilla") {
    throw Error(
        "replay: --backend must be auto, fused, vanilla (CUDA) or reference (the CPU), got '" +
        name + "'");
  }
  if (name != "auto" && device.is_cpu()) {
    throw Error("replay: --backend " + name + " needs a CUDA device, and the device is the CPU (" +
                (device_name == "auto" ? std::string("no GPU visible") : "--device cpu") +
                "); the CPU runs --backend reference or auto");
  }
  return name == "fused" ? Backend::kFused : name == "vanilla" ? Backend::kVanilla : Backend::kAuto;
}

Device parse_device(const std::string& name) {
  if (name == "auto") return cuda_devices().empty() ? Device::cpu() : Device::cuda(0);
  if (name == "cpu") return Device::cpu();
  if (name.rfind("cuda", 0) == 0) {
    int ordinal = 0;
    if (name.size() > 5 && name[4] == ':')
      ordinal = std::stoi(name.substr(5));
    else if (name != "cuda")
      ordinal = -1;
    if (ordinal >= 0) return Device::cuda(ordinal);
  }
  throw Error("replay: --device must be auto, cpu, cuda or cuda:N, got '" + name + "'");
}

// Progress: a redrawn bar when stderr is a terminal, else a line every ~10% of the requests.
class Progress {
 public:
  explicit Progress(bool quiet) : quiet_(quiet), tty_(isatty(STDERR_FILENO) != 0) {}
  void operator()(const ReplayProgress& p) {
    if (quiet_) return;
    const double rate = p.seconds > 0 ? p.tokens / p.seconds : 0.0;
    if (tty_) {
      constexpr int kWidth = 30;
      const int filled = p.total ? kWidth * p.finished / p.total : kWidth;
      std::fprintf(stderr,
                   "\r[%s%s] %d/%d requests  step %lld  running %d  waiting %d  %.0f tok/s ",
                   std::string(filled, '#').c_str(), std::string(kWidth - filled, '.').c_str(),
                   p.finished, p.total, static_cast<long long>(p.step), p.running, p.waiting, rate);
      if (p.finished == p.total) std::fputc('\n', stderr);
      std::fflush(stderr);
      return;
    }
    const int decile = p.total ? 10 * p.finished / p.total : 10;
    if (decile > last_decile_) {
      last_decile_ = decile;
      std::fprintf(stderr, "replay: %d/%d requests done, step %lld, %.1f s, %.0f tok/s\n",
                   p.finished, p.total, static_cast<long long>(p.step), p.seconds, rate);
    }
  }

 private:
  bool quiet_;
  bool tty_;
  int last_decile_ = 0;
};

double per_second(double count, double seconds) { return seconds > 0 ? count / seconds : 0.0; }

nlohmann::json to_json(const ReplayOptions& o, const ReplayResult& r) {
  nlohmann::json j;
  j["device"] = r.device;
  j["backend"] = r.backend;
  j["options"] = {{"layers", o.layers},
                  {"num_q_heads", o.num_q_heads},
                  {"num_kv_heads", o.num_kv_heads},
                  {"head_dim", o.head_dim},
                  {"requests", o.requests},
                  {"seed", o.seed},
                  {"arrival_rate", o.arrival_rate},
                  {"system_prompts", o.system_prompts},
                  {"system_prompt_len", o.system_prompt_len},
                  {"user_len", {o.min_user_len, o.max_user_len}},
                  {"output_len", {o.min_output_len, o.max_output_len}},
                  {"beam_fraction", o.beam_fraction},
                  {"beam_width", o.beam_width},
                  {"max_batch_tokens", o.max_batch_tokens},
                  {"max_batch_requests", o.max_batch_requests},
                  {"page", o.tokens_per_block},
                  {"kv_dtype", dtype_name(o.kv_dtype)},
                  {"cache_tokens", o.cache_tokens},
                  {"host_cache_mb", o.host_cache_mb},
                  {"prefix_reuse", o.prefix_reuse},
                  {"check_every", o.check_every},
                  {"check_seqs", o.check_max_seqs}};
  j["requests"] = r.requests;
  j["beam_requests"] = r.beam_requests;
  j["steps"] = r.steps;
  j["forward_calls"] = r.forward_calls;
  j["max_running"] = r.max_running;
  j["prompt_tokens"] = r.prompt_tokens;
  j["reused_prompt_tokens"] = r.reused_tokens;
  j["computed_prompt_tokens"] = r.computed_prompt_tokens;
  j["context_chunks"] = r.context_chunks;
  j["generated_tokens"] = r.generated_tokens;
  j["decode_tokens"] = r.decode_tokens;
  j["prefill_seconds"] = r.prefill_seconds;
  j["decode_seconds"] = r.decode_seconds;
  j["wall_seconds"] = r.wall_seconds;
  j["prefill_tokens_per_s"] = per_second(r.computed_prompt_tokens, r.prefill_seconds);
  j["decode_tokens_per_s"] = per_second(r.decode_tokens, r.decode_seconds);
  const KvCacheStats& c = r.cache;
  const int64_t lookups = c.hits + c.misses;
  j["cache"] = {{"hits", c.hits},
                {"misses", c.misses},
                {"hit_rate", lookups ? static_cast<double>(c.hits) / lookups : 0.0},
                {"evictions", c.evictions},
                {"offloads", c.offloads},
                {"onboards", c.onboards},
                {"cow_copies", c.cow_copies},
                {"num_blocks", c.num_blocks},
                {"host_blocks", c.host_blocks}};
  j["checks"] = {{"passed", r.checks_passed},
                 {"failed", r.checks_failed},
                 {"max_error", r.max_check_error},
                 {"failures", r.failures}};
  j["trace_digest"] = r.trace_digest;
  return j;
}

void print_summary(const ReplayOptions& o, const ReplayResult& r) {
  const KvCacheStats& c = r.cache;
  const int64_t lookups = c.hits + c.misses;
  std::printf("attnkit replay: %s, backend %s, seed %llu\n", r.device.c_str(), r.backend.c_str(),
              static_cast<unsigned long long>(o.seed));
  std::printf("  model        %d layers x (%d q heads, %d kv heads, D=%d), kv %s, page %d\n",
              o.layers, o.num_q_heads, o.num_kv_heads, o.head_dim, dtype_name(o.kv_dtype),
              o.tokens_per_block);
  std::printf("  requests     %d (%d with beam search, width %d), max %d in flight\n", r.requests,
              r.beam_requests, o.beam_width, r.max_running);
  std::printf(
      "  prompt       %lld tokens: %lld reused from the cache, %lld computed in %lld chunks\n",
      static_cast<long long>(r.prompt_tokens), static_cast<long long>(r.reused_tokens),
      static_cast<long long>(r.computed_prompt_tokens), static_cast<long long>(r.context_chunks));
  std::printf("  generated    %lld tokens (all beams)\n",
              static_cast<long long>(r.generated_tokens));
  std::printf("  steps        %lld (%lld forward batches x %d layers)\n",
              static_cast<long long>(r.steps), static_cast<long long>(r.forward_calls), o.layers);
  std::printf("  prefill      %.1f tokens/s (%.2f s in forward)\n",
              per_second(r.computed_prompt_tokens, r.prefill_seconds), r.prefill_seconds);
  std::printf("  decode       %.1f tokens/s (%.2f s in forward)\n",
              per_second(r.decode_tokens, r.decode_seconds), r.decode_seconds);
  std::printf("  wall         %.2f s\n", r.wall_seconds);
  std::printf(
      "  cache        %d blocks; hits %lld, misses %lld, hit rate %.1f%%, evictions %lld, "
      "offloads %lld, onboards %lld, cow copies %lld\n",
      c.num_blocks, static_cast<long long>(c.hits), static_cast<long long>(c.misses),
      lookups ? 100.0 * c.hits / lookups : 0.0, static_cast<long long>(c.evictions),
      static_cast<long long>(c.offloads), static_cast<long long>(c.onboards),
      static_cast<long long>(c.cow_copies));
  std::printf("  checks       %lld passed, %lld failed (every %d steps; max |out - ref| %.3g)\n",
              static_cast<long long>(r.checks_passed), static_cast<long long>(r.checks_failed),
              o.check_every, r.max_check_error);
  for (const std::string& f : r.failures) std::printf("    FAILED %s\n", f.c_str());
  std::printf("  trace digest %016llx\n", static_cast<unsigned long long>(r.trace_digest));
}

int run(ReplayCli& cli, const CLI::App& cmd) {
  ReplayOptions& o = cli.options;
  o.device = parse_device(cli.device);
  o.backend = parse_backend(cli.backend, cli.device, o.device);
  o.kv_dtype = parse_kv_dtype(cli.kv_dtype);
  apply_defaults(o, cli, cmd);
  if (o.device.is_cpu()) {
    if (cmd.count("--layers") == 0 && !cli.quiet && !cli.json) {
      std::fprintf(stderr,
                   "replay: no GPU, running the reference backend with %d of 32 layers "
                   "(--layers to change)\n",
                   o.layers);
    }
  }
  Progress progress(cli.quiet);
  o.on_step = [&](const ReplayProgress& p) { progress(p); };
  const ReplayResult r = run_replay(o);
  if (cli.json) {
    std::printf("%s\n", to_json(o, r).dump(2).c_str());
  } else {
    print_summary(o, r);
  }
  return r.checks_failed == 0 ? 0 : 1;
}

}  // namespace

void register_replay_command(CLI::App& app) {
  auto cli = std::make_shared<ReplayCli>();
  ReplayOptions& o = cli->options;
  CLI::App* cmd = app.add_subcommand(
      "replay", "Replay a synthetic serving trace through forward() and the KV-cache manager");
  cmd->add_option("--device", cli->device, "auto, cpu, cuda or cuda:N (auto: cuda:0 if present)")
      ->capture_default_str();
  cmd->add_option("--backend", cli->backend,
                  "auto, fused or vanilla on a GPU; reference (or auto) on the CPU")
      ->capture_default_str();
  cmd->add_option("--layers", cli->layers, "attention layers (default 2 on the CPU, 32 on a GPU)");
  cmd->add_option("--requests", cli->requests, "requests in the trace (default 40 CPU, 128 GPU)");
  cmd->add_option("--seed", o.seed, "trace and activation seed")->capture_default_str();
  cmd->add_option("--arrival-rate", o.arrival_rate, "mean arrivals per step (0: all at once)")
      ->capture_default_str();
  cmd->add_option("--system-prompts", o.system_prompts,
                  "distinct shared system prompts (default: CPU 6, GPU 8)");
  cmd->add_option("--system-prompt-len", o.system_prompt_len,
                  "tokens of each system prompt (default: CPU 96, GPU 256)");
  cmd->add_option("--min-user-len", o.min_user_len,
                  "shortest own prompt part (default: CPU 4, GPU 16)");
  cmd->add_option("--max-user-len", o.max_user_len,
                  "longest own prompt part (default: CPU 128, GPU 512)");
  cmd->add_option("--min-output-len", o.min_output_len,
                  "fewest generated tokens (default: CPU 8, GPU 16)");
  cmd->add_option("--max-output-len", o.max_output_len,
                  "most generated tokens (default: CPU 40, GPU 128)");
  cmd->add_option("--beam-fraction", o.beam_fraction, "share of requests using beam search")
      ->capture_default_str();
  cmd->add_option("--beam-width", o.beam_width, "beams of a beam-search request")
      ->capture_default_str();
  cmd->add_option("--max-batch-tokens", o.max_batch_tokens,
                  "token budget of one step (default: CPU 128, GPU 2048)");
  cmd->add_option("--max-batch-requests", o.max_batch_requests, "requests in flight at once")
      ->capture_default_str();
  cmd->add_option("--page", o.tokens_per_block, "tokens per cache block: 8, 16, 32, 64, 128")
      ->capture_default_str();
  cmd->add_option("--kv-dtype", cli->kv_dtype, "cache dtype: bf16, f16, fp8_e4m3, int8")
      ->capture_default_str();
  cmd->add_option("--cache-tokens", cli->cache_tokens,
                  "KV pool size in tokens (default 1536 CPU, 32768 GPU; 0 on a GPU: 0.9 of free "
                  "memory)");
  cmd->add_option("--host-cache-mb", cli->host_cache_mb,
                  "host offload tier in MiB (default 4 CPU, 4096 GPU; 0 = off)");
  cmd->add_flag("!--no-prefix-reuse", o.prefix_reuse, "turn prefix reuse off");
  cmd->add_option("--check-every", o.check_every,
                  "check every Nth step against an independent recomputation (0 = never) (default: "
                  "CPU 4, GPU 16)");
  cmd->add_option("--check-seqs", o.check_max_seqs,
                  "sequences checked per checked batch, evenly spaced (0 = all; default: CPU 0, "
                  "GPU 4)");
  cmd->add_flag("--json", cli->json, "print the summary as JSON on stdout");
  cmd->add_flag("--quiet", cli->quiet, "no progress output");
  cmd->add_flag("--inject-fault", o.inject_fault,
                "corrupt one checked output element (shows that the checks can fail)");
  cmd->callback([cli, cmd]() {
    const int rc = run(*cli, *cmd);
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace attnkit::tools
