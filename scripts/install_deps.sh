#!/usr/bin/env bash
# Installs the build and test dependencies that are missing (Debian packages, and the PyPI
# packages of the Python binding). Idempotent and quiet when everything is present.
set -euo pipefail

need=()
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
# clang and libclang-rt-dev (libFuzzer and the sanitizer runtimes) build `make fuzz-smoke`.
for pkg in cmake ninja-build g++ make nlohmann-json3-dev libcli11-dev libgtest-dev clang-format \
  clang libclang-rt-dev python3-dev python3-venv; do
  have_pkg "$pkg" || need+=("$pkg")
done
# pip for the python3 on PATH when it is Debian's (a pyenv / venv python brings its own).
if ! python3 -m pip --version >/dev/null 2>&1; then
  have_pkg python3-pip || need+=(python3-pip)
fi
if ((${#need[@]})); then
  if ! command -v apt-get >/dev/null; then
    echo "install_deps: missing ${need[*]} and no apt-get; install them by hand" >&2
    exit 1
  fi
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  echo "install_deps: installing ${need[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi

# PyPI packages of the Python binding and its tests, for the python3 on PATH (scikit-build-core:
# the pip build that scripts/pip_check.sh runs without build isolation). module:package pairs.
py_need=()
for pair in nanobind:nanobind numpy:numpy pytest:pytest scikit_build_core:scikit-build-core; do
  python3 -c "import ${pair%%:*}" >/dev/null 2>&1 || py_need+=("${pair#*:}")
done
if ((${#py_need[@]})); then
  echo "install_deps: pip installing ${py_need[*]}"
  # Debian's own python3 is "externally managed" (PEP 668); a pyenv / venv python is not.
  python3 -m pip install --quiet "${py_need[@]}" 2>/dev/null ||
    python3 -m pip install --quiet --break-system-packages "${py_need[@]}"
fi
