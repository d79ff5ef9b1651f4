#!/usr/bin/env bash
# The full GPU check (docs/gpu.md), one command on any machine with an NVIDIA GPU and the CUDA
# toolkit: configure and build the CUDA backend, run the gpu and cpu tests, pytest, `attnkit
# check` and the benchmarks, with one log per step packed into $OUT/logs.tgz and a summary in
# $OUT/summary.txt, so that a run on a remote machine comes back as two files.
#
#   bash scripts/gpu_check.sh
#
# Environment (all optional):
#   OUT                 where the summary and logs.tgz go (default ./gpu-check-out)
#   GPU_CHECK_BUILD     build directory (default build-gpu)
#   GPU_CHECK_ARCHS     CUDA architectures (default "80;90a": the full matrix)
#   GPU_CHECK_STEPS     steps to run, space separated, in this order (default: all of
#                       "info configure build sass_check gpu_tests cpu_tests pytest check bench_decode
#                        bench_prefill bench_dense bench_append peers")
#   GPU_CHECK_PEERS_ARGS options of bench/peers.py in the peers step (default "--quick"; empty: the
#                       full grids of every suite, several minutes)
#   GPU_CHECK_FILTER    --gtest_filter for the gpu tests (default: all)
#   GPU_CHECK_CPU_FILTER --gtest_filter for the cpu tests (default: all)
#   GPU_CHECK_JOBS      parallel build jobs (default: nproc)
#   GPU_CHECK_CMAKE_ARGS extra configure arguments (e.g. -DATTNKIT_KERNEL_SUBSET=ON)
#   GPU_CHECK_STEP_TIMEOUT seconds after which a step is stopped (default 0: no limit)
#   GPU_CHECK_GTEST_SOURCE a GoogleTest source tree, for machines whose GoogleTest package has
#                       headers but no libraries (default: a googletest/ folder at the top of one
#                       of the checkout's folders, e.g. a git-ignored copy of /usr/src/googletest)
# A step that fails is recorded and the script goes on (a failed build skips what needs it); the
# exit status is 0 only when every step that ran passed.
set -u -o pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-check-out}"
# Step logs go to $LOGS and are packed into $OUT/logs.tgz at the end; summary.txt stays beside
# it (two files to copy back from a remote machine).
LOGS="$OUT/logs"
mkdir -p "$LOGS"
BUILD="${GPU_CHECK_BUILD:-build-gpu}"
ARCHS="${GPU_CHECK_ARCHS:-80;90a}"
STEPS="${GPU_CHECK_STEPS:-info configure build sass_check gpu_tests cpu_tests pytest check bench_decode bench_prefill bench_dense bench_append peers}"
JOBS="${GPU_CHECK_JOBS:-$(nproc)}"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
FAILED=0
BUILD_OK=1

note() { echo "$*" | tee -a "$SUMMARY"; }

# run_step NAME COMMAND...: runs COMMAND with its output in $LOGS/NAME.log; records the result.
run_step() {
  local name="$1"
  shift
  local start=$SECONDS
  echo "=== $name: $*" | tee "$LOGS/$name.log"
  timeout "${GPU_CHECK_STEP_TIMEOUT:-0}" "$@" >>"$LOGS/$name.log" 2>&1
  local rc=$?
  local took=$((SECONDS - start))
  if [ $rc -eq 0 ]; then
    note "PASS  $name (${took}s)"
  else
    note "FAIL  $name (rc=$rc, ${took}s): see $name.log"
    tail -n 30 "$LOGS/$name.log" | sed 's/^/      /' >>"$SUMMARY"
    FAILED=1
  fi
  return $rc
}
skip() { note "SKIP  $1: $2"; }
wants() { [[ " $STEPS " == *" $1 "* ]]; }

