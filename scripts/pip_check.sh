#!/usr/bin/env bash
# `pip install .` as a user runs it, CPU only, into a fresh virtual environment, then what it
# installed run from there: the `attnkit` command (the C++ program inside the package) and the
# Python package (tests/install/check_python.py). `make test-pip`; CI runs it too. Prints how long
# the install took (docs/python.md quotes it).
#
#   bash scripts/pip_check.sh [WORK_DIR]     (default build-pip; emptied first)
#
# The build runs without build isolation, on the scikit-build-core, nanobind and numpy that
# scripts/install_deps.sh installs for python3 (the environment sees them through
# --system-site-packages), so it needs no network; `pip install .` itself fetches them.
set -euo pipefail
cd "$(dirname "$0")/.."
src=$PWD
work="${1:-build-pip}"
rm -rf "$work"
mkdir -p "$work"
work=$(cd "$work" && pwd)
python3 -m venv --system-site-packages "$work/venv"
py="$work/venv/bin/python"

start=$SECONDS
if ! ATTNKIT_WITH_CUDA=OFF "$py" -m pip install -v --no-build-isolation --no-deps \
  -C build-dir="$work/build" "$src" >"$work/pip.log" 2>&1; then
  tail -n 40 "$work/pip.log" >&2
  echo "pip_check: pip install failed (log: $work/pip.log)" >&2
  exit 1
fi
echo "pip_check: CPU-only pip install took $((SECONDS - start)) s on $(nproc) cores"

site=$("$py" -c "import sysconfig; print(sysconfig.get_path('platlib'))")
cd "$work"  # away from the source tree: nothing there can stand in for the installed package
version=$("$work/venv/bin/attnkit" --version)
echo "pip_check: attnkit --version: $version"
case "$version" in
  "attnkit "*" (CPU only)") ;;
  *)
    echo "pip_check: unexpected --version output" >&2
    exit 1
    ;;
esac
info=$("$work/venv/bin/attnkit" info)
grep -q "^support matrix on cpu" <<<"$info" || {
  echo "pip_check: attnkit info printed no support matrix" >&2
  exit 1
}
[ -x "$site/attnkit/bin/attnkit" ] || {
  echo "pip_check: the program is not at $site/attnkit/bin/attnkit" >&2
  exit 1
}
env -u PYTHONPATH -u LD_LIBRARY_PATH "$py" "$src/tests/install/check_python.py" "$site"
echo "pip_check: ok"
