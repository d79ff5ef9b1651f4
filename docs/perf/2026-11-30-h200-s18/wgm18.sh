# Session 18 call 6: the wgmma kernel's in-kernel merge (auto: where the partials fit the ring)
# against decode_merge.cu's kernel (--merge separate), same build, A B A.
. "$(dirname "${BASH_SOURCE[0]}")/rows.sh"  # B (ran inline)
Q1="--q-heads 32 --kv-heads 1" G16="--q-heads 32 --kv-heads 2"
for row in "$Q1 --batch 64 --context 4096" "$Q1 --batch 128 --context 8192" \
           "$G16 --batch 64 --context 4096" "$Q1 --batch 64 --context 2048" \
           "$Q1 --batch 32 --context 32768" "--batch 64 --context 4096"; do
  B auto $row; B sep $row --merge separate; B auto $row
done