# GoogleTest: the system package, else a source tree ($GPU_CHECK_GTEST_SOURCE, or the first
# <folder>/googletest of the checkout), else /usr/src/googletest (tests/CMakeLists.txt).
GTEST_SRC="${GPU_CHECK_GTEST_SOURCE:-}"
if [ -z "$GTEST_SRC" ]; then
  for dir in "$PWD"/.[!.]*/googletest "$PWD"/*/googletest; do
    if [ -f "$dir/CMakeLists.txt" ]; then
      GTEST_SRC="$dir"
      break
    fi
  done
fi
GTEST_ARGS=()
if [ -n "$GTEST_SRC" ]; then
  GTEST_ARGS=(-DATTNKIT_GTEST_SOURCE_DIR="$(cd "$GTEST_SRC" && pwd)")
fi

if wants info; then
  run_step info bash -c 'date -u; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv; nvcc --version | tail -n 2; cmake --version | head -n 1; nproc'
fi

if wants configure; then
  # shellcheck disable=SC2086
  run_step configure cmake -S . -B "$BUILD" -G Ninja -DATTNKIT_WITH_CUDA=ON \
    -DATTNKIT_CUDA_ARCHS="$ARCHS" "${GTEST_ARGS[@]}" ${GPU_CHECK_CMAKE_ARGS:-} || BUILD_OK=0
fi

if wants build; then
  if [ $BUILD_OK -eq 1 ]; then
    run_step build cmake --build "$BUILD" -j "$JOBS" --target attnkit attnkit_gpu_tests \
      attnkit_cpu_tests attnkit_cli || BUILD_OK=0
  else
    skip build "configure failed"
  fi
fi

TESTS_DIR="$BUILD/tests"
CLI="$BUILD/attnkit"

# The SASS of the library: no memory instruction may name a descriptor register that nothing
# writes (ptxas of CUDA 13.0 emitted such hinted cp.async copies in some decode kernels; an
# illegal instruction at run time, docs/decode_design.md "L2 evict_first"). Needs cuobjdump (CUDA
# toolkit); skipped without it.
if wants sass_check; then
  if ! python3 scripts/check_sass_descriptors.py --has-cuobjdump; then
    skip sass_check "no cuobjdump"
  elif [ $BUILD_OK -eq 1 ] && ls "$BUILD"/libattnkit.so* >/dev/null 2>&1; then
    run_step sass_check python3 scripts/check_sass_descriptors.py "$(ls "$BUILD"/libattnkit.so.*.*.* | head -n 1)"
  else
    skip sass_check "no library built"
  fi
fi

# run_gtests LABEL FILTER: runs $TESTS_DIR/attnkit_LABEL with an xml report, or records a skip.
run_gtests() {
  local label="$1" filter="$2" bin="$TESTS_DIR/attnkit_$1"
  if [ $BUILD_OK -eq 1 ] && [ -x "$bin" ]; then
    run_step "$label" "$bin" --gtest_color=no --gtest_filter="$filter" \
      --gtest_output="xml:$LOGS/$label.xml"
  else
    skip "$label" "no test binary ($bin)"
  fi
}
if wants gpu_tests; then run_gtests gpu_tests "${GPU_CHECK_FILTER:-*}"; fi
if wants cpu_tests; then run_gtests cpu_tests "${GPU_CHECK_CPU_FILTER:-*}"; fi

# The Python package on the GPU: builds the nanobind module into the same build folder and runs
# pytest there, so the torch/CUDA tests (skipped without a GPU) run on this GPU.
if wants pytest; then
  if [ $BUILD_OK -eq 1 ] && python3 -c "import nanobind, pytest" >/dev/null 2>&1; then
    run_step pytest bash -c "cmake -S . -B '$BUILD' -DATTNKIT_BUILD_PYTHON=ON >/dev/null && \
      cmake --build '$BUILD' -j $JOBS --target _attnkit && \
      PYTHONPATH='$BUILD/python' python3 -m pytest -q -rs python/tests"
  else
    skip pytest "no build, or python3 lacks nanobind/pytest"
  fi
fi

# A subcommand that exists but only says "(not yet implemented)" is skipped, not failed.
cli_has() {
  [ -x "$CLI" ] && "$CLI" "$@" --help >/dev/null 2>&1 &&
    ! "$CLI" "$@" --help 2>&1 | grep -q "not yet implemented"
}

if wants check; then
  if cli_has check; then run_step check "$CLI" check; else skip check "attnkit check not built or not implemented"; fi
fi
if wants bench_decode; then
  if cli_has bench decode; then run_step bench_decode "$CLI" bench decode; else skip bench_decode "attnkit bench decode not implemented"; fi
fi
if wants bench_prefill; then
  if cli_has bench prefill; then run_step bench_prefill "$CLI" bench prefill; else skip bench_prefill "attnkit bench prefill not implemented"; fi
fi
if wants bench_dense; then
  if cli_has bench dense; then run_step bench_dense "$CLI" bench dense; else skip bench_dense "attnkit bench dense not implemented"; fi
fi
if wants bench_append; then
  if cli_has bench append; then run_step bench_append "$CLI" bench append; else skip bench_append "attnkit bench append not implemented"; fi
fi
if wants peers; then
  # attnkit and the peers (PyTorch SDPA, FlexAttention, FlashInfer when importable) on the same
  # shapes: results.json, peers.md and the plots land in logs/peers/.
  if [ ! -f bench/peers.py ]; then
    skip peers "bench/peers.py not present"
  elif ! python3 -c "import torch" >/dev/null 2>&1; then
    skip peers "python3 has no torch"
  else
    # shellcheck disable=SC2086
    run_step peers python3 bench/peers.py ${GPU_CHECK_PEERS_ARGS---quick} --out "$LOGS/peers" \
      --attnkit-cli "$CLI"
  fi
fi

# Failing tests by name, for the summary.
for xml in "$LOGS"/gpu_tests.xml "$LOGS"/cpu_tests.xml; do
  [ -f "$xml" ] || continue
  python3 - "$xml" <<'EOF' >>"$SUMMARY" 2>/dev/null || true
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
tests, failures = int(root.get("tests", 0)), int(root.get("failures", 0))
skipped = sum(1 for c in root.iter("testcase") if c.find("skipped") is not None)
print(f"      {sys.argv[1].rsplit('/', 1)[-1]}: {tests} tests, {failures} failed, {skipped} skipped")
for case in root.iter("testcase"):
    if case.find("failure") is not None:
        print(f"      failed: {case.get('classname')}.{case.get('name')}")
EOF
done

tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOGS"
echo "--- summary ($SUMMARY; step logs in $OUT/logs.tgz)"
cat "$SUMMARY"
exit $FAILED
