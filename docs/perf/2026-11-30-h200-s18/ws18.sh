# Session 18 call 3: the warp-specialized wgmma decode kernels (branch w-ws18b): ATTNKIT_EXP_WGMMA_WS=1
# (producer warp, noinc arrivals, serial consumer loop) and =2 (the same + FA3's intra-warpgroup
# overlap, P through shared memory) against the landed kernel (0) in the same build.
TESTS="$(dirname "$CLI")/tests/attnkit_gpu_tests"
for w in 2 1; do
  echo "== wgmma tests, ATTNKIT_EXP_WGMMA_WS=$w (the build-count check expects 3-CTA launches: fails by design)"
  ATTNKIT_EXP_WGMMA_WS=$w timeout 100 "$TESTS" \
    --gtest_filter='DecodeFused.HopperWarpgroup*:DecodeFused.MqaAndGroups*:DecodeFused.SplitKvAcross*:DecodeWorkspace.CapturedGraph*' \
    2>&1 | grep -E 'Failure|Expected|Which is|max|FAILED|PASSED|OK \]' | sort | uniq -c | head -30
done
. "$(dirname "${BASH_SOURCE[0]}")/rows.sh"  # BE, called B when they ran (inline)
Q1="--q-heads 32 --kv-heads 1" G16="--q-heads 32 --kv-heads 2"
for row in "$Q1 --batch 64 --context 4096" "$Q1 --batch 32 --context 32768" \
           "$Q1 --batch 256 --context 2048" "$G16 --batch 64 --context 4096" \
           "$Q1 --batch 128 --context 8192" "$Q1 --batch 96 --context 4096" \
           "$Q1 --batch 16 --context 8192" "$Q1 --batch 128 --context 2048"; do
  for v in 0 1 2 0; do BE ws$v "ATTNKIT_EXP_WGMMA_WS=$v" $row; done
done
