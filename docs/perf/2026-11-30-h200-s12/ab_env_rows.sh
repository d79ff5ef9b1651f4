#!/usr/bin/env bash
# Session 12, calls 2 and 6 (run as dyn.sh and tma.sh, folded here): a branch build ($CLI) with an
# experiment switch in the environment against main's own build, same call.
#   ab_env_rows.sh dyn : ATTNKIT_DECODE_DYN (w-dyn12: quarters of each split's tiles claimed by
#                        warps); rows main, q = 1 / 2 / 3, q = 0, main
#   ab_env_rows.sh tma : ATTNKIT_DECODE_TMA (w-tmakv: TMA copies in the 4-CTA 8-bit kernel);
#                        rows main, on, off, on, main
T0=$SECONDS
MB=$HOME/build-main
for i in $(seq 200); do [ -f "$MB/DONE" ] && break; sleep 1; done; [ -x "$MB/attnkit" ] || echo "main build missing"
echo "main build waited $((SECONDS - T0)) s"
case "$1" in
  dyn) VAR=ATTNKIT_DECODE_DYN ;;
  tma) VAR=ATTNKIT_DECODE_TMA ;;
  *) echo "usage: $0 dyn|tma"; exit 2 ;;
esac
: "${ROW_BUDGET:=210}"
# shellcheck source=../ab_row.sh
source "$(dirname "$0")/../ab_row.sh"
if [ "$1" = dyn ]; then
  for row in "--batch 1 --context 32768" "--kv-dtype fp8_e4m3 --batch 1 --context 32768" \
             "--batch 1 --context 8192" "--batch 1 --context 16384" "--batch 2 --context 32768"; do
    B "$MB/attnkit" main 0 $row; B "$CLI" dyn1 1 $row; B "$CLI" dyn2 2 $row; B "$CLI" dyn3 3 $row
    B "$CLI" dyn0 0 $row; B "$MB/attnkit" main 0 $row
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
else
  for row in "--kv-dtype fp8_e4m3 --batch 64 --context 4096" "--kv-dtype int8 --batch 64 --context 4096" \
             "--kv-dtype fp8_e4m3 --batch 128 --context 2048" "--kv-dtype fp8_e4m3 --batch 256 --context 1024" \
             "--kv-dtype fp8_e4m3 --batch 32 --context 32768" "--kv-dtype fp8_e4m3 --batch 64 --context 4096 --page 16" \
             "--kv-dtype fp8_e4m3 --batch 64 --context 4096 --page 64"; do
    B "$MB/attnkit" main 1 $row; B "$CLI" tma 1 $row; B "$CLI" off 0 $row; B "$CLI" tma 1 $row
    B "$MB/attnkit" main 1 $row
  done
  for row in "--batch 64 --context 4096" "--kv-dtype fp8_e4m3 --batch 1 --context 32768"; do
    B "$MB/attnkit" main 1 $row; B "$CLI" tma 1 $row
  done
fi
