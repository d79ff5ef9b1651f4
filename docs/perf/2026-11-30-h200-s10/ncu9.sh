#!/usr/bin/env bash
# w-tl9 (next session): is the fp8 4-CTA decode kernel issue-bound? ncu on the bf16 and fp8
# 64 x 4k rows (Firecracker machines read the counters; --clock-control none per METHOD.md).
# Also the bf16 1 x 32k split kernel, whose epilogue stretch the timeline stamps measure.
M=smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__warps_active.avg.per_cycle_active,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_barrier.ratio,smsp__average_warp_latency_issue_stalled_wait.ratio,smsp__average_warp_latency_issue_stalled_mio_throttle.ratio,smsp__average_warp_latency_issue_stalled_lg_throttle.ratio
for row in "--batch 64 --context 4096" "--kv-dtype fp8_e4m3 --batch 64 --context 4096" "--batch 1 --context 32768"; do
  echo "== $row"
  timeout 120 ncu --clock-control none --kernel-name regex:decode_kernel --launch-skip 20 --launch-count 1 \
    --metrics "$M" "$CLI" bench decode --no-ceilings --iters 20 $row 2>&1 | grep -E "decode_kernel|smsp__|sm__|dram__|==PROF==|rror" | head -20
done
