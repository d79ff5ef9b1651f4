# Session 19 call 5: the prefetch before the wait in the wgmma kernel (branch w-pf19g):
# ATTNKIT_EXP_WG_PF = keys a CTA (0: main), one-wave programmatic wgmma calls.
# Row helpers B / BE (they ran inline, as session 18's): ../2026-11-30-h200-s18/rows.sh.
. "$(dirname "$0")/../2026-11-30-h200-s18/rows.sh"
Q1="--q-heads 32 --kv-heads 1" G16="--q-heads 32 --kv-heads 2"
for row in "$Q1 --batch 64 --context 4096" "$Q1 --batch 32 --context 32768" "$G16 --batch 64 --context 4096"; do
  for k in 0 64 128 64 0; do BE wgpf$k "ATTNKIT_EXP_WG_PF=$k" $row; done
done
for row in "$Q1 --batch 96 --context 4096" "$Q1 --batch 16 --context 8192" "$Q1 --batch 256 --context 2048" \
           "$Q1 --batch 128 --context 8192" "$Q1 --batch 48 --context 8192" "$G16 --batch 8 --context 8192"; do
  for k in 0 64 0; do BE wgpf$k "ATTNKIT_EXP_WG_PF=$k" $row; done
done
