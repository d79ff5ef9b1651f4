# Session 20 call 1: the accumulating split merge (branch w-acc20): --merge in-kernel (main's
# last-CTA merge) against --merge accumulate, same build.
source "$ROOT/docs/perf/2026-11-30-h200-s18/rows.sh"
# Is call 1's Forward.ChunkedPrefill LSE failure (a context chunk: no split merge) main's own?
[ -n "${SEED_CHECK:-}" ] && ATTNKIT_EXP_ACCUM=0 ATTNKIT_TEST_SEED=$SEED_CHECK timeout 30 \
  "$HOME/build-snap/tests/attnkit_gpu_tests" --gtest_filter='Forward.Chunked*' 2>&1 | grep -E "OK|FAILED|Failure|actual" | head
ROW_BUDGET=${ROW_BUDGET:-200}
for row in "--batch 1 --context 32768" "--kv-dtype fp8_e4m3 --batch 1 --context 32768"; do
  for m in in-kernel accumulate accumulate in-kernel; do B $m $row --merge $m; done
done
for row in "--kv-dtype int8 --batch 1 --context 32768" "--batch 1 --context 8192" \
           "--batch 1 --context 16384" "--batch 2 --context 32768" "--batch 4 --context 32768" \
           "--kv-dtype fp8_e4m3 --batch 1 --context 16384" "--kv-dtype fp8_e4m3 --batch 2 --context 32768" \
           "--head-dim 64 --batch 1 --context 32768" "--head-dim 256 --batch 1 --context 32768" \
           "--q-heads 32 --kv-heads 4 --batch 1 --context 32768" "--page 16 --batch 1 --context 32768" \
           "--kv-dtype fp8_e4m3 --batch 1 --context 65536"; do
  for m in in-kernel accumulate; do B $m $row --merge $m; done
done
for row in "--batch 1 --context 32768" "--kv-dtype fp8_e4m3 --batch 1 --context 32768"; do
  for m in accumulate in-kernel; do B $m $row --merge $m; done
done
