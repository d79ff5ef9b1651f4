#!/usr/bin/env bash
# Bounded libFuzzer runs (docs/safety.md): every target of fuzz/ for SECONDS, in parallel, over
# its committed seed corpus (fuzz/corpus/<target>, read only) plus a scratch corpus in the build
# directory that collects what the run finds. A crash, a hang (-timeout), an RSS past the limit,
# a sanitizer report or a failed check of the target fails the run; its input is written to the
# build directory as crash-* / timeout-* / oom-* (replay: <build>/fuzz/attnkit_fuzz_<target> FILE).
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-sanitize}
seconds=${2:-60}
targets=(config entry)

pids=()
for target in "${targets[@]}"; do
  mkdir -p "$build/corpus/$target"
  "$build/fuzz/attnkit_fuzz_$target" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=3072 \
    -print_final_stats=1 -artifact_prefix="$build/" "$build/corpus/$target" \
    "fuzz/corpus/$target" >"$build/fuzz_$target.log" 2>&1 &
  pids+=($!)
done
passed=0
failed=0
for i in "${!targets[@]}"; do
  target=${targets[$i]}
  log="$build/fuzz_$target.log"
  if wait "${pids[$i]}"; then
    runs=$(grep -m1 -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$')
    echo "fuzz $target: ${runs:-?} inputs in ${seconds} s, no finding"
    passed=$((passed + 1))
  else
    echo "fuzz $target: FAILED (log: $log); its end:"
    tail -n 60 "$log"
    failed=$((failed + 1))
  fi
done
echo "fuzz-smoke: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
