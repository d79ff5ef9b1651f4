# Session 18 call 7: is the wgmma kernel bound by its MMA or softmax work? Timing-only variants
# (ATTNKIT_EXP_WGMMA_CUT, branch w-cut18: wrong results): 1 half the S MMAs, 2 half the O MMAs,
# 3 both, 4 no exponentials, 7 all three; 0 the landed kernel.
. "$(dirname "${BASH_SOURCE[0]}")/rows.sh"  # BE, called B when they ran (inline)
Q1="--q-heads 32 --kv-heads 1" G16="--q-heads 32 --kv-heads 2"
for row in "$Q1 --batch 32 --context 32768" "$Q1 --batch 64 --context 4096" \
           "$G16 --batch 64 --context 4096" "$Q1 --batch 128 --context 8192"; do
  for v in 0 1 2 3 4 7 0; do BE cut$v "ATTNKIT_EXP_WGMMA_CUT=$v" $row; done
done
BE gqa8 "X=0" --batch 16 --context 16384
