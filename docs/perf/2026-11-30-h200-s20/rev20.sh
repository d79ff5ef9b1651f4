# Session 20 call 8: the review's kernel refactor (LSE helper): split / workspace / forward tests, two rows.
T=$HOME/build-snap/tests/attnkit_gpu_tests
timeout 150 $T --gtest_filter='DecodeSplit.*:DecodeWorkspace.*:Forward.*:DecodeLaunch.*' 2>&1 | grep -E "^\[  (PASSED|FAILED)|FAILED  \]|Failure" | head
source "$ROOT/docs/perf/2026-11-30-h200-s18/rows.sh"
for row in "--batch 1 --context 32768" "--kv-dtype fp8_e4m3 --batch 1 --context 32768"; do
  for m in auto accumulate; do B $m $row --merge $m; done
done
