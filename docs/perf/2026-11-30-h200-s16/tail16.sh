# Session 16, last call: split-count sweeps of the target rows on the final tree ($CLI).
T0=$SECONDS
B() { local e=$1; shift
  [ $((SECONDS - T0)) -lt ${ROW_BUDGET:-60} ] || { echo "skip $e $*"; return; }
  timeout 10 "$CLI" bench decode --no-ceilings --iters 20 "$@" 2>&1 | grep -E '^\| [a-z0-9]|rror' |
    grep -v '^| label' | sed "s/^/$e $* /" | awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'
}
for s in 0 16 24 32 48 64; do B s$s --batch 1 --context 32768 --splits $s; done
for s in 0 16 32 48 64; do B s$s --kv-dtype fp8_e4m3 --batch 1 --context 32768 --splits $s; done
for s in 0 2; do B s$s --kv-dtype fp8_e4m3 --batch 64 --context 4096 --splits $s; done
B s0 --batch 1 --context 32768
