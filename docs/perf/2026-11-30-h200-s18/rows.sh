# The row helpers of this folder's step scripts (sourced; they ran with them inline):
# B LABEL [ARGS...] prints `LABEL ARGS | ms a call | TB/s |` of one `attnkit bench decode` row
# ($CLI), until ROW_BUDGET seconds have passed since T0; BE LABEL VAR=VALUE [ARGS...] the same
# with one environment variable set (the experiments' switches).
T0=$SECONDS
BE() { local e=$1 env=$2; shift 2
  [ $((SECONDS - T0)) -lt ${ROW_BUDGET:-150} ] || { echo "skip $e $*"; return; }
  env $env timeout 10 "$CLI" bench decode --no-ceilings --iters 20 "$@" 2>&1 |
    grep -E '^\| [a-z0-9]|rror' | grep -v '^| label' | sed "s/^/$e $* /" |
    awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'; }
B() { local e=$1; shift; BE "$e" "ROWS_NO_SWITCH=1" "$@"; }
