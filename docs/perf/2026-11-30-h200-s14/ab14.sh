#!/usr/bin/env bash
# Session 14's A/B rows (calls 1-5, run as the step scripts xm13.sh, xm14.sh, xm15.sh, sep16.sh and
# grp16.sh, folded here): `attnkit bench decode --no-ceilings --iters 20`, TB/s and ms a call. $CLI
# is the call's core build (scripts/gpu_check.sh on the tree under test), $HOME/build-main/attnkit
# the pre-session main compiled in the same call (`../2026-11-30-h200-s10/mainbuild.sh`; call 5: the
# kernel subset), $HOME/build-exp/attnkit an experiment build (kernel subset, CLI only).
#   ab14.sh xm1 : call 1, the separate merge as prepared (one warp a (row, head)) vs main
#   ab14.sh xm2 : call 2, four warps a (row, head) below 8 pairs an SM, batched loads ($CLI) and
#                 the same with one warp always (exp) vs main
#   ab14.sh xm3 : call 3, four warps only below one pair an SM (landed as da10997) vs main
#   ab14.sh sep : call 4, da10997 ($CLI) vs every split call merged apart (exp)
#   ab14.sh grp : call 5, da10997 (build-main) vs the rule by the KV head's group (exp; efffac6)
T0=$SECONDS
MODE=${1:?usage: ab14.sh xm1|xm2|xm3|sep|grp}
M=$HOME/build-main/attnkit X=$HOME/build-exp/attnkit VAR=ATTNKIT_UNUSED
for i in $(seq 240); do [ -x "$M" ] && [ -x "$X" ] && break; sleep 1; done
# shellcheck source=../ab_row.sh
source "$(dirname "$0")/../ab_row.sh"
Q1="--q-heads 32 --kv-heads 1" Q2="--q-heads 32 --kv-heads 2"
case "$MODE" in
  xm1)
    for row in "$Q1 --batch 64 --context 4096" "$Q1 --batch 16 --context 8192" "$Q1 --batch 1 --context 32768" \
               "$Q2 --batch 1 --context 32768" "$Q2 --batch 8 --context 8192" "$Q2 --batch 64 --context 4096" \
               "--q-heads 64 --kv-heads 8 --batch 1 --context 32768" "$Q1 --batch 8 --context 32768" \
               "--batch 1 --context 32768" "--kv-dtype fp8_e4m3 --batch 1 --context 32768" \
               "--batch 1 --context 8192" "--batch 64 --context 4096"; do
      B $M main 0 $row; B $CLI xm 0 $row; B $M main 0 $row
    done ;;
  xm2 | xm3)
    for row in "$Q1 --batch 1 --context 32768" "$Q1 --batch 16 --context 8192" "$Q2 --batch 1 --context 32768" \
               "$Q1 --batch 64 --context 4096" "$Q2 --batch 8 --context 8192" \
               "$([ $MODE = xm2 ] && echo "$Q1 --batch 4 --context 16384" || echo "--kv-dtype fp8_e4m3 --batch 1 --context 32768")" \
               "$Q2 --batch 64 --context 4096" "--q-heads 32 --kv-heads 4 --batch 1 --context 32768" \
               "$([ $MODE = xm2 ] && echo "$Q1 --batch 8 --context 32768" || echo "--batch 128 --context 2048")" \
               "--batch 1 --context 32768" "--kv-dtype fp8_e4m3 $Q1 --batch 1 --context 32768" "--batch 64 --context 4096"; do
      B $M main 0 $row; B $CLI xm 0 $row; [ $MODE = xm2 ] && B $X exp 0 $row; B $M main 0 $row
    done ;;
  sep)
    for row in "--batch 1 --context 32768" "--kv-dtype fp8_e4m3 --batch 1 --context 32768" "--batch 1 --context 8192" \
               "--batch 1 --context 16384" "--batch 2 --context 32768" "--kv-dtype int8 --batch 1 --context 32768" \
               "--batch 4 --context 32768" "--q-heads 32 --kv-heads 32 --batch 1 --context 32768" \
               "--head-dim 64 --batch 1 --context 32768" "--kv-dtype fp8_e4m3 --batch 16 --context 32768" \
               "$Q1 --batch 4 --context 16384"; do
      B $CLI main 0 $row; B $X exp 0 $row; B $CLI main 0 $row
    done ;;
  grp)
    Q16="--q-heads 16 --kv-heads 1"
    for row in "$Q1 --batch 4 --context 16384" "$Q1 --batch 8 --context 32768" "$Q1 --batch 2 --context 32768" \
               "$Q1 --batch 16 --context 4096" "$Q2 --batch 4 --context 16384" "$Q2 --batch 16 --context 8192" \
               "$Q16 --batch 4 --context 16384" "$Q16 --batch 1 --context 32768" \
               "--kv-dtype fp8_e4m3 $Q1 --batch 8 --context 32768" "--kv-dtype fp8_e4m3 $Q1 --batch 64 --context 4096" \
               "$Q1 --batch 64 --context 4096" "--batch 1 --context 32768"; do
      B $M main 0 $row; B $X exp 0 $row; B $M main 0 $row
    done ;;
esac
