#!/usr/bin/env bash
# w-tl9: timelines of bf16 1 x 32k, 1 x 8k, fp8 1 x 32k (graph-replayed calls), and the same rows
# without stamps (their cost).
HERE=$(cd "$(dirname "$0")" && pwd)
for row in "--batch 1 --context 32768" "--batch 1 --context 8192" "--kv-dtype fp8_e4m3 --batch 1 --context 32768"; do
  tag=$(echo "$row" | tr -c 'a-z0-9' '_')
  timeout 10 "$CLI" bench decode --no-ceilings --iters 20 $row 2>&1 | grep -E '^\| [a-z0-9]' | grep -v label | sed "s/^/plain $row /"
  ATTNKIT_EXP_TIMELINE="$OUT/tl_$tag.bin" timeout 10 "$CLI" bench decode --no-ceilings --iters 20 $row 2>&1 | grep -E '^\| [a-z0-9]' | grep -v label | sed "s/^/stamped $row /"
  python3 "$HERE/tl11.py" "$OUT/tl_$tag.bin" "$row" 2>&1 | head -40
  case "$row" in "--batch 1 --context 32768") ;; *) rm -f "$OUT/tl_$tag.bin";; esac
done
