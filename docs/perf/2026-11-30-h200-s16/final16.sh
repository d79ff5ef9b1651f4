# Session 16 final tree ($CLI): the split rule's rows on auto, with the landed no-split rule.
T0=$SECONDS
B() { # tag args...
  local e=$1; shift
  [ $((SECONDS - T0)) -lt ${ROW_BUDGET:-150} ] || { echo "skip $e $*"; return; }
  timeout 10 "$CLI" bench decode --no-ceilings --iters 20 "$@" 2>&1 |
    grep -E '^\| [a-z0-9]|rror' | grep -v '^| label' | sed "s/^/$e $* /" |
    awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'
}
Q1="--q-heads 32 --kv-heads 1" G2="--q-heads 64 --kv-heads 2"
for row in "$Q1 --batch 104 --context 2048" "$Q1 --batch 104 --context 8192" "$Q1 --batch 112 --context 2048" \
           "$Q1 --batch 112 --context 8192" "$Q1 --batch 120 --context 4096" "$Q1 --batch 96 --context 4096" \
           "$Q1 --batch 128 --context 2048" "$Q1 --batch 64 --context 4096" "$Q1 --batch 48 --context 8192" \
           "$G2 --batch 52 --context 4096" "$G2 --batch 64 --context 4096" "$Q1 --batch 16 --context 8192"; do
  B auto $row
done
