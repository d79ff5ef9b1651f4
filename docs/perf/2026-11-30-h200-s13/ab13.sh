#!/usr/bin/env bash
# Session 13's A/B rows (calls 1-5, run as one13.sh, arr13.sh, tkt13.sh, tkt13b.sh and lse13.sh,
# folded here): an experiment build ($CLI, or $HOME/build-exp/attnkit in call 1) against main's own
# build compiled in the same call (`../2026-11-30-h200-s10/mainbuild.sh`; call 1: the core build of
# main itself), `attnkit bench decode --no-ceilings --iters 20`, TB/s and ms a call.
#   ab13.sh one : w-one13, ATTNKIT_DECODE_ONECTA=1 (split calls on 1 CTA an SM, 12 halves)
#   ab13.sh arr : w-arr13, ATTNKIT_DECODE_ARRIVE=0 turns the merge-as-they-arrive off
#   ab13.sh tkt : w-tkt13 as in call 3 (w-tkt13-call3.diff: the ticket test missed its mask),
#                 ATTNKIT_DECODE_TICKET=1 turns it on
#   ab13.sh tkt2: w-tkt13 (w-tkt13.diff, the protocol replacing the count), A B A
#   ab13.sh lse : w-lse13 (every head's LSEs loaded first), A B A
T0=$SECONDS
MODE=${1:?usage: ab13.sh one|arr|tkt|tkt2|lse}
if [ "$MODE" = one ]; then
  M=$HOME/build-snap/attnkit X=$HOME/build-exp/attnkit DONE=$HOME/build-exp/DONE VAR=ATTNKIT_DECODE_ONECTA
else
  M=$HOME/build-main/attnkit X=$CLI DONE=$HOME/build-main/DONE
  case "$MODE" in arr) VAR=ATTNKIT_DECODE_ARRIVE ;; tkt) VAR=ATTNKIT_DECODE_TICKET ;; *) VAR=ATTNKIT_UNUSED ;; esac
fi
for i in $(seq 200); do [ -f "$DONE" ] && break; sleep 1; done
echo "build waited $((SECONDS - T0)) s"
# shellcheck source=../ab_row.sh
source "$(dirname "$0")/../ab_row.sh"
R1="--batch 1 --context 32768"
BATCH1=("--batch 1 --context 32768" "--kv-dtype fp8_e4m3 --batch 1 --context 32768"
        "--batch 1 --context 8192" "--batch 1 --context 16384" "--batch 2 --context 32768")
OTHERS=("--batch 4 --context 32768" "--kv-dtype int8 --batch 1 --context 32768"
        "--q-heads 32 --kv-heads 1 --batch 64 --context 4096" "--q-heads 32 --kv-heads 2 --batch 1 --context 32768"
        "--q-heads 32 --kv-heads 32 --batch 1 --context 32768" "--head-dim 64 --batch 1 --context 32768"
        "--kv-dtype fp8_e4m3 --batch 16 --context 32768")
case "$MODE" in
  one)
    B $M main 0 $R1; B $X one 1 $R1 --splits 16; B $X one 1 $R1 --splits 16; B $M main 0 $R1
    B $M main16 0 $R1 --splits 16; B $X off 0 $R1
    for row in "--kv-dtype fp8_e4m3 --batch 1 --context 32768" "--batch 2 --context 32768"; do
      B $M main 0 $row; B $X one16 1 $row --splits 16; B $X one8 1 $row --splits 8; B $M main 0 $row
    done
    for row in "--batch 1 --context 8192" "--batch 1 --context 16384" "--kv-dtype int8 --batch 1 --context 32768" \
               "--batch 4 --context 32768" "--q-heads 32 --kv-heads 32 --batch 1 --context 32768"; do
      B $M main 0 $row; B $X one 1 $row; B $M main 0 $row
    done
    B $M main 0 $R1 --splits 24; B $X one24 1 $R1 --splits 24
    B $M main 0 $R1 --splits 20; B $X one20 1 $R1 --splits 20 ;;
  arr | tkt)
    # The switch: on (1) for the experiment's rows, 0 for its "off" rows (main's build ignores it).
    for row in "${BATCH1[@]}"; do
      B $M main 0 $row; B $X $MODE 1 $row; B $X off 0 $row; B $X $MODE 1 $row; B $M main 0 $row
    done
    extra=("--batch 64 --context 4096")
    [ "$MODE" = arr ] && extra+=("--kv-dtype fp8_e4m3 --batch 64 --context 4096" "--batch 32 --context 32768")
    for row in "${OTHERS[@]}" "${extra[@]}"; do
      B $M main 0 $row; B $X $MODE 1 $row; B $X off 0 $row; B $M main 0 $row
    done ;;
  tkt2)
    for row in "${BATCH1[@]}" "${OTHERS[@]:0:6}" "--kv-dtype fp8_e4m3 --batch 16 --context 32768" \
               "--q-heads 32 --kv-heads 1 --batch 1 --context 32768" "--head-dim 256 --batch 1 --context 32768" \
               "--batch 16 --context 32768"; do
      B $M main 0 $row; B $X tkt 0 $row; B $M main 0 $row
    done ;;
  lse)
    for row in "--q-heads 32 --kv-heads 1 --batch 64 --context 4096" "--q-heads 32 --kv-heads 2 --batch 1 --context 32768" \
               "--q-heads 32 --kv-heads 1 --batch 1 --context 32768" "--q-heads 64 --kv-heads 8 --batch 1 --context 32768" \
               "--q-heads 32 --kv-heads 4 --batch 1 --context 32768" "--q-heads 32 --kv-heads 2 --batch 8 --context 8192" \
               "--q-heads 32 --kv-heads 1 --batch 16 --context 8192" "--batch 1 --context 32768" \
               "--kv-dtype fp8_e4m3 --batch 1 --context 32768" "--batch 1 --context 8192" "--batch 64 --context 4096" \
               "--kv-dtype fp8_e4m3 --batch 64 --context 4096" "--batch 32 --context 32768"; do
      B $M main 0 $row; B $X lse 0 $row; B $M main 0 $row
    done ;;
esac
