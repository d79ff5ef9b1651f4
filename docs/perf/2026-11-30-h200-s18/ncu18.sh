# Session 18 call 5: the 16+-head calls' time split between the wgmma kernel and the merge kernel,
# and the wgmma kernel's tensor-pipe load, next to GQA 32/8 on the same bytes.
run() { # metrics kernel-regex count args...
  local m=$1 k=$2 n=$3; shift 3
  echo "== $k $*"
  timeout 60 ncu --clock-control none --kernel-name "regex:$k" --launch-skip 40 --launch-count $n \
    --metrics "$m" "$CLI" bench decode --no-ceilings --iters 20 "$@" 2>&1 |
    grep -E "decode_|gpu__|sm__|dram__|rror|ERR" | head -20
}
T=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed
Q1="--q-heads 32 --kv-heads 1"
for row in "$Q1 --batch 32 --context 32768" "$Q1 --batch 128 --context 8192" "$Q1 --batch 64 --context 4096"; do
  timeout 10 "$CLI" bench decode --no-ceilings --iters 20 $row 2>&1 | grep -E '^\| [a-z0-9]' | grep -v '^| label'
  run $T "decode_(wgmma|merge)" 4 $row
done
run $T decode_kernel 2 --batch 16 --context 16384
run sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_gmma.sum decode_wgmma 1 $Q1 --batch 32 --context 32768
run smsp__cycles_active.avg.pct_of_peak_sustained_elapsed,sm__cycles_active.avg decode_wgmma 1 $Q1 --batch 32 --context 32768
