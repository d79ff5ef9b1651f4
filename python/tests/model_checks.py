"""Helpers of the end-to-end model tests (test_hf.py, test_diffusers.py): the device matrix and
the three-way comparison of docs/testing.md. Imported after pytest.importorskip("torch")."""

import numpy as np
import pytest
import torch

import attnkit

needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and attnkit.info()["cuda"]),
    reason="needs a CUDA GPU and attnkit built with the CUDA backend",
)
# CPU: float32 on the reference backend; CUDA: bf16 on the fused kernels.
DEVICES = [("cpu", torch.float32), pytest.param("cuda", torch.bfloat16, marks=needs_cuda)]


def seed(rng):
    """Seeds torch's generator (the models' random weights) from the test's NumPy stream."""
    torch.manual_seed(int(rng.integers(2**31)))


def check_outputs(ours, naive, ref, wrong=None, keep=None):
    """max|ours - ref| <= 2 * max|naive - ref| + 1e-3 (docs/testing.md) over the ``keep``
    positions, with ref the float64 run and naive the model's own path in the tested dtype;
    ``wrong`` (the float64 model run with an error the test must catch: a lost mask, doubled
    logits) must miss the bound twofold, or the comparison could not fail (see below)."""
    ours, naive, ref = (np.asarray(x, dtype=np.float64) for x in (ours, naive, ref))
    if keep is not None:
        ours, naive, ref = ours[keep], naive[keep], ref[keep]
    assert np.all(np.isfinite(ours)), "NaN / inf in the output"
    tol = 2.0 * float(np.max(np.abs(naive - ref))) + 1e-3
    err = float(np.max(np.abs(ours - ref)))
    assert err <= tol, f"max |attnkit - ref64| = {err:.3g} > {tol:.3g}"
    if wrong is not None:
        wrong = np.asarray(wrong, dtype=np.float64)
        wrong = wrong[keep] if keep is not None else wrong
        # An attention with this error would return ``wrong`` plus the rounding of the tested
        # dtype, about max|naive - ref| <= tol / 2 per element. Missing the bound by 2x leaves
        # that broken output at least 1.5 tol from ref at wrong's worst element, so the check
        # above would fail for it. A larger multiple of tol asks more than detection
        # needs: in bf16 tol is a sizeable share of the logits, and a lost mask moves them by
        # only a few times tol.
        miss = float(np.max(np.abs(wrong - ref)))
        assert miss > 2 * tol, (
            f"the bound cannot detect the error: max |wrong - ref64| = {miss:.3g} <= 2 * {tol:.3g}"
        )
