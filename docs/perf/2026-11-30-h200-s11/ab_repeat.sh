#!/usr/bin/env bash
# Session 11 call 3: w-itm11 (w-stg11 + the output items unrolled over the least count that
# covers the CTA's heads) against main's own build, A B B A on the first rows.
T0=$SECONDS
MB=$HOME/build-main
for i in $(seq 240); do [ -f "$MB/DONE" ] && break; sleep 1; done; [ -x "$MB/attnkit" ] || echo "main build missing"
echo "main build waited $((SECONDS - T0)) s"
B() { # cli tag args...
  local c=$1 e=$2; shift 2
  [ $((SECONDS - T0)) -lt ${ROW_BUDGET:-190} ] || { echo "skip $e $*"; return; }
  timeout 10 "$c" bench decode --no-ceilings --iters 20 "$@" 2>&1 | grep -E '^\| [a-z0-9]|rror' |
    grep -v '^| label' | sed "s/^/$e $* /" | awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'
}
for row in "--batch 1 --context 32768" "--batch 64 --context 4096" "--kv-dtype fp8_e4m3 --batch 64 --context 4096" \
           "--q-heads 32 --kv-heads 32 --batch 1 --context 32768" "--batch 256 --context 1024" \
           "--batch 32 --context 32768" "--kv-dtype fp8_e4m3 --batch 1 --context 32768"; do
  B "$MB/attnkit" main $row; B "$CLI" new $row; B "$CLI" new $row; B "$MB/attnkit" main $row
done
for row in "--batch 1 --context 8192" "--q-heads 32 --kv-heads 2 --batch 1 --context 32768" \
           "--q-heads 32 --kv-heads 1 --batch 64 --context 4096" "--head-dim 64 --batch 1 --context 32768" \
           "--head-dim 256 --batch 1 --context 32768" "--batch 128 --context 2048"; do
  B "$MB/attnkit" main $row; B "$CLI" new $row
done
