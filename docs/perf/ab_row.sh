# Sourced by the A/B row scripts of sessions 12-14 (`2026-11-30-h200-s12/ab_env_rows.sh`,
# `2026-11-30-h200-s13/ab13.sh`, `2026-11-30-h200-s14/ab14.sh`): B CLI TAG VALUE ARGS... runs one
# `attnkit bench decode --no-ceilings --iters 20 ARGS` row with the experiment switch $VAR=VALUE
# and prints "TAG ARGS | ms | TB/s |", or "skip" once ROW_BUDGET seconds (default 200) have passed
# since T0.
B() {
  local c=$1 e=$2 v=$3
  shift 3
  [ $((SECONDS - T0)) -lt ${ROW_BUDGET:-200} ] || { echo "skip $e $*"; return; }
  env "$VAR=$v" timeout 10 "$c" bench decode --no-ceilings --iters 20 "$@" 2>&1 |
    grep -E '^\| [a-z0-9]|rror' | grep -v '^| label' | sed "s/^/$e $* /" |
    awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'
}
