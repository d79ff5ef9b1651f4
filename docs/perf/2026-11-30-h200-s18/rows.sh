# The row helper of this folder's step scripts (sourced; they ran with it inline):
# B LABEL [ARGS...] prints `LABEL ARGS | ms a call | TB/s |` of one `attnkit bench decode` row
# ($CLI), until ROW_BUDGET seconds have passed since T0.
T0=$SECONDS
B() { local e=$1; shift
  [ $((SECONDS - T0)) -lt ${ROW_BUDGET:-150} ] || { echo "skip $e $*"; return; }
  timeout 10 "$CLI" bench decode --no-ceilings --iters 20 "$@" 2>&1 |
    grep -E '^\| [a-z0-9]|rror' | grep -v '^| label' | sed "s/^/$e $* /" |
    awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'; }
