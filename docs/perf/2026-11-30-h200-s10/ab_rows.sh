#!/usr/bin/env bash
# Session 10, calls 3, 4 and 7 (as e10.sh, m10.sh and p10.sh, this script under three names):
# the branch build ($CLI) against main's own build, same call, A B B A on the batch-1 rows.
T0=$SECONDS
MB=$HOME/build-main
for i in $(seq 200); do [ -f "$MB/DONE" ] && break; sleep 1; done; [ -x "$MB/attnkit" ] || echo "main build missing"
echo "main build waited $((SECONDS - T0)) s"
B() { # cli tag args...
  local c=$1 e=$2; shift 2
  [ $((SECONDS - T0)) -lt ${ROW_BUDGET:-170} ] || { echo "skip $e $*"; return; }
  timeout 10 "$c" bench decode --no-ceilings --iters 20 "$@" 2>&1 | grep -E '^\| [a-z0-9]|rror' |
    grep -v '^| label' | sed "s/^/$e $* /" | awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'
}
for row in "--batch 1 --context 32768" "--kv-dtype fp8_e4m3 --batch 1 --context 32768" \
           "--batch 1 --context 8192" "--batch 1 --context 16384" "--batch 2 --context 32768"; do
  B "$MB/attnkit" main $row; B "$CLI" new $row; B "$CLI" new $row; B "$MB/attnkit" main $row
done
for row in "--batch 4 --context 32768" "--kv-dtype int8 --batch 1 --context 32768" \
           "--batch 64 --context 4096" "--kv-dtype fp8_e4m3 --batch 64 --context 4096" \
           "--batch 32 --context 32768" "--batch 256 --context 1024" \
           "--q-heads 32 --kv-heads 2 --batch 1 --context 32768" "--q-heads 32 --kv-heads 1 --batch 1 --context 32768" \
           "--q-heads 32 --kv-heads 1 --batch 64 --context 4096" "--head-dim 64 --batch 1 --context 32768" \
           "--head-dim 256 --batch 1 --context 32768" "--q-heads 32 --kv-heads 32 --batch 1 --context 32768"; do
  B "$MB/attnkit" main $row; B "$CLI" new $row
done
