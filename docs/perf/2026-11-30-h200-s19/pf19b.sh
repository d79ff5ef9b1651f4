# Session 19 call 2: the prefetch rule (one resident wave, >= 32 splits) on the rows it takes,
# keys 0 (off: main's path) / 64 / 32 / 96 / 64 / 0; then a control row it leaves alone.
T0=$SECONDS
BE() { local e=$1 env=$2; shift 2
  [ $((SECONDS - T0)) -lt ${ROW_BUDGET:-150} ] || { echo "skip $e $*"; return; }
  env $env timeout 10 "$CLI" bench decode --no-ceilings --iters 20 "$@" 2>&1 |
    grep -E '^\| [a-z0-9]|rror' | grep -v '^| label' | sed "s/^/$e $* /" |
    awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'; }
for row in "--batch 1 --context 32768" "--kv-dtype fp8_e4m3 --batch 1 --context 32768"; do
  for k in 0 64 32 96 64 0; do BE pf$k "ATTNKIT_EXP_PREFETCH_KEYS=$k" $row; done
done
for row in "--kv-dtype int8 --batch 1 --context 32768" "--head-dim 64 --batch 1 --context 32768" \
           "--head-dim 256 --batch 1 --context 32768" "--head-dim 96 --batch 1 --context 32768" \
           "--page 16 --batch 1 --context 32768" "--page 64 --batch 1 --context 32768" \
           "--page 8 --batch 1 --context 32768" "--page 128 --batch 1 --context 32768" \
           "--batch 1 --context 65536" "--batch 1 --context 131072" \
           "--kv-dtype fp8_e4m3 --batch 1 --context 131072" \
           "--kv-heads 4 --batch 1 --context 32768" "--kv-heads 2 --batch 1 --context 32768" \
           "--kv-heads 1 --batch 1 --context 32768" "--batch 1 --context 24576" \
           "--batch 64 --context 4096"; do
  for k in 0 64 0; do BE pf$k "ATTNKIT_EXP_PREFETCH_KEYS=$k" $row; done
done
