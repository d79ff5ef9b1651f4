#!/usr/bin/env bash
# w-dyn12: dynamic tail (ATTNKIT_DECODE_DYN quarters of each split's share claimed by warps) vs main.
T0=$SECONDS
MB=$HOME/build-main
for i in $(seq 200); do [ -f "$MB/DONE" ] && break; sleep 1; done; [ -x "$MB/attnkit" ] || echo "main build missing"
echo "main build waited $((SECONDS - T0)) s"
B() { # cli tag dyn args...
  local c=$1 e=$2 d=$3; shift 3
  [ $((SECONDS - T0)) -lt ${ROW_BUDGET:-215} ] || { echo "skip $e $*"; return; }
  ATTNKIT_DECODE_DYN=$d timeout 10 "$c" bench decode --no-ceilings --iters 20 "$@" 2>&1 | grep -E '^\| [a-z0-9]|rror' |
    grep -v '^| label' | sed "s/^/$e $* /" | awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'
}
for row in "--batch 1 --context 32768" "--kv-dtype fp8_e4m3 --batch 1 --context 32768" \
           "--batch 1 --context 8192" "--batch 1 --context 16384" "--batch 2 --context 32768"; do
  B "$MB/attnkit" main 0 $row; B "$CLI" dyn1 1 $row; B "$CLI" dyn2 2 $row; B "$CLI" dyn3 3 $row; B "$CLI" dyn0 0 $row; B "$MB/attnkit" main 0 $row
done
for row in "--batch 4 --context 32768" "--kv-dtype int8 --batch 1 --context 32768" \
           "--q-heads 32 --kv-heads 2 --batch 1 --context 32768" "--head-dim 64 --batch 1 --context 32768" \
           "--head-dim 256 --batch 1 --context 32768" "--q-heads 32 --kv-heads 32 --batch 1 --context 32768"; do
  B "$MB/attnkit" main 0 $row; B "$CLI" dyn1 1 $row; B "$CLI" dyn2 2 $row; B "$CLI" dyn0 0 $row
done
for row in "--batch 64 --context 4096" "--kv-dtype fp8_e4m3 --batch 64 --context 4096" \
           "--batch 32 --context 32768" "--batch 256 --context 1024" "--q-heads 32 --kv-heads 1 --batch 64 --context 4096"; do
  B "$MB/attnkit" main 0 $row; B "$CLI" new 1 $row; B "$CLI" new 1 $row; B "$MB/attnkit" main 0 $row
done
