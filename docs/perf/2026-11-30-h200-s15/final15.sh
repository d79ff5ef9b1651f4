# (a) main's kernels before f32 partials (c4aeee6) with the new test SplitMeansFarFromTheRowsMean;
# (b) w-pair14 on f32 main (pair) vs main (f32), split counts 0 / 1 / 2, MQA and group-32 rows.
T0=$SECONDS
for n in old main pair; do
  for i in $(seq 300); do [ -f "$HOME/build-$n/DONE" ] && break; sleep 1; done
done
echo "builds waited $((SECONDS - T0)) s"
echo "== (a) c4aeee6 kernels, new test"
timeout 60 $HOME/build-old/tests/attnkit_gpu_tests --gtest_color=no \
  --gtest_filter='DecodeSplit.SplitMeansFarFromTheRowsMean:DecodeSplit.PartialsKeepTheRangeOfTheOutputType' 2>&1 |
  grep -E "seed|Failure|actual|trace:|hq=|merge|OK \]|FAILED|PASSED" | head -60
B() { # cli tag args...
  local c=$1 e=$2; shift 2
  [ $((SECONDS - T0)) -lt ${ROW_BUDGET:-150} ] || { echo "skip $e $*"; return; }
  timeout 10 "$c" bench decode --no-ceilings --iters 20 "$@" 2>&1 |
    grep -E '^\| [a-z0-9]|rror' | grep -v '^| label' | sed "s/^/$e $* /" |
    awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'
}
M=$HOME/build-main/attnkit P=$HOME/build-pair/attnkit
Q1="--q-heads 32 --kv-heads 1" G2="--q-heads 64 --kv-heads 2"
echo "== (b) pair vs main"
for row in "$Q1 --batch 128 --context 2048" "$G2 --batch 64 --context 4096" "$Q1 --batch 64 --context 4096" \
           "$Q1 --batch 256 --context 2048" "$G2 --batch 128 --context 2048" "$Q1 --batch 32 --context 4096" \
           "$G2 --batch 32 --context 8192" "$Q1 --batch 96 --context 4096"; do
  for s in 0 1 2; do B $M main-s$s $row --splits $s; B $P pair-s$s $row --splits $s; done
done
