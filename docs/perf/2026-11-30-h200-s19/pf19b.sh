# Session 19 call 2: the prefetch rule (one resident wave, >= 32 splits) on the rows it takes,
# keys 0 (off: main's path) / 64 / 32 / 96 / 64 / 0; then a control row it leaves alone.
# Row helpers B / BE (they ran inline, as session 18's): ../2026-11-30-h200-s18/rows.sh.
. "$(dirname "$0")/../2026-11-30-h200-s18/rows.sh"
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
