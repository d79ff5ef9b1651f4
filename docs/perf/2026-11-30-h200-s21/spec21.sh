# Session 21 call 1: the speculative prologue (branch w-spec21), from binaries built on the
# development machine (kernel subset: head_dim 128, sm_90a) and carried in .carry/bin21: br (the
# branch) and main (df264cb). Tests (the new one with the check switched off too: it must fail),
# then rows: the branch with and without speculation (ATTNKIT_EXP_NOSPEC=1, main's prologue) and
# main's own binary, A B C C B A.
BIN=${BIN:-$PWD/.carry/bin21}
T0=$SECONDS
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
run_tests() { LD_LIBRARY_PATH=$BIN/br timeout ${2:-200} $BIN/br/attnkit_gpu_tests --gtest_filter="$1" 2>&1; }
run_tests 'DecodeFused.Speculative*:DecodeFused.PrefetchBefore*:DecodeSplit.*:DecodeWorkspace.*:DecodeLaunch.*:Forward.*' |
  grep -E "^\[  (PASSED|FAILED)|FAILED  \]|Failure|tests ran|^\[ +OK" | head -40
echo "--- the check off (must fail):"
ATTNKIT_EXP_NOVALIDATE=1 run_tests 'DecodeFused.SpeculativePrologue*' 60 |
  grep -E "stale:|^\[  (PASSED|FAILED)|FAILED  \]|max|Expected|Which is" | head -30
# R TAG BUILD ENV ARGS...: one `attnkit bench decode` row: "TAG ARGS | ms a call | TB/s |".
R() { local e=$1 b=$2 env=$3; shift 3
  [ $((SECONDS - T0)) -lt ${ROW_BUDGET:-330} ] || { echo "skip $e $*"; return; }
  env LD_LIBRARY_PATH=$BIN/$b $env timeout 10 $BIN/$b/attnkit bench decode --no-ceilings --iters 20 "$@" 2>&1 |
    grep -E '^\| [a-z0-9]|rror' | grep -v '^| label' | sed "s/^/$e $* /" |
    awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'; }
for row in "--kv-dtype fp8_e4m3 --batch 1 --context 32768" "--batch 1 --context 32768" \
           "--kv-dtype int8 --batch 1 --context 32768" "--page 16 --batch 1 --context 32768" \
           "--kv-dtype fp8_e4m3 --batch 1 --context 65536" "--batch 1 --context 131072" \
           "--q-heads 32 --kv-heads 4 --batch 1 --context 32768"; do
  R spec br X=1 $row; R nospec br ATTNKIT_EXP_NOSPEC=1 $row; R main main X=1 $row
  R main main X=1 $row; R nospec br ATTNKIT_EXP_NOSPEC=1 $row; R spec br X=1 $row
done
for row in "--kv-dtype fp8_e4m3 --batch 1 --context 32768" "--batch 1 --context 32768"; do
  R spec-acc br X=1 $row --merge accumulate; R nospec-acc br ATTNKIT_EXP_NOSPEC=1 $row --merge accumulate
  R spec-acc br X=1 $row --merge accumulate; R nospec-acc br ATTNKIT_EXP_NOSPEC=1 $row --merge accumulate
done
# Rows that do not speculate (their kernels' code moved): the branch against main.
for row in "--kv-dtype fp8_e4m3 --batch 64 --context 4096" "--batch 64 --context 4096" \
           "--batch 1 --context 8192" "--kv-dtype fp8_e4m3 --batch 256 --context 1024"; do
  R br br X=1 $row; R main main X=1 $row; R main main X=1 $row; R br br X=1 $row
done
echo "total $((SECONDS - T0)) s"
