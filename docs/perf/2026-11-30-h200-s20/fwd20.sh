# Session 20 call 5: forward tests judged on each side's own inputs; the seed that failed in calls
# 1-2 (2346050318) and 8 more, then the Vanilla tests (the shared helper changed).
T=$HOME/build-snap/tests/attnkit_gpu_tests
for seed in 2346050318 1 2 3 4 5 6 7 8; do
  echo "seed $seed: $(ATTNKIT_TEST_SEED=$seed timeout 60 $T --gtest_filter='Forward.*' 2>&1 | grep -E '^\[  (PASSED|FAILED)' | tr '\n' ' ')"
done
ATTNKIT_TEST_SEED=2346050318 timeout 60 $T --gtest_filter='Forward.Chunked*' 2>&1 | grep -E "Failure|actual|OK|FAILED" | head
timeout 120 $T --gtest_filter='Vanilla*:MergeStates*' 2>&1 | tail -3
