# Session 20 call 7: short splits at two CTAs an SM (the new rule, auto) against one CTA an SM
# (the old rule's count, forced), deterministic merges both.
source "$ROOT/docs/perf/2026-11-30-h200-s18/rows.sh"
ROW_BUDGET=${ROW_BUDGET:-110}
while read -r old row; do
  B new $row; B old$old $row --splits $old; B new $row
done <<'ROWS'
16 --batch 1 --context 8192
16 --batch 1 --context 16384
16 --kv-dtype fp8_e4m3 --batch 1 --context 16384
8 --batch 2 --context 8192
8 --batch 2 --context 4096
4 --batch 4 --context 4096
4 --batch 4 --context 2048
2 --batch 8 --context 2048
8 --kv-dtype fp8_e4m3 --batch 2 --context 8192
4 --kv-dtype fp8_e4m3 --batch 4 --context 4096
16 --kv-dtype int8 --batch 1 --context 16384
ROWS
