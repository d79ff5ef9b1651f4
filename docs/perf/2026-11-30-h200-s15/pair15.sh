# w-pair14 (rebased on main; exp subset build) vs main HEAD (core build, $CLI), A B A; then the
# branch's Decode*/Forward* gpu tests.
T0=$SECONDS
EB=$HOME/build-exp
for i in $(seq 240); do [ -f "$EB/DONE" ] && break; sleep 1; done
[ -x "$EB/attnkit" ] || echo "exp build missing"
echo "builds waited $((SECONDS - T0)) s"
B() { # cli tag args...
  local c=$1 e=$2; shift 2
  [ $((SECONDS - T0)) -lt ${ROW_BUDGET:-150} ] || { echo "skip $e $*"; return; }
  timeout 10 "$c" bench decode --no-ceilings --iters 20 "$@" 2>&1 |
    grep -E '^\| [a-z0-9]|rror' | grep -v '^| label' | sed "s/^/$e $* /" |
    awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'
}
Q1="--q-heads 32 --kv-heads 1"
for row in "$Q1 --batch 64 --context 4096" "$Q1 --batch 16 --context 8192" "$Q1 --batch 128 --context 2048" \
           "--q-heads 64 --kv-heads 2 --batch 64 --context 4096" "$Q1 --batch 32 --context 4096" \
           "--batch 64 --context 4096" "--batch 1 --context 32768"; do
  B $CLI main $row; B $EB/attnkit pair $row; B $CLI main $row
done
echo "== pair gpu tests"
timeout 120 $EB/tests/attnkit_gpu_tests --gtest_color=no --gtest_brief=1 --gtest_filter='Decode*:Forward*' 2>&1 | tail -25
