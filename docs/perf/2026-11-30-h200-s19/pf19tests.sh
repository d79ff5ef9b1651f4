# The decode and forward gpu tests with the prefetch on every programmatic launch.
cd "$HOME/build-snap/tests" && ATTNKIT_EXP_PREFETCH_ANY=1 ./attnkit_gpu_tests \
  --gtest_filter='Decode*:Forward*' 2>&1 | grep -E "^\[  (PASSED|FAILED)|FAILED|tests ran|OK \]" | tail -60
