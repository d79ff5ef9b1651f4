#!/usr/bin/env bash
# Session 9 (branch w-mqa): groups beyond 16 heads on the one-M-block kernels
# (ATTNKIT_EXP_HPC=8|16) against the two-M-block kernel (unset = main).
T0=$SECONDS
G=$(ls "$BUILD"/tests/attnkit_gpu_tests "$BUILD"/tests/gpu/attnkit_gpu_tests 2>/dev/null | head -1)
F='DecodeFused.MqaAndGroupsBeyondSixteenHeads:DecodeFused.ManySplitsMostlyEmptyAndAlibiMqa:DecodeFused.SplitKvAcrossStreamsAndInsideGraphs:DecodeSplit.GroupSizesAndHeadDims:DecodeWorkspace.TwoStreamsTwoWorkspaces'
for e in 8 16; do
  ATTNKIT_EXP_HPC=$e timeout 60 "$G" --gtest_color=no --gtest_filter="$F" >"$OUT/tests_$e.log" 2>&1
  echo "tests HPC=$e rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/tests_$e.log" | tr '\n' ' ') t=$((SECONDS-T0))"
done
B() { # env args...
  local e=$1; shift
  [ $((SECONDS - T0)) -lt 100 ] || { echo "skip $e $*"; return; }
  env $e timeout 8 "$CLI" bench decode --no-ceilings --iters 20 "$@" 2>&1 | grep -E '^\| [a-z0-9]|rror' |
    grep -v '^| label' | sed "s/^/$e $* /" | awk -F'|' '{print $1 "|" $(NF-6) "|" $(NF-5) "|" $(NF-4) "|"}'
}
for row in "--batch 64 --context 4096" "--batch 8 --context 32768" "--batch 1 --context 32768" \
           "--kv-dtype fp8_e4m3 --batch 64 --context 4096"; do
  for rep in 1 2; do
    for e in HPC=32 ATTNKIT_EXP_HPC=8 ATTNKIT_EXP_HPC=16; do B $e --q-heads 32 --kv-heads 1 $row; done
  done
done
