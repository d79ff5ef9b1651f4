#!/usr/bin/env bash
# compute-sanitizer over the gpu suite (docs/safety.md): memcheck, racecheck, synccheck and
# initcheck, each over every test of tests/attnkit_gpu_tests (or a gtest filter), the bad
# device-metadata tests (the *Fault* suites) included. Zero findings and zero failed tests is the
# bar: the script prints one line per tool (tests run, failed, findings, time) and exits 1 on any
# finding, failed test, crash or timeout.
#
#   bash scripts/gpu_sanitize.sh [options] [BUILD_DIR]      (BUILD_DIR: default build-gpu)
#
# Options:
#   --tools "T ..."    tools to run (default "memcheck racecheck synccheck initcheck")
#   --filter PATTERN   --gtest_filter of the suite (default "*": every test)
#   --bad-filter PAT   with a --filter, the bad-metadata tests also run under every tool in a run
#                      of their own (default "*Fault*"; "" skips them)
#   --timeout SECONDS  each process of a tool is stopped after this long and counted as failed
#                      (default 0: no limit)
#   --shards N         each tool's tests are split over N processes (gtest sharding: every test
#                      runs in exactly one of them; default 4)
#   --jobs N           processes running at once, all tools together (default 16); the GPU is
#                      shared, so this overlaps their host work (oracles, the sanitizers' own)
#   --scale S          ATTNKIT_TEST_SCALE of the tests (default small: the large cases scaled
#                      down, every kernel path kept; full: as in the plain suite)
#   --out DIR          logs and summary.txt (default ./gpu-sanitize-out)
# One ATTNKIT_TEST_SEED serves every process (the one set in the environment, else a fresh one,
# printed), so that every tool sees the same data.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2

TOOLS="memcheck racecheck synccheck initcheck"
FILTER="*"
BAD="*Fault*"
TIMEOUT=0
SHARDS=4
JOBS=16
SCALE="${ATTNKIT_TEST_SCALE:-small}"
OUT="$PWD/gpu-sanitize-out"
BUILD=build-gpu
usage() { sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --tools) TOOLS="$2"; shift 2 ;;
    --filter) FILTER="$2"; shift 2 ;;
    --bad-filter) BAD="$2"; shift 2 ;;
    --timeout) TIMEOUT="$2"; shift 2 ;;
    --shards) SHARDS="$2"; shift 2 ;;
    --jobs) JOBS="$2"; shift 2 ;;
    --scale) SCALE="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    -*) echo "gpu_sanitize: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) BUILD="$1"; shift ;;
  esac
done
for n in "$TIMEOUT" "$SHARDS" "$JOBS"; do
  if ! [[ "$n" =~ ^[0-9]+$ ]]; then
    echo "gpu_sanitize: --timeout, --shards and --jobs take whole numbers, got '$n'" >&2
    exit 2
  fi
done
[ "$SHARDS" -ge 1 ] || SHARDS=1
[ "$JOBS" -ge 1 ] || JOBS=1
for tool in $TOOLS; do
  case "$tool" in
    memcheck | racecheck | synccheck | initcheck) ;;
    *) echo "gpu_sanitize: --tools: '$tool' is not memcheck, racecheck, synccheck or initcheck" >&2
       exit 2 ;;
  esac
done
TESTS="$BUILD/tests/attnkit_gpu_tests"
if [ ! -x "$TESTS" ]; then
  echo "gpu_sanitize: $TESTS not found: build the target attnkit_gpu_tests in $BUILD first" >&2
  exit 2
fi
SANITIZER="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
if [ ! -x "$SANITIZER" ]; then
  echo "gpu_sanitize: compute-sanitizer is not on PATH nor in /usr/local/cuda/bin" >&2
  exit 2
