# Session 17's device steps for the warpgroup-MMA decode kernel (run by .carry/devq/round.sh after
# gpu_check.sh's build, CLI = the tree's attnkit): bash wg17.sh tests|rows|sweep.
# Rows: `attnkit bench decode --no-ceilings --iters 20`, "tag args | ms | TB/s |"; the tag says
# ATTNKIT_EXP_WGMMA (wg0: the mma.sync kernels, wg1: the wgmma kernel).
T0=$SECONDS
TESTS="$(dirname "$CLI")/tests/attnkit_gpu_tests"
B() { # tag env args...
  local e=$1 env=$2; shift 2
  [ $((SECONDS - T0)) -lt ${ROW_BUDGET:-200} ] || { echo "skip $e $*"; return; }
  env $env timeout 10 "$CLI" bench decode --no-ceilings --iters 20 "$@" 2>&1 |
    grep -E '^\| [a-z0-9]|rror' | grep -v '^| label' | sed "s/^/$e $* /" |
    awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'
}
Q1="--q-heads 32 --kv-heads 1" G2="--q-heads 64 --kv-heads 2" G16="--q-heads 32 --kv-heads 2"
case "$1" in
  tests)  # call 1 (its build had ATTNKIT_EXP_WGMMA_VSWAP: the V descriptor's offsets swapped)
    for vs in 0 1; do
      echo "== wgmma tests, ATTNKIT_EXP_WGMMA_VSWAP=$vs"
      ATTNKIT_EXP_WGMMA_VSWAP=$vs timeout 120 "$TESTS" \
        --gtest_filter='DecodeFused.HopperWarpgroup*:DecodeFused.MqaAndGroups*' 2>&1 |
        grep -E 'Failure|Expected|Which is|max_abs|bound|FAILED|PASSED|OK \]|hq=' | head -40
    done ;;
  rows)
    for row in "$Q1 --batch 64 --context 4096" "$Q1 --batch 128 --context 2048" \
               "$Q1 --batch 200 --context 2048" "$Q1 --batch 96 --context 4096" \
               "$Q1 --batch 16 --context 8192" "$Q1 --batch 48 --context 8192" \
               "$Q1 --batch 256 --context 2048" "$G2 --batch 64 --context 4096" \
               "$G16 --batch 64 --context 4096" "$G16 --batch 8 --context 8192" \
               "$Q1 --batch 32 --context 32768"; do
      B wg0 "ATTNKIT_EXP_WGMMA=0" $row
      B wg1 "ATTNKIT_EXP_WGMMA=1" $row
    done ;;
  sweep)
    for row in "$Q1 --batch 64 --context 4096" "$Q1 --batch 32 --context 4096" \
               "$Q1 --batch 96 --context 4096"; do
      for s in 0 1 2 3 4 6 8; do
        B wg1s$s "ATTNKIT_EXP_WGMMA=1" $row --splits $s
      done
    done ;;
  tests2)  # call 2: the kernel built for 2 and for 3 CTAs an SM (the V descriptor swap is gone)
    for c in 2 3; do
      echo "== wgmma tests, ATTNKIT_EXP_WGMMA_CTAS=$c"
      ATTNKIT_EXP_WGMMA_CTAS=$c timeout 120 "$TESTS" \
        --gtest_filter='DecodeFused.HopperWarpgroup*:DecodeFused.MqaAndGroups*' 2>&1 |
        grep -E 'Failure|Expected|Which is|FAILED|PASSED|OK \]' | head -20
    done ;;
  rows2)
    for row in "$Q1 --batch 64 --context 4096" "$Q1 --batch 128 --context 2048" \
               "$Q1 --batch 200 --context 2048" "$Q1 --batch 96 --context 4096" \
               "$Q1 --batch 16 --context 8192" "$Q1 --batch 48 --context 8192" \
               "$Q1 --batch 256 --context 2048" "$G2 --batch 64 --context 4096" \
               "$G16 --batch 64 --context 4096" "$G16 --batch 8 --context 8192" \
               "$Q1 --batch 32 --context 32768" "$Q1 --batch 128 --context 8192"; do
      B wg0 "ATTNKIT_EXP_WGMMA=0" $row
      B wg1c2 "ATTNKIT_EXP_WGMMA=1 ATTNKIT_EXP_WGMMA_CTAS=2" $row
      B wg1c3 "ATTNKIT_EXP_WGMMA=1 ATTNKIT_EXP_WGMMA_CTAS=3" $row
    done
    for row in "$Q1 --batch 128 --context 2048" "$Q1 --batch 200 --context 2048" \
               "$Q1 --batch 64 --context 4096" "$Q1 --batch 16 --context 8192"; do
      for s in 1 2 4 8; do
        for c in 2 3; do B wg1c${c}s$s "ATTNKIT_EXP_WGMMA_CTAS=$c" $row --splits $s; done
      done
    done ;;
  final)  # call 3: the landed rule (no switches), auto
    for row in "$Q1 --batch 64 --context 4096" "$Q1 --batch 96 --context 4096" \
               "$Q1 --batch 48 --context 8192" "$Q1 --batch 16 --context 8192" \
               "$Q1 --batch 256 --context 2048" "$Q1 --batch 32 --context 32768" \
               "$Q1 --batch 128 --context 8192" "$Q1 --batch 128 --context 2048" \
               "$Q1 --batch 200 --context 2048" "$G2 --batch 64 --context 4096" \
               "$G16 --batch 64 --context 4096" "$G16 --batch 8 --context 8192" \
               "--batch 64 --context 4096" "--batch 1 --context 32768"; do
      B auto "" $row
    done ;;
  variants)  # call 4: ATTNKIT_EXP_WGMMA_VARIANT 0 (landed) / 1 (overlap) / 2 (lean copies) / 3
    echo "== wgmma tests, variant 3"
    ATTNKIT_EXP_WGMMA_VARIANT=3 timeout 150 "$TESTS" \
      --gtest_filter='DecodeFused.HopperWarpgroup*:DecodeFused.MqaAndGroups*:DecodeFused.SplitKvAcross*' \
      2>&1 | grep -E 'Failure|Expected|Which is|FAILED|PASSED|OK \]' | head -20
    for row in "$Q1 --batch 64 --context 4096" "$Q1 --batch 96 --context 4096" \
               "$Q1 --batch 256 --context 2048" "$Q1 --batch 32 --context 32768" \
               "$Q1 --batch 16 --context 8192" "$G16 --batch 64 --context 4096" \
               "$Q1 --batch 48 --context 8192"; do
      for v in 0 1 2 3 0; do B v$v "ATTNKIT_EXP_WGMMA_VARIANT=$v" $row; done
    done ;;
  *) echo "usage: wg17.sh tests|rows|sweep|tests2|rows2|final|variants" >&2; exit 2 ;;
esac
