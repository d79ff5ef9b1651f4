# Session 21 call 6: call 5's test failure with the evict_first build, in full.
BIN=${BIN:-$PWD/.carry/bin21}
F='DecodeSplit.DeterministicByDefault*:DecodeWorkspace.ManySplit*'
for v in "ev ATTNKIT_EXP_EVICT=1" "ev X=1" "fin X=1"; do
  set -- $v
  echo "=== $1 $2"
  env LD_LIBRARY_PATH=$BIN/$1 $2 timeout 100 $BIN/$1/attnkit_gpu_tests --gtest_filter="$F" --gtest_repeat=2 2>&1 |
    grep -v -E "^\[ RUN|^\[----------\]|^$" | head -30
done
echo "=== ev evict: compute-sanitizer on the first failing test"
ATTNKIT_EXP_EVICT=1 LD_LIBRARY_PATH=$BIN/ev timeout 150 compute-sanitizer --print-limit 5 $BIN/ev/attnkit_gpu_tests --gtest_filter='DecodeSplit.DeterministicByDefault*' 2>&1 | head -60
