"""Device-fault reporting from Python (check_errors, checked=, ATTNKIT_CHECKED) on CPU arrays,
and arguments that do not fit the C++ int32 geometry: rejected, never truncated or wrapped."""

import os
import subprocess
import sys

import numpy as np
import pytest

import attnkit


def _decode_args(rng, lens=(5, 9)):
    hkv, d, block, blocks = 2, 16, 8, 6
    k = rng.standard_normal((blocks, hkv, block, d)).astype(np.float16)
    v = rng.standard_normal((blocks, hkv, block, d)).astype(np.float16)
    table = np.arange(2 * 3, dtype=np.int32).reshape(2, 3)
    q = rng.standard_normal((len(lens), 4, d)).astype(np.float32)
    return q, k, v, np.array(lens, np.int32), table


def test_check_errors_without_cuda_work_returns():
    assert attnkit.check_errors() is None
    assert attnkit.check_errors(stream=0) is None
    assert issubclass(attnkit.DeviceFaultError, attnkit.Error)
    assert issubclass(attnkit.DeviceFaultError, ValueError)


def test_checked_calls_on_cpu_give_the_same_result(rng):
    q, k, v, lens, table = _decode_args(rng)
    plain = attnkit.decode(q, k, v, lens, table)
    checked = attnkit.decode(q, k, v, lens, table, checked=True)
    np.testing.assert_array_equal(plain, checked)
    out_a = rng.standard_normal((3, 2, 8)).astype(np.float32)
    lse_a = rng.standard_normal((3, 2)).astype(np.float32)
    out, _ = attnkit.merge_states(out_a, lse_a, out_a, lse_a, checked=True)
    np.testing.assert_allclose(out, out_a, rtol=1e-6)


def _run_with_env(value, code):
    env = dict(os.environ, ATTNKIT_CHECKED=value)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


_MERGE = (
    "import numpy as np, attnkit\n"
    "a = np.zeros((2, 1, 8), np.float32); l = np.zeros((2, 1), np.float32)\n"
    "try:\n"
    "    attnkit.merge_states(a, l, a, l)\n"
    "    print('ran')\n"
    "except attnkit.Error as e:\n"
    "    print('error:', e)\n"
)


def test_attnkit_checked_environment():
    for value in ("1", "true", "0", ""):
        r = _run_with_env(value, _MERGE)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == "ran", (value, r.stdout, r.stderr)
    r = _run_with_env("sometimes", _MERGE)
    assert r.returncode == 0, r.stderr
    assert "error: ATTNKIT_CHECKED: accepted 1, true, on, yes" in r.stdout, r.stdout


def test_forward_past_lens_outside_int32_are_rejected(rng):
    # int64 past_lens = [2**32] once wrapped to 0 and the call succeeded.
    hq, hkv, d = 4, 2, 16
    cache = attnkit.KvCache(num_kv_heads=hkv, head_dim=d, max_seq_len=64, tokens_per_block=16,
                            dtype="f16", max_tokens=256)
    cache.add(0, [1, 2, 3])
    qkv = rng.standard_normal((1, (hq + 2 * hkv) * d)).astype(np.float16)
    for past in (np.array([2**32], dtype=np.int64), [2**32], np.array([-(2**31) - 1])):
        with pytest.raises(attnkit.Error, match="past_lens: values must fit in int32"):
            attnkit.forward(qkv, cache.view(0, [0]), [0, 1], past, num_context=0)
    with pytest.raises(attnkit.Error, match="cu_seqlens_q: values must fit in int32"):
        attnkit.forward(qkv, cache.view(0, [0]), np.array([0, 2**33]), [2], num_context=0)


def test_cache_extents_beyond_int32_are_rejected(rng):
    # A view claiming 2**32 + 1 blocks over a one-block array (stride tricks, never read): the
    # extent was truncated to 1 and the call ran.
    q, k, v, _, _ = _decode_args(rng, lens=(5,))
    one_k, one_v = k[:1], v[:1]
    big = 2**32 + 1
    fake_k = np.lib.stride_tricks.as_strided(one_k, (big,) + one_k.shape[1:],
                                             (one_k.strides[0],) + one_k.strides[1:],
                                             writeable=False)
    fake_v = np.lib.stride_tricks.as_strided(one_v, (big,) + one_v.shape[1:],
                                             (one_v.strides[0],) + one_v.strides[1:],
                                             writeable=False)
    out = np.full(q.shape, np.nan, np.float32)
    with pytest.raises(attnkit.Error, match="k_cache: num_blocks = 4294967297 is more than int32"):
        attnkit.decode(q, fake_k, fake_v, [5], np.zeros((1, 1), np.int32), out=out)
    assert np.isnan(out).all()
