# Session 19 call 4: the prefetch before the wait in the first wave of multi-wave grids (branch
# w-pf19w): ATTNKIT_EXP_PF_WAVE=0 main's rule, 1 first wave only, 2 every CTA; 32 KB a CTA.
T0=$SECONDS
BE() { local e=$1 env=$2; shift 2
  [ $((SECONDS - T0)) -lt ${ROW_BUDGET:-150} ] || { echo "skip $e $*"; return; }
  env $env timeout 10 "$CLI" bench decode --no-ceilings --iters 20 "$@" 2>&1 |
    grep -E '^\| [a-z0-9]|rror' | grep -v '^| label' | sed "s/^/$e $* /" |
    awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'; }
for row in "--batch 64 --context 4096" "--batch 128 --context 2048" "--batch 256 --context 1024" \
           "--kv-dtype fp8_e4m3 --batch 256 --context 1024" "--kv-dtype fp8_e4m3 --batch 128 --context 2048" \
           "--page 16 --batch 64 --context 4096" "--head-dim 64 --batch 128 --context 4096"; do
  for w in 0 1 2 1 0; do BE wave$w "ATTNKIT_EXP_PF_WAVE=$w" $row; done
done
BE wave0 "ATTNKIT_EXP_PF_WAVE=0" --batch 1 --context 32768
BE wave1 "ATTNKIT_EXP_PF_WAVE=1" --batch 1 --context 32768
