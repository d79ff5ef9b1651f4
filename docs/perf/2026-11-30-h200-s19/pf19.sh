# Session 19 call 1: L2 prefetch of each CTA's first keys before griddepcontrol.wait (branch
# w-pf19). ATTNKIT_EXP_PREFETCH_KEYS=0 is main's kernel path; 64/128/256 keys; PDL_ALL=1 puts
# every grid on PDL (one-wave grids too).
T0=$SECONDS
BE() { local e=$1 env=$2; shift 2
  [ $((SECONDS - T0)) -lt ${ROW_BUDGET:-150} ] || { echo "skip $e $*"; return; }
  env $env timeout 10 "$CLI" bench decode --no-ceilings --iters 20 "$@" 2>&1 |
    grep -E '^\| [a-z0-9]|rror' | grep -v '^| label' | sed "s/^/$e $* /" |
    awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'; }
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
