# Session 19 call 4: the prefetch before the wait in the first wave of multi-wave grids (branch
# w-pf19w): ATTNKIT_EXP_PF_WAVE=0 main's rule, 1 first wave only, 2 every CTA; 32 KB a CTA.
# Row helpers B / BE (they ran inline, as session 18's): ../2026-11-30-h200-s18/rows.sh.
. "$(dirname "$0")/../2026-11-30-h200-s18/rows.sh"
for row in "--batch 64 --context 4096" "--batch 128 --context 2048" "--batch 256 --context 1024" \
           "--kv-dtype fp8_e4m3 --batch 256 --context 1024" "--kv-dtype fp8_e4m3 --batch 128 --context 2048" \
           "--page 16 --batch 64 --context 4096" "--head-dim 64 --batch 128 --context 4096"; do
  for w in 0 1 2 1 0; do BE wave$w "ATTNKIT_EXP_PF_WAVE=$w" $row; done
done
BE wave0 "ATTNKIT_EXP_PF_WAVE=0" --batch 1 --context 32768
BE wave1 "ATTNKIT_EXP_PF_WAVE=1" --batch 1 --context 32768
