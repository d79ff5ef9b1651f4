# w-exp16 (= w-lazy15 + w-wave15; core build, $CLI, gpu tests before) vs main (build-main:
# mainbuild.sh in the background, snap_main = main). Env: ATTNKIT_DECODE_RESCALE_SLACK (0 exact max,
# 8 lazy), ATTNKIT_DECODE_ONE_WAVE (0 off, 1 on). Columns: main | ex2 only | +lazy | +lazy+wave | main.
T0=$SECONDS
MB=$HOME/build-main
for i in $(seq 240); do [ -f "$MB/DONE" ] && break; sleep 1; done
echo "builds waited $((SECONDS - T0)) s"
B() { # cli tag slack wave args...
  local c=$1 e=$2 sl=$3 w=$4; shift 4
  [ $((SECONDS - T0)) -lt ${ROW_BUDGET:-200} ] || { echo "skip $e $*"; return; }
  ATTNKIT_DECODE_RESCALE_SLACK=$sl ATTNKIT_DECODE_ONE_WAVE=$w timeout 10 "$c" bench decode \
    --no-ceilings --iters 20 "$@" 2>&1 | grep -E '^\| [a-z0-9]|rror' | grep -v '^| label' |
    sed "s/^/$e $* /" | awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'
}
Q1="--q-heads 32 --kv-heads 1" G2="--q-heads 64 --kv-heads 2"
for row in "$Q1 --batch 64 --context 4096" "$Q1 --batch 128 --context 2048" "$Q1 --batch 16 --context 8192" \
           "$Q1 --batch 96 --context 4096" "$Q1 --batch 48 --context 8192" "$Q1 --batch 112 --context 2048" \
           "$G2 --batch 64 --context 4096" "--q-heads 32 --kv-heads 2 --batch 8 --context 8192" \
           "--batch 64 --context 4096" "--batch 1 --context 32768" "--kv-dtype fp8_e4m3 --batch 64 --context 4096" \
           "--kv-dtype fp8_e4m3 --batch 1 --context 32768" "--batch 256 --context 1024"; do
  B $MB/attnkit main 0 0 $row; B $CLI ex2 0 0 $row; B $CLI lazy 8 0 $row; B $CLI wave 8 1 $row
  B $MB/attnkit main 0 0 $row
done
