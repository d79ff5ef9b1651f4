# Split counts of the two-M-block (pair-barrier) kernel on main ($CLI, core build): which count each
# MQA / group-32 grid wants, to derive a rule (session 15 left the 96-item and 32/64-item counts).
T0=$SECONDS
B() { # tag args...
  local e=$1; shift
  [ $((SECONDS - T0)) -lt ${ROW_BUDGET:-150} ] || { echo "skip $e $*"; return; }
  timeout 10 "$CLI" bench decode --no-ceilings --iters 20 "$@" 2>&1 |
    grep -E '^\| [a-z0-9]|rror' | grep -v '^| label' | sed "s/^/$e $* /" |
    awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'
}
Q1="--q-heads 32 --kv-heads 1" G2="--q-heads 64 --kv-heads 2"
for row in "$Q1 --batch 96 --context 4096" "$Q1 --batch 64 --context 4096" "$Q1 --batch 32 --context 4096" \
           "$Q1 --batch 48 --context 8192" "$G2 --batch 48 --context 4096" "$Q1 --batch 112 --context 2048" \
           "$Q1 --batch 200 --context 2048"; do
  for s in 0 1 2 3 4 6 8; do B s$s $row --splits $s; done
done
echo "== merge modes with f32 partials (bench decode --merge)"
for row in "--batch 1 --context 32768" "--kv-dtype fp8_e4m3 --batch 1 --context 32768" "--batch 1 --context 8192" \
           "--batch 2 --context 32768" "--q-heads 32 --kv-heads 4 --batch 1 --context 32768" \
           "--q-heads 64 --kv-heads 8 --batch 1 --context 32768"; do
  for m in auto in-kernel separate auto; do B m-$m $row --merge $m; done
done
