# Session 19 call 1: L2 prefetch of each CTA's first keys before griddepcontrol.wait (branch
# w-pf19). ATTNKIT_EXP_PREFETCH_KEYS=0 is main's kernel path; 64/128/256 keys; PDL_ALL=1 puts
# every grid on PDL (one-wave grids too).
# Row helpers B / BE (they ran inline, as session 18's): ../2026-11-30-h200-s18/rows.sh.
. "$(dirname "$0")/../2026-11-30-h200-s18/rows.sh"
for row in "--batch 1 --context 32768" "--kv-dtype fp8_e4m3 --batch 1 --context 32768" \
           "--batch 1 --context 8192" "--batch 2 --context 32768" "--batch 64 --context 4096"; do
  for k in 0 128 64 256 128 0; do BE pf$k "ATTNKIT_EXP_PREFETCH_KEYS=$k" $row; done
done
for row in "--batch 32 --context 32768" "--kv-dtype fp8_e4m3 --batch 64 --context 4096" \
           "--batch 1 --context 32768" "--kv-dtype fp8_e4m3 --batch 1 --context 32768"; do
  for v in "ATTNKIT_EXP_PREFETCH_KEYS=0" "ATTNKIT_EXP_PDL_ALL=1" "ATTNKIT_EXP_PREFETCH_KEYS=0"; do
    BE "$v" "$v" $row; done
done
for row in "--kv-dtype int8 --batch 1 --context 32768" "--page 16 --batch 1 --context 32768" \
           "--batch 256 --context 1024" "--batch 1 --context 16384" "--head-dim 64 --batch 1 --context 32768"; do
  for k in 0 128 0; do BE pf$k "ATTNKIT_EXP_PREFETCH_KEYS=$k" $row; done
done
