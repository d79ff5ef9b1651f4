# w-f32p (core build, $CLI: f32 partials) vs main (build-main: query-type partials), A B A on split
# rows; then main's split count 1 against its heuristic on 128-item two-M-block rows.
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
for row in "--batch 1 --context 32768" "--kv-dtype fp8_e4m3 --batch 1 --context 32768" \
           "--batch 1 --context 8192" "--batch 1 --context 16384" "--batch 2 --context 32768" \
           "--q-heads 32 --kv-heads 4 --batch 1 --context 32768" "--q-heads 64 --kv-heads 8 --batch 1 --context 32768" \
           "$Q1 --batch 1 --context 32768" "$Q1 --batch 16 --context 8192" "$Q1 --batch 64 --context 4096" \
           "--q-heads 32 --kv-heads 2 --batch 1 --context 32768" "--batch 16 --context 32768" \
           "--batch 64 --context 4096"; do
  B $MB/attnkit main $row; B $CLI f32 $row; B $MB/attnkit main $row
done
echo "== main: split count 1 vs heuristic"
for row in "$Q1 --batch 128 --context 2048" "$G2 --batch 64 --context 4096" "$Q1 --batch 96 --context 4096" \
           "$Q1 --batch 256 --context 1024"; do
  B $MB/attnkit s0 $row; B $MB/attnkit s1 $row --splits 1; B $MB/attnkit s0 $row
done
