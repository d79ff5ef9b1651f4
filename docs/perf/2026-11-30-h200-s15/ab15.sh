#!/usr/bin/env bash
# Session 15's A/B rows (calls 1-4 and 6, run as the step scripts pair15.sh, pair16.sh, f32ab.sh,
# final15.sh and pairrule.sh, folded here): `attnkit bench decode --no-ceilings --iters 20`, TB/s
# and ms a call. $CLI is the call's core build (scripts/gpu_check.sh on the tree under test);
# $HOME/build-main, -exp and -pair hold builds compiled in the same call (`subbuild.sh`, or the
# full CLI build of `../2026-11-30-h200-s10/mainbuild.sh`).
#   ab15.sh pair1  : call 1, w-pair14 (exp) vs main c4aeee6 ($CLI)
#   ab15.sh pair2  : call 2, w-pair14 ($CLI) vs main c4aeee6 (build-main), then --splits sweeps
#   ab15.sh f32    : call 3, f32 partials ($CLI) vs 16-bit partials (build-main), then main's
#                    --splits 1 vs the heuristic on 32-head grids
#   ab15.sh splits : call 4, w-pair14 on the f32 tree (build-pair) vs the f32 tree (build-main) at
#                    --splits 0 / 1 / 2
#   ab15.sh rule   : call 6, w-pair14 with its split rule ($CLI; 6826da5) vs the f32 tree
T0=$SECONDS
MODE=${1:?usage: ab15.sh pair1|pair2|f32|splits|rule}
M=$HOME/build-main/attnkit X=$HOME/build-exp/attnkit P=$HOME/build-pair/attnkit VAR=ATTNKIT_UNUSED
# shellcheck source=../ab_row.sh
source "$(dirname "$0")/../ab_row.sh"
Q1="--q-heads 32 --kv-heads 1" G2="--q-heads 64 --kv-heads 2"
aba() { # A B A over the rows in $ROWS: aba A_CLI A_TAG B_CLI B_TAG
  local row
  for row in "${ROWS[@]}"; do B "$1" "$2" 0 $row; B "$3" "$4" 0 $row; B "$1" "$2" 0 $row; done
}
sweep() { # sweep CLI TAG_PREFIX COUNTS... over $ROWS
  local c=$1 t=$2 row s
  shift 2
  for row in "${ROWS[@]}"; do for s in "$@"; do B "$c" "$t$s" 0 $row --splits "$s"; done; done
}
case "$MODE" in
  pair1)
    ROWS=("$Q1 --batch 64 --context 4096" "$Q1 --batch 16 --context 8192" "$Q1 --batch 128 --context 2048"
          "$G2 --batch 64 --context 4096" "$Q1 --batch 32 --context 4096" "--batch 64 --context 4096"
          "--batch 1 --context 32768")
    aba "$CLI" main "$X" pair ;;
  pair2)
    ROWS=("$G2 --batch 64 --context 4096" "$G2 --batch 32 --context 8192" "$G2 --batch 128 --context 2048"
          "$G2 --batch 8 --context 16384" "$Q1 --batch 256 --context 2048" "$Q1 --batch 8 --context 32768"
          "$Q1 --batch 2 --context 32768" "--head-dim 64 $Q1 --batch 64 --context 4096"
          "--page 16 $Q1 --batch 64 --context 4096" "--kv-dtype fp8_e4m3 --batch 64 --context 4096")
    aba "$M" main "$CLI" pair
    ROWS=("$Q1 --batch 64 --context 4096" "$Q1 --batch 16 --context 8192" "$G2 --batch 64 --context 4096"
          "$Q1 --batch 128 --context 2048")
    sweep "$CLI" s 0 1 2 3 4 6 8 12 16 24 ;;
  f32)
    ROWS=("--batch 1 --context 32768" "--kv-dtype fp8_e4m3 --batch 1 --context 32768"
          "--batch 1 --context 8192" "--batch 1 --context 16384" "--batch 2 --context 32768"
          "--q-heads 32 --kv-heads 4 --batch 1 --context 32768" "--q-heads 64 --kv-heads 8 --batch 1 --context 32768"
          "$Q1 --batch 1 --context 32768" "$Q1 --batch 16 --context 8192" "$Q1 --batch 64 --context 4096"
          "--q-heads 32 --kv-heads 2 --batch 1 --context 32768" "--batch 16 --context 32768"
          "--batch 64 --context 4096")
    aba "$M" main "$CLI" f32
    ROWS=("$Q1 --batch 128 --context 2048" "$G2 --batch 64 --context 4096" "$Q1 --batch 96 --context 4096"
          "$Q1 --batch 256 --context 1024")
    for row in "${ROWS[@]}"; do
      B "$M" s0 0 $row; B "$M" s1 0 $row --splits 1; B "$M" s0 0 $row
    done ;;
  splits)
    for row in "$Q1 --batch 128 --context 2048" "$G2 --batch 64 --context 4096" "$Q1 --batch 64 --context 4096" \
               "$Q1 --batch 256 --context 2048" "$G2 --batch 128 --context 2048" "$Q1 --batch 32 --context 4096" \
               "$G2 --batch 32 --context 8192" "$Q1 --batch 96 --context 4096"; do
      for s in 0 1 2; do B "$M" "main-s$s" 0 $row --splits $s; B "$P" "pair-s$s" 0 $row --splits $s; done
    done ;;
  rule)
    ROWS=("$Q1 --batch 128 --context 2048" "$G2 --batch 64 --context 4096" "$Q1 --batch 64 --context 4096"
          "$Q1 --batch 32 --context 4096" "$Q1 --batch 16 --context 8192" "$Q1 --batch 96 --context 4096"
          "$Q1 --batch 256 --context 2048" "$G2 --batch 128 --context 2048" "$G2 --batch 32 --context 8192"
          "--batch 64 --context 4096" "--batch 1 --context 32768")
    aba "$M" main "$CLI" pair ;;
  *) echo "unknown mode $MODE" >&2; exit 2 ;;
esac
