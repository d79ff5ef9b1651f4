#!/usr/bin/env bash
# Session 17 call 6: where the warpgroup-MMA decode kernel's stream goes (ncu, --clock-control
# none per METHOD.md), next to the GQA 32/8 one-M-block kernel. CLI = the tree's attnkit.
M=smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__warps_active.avg.per_cycle_active,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_barrier.ratio,smsp__average_warp_latency_issue_stalled_wait.ratio,smsp__average_warp_latency_issue_stalled_membar.ratio,smsp__average_warp_latency_issue_stalled_math_pipe_throttle.ratio,smsp__average_warp_latency_issue_stalled_short_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_mio_throttle.ratio,smsp__average_warp_latency_issue_stalled_lg_throttle.ratio
run() { # kernel-regex args...
  local k=$1; shift
  echo "== $k $*"
  timeout 60 ncu --clock-control none --kernel-name "regex:$k" --launch-skip 20 --launch-count 1 \
    --metrics "$M" "$CLI" bench decode --no-ceilings --iters 20 "$@" 2>&1 |
    grep -E "decode_|smsp__|sm__|dram__|rror" | head -20
}
run decode_wgmma_kernel --q-heads 32 --kv-heads 1 --batch 256 --context 2048
run decode_wgmma_kernel --q-heads 32 --kv-heads 1 --batch 64 --context 4096
run decode_kernel --batch 64 --context 4096
