#!/usr/bin/env bash
# Session 9 (branch w-dyn): dynamic split tiles. ATTNKIT_EXP_DYN=<sixteenths kept static> (16 =
# main's static splits). Tests under several values, a deliberate break, then A/B benches.
T0=$SECONDS
G=$(ls "$BUILD"/tests/attnkit_gpu_tests "$BUILD"/tests/gpu/attnkit_gpu_tests 2>/dev/null | head -1)
t() { # name env filter
  local n=$1 e=$2 f=$3
  env $e timeout 90 "$G" --gtest_color=no --gtest_filter="$f" >"$OUT/tests_$n.log" 2>&1
  echo "tests $n ($e, $f) rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/tests_$n.log" | tr '\n' ' ') t=$((SECONDS-T0))"
}
t dyn12 ATTNKIT_EXP_DYN=12 'Decode*'
t dyn0 ATTNKIT_EXP_DYN=0 'DecodeSplit*:DecodeWorkspace*'
t dyn15 ATTNKIT_EXP_DYN=15 'DecodeSplit*:DecodeWorkspace*'
t break "ATTNKIT_EXP_DYN=12 ATTNKIT_EXP_DYN_BREAK=1" 'DecodeSplit.*'
grep -E "Failure|Which is|max_err|bound|exceed" "$OUT/tests_break.log" | head -8
B() { # env args...
  local e=$1; shift
  [ $((SECONDS - T0)) -lt ${BENCH_UNTIL:-330} ] || { echo "skip $e $*"; return; }
  env $e timeout 8 "$CLI" bench decode --no-ceilings --iters 20 "$@" 2>&1 | grep -E '^\| [a-z0-9]|rror' |
    grep -v '^| label' | sed "s/^/$e $* /" | awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'
}
for row in "--batch 1 --context 32768" "--kv-dtype fp8_e4m3 --batch 1 --context 32768" \
           "--batch 1 --context 8192" "--batch 1 --context 16384" "--batch 2 --context 32768" \
           "--batch 4 --context 32768" "--batch 64 --context 4096"; do
  for e in 16 12 14 8 0 16 12 14 8 0; do
    B ATTNKIT_EXP_DYN=$e $row
  done
done
