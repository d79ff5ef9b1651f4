# Session 20 call 3: where the accumulating merge stands against the rule's other merges.
source "$ROOT/docs/perf/2026-11-30-h200-s18/rows.sh"
ROW_BUDGET=${ROW_BUDGET:-100}
for row in "--q-heads 32 --kv-heads 4 --batch 1 --context 32768" "--head-dim 256 --batch 1 --context 32768" \
           "--q-heads 32 --kv-heads 32 --batch 1 --context 32768" "--kv-dtype fp8_e4m3 --batch 8 --context 32768" \
           "--batch 1 --context 131072" "--kv-dtype fp8_e4m3 --batch 1 --context 32768"; do
  for m in auto accumulate in-kernel; do B $m $row --merge $m; done
done
