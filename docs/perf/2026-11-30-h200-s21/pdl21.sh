# Session 21 call 2: the test of a programmatic decode after a kernel that rewrites the table.
# .carry/bin21/fin: main + the test (kernel subset: head_dim 128, sm_90a, built on the development
# machine); .carry/bin21/br: branch w-spec21 (the speculative prologue) + the same test, run with
# the prologue's check switched off (ATTNKIT_EXP_NOVALIDATE=1), where the stale cases must fail.
BIN=${BIN:-$PWD/.carry/bin21}
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
t() { local b=$1; shift; LD_LIBRARY_PATH=$BIN/$b timeout 200 env "$@" 2>&1; }
echo "=== fin: decode (head_dim 128) and forward tests"
t fin $BIN/fin/attnkit_gpu_tests --gtest_filter='DecodeFused.ProgrammaticLaunch*:DecodeFused.PrefetchBefore*:DecodeLaunch.*:DecodeWorkspace.*:Forward.*:DecodeSplit.AccumulatingMergeWithOutliers:DecodeSplit.DeterministicByDefault*' |
  grep -E "^\[  (PASSED|FAILED)|FAILED  \]|Failure|tests ran|^\[ +OK" | head -40
echo "=== br: the speculative prologue with its check"
t br $BIN/br/attnkit_gpu_tests --gtest_filter='DecodeFused.SpeculativePrologue*' | grep -E "^\[  (PASSED|FAILED)|tests ran|Failure" | head
echo "=== br: the check off (must fail)"
t br ATTNKIT_EXP_NOVALIDATE=1 $BIN/br/attnkit_gpu_tests --gtest_filter='DecodeFused.SpeculativePrologue*' |
  grep -E "stale:|kv=|^\[  (PASSED|FAILED)|tests ran|Failure|max" | head -60
echo "=== fin rows"
for row in "--batch 1 --context 32768" "--kv-dtype fp8_e4m3 --batch 1 --context 32768"; do
  LD_LIBRARY_PATH=$BIN/fin timeout 10 $BIN/fin/attnkit bench decode --no-ceilings --iters 20 $row 2>&1 | grep -E '^\| [a-z0-9]' | grep -v '^| label'
done
