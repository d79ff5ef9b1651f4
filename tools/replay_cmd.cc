// `attnkit replay`: the main job. Replays a synthetic serving trace through forward() and the
// KvCacheManager, checks sampled steps against the reference, prints throughput and cache
// statistics (docs/replay.md).
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

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

// Sizes for the device, for every option the user did not give. The CPU ones finish in about a
// minute on one core through the reference backend. The GPU ones are a serving load for one
// H200 that finishes in about a minute with forward() most of the wall time (docs/replay.md,
// "Defaults"): Llama-3-8B's 32 layers, prompts up to 8k tokens behind 8 shared 1k-token system
// prompts, outputs up to 512 tokens, the pool at 0.9 of the free memory, checks on host threads.
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
  set("--requests", o.requests, 40, 512);
  set("--system-prompts", o.system_prompts, 6, 8);
  set("--system-prompt-len", o.system_prompt_len, 96, 1024);
  set("--min-user-len", o.min_user_len, 4, 32);
  set("--max-user-len", o.max_user_len, 128, 7168);
  set("--min-output-len", o.min_output_len, 8, 16);
  set("--max-output-len", o.max_output_len, 40, 512);
  set("--max-batch-tokens", o.max_batch_tokens, 128, 8192);
  set("--max-batch-requests", o.max_batch_requests, 64, 256);
  set("--cache-tokens", o.cache_tokens, int64_t{1536}, int64_t{0});
  set("--host-cache-mb", o.host_cache_mb, 4.0, 4096.0);
  set("--check-every", o.check_every, 4, 32);
  set("--check-seqs", o.check_max_seqs, 0, 4);
  set("--check-rows", o.check_rows, 0, 2);
  // Leave a core to the step loop and one to the driver's threads.
  const int32_t hardware = static_cast<int32_t>(std::thread::hardware_concurrency());
  set("--check-threads", o.check_threads, 0, std::max(1, hardware - 2));
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

// Progress: a redrawn bar when stderr is a terminal, else a line every ~10% of the requests. The
// rate is the engine's: tokens run through forward() per second spent inside it.
class Progress {
 public:
  explicit Progress(bool quiet) : quiet_(quiet), tty_(isatty(STDERR_FILENO) != 0) {}
  void operator()(const ReplayProgress& p) {
    if (quiet_) return;
    const double rate = p.forward_seconds > 0 ? p.forward_tokens / p.forward_seconds : 0.0;
    const double share = p.seconds > 0 ? 100.0 * p.forward_seconds / p.seconds : 0.0;
    if (tty_) {
      constexpr int kWidth = 30;
      const int filled = p.total ? kWidth * p.finished / p.total : kWidth;
      std::fprintf(stderr,
                   "\r[%s%s] %d/%d requests  step %lld  running %d  waiting %d  %.0f tok/s in "
                   "forward (%.0f%% of wall) ",
                   std::string(filled, '#').c_str(), std::string(kWidth - filled, '.').c_str(),
                   p.finished, p.total, static_cast<long long>(p.step), p.running, p.waiting, rate,
                   share);
      if (p.finished == p.total) std::fputc('\n', stderr);
      std::fflush(stderr);
      return;
    }
    const int decile = p.total ? 10 * p.finished / p.total : 10;
    if (decile > last_decile_) {
      last_decile_ = decile;
      std::fprintf(stderr,
                   "replay: %d/%d requests done, step %lld, %.1f s, %.0f tok/s in forward (%.0f%% "
                   "of wall)\n",
                   p.finished, p.total, static_cast<long long>(p.step), p.seconds, rate, share);
    }
  }

 private:
  bool quiet_;
  bool tty_;
  int last_decile_ = 0;
};

double per_second(double count, double seconds) { return seconds > 0 ? count / seconds : 0.0; }

// Tokens run through forward(): prompt chunks and generation rows (one per beam).
double forward_tokens(const ReplayResult& r) {
  return static_cast<double>(r.computed_prompt_tokens + r.decode_tokens);
}

