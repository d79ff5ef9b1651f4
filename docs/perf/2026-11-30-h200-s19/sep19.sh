# Session 19 call 7: batch-1 split calls with the separate merge kernel now that the next call's
# CTAs prefetch while it runs (main, no switch: `--merge separate` against auto, A B A).
# Row helpers B / BE (they ran inline, as session 18's): ../2026-11-30-h200-s18/rows.sh.
. "$(dirname "$0")/../2026-11-30-h200-s18/rows.sh"
for row in "--batch 1 --context 32768" "--kv-dtype fp8_e4m3 --batch 1 --context 32768" \
           "--kv-dtype int8 --batch 1 --context 32768"; do
  for m in auto separate auto; do B "" --merge $m $row; done
done
