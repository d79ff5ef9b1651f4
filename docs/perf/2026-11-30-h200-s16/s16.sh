# Session 16's row scripts (run on the GPU machine by .carry/devq/round.sh after gpu_check.sh's
# steps, CLI = the tree's attnkit; calls 1, 4 and 5): bash s16.sh sweep|land|final.
# `attnkit bench decode --no-ceilings --iters 20` a row; prints "tag args | ms | TB/s |".
T0=$SECONDS
B() { # tag args...
  local e=$1; shift
  [ $((SECONDS - T0)) -lt ${ROW_BUDGET:-150} ] || { echo "skip $e $*"; return; }
  timeout 10 "$CLI" bench decode --no-ceilings --iters 20 "$@" 2>&1 |
    grep -E '^\| [a-z0-9]|rror' | grep -v '^| label' | sed "s/^/$e $* /" |
    awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'
}
Q1="--q-heads 32 --kv-heads 1" G2="--q-heads 64 --kv-heads 2"
case "$1" in
  sweep)  # call 1: split counts of the two-M-block kernel; merge modes on the split rows
    for row in "$Q1 --batch 96 --context 4096" "$Q1 --batch 64 --context 4096" \
               "$Q1 --batch 32 --context 4096" "$Q1 --batch 48 --context 8192" \
               "$G2 --batch 48 --context 4096" "$Q1 --batch 112 --context 2048" \
               "$Q1 --batch 200 --context 2048"; do
      for s in 0 1 2 3 4 6 8; do B s$s $row --splits $s; done
    done
    echo "== merge modes with f32 partials (bench decode --merge)"
    for row in "--batch 1 --context 32768" "--kv-dtype fp8_e4m3 --batch 1 --context 32768" \
               "--batch 1 --context 8192" "--batch 2 --context 32768" \
               "--q-heads 32 --kv-heads 4 --batch 1 --context 32768" \
               "--q-heads 64 --kv-heads 8 --batch 1 --context 32768"; do
      for m in auto in-kernel separate auto; do B m-$m $row --merge $m; done
    done ;;
  land)  # call 4: the forward tests at call 3's seed; 1 vs 2 splits around the no-split rule
    echo "== Forward.* at seed 2154024671"
    ATTNKIT_TEST_SEED=2154024671 timeout 60 "$(dirname "$CLI")/tests/attnkit_gpu_tests" \
      --gtest_filter='Forward.*' 2>&1 | grep -E '^\[forward\]|Failure|FAILED|PASSED|differs' | head -60
    echo "== no-split threshold (auto, 1, 2 splits)"
    for row in "$Q1 --batch 104 --context 2048" "$Q1 --batch 104 --context 8192" \
               "$Q1 --batch 112 --context 2048" "$Q1 --batch 112 --context 8192" \
               "$Q1 --batch 120 --context 4096" "$Q1 --batch 96 --context 4096" \
               "$G2 --batch 52 --context 4096" "$Q1 --batch 48 --context 8192"; do
      B auto $row; B s1 $row --splits 1; B s2 $row --splits 2
    done ;;
  final)  # call 5: the split rule's rows on auto
    for row in "$Q1 --batch 104 --context 2048" "$Q1 --batch 104 --context 8192" \
               "$Q1 --batch 112 --context 2048" "$Q1 --batch 112 --context 8192" \
               "$Q1 --batch 120 --context 4096" "$Q1 --batch 96 --context 4096" \
               "$Q1 --batch 128 --context 2048" "$Q1 --batch 64 --context 4096" \
               "$Q1 --batch 48 --context 8192" "$G2 --batch 52 --context 4096" \
               "$G2 --batch 64 --context 4096" "$Q1 --batch 16 --context 8192"; do
      B auto $row
    done ;;
  *) echo "usage: s16.sh sweep|land|final" >&2; exit 2 ;;
esac
