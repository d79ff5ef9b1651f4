"""Ctrl-C stops a long CPU (reference) call: a SIGINT sent by a timer thread while prefill,
decode or dense runs raises KeyboardInterrupt from inside the call (its output left partly
unwritten) within a fraction of a second, instead of after the tens of seconds the call takes;
a handler's own exception comes through as it is, and a handler that does not raise lets the
call finish with the same result."""

import contextlib
import os
import signal
import threading
import time

import numpy as np
import pytest

import attnkit

HQ, HKV, D = 32, 8, 64


@contextlib.contextmanager
def _sigint_after(seconds, handler=signal.default_int_handler):
    """Installs `handler` for SIGINT and sends SIGINT to this process after `seconds` from a
    timer thread; restores the previous handler once the timer is done."""
    previous = signal.signal(signal.SIGINT, handler)
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        yield
    finally:
        timer.join()
        signal.signal(signal.SIGINT, previous)


def _long_prefill(rng):
    # The reported case: a 2k-token, 32-head prefill, tens of seconds on the reference.
    q = rng.standard_normal((2048, HQ, D)).astype(np.float32)
    k = rng.standard_normal((2048, HKV, D)).astype(np.float32)
    v = rng.standard_normal((2048, HKV, D)).astype(np.float32)
    out = np.full(q.shape, np.nan, np.float32)
    return lambda: attnkit.prefill(q, k, v, out=out), out


def _long_decode(rng):
    # 2048 rows, each reading the same 2048 cached tokens through its block table.
    blocks, block = 128, 16
    k = rng.standard_normal((blocks, HKV, block, D)).astype(np.float16)
    v = rng.standard_normal((blocks, HKV, block, D)).astype(np.float16)
    rows = 2048
    table = np.tile(np.arange(blocks, dtype=np.int32), (rows, 1))
    lens = np.full(rows, blocks * block, np.int32)
    q = rng.standard_normal((rows, HQ, D)).astype(np.float32)
    out = np.full(q.shape, np.nan, np.float32)
    return lambda: attnkit.decode(q, k, v, lens, table, out=out), out


def _long_dense(rng):
    q = rng.standard_normal((1, 2048, HQ, D)).astype(np.float32)
    k = rng.standard_normal((1, 2048, HKV, D)).astype(np.float32)
    v = rng.standard_normal((1, 2048, HKV, D)).astype(np.float32)
    out = np.full(q.shape, np.nan, np.float32)
    return lambda: attnkit.dense(q, k, v, out=out), out


def _wait_for_late_signal():
    # Reached only when the call ignored the signal: the pending KeyboardInterrupt is raised here
    # at the latest, and the out check below tells the two apart.
    time.sleep(1.0)


@pytest.mark.parametrize("make", [_long_prefill, _long_decode, _long_dense])
def test_ctrl_c_interrupts_a_long_cpu_call(rng, make):
    call, out = make(rng)
    start = time.monotonic()
    with _sigint_after(0.3):
        with pytest.raises(KeyboardInterrupt):
            call()
            _wait_for_late_signal()
    elapsed = time.monotonic() - start
    assert np.isnan(out).any(), "the call ran to the end: the signal was handled after it"
    assert elapsed < 10.0, f"interrupted only after {elapsed:.1f} s"


class _Stop(Exception):
    pass


def _raise_stop(signum, frame):
    raise _Stop("stopped by the handler")


def test_the_handlers_own_exception_comes_through(rng):
    call, out = _long_prefill(rng)
    with _sigint_after(0.3, _raise_stop):
        with pytest.raises(_Stop, match="stopped by the handler"):
            call()
            _wait_for_late_signal()
    assert np.isnan(out).any()


def test_a_handler_that_does_not_raise_lets_the_call_finish(rng):
    q = rng.standard_normal((512, 8, D)).astype(np.float32)
    k = rng.standard_normal((512, 2, D)).astype(np.float32)
    expected = attnkit.prefill(q, k, k)
    seen = []
    with _sigint_after(0.05, lambda signum, frame: seen.append(signum)):
        got = attnkit.prefill(q, k, k)
        deadline = time.monotonic() + 2.0
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
    assert seen == [signal.SIGINT]
    np.testing.assert_array_equal(got, expected)
