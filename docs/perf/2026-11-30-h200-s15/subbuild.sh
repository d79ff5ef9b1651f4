#!/usr/bin/env bash
# subbuild.sh NAME TARGETS...: builds .carry/snap_NAME into $HOME/build-NAME (kernel subset, sm_90a)
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
N=$1; shift
B=$HOME/build-$N
cmake -S "$ROOT/.carry/snap_$N" -B "$B" -G Ninja -DATTNKIT_WITH_CUDA=ON -DATTNKIT_CUDA_ARCHS=90a \
  -DATTNKIT_KERNEL_SUBSET=ON -DATTNKIT_GTEST_SOURCE_DIR="$ROOT/.carry/googletest" >/dev/null 2>&1 &&
  cmake --build "$B" -j ${JOBS:-6} --target "$@" 2>&1 | tail -1
touch "$B/DONE"
