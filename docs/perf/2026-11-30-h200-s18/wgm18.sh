# Session 18 call 6: the wgmma kernel's in-kernel merge (auto: where the partials fit the ring)
# against decode_merge.cu's kernel (--merge separate), same build, A B A.
T0=$SECONDS
B() { local e=$1; shift
  [ $((SECONDS - T0)) -lt ${ROW_BUDGET:-150} ] || { echo "skip $e $*"; return; }
  timeout 10 "$CLI" bench decode --no-ceilings --iters 20 "$@" 2>&1 |
    grep -E '^\| [a-z0-9]|rror' | grep -v '^| label' | sed "s/^/$e $* /" |
    awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'; }
Q1="--q-heads 32 --kv-heads 1" G16="--q-heads 32 --kv-heads 2"
for row in "$Q1 --batch 64 --context 4096" "$Q1 --batch 128 --context 8192" \
           "$G16 --batch 64 --context 4096" "$Q1 --batch 64 --context 2048" \
           "$Q1 --batch 32 --context 32768" "--batch 64 --context 4096"; do
  B auto $row; B sep $row --merge separate; B auto $row
done
