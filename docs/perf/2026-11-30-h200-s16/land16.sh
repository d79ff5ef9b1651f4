# Session 16 landing checks on the core build ($CLI): the forward test's seed replay with the shared
# units metric, then the two-M-block no-split threshold (80% of SMs) around its edge.
T0=$SECONDS
BD=$(dirname "$CLI")
echo "== Forward.* at seed 2154024671"
ATTNKIT_TEST_SEED=2154024671 timeout 60 "$BD/tests/attnkit_gpu_tests" --gtest_filter='Forward.*' 2>&1 |
  grep -E '^\[forward\]|Failure|FAILED|PASSED|differs' | head -60
B() { # tag args...
  local e=$1; shift
  [ $((SECONDS - T0)) -lt ${ROW_BUDGET:-150} ] || { echo "skip $e $*"; return; }
  timeout 10 "$CLI" bench decode --no-ceilings --iters 20 "$@" 2>&1 |
    grep -E '^\| [a-z0-9]|rror' | grep -v '^| label' | sed "s/^/$e $* /" |
    awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'
}
Q1="--q-heads 32 --kv-heads 1"
echo "== no-split threshold (auto, 1, 2 splits)"
for row in "$Q1 --batch 104 --context 2048" "$Q1 --batch 104 --context 8192" "$Q1 --batch 112 --context 2048" \
           "$Q1 --batch 112 --context 8192" "$Q1 --batch 120 --context 4096" "$Q1 --batch 96 --context 4096" \
           "--q-heads 64 --kv-heads 2 --batch 52 --context 4096" "$Q1 --batch 48 --context 8192"; do
  B auto $row; B s1 $row --splits 1; B s2 $row --splits 2
done