// The step-latency table: each batch kind that occurred, then all steps.
std::vector<std::pair<std::string, StepStats>> step_table(const ReplayResult& r) {
  std::vector<std::pair<std::string, StepStats>> rows;
  for (StepKind kind : {StepKind::kPrefill, StepKind::kDecode, StepKind::kMixed}) {
    const StepStats stats = summarize_steps(r.step_log, &kind);
    if (stats.steps > 0) rows.emplace_back(step_kind_name(kind), stats);
  }
  rows.emplace_back("all", summarize_steps(r.step_log));
  return rows;
}

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
                  {"check_seqs", o.check_max_seqs},
                  {"check_rows", o.check_rows},
                  {"check_threads", o.check_threads}};
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
  j["forward_seconds"] = r.forward_seconds;
  j["forward_fraction"] = r.wall_seconds > 0 ? r.forward_seconds / r.wall_seconds : 0.0;
  j["check_seconds"] = r.check_seconds;
  j["check_cpu_seconds"] = r.check_cpu_seconds;
  j["tokens_per_s"] = per_second(forward_tokens(r), r.forward_seconds);
  j["prefill_tokens_per_s"] = per_second(r.computed_prompt_tokens, r.prefill_seconds);
  j["decode_tokens_per_s"] = per_second(r.decode_tokens, r.decode_seconds);
  nlohmann::json kinds;
  for (const auto& [name, stats] : step_table(r)) {
    kinds[name] = {{"steps", stats.steps},
                   {"forward_seconds", stats.forward_seconds},
                   {"p50_ms", 1e3 * stats.p50_seconds},
                   {"p90_ms", 1e3 * stats.p90_seconds},
                   {"p99_ms", 1e3 * stats.p99_seconds},
                   {"max_ms", 1e3 * stats.max_seconds},
                   {"mean_context_tokens", stats.mean_context_tokens},
                   {"mean_generation_tokens", stats.mean_generation_tokens}};
  }
  j["step_kinds"] = kinds;
  // Every step, in order: its token mix and its time inside forward().
  std::vector<int32_t> context, generation;
  std::vector<double> forward_ms;
  for (const ReplayStep& step : r.step_log) {
    context.push_back(step.context_tokens);
    generation.push_back(step.generation_tokens);
    forward_ms.push_back(1e3 * step.forward_seconds);
  }
  j["per_step"] = {
      {"context_tokens", context}, {"generation_tokens", generation}, {"forward_ms", forward_ms}};
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
  std::printf("  forward      %.1f tokens/s: %lld context + %lld generation tokens in %.2f s\n",
              per_second(forward_tokens(r), r.forward_seconds),
              static_cast<long long>(r.computed_prompt_tokens),
              static_cast<long long>(r.decode_tokens), r.forward_seconds);
  std::printf("  prefill      %.1f tokens/s (%.2f s in forward)\n",
              per_second(r.computed_prompt_tokens, r.prefill_seconds), r.prefill_seconds);
  std::printf("  decode       %.1f tokens/s (%.2f s in forward)\n",
              per_second(r.decode_tokens, r.decode_seconds), r.decode_seconds);
  const double other = std::max(0.0, r.wall_seconds - r.forward_seconds - r.check_seconds);
  std::printf(
      "  wall         %.2f s: forward %.2f s (%.1f%%), checks %.2f s, other %.2f s (scheduling, "
      "activations, copies, sampling)\n",
      r.wall_seconds, r.forward_seconds,
      r.wall_seconds > 0 ? 100.0 * r.forward_seconds / r.wall_seconds : 0.0, r.check_seconds,
      other);
  std::printf("  step time    forward per step, ms (p50 / p90 / p99 / max); tokens per step\n");
  for (const auto& [name, stats] : step_table(r)) {
    std::printf("    %-8s %6lld steps  %8.2f %8.2f %8.2f %8.2f   context %7.1f  generation %6.1f\n",
                name.c_str(), static_cast<long long>(stats.steps), 1e3 * stats.p50_seconds,
                1e3 * stats.p90_seconds, 1e3 * stats.p99_seconds, 1e3 * stats.max_seconds,
                stats.mean_context_tokens, stats.mean_generation_tokens);
  }
  std::printf(
      "  cache        %d blocks; hits %lld, misses %lld, hit rate %.1f%%, evictions %lld, "
      "offloads %lld, onboards %lld, cow copies %lld\n",
      c.num_blocks, static_cast<long long>(c.hits), static_cast<long long>(c.misses),
      lookups ? 100.0 * c.hits / lookups : 0.0, static_cast<long long>(c.evictions),
      static_cast<long long>(c.offloads), static_cast<long long>(c.onboards),
      static_cast<long long>(c.cow_copies));
  std::string rows = o.check_rows > 0 ? std::to_string(o.check_rows) + " rows" : "all rows";
  std::string seqs = o.check_max_seqs > 0 ? std::to_string(o.check_max_seqs) : "all";
  std::printf(
      "  checks       %lld passed, %lld failed (every %d steps, %s sequences a batch, %s a chunk; "
      "max |out - ref| %.3g)\n",
      static_cast<long long>(r.checks_passed), static_cast<long long>(r.checks_failed),
      o.check_every, seqs.c_str(), rows.c_str(), r.max_check_error);
  if (r.check_threads > 0) {
    std::printf(
        "               %.1f s of computation on %d host threads beside the step loop, "
        "which waited %.2f s for them\n",
        r.check_cpu_seconds, r.check_threads, r.check_seconds);
  } else {
    std::printf("               %.2f s in the step loop\n", r.check_seconds);
  }
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
  cmd->add_option("--requests", cli->requests, "requests in the trace (default 40 CPU, 512 GPU)");
  cmd->add_option("--seed", o.seed, "trace and activation seed")->capture_default_str();
  cmd->add_option("--arrival-rate", o.arrival_rate, "mean arrivals per step (0: all at once)")
      ->capture_default_str();
  cmd->add_option("--system-prompts", o.system_prompts,
                  "distinct shared system prompts (default: CPU 6, GPU 8)");
  cmd->add_option("--system-prompt-len", o.system_prompt_len,
                  "tokens of each system prompt (default: CPU 96, GPU 1024)");
  cmd->add_option("--min-user-len", o.min_user_len,
                  "shortest own prompt part (default: CPU 4, GPU 32)");
  cmd->add_option("--max-user-len", o.max_user_len,
                  "longest own prompt part (default: CPU 128, GPU 7168)");
  cmd->add_option("--min-output-len", o.min_output_len,
                  "fewest generated tokens (default: CPU 8, GPU 16)");
  cmd->add_option("--max-output-len", o.max_output_len,
                  "most generated tokens (default: CPU 40, GPU 512)");
  cmd->add_option("--beam-fraction", o.beam_fraction, "share of requests using beam search")
      ->capture_default_str();
  cmd->add_option("--beam-width", o.beam_width, "beams of a beam-search request")
      ->capture_default_str();
  cmd->add_option("--max-batch-tokens", o.max_batch_tokens,
                  "token budget of one step (default: CPU 128, GPU 8192)");
  cmd->add_option("--max-batch-requests", o.max_batch_requests,
                  "requests in flight at once (default: CPU 64, GPU 256)");
  cmd->add_option("--page", o.tokens_per_block, "tokens per cache block: 8, 16, 32, 64, 128")
      ->capture_default_str();
  cmd->add_option("--kv-dtype", cli->kv_dtype, "cache dtype: bf16, f16, fp8_e4m3, int8")
      ->capture_default_str();
  cmd->add_option("--cache-tokens", cli->cache_tokens,
                  "KV pool size in tokens (default: CPU 1536; GPU 0 = 0.9 of the free device "
                  "memory)");
  cmd->add_option("--host-cache-mb", cli->host_cache_mb,
                  "host offload tier in MiB (default 4 CPU, 4096 GPU; 0 = off)");
  cmd->add_flag("!--no-prefix-reuse", o.prefix_reuse, "turn prefix reuse off");
  cmd->add_option("--check-every", o.check_every,
                  "check every Nth step against an independent recomputation (0 = never) (default: "
                  "CPU 4, GPU 32)");
  cmd->add_option("--check-seqs", o.check_max_seqs,
                  "sequences checked per checked batch, evenly spaced (0 = all; default: CPU 0, "
                  "GPU 4)");
  cmd->add_option("--check-rows", o.check_rows,
                  "query rows checked per checked context chunk, evenly spaced with the last (0 = "
                  "all; default: CPU 0, GPU 2)");
  cmd->add_option("--check-threads", o.check_threads,
                  "host threads computing the checks beside the step loop (0 = inline; default: "
                  "CPU 0, GPU all cores but 2)");
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
