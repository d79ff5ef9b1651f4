# Session 18 call 4: is the wgmma kernel's MQA gap the page pattern (8 KB scattered blocks at page 32)?
. "$(dirname "${BASH_SOURCE[0]}")/rows.sh"  # B (ran inline)
Q1="--q-heads 32 --kv-heads 1"
for pg in 16 32 64 128; do
  B wg $Q1 --batch 32 --context 32768 --page $pg
  B mma $Q1 --batch 32 --context 32768 --page $pg --merge in-kernel
  B wg $Q1 --batch 128 --context 8192 --page $pg
  B gqa --batch 64 --context 4096 --page $pg
  B gqa8 --batch 16 --context 16384 --kv-heads 8 --page $pg
done
