#!/usr/bin/env bash
# clang-format over the project's C++/CUDA sources; --check fails on any unformatted file.
set -euo pipefail
cd "$(dirname "$0")/.."
files=$(git ls-files --cached --others --exclude-standard -- '*.h' '*.cc' '*.cu' '*.cuh' | grep -v '^third_party/' || true)
[ -n "$files" ] || exit 0
if [ "${1:-}" = "--check" ]; then
  # shellcheck disable=SC2086
  if ! clang-format --dry-run -Werror $files; then
    echo "clang-format: the files above are not formatted (run 'make format')" >&2
    exit 1
  fi
  echo "clang-format: $(echo "$files" | wc -l) files formatted"
else
  # shellcheck disable=SC2086
  clang-format -i $files
fi
