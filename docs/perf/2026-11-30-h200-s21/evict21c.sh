# Session 21 call 7 (after scripts/gpu_check.sh on the final tree): the final evict_first build
# ($CLI, built there) against main's own binary (.carry/bin21/fin, kernel subset, built on the
# development machine), A B B A.
BIN=${BIN:-$ROOT/.carry/bin21}
T0=$SECONDS
R() { local e=$1 c=$2 lib=$3; shift 3
  [ $((SECONDS - T0)) -lt ${ROW_BUDGET:-150} ] || { echo "skip $e $*"; return; }
  env LD_LIBRARY_PATH=$lib timeout 10 $c bench decode --no-ceilings --iters 20 "$@" 2>&1 |
    grep -E '^\| [a-z0-9]|rror' | grep -v '^| label' | sed "s/^/$e $* /" |
    awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'; }
for row in "--kv-dtype fp8_e4m3 --batch 1 --context 32768" "--batch 1 --context 32768" \
           "--kv-dtype int8 --batch 1 --context 32768" "--batch 1 --context 8192" \
           "--kv-dtype fp8_e4m3 --batch 64 --context 4096" "--batch 64 --context 4096" \
           "--kv-dtype fp8_e4m3 --batch 256 --context 1024" "--page 16 --batch 1 --context 32768" \
           "--q-heads 32 --kv-heads 1 --batch 64 --context 4096" "--batch 1 --context 131072"; do
  R new $CLI "" $row; R main $BIN/fin/attnkit $BIN/fin $row; R main $BIN/fin/attnkit $BIN/fin $row; R new $CLI "" $row
done
echo "total $((SECONDS - T0)) s"
