#!/usr/bin/env bash
# Deliberate break on a fresh build: the merge's staging start found by one subtraction instead of
# a loop (wrong where split_vecs < 64: small groups, head_dim 64-96). Which split tests fail?
cd "$ROOT"
F=src/cuda/decode/decode_kernel.cuh
sed -i 's/while (first_i >= split_vecs) first_i -= split_vecs, ++first_s;/if (first_i >= split_vecs) first_i -= split_vecs, ++first_s;/' $F
grep -c "if (first_i >= split_vecs) first_i" $F
B=$HOME/build-break
cmake -S . -B $B -G Ninja -DATTNKIT_WITH_CUDA=ON -DATTNKIT_CUDA_ARCHS=90a -DATTNKIT_GTEST_SOURCE_DIR=$ROOT/.carry/googletest >/dev/null 2>&1
cmake --build $B -j 16 --target attnkit_gpu_tests 2>&1 | tail -1
$B/tests/attnkit_gpu_tests --gtest_color=no --gtest_filter='DecodeSplit.*:DecodeWorkspace.*' 2>&1 | grep -E "^\[       OK|^\[  FAILED|^\[  PASSED"
