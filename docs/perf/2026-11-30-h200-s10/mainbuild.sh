#!/usr/bin/env bash
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
MB=$HOME/build-main
cmake -S "$ROOT/.carry/snap_main" -B "$MB" -G Ninja -DATTNKIT_WITH_CUDA=ON -DATTNKIT_CUDA_ARCHS=90a \
  -DATTNKIT_GTEST_SOURCE_DIR="$ROOT/.carry/googletest" >/dev/null 2>&1 && cmake --build "$MB" -j 16 --target attnkit_cli 2>&1 | tail -1
touch "$MB/DONE"