fi
export ATTNKIT_TEST_SCALE="$SCALE"
export ATTNKIT_TEST_SEED="${ATTNKIT_TEST_SEED:-$(( (RANDOM << 15) | RANDOM ))}"
mkdir -p "$OUT"
rm -f "$OUT"/*.log "$OUT"/*.status
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

# count_tests FILTER: how many tests of the binary the filter selects.
count_tests() {
  "$TESTS" --gtest_list_tests --gtest_filter="$1" 2>/dev/null | grep -c '^  '
}

# The runs of each tool: the suite, and the bad-metadata tests when a filter leaves them out.
GROUPS_NAMES=(suite)
GROUPS_FILTERS=("$FILTER")
if [ "$FILTER" != "*" ] && [ -n "$BAD" ]; then
  GROUPS_NAMES+=(bad-metadata)
  GROUPS_FILTERS+=("$BAD")
fi
EXPECTED=()
for g in "${!GROUPS_NAMES[@]}"; do
  EXPECTED[g]="$(count_tests "${GROUPS_FILTERS[$g]}")"
  if [ "${EXPECTED[$g]}" -eq 0 ]; then
    echo "gpu_sanitize: the filter '${GROUPS_FILTERS[$g]}' selects no test" >&2
    exit 2
  fi
done
note "gpu_sanitize: $TESTS, tools: $TOOLS, filter '$FILTER', ATTNKIT_TEST_SCALE=$SCALE," \
  "ATTNKIT_TEST_SEED=$ATTNKIT_TEST_SEED, $SHARDS shards a tool, $JOBS at once, timeout ${TIMEOUT}s"

# run_shard TOOL GROUP SHARD SHARDS SLOT: one process of TOOL over shard SHARD of GROUP's tests.
# Writes $OUT/TOOL-GROUPNAME-SHARD.log and a .status of "rc start end".
run_shard() {
  local tool="$1" g="$2" shard="$3" shards="$4" slot="$5"
  local name="$tool-${GROUPS_NAMES[$g]}-$shard"
  local extra=()
  case "$tool" in
    memcheck) extra=(--check-device-heap yes) ;;
    racecheck) extra=(--racecheck-report all --racecheck-num-workers "$RACECHECK_WORKERS") ;;
  esac
  local start=$SECONDS
  # Each concurrent sanitizer gets ports of its own to reach its target (10 from its base). A
  # failed test is counted from gtest's lines, not as a sanitizer error (--check-exit-code no).
  GTEST_TOTAL_SHARDS="$shards" GTEST_SHARD_INDEX="$shard" \
    timeout --kill-after=30 "$TIMEOUT" "$SANITIZER" --tool "$tool" "${extra[@]}" \
    --error-exitcode 86 --check-exit-code no --print-limit 100 --nvtx no --launch-timeout 120 \
    --port $((49152 + 10 * slot)) --max-connections 10 \
    "$TESTS" --gtest_filter="${GROUPS_FILTERS[$g]}" --gtest_color=no >"$OUT/$name.log" 2>&1
  echo "$? $start $SECONDS" >"$OUT/$name.status"
}

# racecheck's host threads: the cores shared among the racecheck processes that run at once.
RACECHECK_WORKERS=$(($(nproc) / (SHARDS < JOBS ? SHARDS : JOBS)))
[ "$RACECHECK_WORKERS" -ge 1 ] || RACECHECK_WORKERS=1

# Every (tool, group, shard) process through a pool of $JOBS slots; racecheck, the slowest tool,
# starts first.
ORDERED=""
for t in racecheck memcheck initcheck synccheck; do
  case " $TOOLS " in *" $t "*) ORDERED="$ORDERED $t" ;; esac
done
declare -A SHARDS_OF
slot_pids=()
for tool in $ORDERED; do
  for g in "${!GROUPS_NAMES[@]}"; do
    shards=$SHARDS
    [ "${EXPECTED[$g]}" -lt "$shards" ] && shards="${EXPECTED[$g]}"
    SHARDS_OF[$tool-$g]=$shards
    for ((shard = 0; shard < shards; ++shard)); do
      slot=-1
      while [ "$slot" -lt 0 ]; do
        for ((s = 0; s < JOBS; ++s)); do
          if [ -z "${slot_pids[$s]:-}" ] || ! kill -0 "${slot_pids[$s]}" 2>/dev/null; then
            slot=$s
            break
          fi
        done
        [ "$slot" -lt 0 ] && wait -n 2>/dev/null
      done
      run_shard "$tool" "$g" "$shard" "$shards" "$slot" &
      slot_pids[slot]=$!
    done
  done
done
wait

# findings LOG TOOL: the sanitizer's count of findings in LOG, empty when it printed none.
findings() {
  local pattern='ERROR SUMMARY: [0-9]+'
  [ "$2" = racecheck ] && pattern='(RACECHECK|ERROR) SUMMARY: [0-9]+'
  grep -Eo "$pattern" "$1" | grep -Eo '[0-9]+$' | sort -n | tail -1
}

FAILED=0
for tool in $ORDERED; do
  run=0 failed=0 found=0 expected=0 first=-1 last=0 problems=""
  for g in "${!GROUPS_NAMES[@]}"; do
    expected=$((expected + EXPECTED[g]))
    shards=${SHARDS_OF[$tool-$g]}
    for ((shard = 0; shard < shards; ++shard)); do
      name="$tool-${GROUPS_NAMES[$g]}-$shard"
      log="$OUT/$name.log"
      read -r rc start end <"$OUT/$name.status"
      [ "$first" -lt 0 ] || [ "$start" -lt "$first" ] && first=$start
      [ "$end" -gt "$last" ] && last=$end
      # A finished test: gtest's "[       OK ] Suite.Name (12 ms)" (or FAILED, SKIPPED).
      done_here=$(grep -Ec '^\[ +(OK|FAILED|SKIPPED) +\] [^ ]+ \([0-9]+ ms\)$' "$log")
      failed_here=$(grep -Ec '^\[  FAILED  \] [^ ]+ \([0-9]+ ms\)$' "$log")
      run=$((run + done_here))
      failed=$((failed + failed_here))
      count="$(findings "$log" "$tool")"
      if [ -z "$count" ]; then
        problems="$problems; $name: no sanitizer summary (rc $rc)"
      else
        found=$((found + count))
      fi
      if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        problems="$problems; $name: stopped after ${TIMEOUT}s"
      elif [ "$rc" -ne 0 ] && [ "$rc" -ne 86 ] && [ "$failed_here" -eq 0 ]; then
        problems="$problems; $name: exit status $rc"
      fi
    done
  done
  verdict=PASS
  if [ "$run" -ne "$expected" ] || [ "$failed" -ne 0 ] || [ "$found" -ne 0 ] || [ -n "$problems" ]
  then
    verdict=FAIL
    FAILED=1
  fi
  note "$(printf '%-9s %s  %d/%d tests run, %d failed, %d findings, %d shards, %ds%s' "$tool" \
    "$verdict" "$run" "$expected" "$failed" "$found" "${SHARDS_OF[$tool-0]}" \
    "$((last - first))" "$problems")"
  # The slowest tests under this tool (where a tighter --timeout or a split run would look first).
  slowest="$(grep -h -E '^\[ +(OK|FAILED) +\] [^ ]+ \([0-9]+ ms\)$' "$OUT/$tool"-*.log |
    sed -E 's/^\[[^]]*\] ([^ ]+) \(([0-9]+) ms\)$/\2 \1/' | sort -rn | head -n 5 |
    awk '{printf "%s%s %.0fs", (NR > 1 ? ", " : ""), $2, $1 / 1000}')"
  [ -n "$slowest" ] && note "          slowest: $slowest"
  if [ "$verdict" = FAIL ]; then
    # The kinds of findings and the failed tests, most frequent first.
    cat "$OUT/$tool"-*.log | grep -E '^========= +(Invalid|Race|Barrier|Uninitialized|Error|Program hit|Warning|Potential|Unused)' |
      sed -E 's/0x[0-9a-f]+/0x../g; s/[0-9]+ bytes/N bytes/g' | sort | uniq -c | sort -rn | head -n 10 |
      sed 's/^/      /' | tee -a "$SUMMARY"
    grep -h -E '^\[  FAILED  \] [^ ]+ \([0-9]+ ms\)$' "$OUT/$tool"-*.log | sed 's/^/      /' |
      tee -a "$SUMMARY"
  fi
done
if [ "$FAILED" -eq 0 ]; then
  note "gpu_sanitize: PASS (logs in $OUT)"
else
  note "gpu_sanitize: FAIL (logs in $OUT)"
fi
exit $FAILED
