# Session 19 call 5: the prefetch before the wait in the wgmma kernel (branch w-pf19g):
# ATTNKIT_EXP_WG_PF = keys a CTA (0: main), one-wave programmatic wgmma calls.
T0=$SECONDS
BE() { local e=$1 env=$2; shift 2
  [ $((SECONDS - T0)) -lt ${ROW_BUDGET:-150} ] || { echo "skip $e $*"; return; }
  env $env timeout 10 "$CLI" bench decode --no-ceilings --iters 20 "$@" 2>&1 |
    grep -E '^\| [a-z0-9]|rror' | grep -v '^| label' | sed "s/^/$e $* /" |
    awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'; }
Q1="--q-heads 32 --kv-heads 1" G16="--q-heads 32 --kv-heads 2"
for row in "$Q1 --batch 64 --context 4096" "$Q1 --batch 32 --context 32768" "$G16 --batch 64 --context 4096"; do
  for k in 0 64 128 64 0; do BE wgpf$k "ATTNKIT_EXP_WG_PF=$k" $row; done
done
for row in "$Q1 --batch 96 --context 4096" "$Q1 --batch 16 --context 8192" "$Q1 --batch 256 --context 2048" \
           "$Q1 --batch 128 --context 8192" "$Q1 --batch 48 --context 8192" "$G16 --batch 8 --context 8192"; do
  for k in 0 64 0; do BE wgpf$k "ATTNKIT_EXP_WG_PF=$k" $row; done
done
