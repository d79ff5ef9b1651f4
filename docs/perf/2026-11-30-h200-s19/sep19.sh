# Session 19 call 7: batch-1 split calls with the separate merge kernel now that the next call's
# CTAs prefetch while it runs (main, no switch: `--merge separate` against auto, A B A).
T0=$SECONDS
B() { [ $((SECONDS - T0)) -lt ${ROW_BUDGET:-60} ] || { echo "skip $*"; return; }
  timeout 10 "$CLI" bench decode --no-ceilings --iters 20 "$@" 2>&1 |
    grep -E '^\| [a-z0-9]|rror' | grep -v '^| label' | sed "s/^/$* /" |
    awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'; }
for row in "--batch 1 --context 32768" "--kv-dtype fp8_e4m3 --batch 1 --context 32768" \
           "--kv-dtype int8 --batch 1 --context 32768"; do
  for m in auto separate auto; do B --merge $m $row; done
done
