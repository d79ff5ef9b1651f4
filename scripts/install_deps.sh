#!/usr/bin/env bash
# Installs the build and test dependencies that are missing (Debian packages; PyPI packages once
# the Python package exists). Idempotent and quiet when everything is present.
set -euo pipefail

need=()
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
for pkg in cmake ninja-build g++ make nlohmann-json3-dev libcli11-dev libgtest-dev clang-format; do
  have_pkg "$pkg" || need+=("$pkg")
done
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
