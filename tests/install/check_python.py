"""An installed attnkit Python package works: imported from where it was installed, a prefill of
fresh random data on the CPU reference matches attention computed here with NumPy.

    python check_python.py SITE_DIR

SITE_DIR: the directory the package must be imported from (a `cmake --install` prefix's
ATTNKIT_PYTHON_INSTALL_DIR, or a virtual environment's site-packages). Run by
tests/install/run_installed.cmake and scripts/pip_check.sh.
"""

import os
import sys

import numpy as np

import attnkit


def numpy_attention(q, k, v, causal):
    """[S, Hq, D] queries over [S, Hkv, D] keys / values of one sequence, in float64."""
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k.astype(np.float64), group, axis=1)
    v = np.repeat(v.astype(np.float64), group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q.astype(np.float64), k) / np.sqrt(q.shape[2])
    if causal:
        s = q.shape[0]
        scores = np.where(np.tril(np.ones((s, s), dtype=bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", weights, v)


def main() -> None:
    site_dir = os.path.realpath(sys.argv[1])
    package_dir = os.path.realpath(os.path.dirname(attnkit.__file__))
    if os.path.commonpath([package_dir, site_dir]) != site_dir:
        sys.exit(f"attnkit imported from {package_dir}, not from {site_dir}")
    rng = np.random.default_rng()
    seqlen, hq, hkv, d = int(rng.integers(2, 40)), 4, 2, 32
    q = rng.standard_normal((seqlen, hq, d), dtype=np.float32)
    k = rng.standard_normal((seqlen, hkv, d), dtype=np.float32)
    v = rng.standard_normal((seqlen, hkv, d), dtype=np.float32)
    cu = np.array([0, seqlen], dtype=np.int32)
    for causal in (False, True):
        out = attnkit.prefill(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=causal)
        np.testing.assert_allclose(out, numpy_attention(q, k, v, causal), rtol=1e-5, atol=1e-5)
    print(f"attnkit {attnkit.info()['version']} from {package_dir}: prefill of {seqlen} tokens ok")


if __name__ == "__main__":
    main()
