#!/usr/bin/env bash
# Next session (branch w-next-epi): the split epilogue's parameters from shared memory
# (ATTNKIT_EXP_EPI_SMEM=1) against the register moves (constant-bank reads after the loop), same
# build, A B B A, plus the split tests under the switch.
T0=$SECONDS
G=$(ls "$BUILD"/tests/attnkit_gpu_tests "$BUILD"/tests/gpu/attnkit_gpu_tests 2>/dev/null | head -1)
ATTNKIT_EXP_EPI_SMEM=1 timeout 40 "$G" --gtest_filter='DecodeSplit*:DecodeWorkspace*' >"$OUT/epi_tests.log" 2>&1
echo "split tests with EPI_SMEM=1 rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/epi_tests.log" | tr '\n' ' ')"
B() { # env args...
  local e=$1; shift
  [ $((SECONDS - T0)) -lt 85 ] || { echo "skip $e $*"; return; }
  env $e timeout 8 "$CLI" bench decode --no-ceilings --iters 20 "$@" 2>&1 | grep -E '^\| [a-z0-9]|rror' |
    grep -v '^| label' | sed "s/^/$e $* /" | awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'
}
for row in "--batch 1 --context 32768" "--kv-dtype fp8_e4m3 --batch 1 --context 32768" \
           "--batch 1 --context 8192" "--batch 64 --context 4096" "--batch 32 --context 32768"; do
  for e in ATTNKIT_EXP_EPI_SMEM=0 ATTNKIT_EXP_EPI_SMEM=1 ATTNKIT_EXP_EPI_SMEM=1 ATTNKIT_EXP_EPI_SMEM=0; do
    B $e $row
  done
done
