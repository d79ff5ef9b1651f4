# w-pair14 (core build, $CLI, full gpu tests before this step) vs main (build-main), A B A, then
# split counts on the pair build for MQA / group-32 rows.
T0=$SECONDS
MB=$HOME/build-main
for i in $(seq 240); do [ -f "$MB/DONE" ] && break; sleep 1; done
[ -x "$MB/attnkit" ] || echo "main build missing"
echo "builds waited $((SECONDS - T0)) s"
B() { # cli tag args...
  local c=$1 e=$2; shift 2
  [ $((SECONDS - T0)) -lt ${ROW_BUDGET:-150} ] || { echo "skip $e $*"; return; }
  timeout 10 "$c" bench decode --no-ceilings --iters 20 "$@" 2>&1 |
    grep -E '^\| [a-z0-9]|rror' | grep -v '^| label' | sed "s/^/$e $* /" |
    awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'
}
Q1="--q-heads 32 --kv-heads 1" G2="--q-heads 64 --kv-heads 2"
for row in "$G2 --batch 64 --context 4096" "$G2 --batch 32 --context 8192" "$G2 --batch 128 --context 2048" \
           "$G2 --batch 8 --context 16384" "$Q1 --batch 256 --context 2048" "$Q1 --batch 8 --context 32768" \
           "$Q1 --batch 2 --context 32768" "--head-dim 64 $Q1 --batch 64 --context 4096" \
           "--page 16 $Q1 --batch 64 --context 4096" "--kv-dtype fp8_e4m3 --batch 64 --context 4096"; do
  B $MB/attnkit main $row; B $CLI pair $row; B $MB/attnkit main $row
done
echo "== splits on the pair build"
for row in "$Q1 --batch 64 --context 4096" "$Q1 --batch 16 --context 8192" "$G2 --batch 64 --context 4096" \
           "$Q1 --batch 128 --context 2048"; do
  for s in 0 1 2 3 4 6 8 12 16 24; do B $CLI s$s $row --splits $s; done
done
