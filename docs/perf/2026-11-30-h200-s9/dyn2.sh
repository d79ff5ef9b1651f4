#!/usr/bin/env bash
# Session 9 (branch w-dyn), round 2: chunked claims (ATTNKIT_EXP_DYN_CHUNK blocks a claim) against
# main's own build in the same run (.carry/snap_main, built here in the background).
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
  env $e timeout 90 "$G" --gtest_color=no --gtest_filter="$f" >"$OUT/tests_$n.log" 2>&1
  echo "tests $n ($e, $f) rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/tests_$n.log" | tr '\n' ' ') t=$((SECONDS-T0))"
}
t c4 "ATTNKIT_EXP_DYN=12 ATTNKIT_EXP_DYN_CHUNK=4" 'DecodeSplit*:DecodeWorkspace*'
t c3 "ATTNKIT_EXP_DYN=0 ATTNKIT_EXP_DYN_CHUNK=3" 'DecodeSplit*:DecodeWorkspace*'
t c2 "ATTNKIT_EXP_DYN=14 ATTNKIT_EXP_DYN_CHUNK=2" 'DecodeSplit*:DecodeWorkspace*'
wait $BP; cat "$OUT/main_build.rc"; tail -3 "$OUT/main_build.log"
B() { # cli env args...
  local c=$1 e=$2; shift 2
  [ $((SECONDS - T0)) -lt ${BENCH_UNTIL:-360} ] || { echo "skip $e $*"; return; }
  env $e timeout 8 "$c" bench decode --no-ceilings --iters 20 "$@" 2>&1 | grep -E '^\| [a-z0-9]|rror' |
    grep -v '^| label' | sed "s/^/$e $* /" | awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'
}
for row in "--batch 1 --context 32768" "--kv-dtype fp8_e4m3 --batch 1 --context 32768" \
           "--batch 2 --context 32768" "--batch 4 --context 32768" "--batch 1 --context 8192" \
           "--batch 1 --context 16384" "--batch 64 --context 4096"; do
  for rep in 1 2; do
    B "$MB/attnkit" MAIN=1 $row
    for e in "ATTNKIT_EXP_DYN=16" "ATTNKIT_EXP_DYN=14,ATTNKIT_EXP_DYN_CHUNK=2" \
             "ATTNKIT_EXP_DYN=14,ATTNKIT_EXP_DYN_CHUNK=4" "ATTNKIT_EXP_DYN=12,ATTNKIT_EXP_DYN_CHUNK=4" \
             "ATTNKIT_EXP_DYN=10,ATTNKIT_EXP_DYN_CHUNK=4" "ATTNKIT_EXP_DYN=12,ATTNKIT_EXP_DYN_CHUNK=8"; do
      B "$CLI" "${e//,/ }" $row
    done
  done
done
