#!/usr/bin/env bash
# Calls 4 and 5: the split-accuracy tests on c4aeee6's kernels (16-bit partials; $HOME/build-old:
# that tree with main's tests/gpu/decode_split_test.cc and decode_case_util.h, `subbuild.sh old
# attnkit_gpu_tests`) and on the f32 tree ($HOME/build-main, `subbuild.sh main attnkit_gpu_tests`).
for n in old main; do
  echo "== $n"
  timeout 60 "$HOME/build-$n/tests/attnkit_gpu_tests" --gtest_color=no \
    --gtest_filter='DecodeSplit.SplitMeansFarFromTheRowsMean:DecodeSplit.PartialsKeepTheRangeOfTheOutputType' 2>&1 |
    grep -E "seed|Failure|actual|merge|OK \]|FAILED|PASSED" | sort | uniq -c | sort -rn | head -20
done
