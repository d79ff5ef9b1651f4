# Session 21 call 4: where the batch-1 split kernels stall, by ncu's warp-state sampling (main's
# kernels: .carry/bin21/fin, kernel subset, built on the development machine with -lineinfo).
# Question: do the split epilogue and the last CTA's merge (cold code, run once a CTA at the
# call's end) wait for instruction fetches ("no instruction" stalls)?
BIN=${BIN:-$PWD/.carry/bin21/fin}
export LD_LIBRARY_PATH=$BIN
which ncu; ncu --version | tail -1
for dt in fp8_e4m3 bf16; do
  timeout 200 ncu --kernel-name regex:decode_kernel --launch-skip 30 --launch-count 1 \
    --section WarpStateStats --section SchedulerStats --section SourceCounters --section LaunchStats \
    --import-source no -f -o $OUT/ncu_$dt $BIN/attnkit bench decode --kv-dtype $dt --batch 1 --context 32768 \
    --no-ceilings --iters 20 > $OUT/ncu_${dt}_run.log 2>&1
  echo "rc=$? $dt"
  ncu --import $OUT/ncu_$dt.ncu-rep --page details > $OUT/ncu_${dt}_details.txt 2>&1
  ncu --import $OUT/ncu_$dt.ncu-rep --page source --csv --print-source sass > $OUT/ncu_${dt}_sass.csv 2>&1
  grep -i -E "no instruction|stall|warp cycles per issued" $OUT/ncu_${dt}_details.txt | head -30
done
ls -la $OUT
