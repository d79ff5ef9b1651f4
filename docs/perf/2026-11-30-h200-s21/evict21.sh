# Session 21 call 5: the K / V copies with an L2 evict_first policy (branch w-evict21,
# ATTNKIT_EXP_EVICT=1) against evict_normal in the same binary and main's own binary (.carry/bin21:
# ev and fin, kernel subset, built on the development machine). The ncu sampling of call 4 put
# most of the last CTA's merge stalls on instruction fetch; a read-once KV stream of 67-134 MB
# through the 50 MB L2 may push the kernel's code (and tables, partials) out of it.
BIN=${BIN:-$PWD/.carry/bin21}
T0=$SECONDS
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
ATTNKIT_EXP_EVICT=1 LD_LIBRARY_PATH=$BIN/ev timeout 150 $BIN/ev/attnkit_gpu_tests \
  --gtest_filter='DecodeFused.ProgrammaticLaunch*:DecodeFused.PrefetchBefore*:DecodeSplit.AccumulatingMergeWithOutliers:DecodeSplit.DeterministicByDefault*:DecodeWorkspace.*:Forward.MixedBatch*:Forward.ChunkedPrefill*' 2>&1 |
  grep -E "^\[  (PASSED|FAILED)|FAILED  \]|Failure" | head -20
R() { local e=$1 b=$2 env=$3; shift 3
  [ $((SECONDS - T0)) -lt ${ROW_BUDGET:-300} ] || { echo "skip $e $*"; return; }
  env LD_LIBRARY_PATH=$BIN/$b $env timeout 10 $BIN/$b/attnkit bench decode --no-ceilings --iters 20 "$@" 2>&1 |
    grep -E '^\| [a-z0-9]|rror' | grep -v '^| label' | sed "s/^/$e $* /" |
    awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'; }
for row in "--kv-dtype fp8_e4m3 --batch 1 --context 32768" "--batch 1 --context 32768" \
           "--kv-dtype int8 --batch 1 --context 32768" "--batch 1 --context 8192" \
           "--kv-dtype fp8_e4m3 --batch 64 --context 4096" "--batch 64 --context 4096" \
           "--kv-dtype fp8_e4m3 --batch 1 --context 65536" "--batch 32 --context 32768" \
           "--page 16 --batch 1 --context 32768" "--kv-dtype fp8_e4m3 --batch 256 --context 1024"; do
  R evict ev ATTNKIT_EXP_EVICT=1 $row; R normal ev X=1 $row; R main fin X=1 $row
  R main fin X=1 $row; R normal ev X=1 $row; R evict ev ATTNKIT_EXP_EVICT=1 $row
done
for row in "--kv-dtype fp8_e4m3 --batch 1 --context 32768" "--batch 1 --context 32768"; do
  R evict-acc ev ATTNKIT_EXP_EVICT=1 $row --merge accumulate; R normal-acc ev X=1 $row --merge accumulate
done
echo "total $((SECONDS - T0)) s"
