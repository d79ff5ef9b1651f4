#!/usr/bin/env bash
# Session 12, calls 7 and 8: the w-tmakv build's ATTNKIT_DECODE_TMA modes on the 8-bit 64 x 4k
# rows (0 cp.async, 1 TMA as built, 2 without the proxy fence, 3 / 5 / 6 L2 promotion none / 64B /
# 128B instead of 256B, 4 without waiting: timing only, it failed). Call 7 ran modes 0 1 2 3 4 0,
# call 8 (this list) 0 3 5 6 1 0.
B=$HOME/build-x
cmake -S "$ROOT/.carry/snap" -B $B -G Ninja -DATTNKIT_WITH_CUDA=ON -DATTNKIT_CUDA_ARCHS=90a -DATTNKIT_KERNEL_SUBSET=ON \
  -DATTNKIT_GTEST_SOURCE_DIR=$ROOT/.carry/googletest >/dev/null 2>&1
cmake --build $B -j 16 --target attnkit_cli 2>&1 | tail -1
for row in "--kv-dtype fp8_e4m3 --batch 64 --context 4096" "--kv-dtype int8 --batch 64 --context 4096"; do
  for m in 0 3 5 6 1 0; do
    ATTNKIT_DECODE_TMA=$m timeout 10 $B/attnkit bench decode --no-ceilings --iters 20 $row 2>&1 | grep -E '^\| [a-z0-9]|rror' |
      grep -v '^| label' | sed "s/^/mode=$m $row /" | awk -F'|' '{print $1 "|" $(NF-5) "|" $(NF-4) "|"}'
  done
done
