# w-pair14 + its split rule (core build, $CLI, full gpu tests before) vs main (f32 partials, subset CLI).
T0=$SECONDS
MB=$HOME/build-main
for i in $(seq 240); do [ -f "$MB/DONE" ] && break; sleep 1; done
echo "builds waited $((SECONDS - T0)) s"
B() { # cli tag args...
  local c=$1 e=$2; shift 2
  [ $((SECONDS - T0)) -lt ${ROW_BUDGET:-150} ] || { echo "skip $e $*"; return; }
  timeout 10 "$c" bench decode --no-ceilings --iters 20 "$@" 2>&1 |
    grep -E '^\| [a-z0-9]|rror' | grep -v '^| label' | sed "s/^/$e $* /" |
    awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'
}
Q1="--q-heads 32 --kv-heads 1" G2="--q-heads 64 --kv-heads 2"
for row in "$Q1 --batch 128 --context 2048" "$G2 --batch 64 --context 4096" "$Q1 --batch 64 --context 4096" \
           "$Q1 --batch 32 --context 4096" "$Q1 --batch 16 --context 8192" "$Q1 --batch 96 --context 4096" \
           "$Q1 --batch 256 --context 2048" "$G2 --batch 128 --context 2048" "$G2 --batch 32 --context 8192" \
           "--batch 64 --context 4096" "--batch 1 --context 32768"; do
  B $MB/attnkit main $row; B $CLI pair $row; B $MB/attnkit main $row
done
