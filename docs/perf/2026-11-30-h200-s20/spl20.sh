# Session 20 call 6: split counts under the accumulating merge (forced --splits), against auto.
source "$ROOT/docs/perf/2026-11-30-h200-s18/rows.sh"
ROW_BUDGET=${ROW_BUDGET:-150}
for row in "--kv-dtype fp8_e4m3 --batch 1 --context 32768" "--batch 1 --context 32768"; do
  B auto $row
  for s in 24 28 32; do B s$s $row --splits $s --merge accumulate; done
  B acc $row --merge accumulate
done
for row in "--batch 1 --context 8192" "--batch 1 --context 16384" "--kv-dtype fp8_e4m3 --batch 1 --context 16384" \
           "--kv-dtype fp8_e4m3 --batch 1 --context 8192"; do
  B auto $row
  for s in 24 32; do B s$s $row --splits $s --merge accumulate; B s$s-ik $row --splits $s --merge in-kernel; done
done
