#!/usr/bin/env bash
# Forced split counts at batch 1 x 32k / 1 x 8k on the final main (no second build).
for row in "--batch 1 --context 32768" "--kv-dtype fp8_e4m3 --batch 1 --context 32768" "--batch 1 --context 8192"; do
  for sp in 0 16 24 32 40 48 64; do
    timeout 10 "$CLI" bench decode --no-ceilings --iters 20 $row --splits $sp 2>&1 | grep -E '^\| [a-z0-9]|rror' |
      grep -v '^| label' | sed "s/^/splits=$sp $row /" | awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'
  done
done
