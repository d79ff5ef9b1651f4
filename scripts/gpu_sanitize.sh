#!/usr/bin/env bash
# compute-sanitizer over the gpu tests (docs/safety.md): memcheck, racecheck, synccheck and
# initcheck, each over the whole gpu suite (or a gtest filter), plus the bad-device-metadata
# tests (the *Fault* suites: every guarded kernel given block ids, lengths, positions,
# cu_seqlens and indirection entries outside their tensors), which must give clean
# DeviceFaultErrors and no finding. Zero findings is the bar.
#
#   bash scripts/gpu_sanitize.sh [BUILD_DIR]     (default build-gpu, configured with CUDA)
#
# Environment (all optional):
#   SANITIZE_TOOLS   tools to run, in order (default "memcheck racecheck synccheck initcheck")
#   SANITIZE_FILTER  --gtest_filter of the suite runs (default "*": the whole gpu suite)
#   SANITIZE_BAD     --gtest_filter of the bad-metadata set, run under every tool even when
#                    SANITIZE_FILTER leaves it out (default "*Fault*"; empty: skip it)
#   SANITIZE_TIMEOUT seconds after which one tool's run is stopped and counted as failed
#                    (default 0: no limit)
#   OUT              where the logs and summary.txt go (default ./gpu-sanitize-out)
# Exit status 0 only when every run passed with zero sanitizer findings.
set -u -o pipefail
cd "$(dirname "$0")/.."
BUILD="${1:-build-gpu}"
TESTS="$BUILD/tests/attnkit_gpu_tests"
TOOLS="${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}"
FILTER="${SANITIZE_FILTER:-*}"
BAD="${SANITIZE_BAD-*Fault*}"
OUT="${OUT:-$PWD/gpu-sanitize-out}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
if [ ! -x "$TESTS" ]; then
  echo "gpu_sanitize: $TESTS not found: build the target attnkit_gpu_tests in $BUILD first" >&2
  exit 2
fi
SANITIZER="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
if [ ! -x "$SANITIZER" ]; then
  echo "gpu_sanitize: compute-sanitizer is not on PATH nor in /usr/local/cuda/bin" >&2
  exit 2
fi
FAILED=0

# sanitize TOOL NAME FILTER: one run of the tests under TOOL; records findings and failures.
sanitize() {
  local tool="$1" name="$2" filter="$3"
  local log="$OUT/$tool-$name.log"
  local extra=()
  case "$tool" in
    memcheck) extra=(--check-device-heap yes) ;;
    racecheck) extra=(--racecheck-report all) ;;
    initcheck) extra=(--track-unused-memory no) ;;
  esac
  local start=$SECONDS
  timeout "${SANITIZE_TIMEOUT:-0}" "$SANITIZER" --tool "$tool" "${extra[@]}" --error-exitcode 86 \
    --print-limit 50 --nvtx no "$TESTS" --gtest_filter="$filter" --gtest_brief=1 >"$log" 2>&1
  local rc=$?
  local took=$((SECONDS - start))
  # The sanitizer's closing line: "ERROR SUMMARY: N errors" (racecheck: "RACECHECK SUMMARY").
  local findings
  findings="$(grep -Eo '(ERROR|RACECHECK) SUMMARY: [0-9]+' "$log" | grep -Eo '[0-9]+$' | tail -1)"
  local tests_line
  tests_line="$(grep -E '^\[  (PASSED|FAILED)  \]' "$log" | tr '\n' ' ')"
  if [ "$rc" -eq 0 ] && [ "${findings:-0}" = "0" ]; then
    echo "PASS  $tool $name: 0 findings, ${took}s; $tests_line" | tee -a "$SUMMARY"
  else
    FAILED=1
    echo "FAIL  $tool $name: rc=$rc, findings=${findings:-?}, ${took}s; $tests_line (see $log)" |
      tee -a "$SUMMARY"
    grep -E '^========= (Invalid|Race|Barrier|Uninitialized|Error|Program hit)' "$log" | sort |
      uniq -c | sort -rn | head -n 10 | sed 's/^/      /' | tee -a "$SUMMARY"
  fi
}

for tool in $TOOLS; do
  sanitize "$tool" suite "$FILTER"
  if [ -n "$BAD" ] && [ "$FILTER" != "*" ]; then sanitize "$tool" bad-metadata "$BAD"; fi
done
echo "gpu_sanitize: summary in $SUMMARY"
exit $FAILED
