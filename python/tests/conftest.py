"""Shared fixtures: a fresh seed per run (printed; ATTNKIT_TEST_SEED replays it) and the NumPy
float64 attention the tests compare against (docs/semantics.md)."""

import os
import random
import zlib

import numpy as np
import pytest

_SEED = int(os.environ.get("ATTNKIT_TEST_SEED", random.SystemRandom().randrange(2**31)))


def pytest_report_header(config):
    return f"attnkit test seed {_SEED} (set ATTNKIT_TEST_SEED to replay)"


@pytest.fixture
def rng(request):
    # One stream per test, derived from the run's seed and the test's name.
    return np.random.default_rng([_SEED, zlib.crc32(request.node.name.encode())])


def reference_attention(q, k, v, q_pos, *, mask="causal", window=0, sink=0, scale=None,
                        slopes=None, softcap=0.0, dtype=np.float64):
    """One sequence: q [n_q, Hq, D] at absolute positions q_pos [n_q], k / v [n_k, Hkv, D] at
    positions 0..n_k-1. Computed in `dtype` (float64: the oracle; the input precision: the
    naive yardstick of the tolerance rule). Returns out [n_q, Hq, D] and lse [n_q, Hq]."""
    q, k, v = (np.asarray(x, dtype=dtype) for x in (q, k, v))
    n_q, hq, d = q.shape
    n_k, hkv, _ = k.shape
    group = hq // hkv
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    out = np.zeros((n_q, hq, d), dtype=np.float64)
    lse = np.full((n_q, hq), -np.inf)
    j = np.arange(n_k)
    for h in range(hq):
        kh, vh = k[:, h // group], v[:, h // group]
        logits = (q[:, h] @ kh.T).astype(np.float64) * scale
        if softcap > 0:
            logits = softcap * np.tanh(logits / softcap)
        if slopes is not None:
            logits = logits + slopes[h] * (j[None, :] - q_pos[:, None])
        p = q_pos[:, None]
        if mask == "causal":
            allowed = j[None, :] <= p
        elif mask == "window":
            in_window = (j[None, :] > p - window) | (j[None, :] < sink)
            allowed = in_window & (j[None, :] <= p)
        else:
            allowed = np.ones((n_q, n_k), dtype=bool)
        probs, lse[:, h] = masked_softmax(logits, allowed)
        out[:, h] = (probs.astype(dtype) @ vh).astype(np.float64)
    return out, lse


def masked_softmax(logits, allowed):
    """Row softmax of float64 logits [n_q, n_k] over the `allowed` keys: (probs, lse [n_q]); a
    row without keys gives zeros and lse = -inf."""
    logits = np.where(allowed, logits, -np.inf)
    m = logits.max(axis=1, keepdims=True, initial=-np.inf)
    has = np.isfinite(m[:, 0])
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(logits - m)
    s = e.sum(axis=1, keepdims=True)
    probs = np.where(has[:, None], e / np.where(s > 0, s, 1.0), 0.0)
    return probs, np.where(has, m[:, 0] + np.log(np.where(s[:, 0] > 0, s[:, 0], 1.0)), -np.inf)


def tolerance(naive, ref64):
    """docs/testing.md: 2 * max|naive_same_precision - ref64| + 1e-3."""
    return 2.0 * float(np.max(np.abs(naive - ref64), initial=0.0)) + 1e-3


def assert_close(out, ref64, naive):
    out = np.asarray(out, dtype=np.float64)
    assert np.all(np.isfinite(out)), "output has NaN/inf (unwritten or broken elements)"
    err = float(np.max(np.abs(out - ref64), initial=0.0))
    tol = tolerance(naive, ref64)
    assert err <= tol, f"max |out - ref64| = {err:.3g} > tolerance {tol:.3g}"
