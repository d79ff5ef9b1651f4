#!/usr/bin/env bash
# Session 9 (branch w-stream): the streaming merge (ATTNKIT_EXP_STREAM=1) against the last-arriver
# merge of the same build and against main's own build (.carry/snap_main, built in the background).
T0=$SECONDS
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
MB=$HOME/build-main
( cmake -S "$ROOT/.carry/snap_main" -B "$MB" -G Ninja -DATTNKIT_WITH_CUDA=ON -DATTNKIT_CUDA_ARCHS=90a \
    -DATTNKIT_GTEST_SOURCE_DIR="$ROOT/.carry/googletest" >"$OUT/main_cfg.log" 2>&1 &&
  nice cmake --build "$MB" -j 10 --target attnkit_cli >"$OUT/main_build.log" 2>&1; echo "main build rc=$? t=$((SECONDS-T0))" >"$OUT/main_build.rc" ) &
BP=$!
G=$(ls "$BUILD"/tests/attnkit_gpu_tests "$BUILD"/tests/gpu/attnkit_gpu_tests 2>/dev/null | head -1)
t() { # name env filter
  local n=$1 e=$2 f=$3
  env $e timeout 100 "$G" --gtest_color=no --gtest_filter="$f" >"$OUT/tests_$n.log" 2>&1
  echo "tests $n ($e, $f) rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/tests_$n.log" | tr '\n' ' ') t=$((SECONDS-T0))"
}
t stream1 ATTNKIT_EXP_STREAM=1 'Decode*'
t stream0 ATTNKIT_EXP_STREAM=0 'DecodeSplit*:DecodeWorkspace*'
t break "ATTNKIT_EXP_STREAM=1 ATTNKIT_EXP_STREAM_BREAK=1" 'DecodeSplit.*'
grep -E "Failure|Which is|actual" "$OUT/tests_break.log" | head -6
wait $BP; cat "$OUT/main_build.rc"
B() { # cli env args...
  local c=$1 e=$2; shift 2
  [ $((SECONDS - T0)) -lt ${BENCH_UNTIL:-330} ] || { echo "skip $e $*"; return; }
  env $e timeout 8 "$c" bench decode --no-ceilings --iters 20 "$@" 2>&1 | grep -E '^\| [a-z0-9]|rror' |
    grep -v '^| label' | sed "s/^/$e $* /" | awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'
}
for row in "--batch 1 --context 32768" "--kv-dtype fp8_e4m3 --batch 1 --context 32768" \
           "--batch 2 --context 32768" "--batch 4 --context 32768" "--batch 1 --context 8192" \
           "--batch 1 --context 16384" "--batch 64 --context 4096" "--batch 32 --context 32768"; do
  for rep in 1 2; do
    B "$MB/attnkit" MAIN=1 $row
    B "$CLI" ATTNKIT_EXP_STREAM=0 $row
    B "$CLI" ATTNKIT_EXP_STREAM=1 $row
  done
done
B "$CLI" ATTNKIT_EXP_STREAM=1 --batch 1 --context 32768 --split-workspace per-call
B "$CLI" ATTNKIT_EXP_STREAM=0 --batch 1 --context 32768 --split-workspace per-call
