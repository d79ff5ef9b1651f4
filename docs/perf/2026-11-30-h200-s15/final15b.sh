# SplitMeansFarFromTheRowsMean (outputs near 1000) on the kernels before (old) and after (main) f32 partials.
T0=$SECONDS
(cmake --build $HOME/build-main -j 8 --target attnkit_gpu_tests 2>&1 | tail -1) &
cmake --build $HOME/build-old -j 8 --target attnkit_gpu_tests 2>&1 | tail -1
wait
echo "built $((SECONDS - T0)) s"
for n in old main; do
  echo "== $n"
  timeout 60 $HOME/build-$n/tests/attnkit_gpu_tests --gtest_color=no \
    --gtest_filter='DecodeSplit.SplitMeansFarFromTheRowsMean:DecodeSplit.PartialsKeepTheRangeOfTheOutputType' 2>&1 |
    grep -E "seed|Failure|actual|merge|OK \]|FAILED|PASSED" | sort | uniq -c | sort -rn | head -20
done
