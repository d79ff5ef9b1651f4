#!/usr/bin/env bash
# Session 9 (branch w-mqa2, the landed rule): MQA rows against main's own build, same call.
T0=$SECONDS
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
MB=$HOME/build-main
for i in $(seq 90); do [ -f "$MB/DONE" ] && break; sleep 1; done; [ -x "$MB/attnkit" ] || echo "main build missing"
B() { # cli tag args...
  local c=$1 e=$2; shift 2
  [ $((SECONDS - T0)) -lt 100 ] || { echo "skip $e $*"; return; }
  timeout 8 "$c" bench decode --no-ceilings --iters 20 "$@" 2>&1 | grep -E '^\| [a-z0-9]|rror' |
    grep -v '^| label' | sed "s/^/$e $* /" | awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'
}
for row in "--batch 1 --context 32768" "--batch 2 --context 32768" "--batch 4 --context 32768" \
           "--batch 8 --context 32768" "--batch 64 --context 4096" "--kv-dtype fp8_e4m3 --batch 64 --context 4096" \
           "--kv-dtype fp8_e4m3 --batch 1 --context 32768" "--kv-dtype int8 --batch 8 --context 32768"; do
  B "$MB/attnkit" main --q-heads 32 --kv-heads 1 $row
  B "$CLI" new --q-heads 32 --kv-heads 1 $row
done
