"""attnkit.cp (context parallelism) against the single-process prefill / decode: ranks as
threads of this process (in_process_group), as processes of a torch.distributed gloo group on
the CPU (transport "torch"), and on CUDA (one GPU: threads, NCCL with one rank; processes on
several GPUs where there are several). Every rejection names its argument, leaves out= untouched
and happens before the rank waits for the others."""

import os
import time
from concurrent.futures import ThreadPoolExecutor

import cp_workers
import numpy as np
import pytest

import attnkit
from attnkit import cp

try:
    import torch
except ImportError:  # the torch.distributed and CUDA tests skip
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="needs PyTorch (torch.distributed)")
needs_cuda = pytest.mark.skipif(
    torch is None or not (torch.cuda.is_available() and attnkit.info()["cuda"]),
    reason="needs a CUDA GPU and attnkit built with the CUDA backend",
)
needs_nccl = pytest.mark.skipif(not cp.nccl_available(), reason="needs attnkit built with NCCL")


def max_diff(a, b):
    """Largest |a - b|; -inf == -inf counts as equal, a NaN as infinitely far."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if np.isnan(a).any() or np.isnan(b).any():
        return np.inf
    with np.errstate(invalid="ignore"):  # -inf - -inf, masked by a == b
        return float(np.max(np.where(a == b, 0.0, np.abs(a - b)), initial=0.0))


def check_f32(got, want):
    """Float32 on the CPU: each block and each merge rounds once to float32 (the reference
    accumulates in float64), as the C++ CpRingPrefill / CpShardedDecode tests hold."""
    (out, lse), (want_out, want_lse) = got, want
    assert max_diff(out, want_out) <= 2e-6
    assert max_diff(lse, want_lse) <= 2e-5
    assert np.array_equal(np.isinf(lse), np.isinf(want_lse))


def run_threads(world, body):
    """body(rank) on one thread per rank; the results in rank order."""
    with ThreadPoolExecutor(max_workers=world) as pool:
        return list(pool.map(body, range(world)))


def unshard(case, world, locals_):
    plan = cp.ZigzagPlan(case["cu"], world)
    return (plan.unshard([o for o, _ in locals_]), plan.unshard([l for _, l in locals_]))


# ---- ranks as threads of this process (CPU) ------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_prefill_threads_equal_prefill(rng, world):
    for case in cp_workers.prefill_cases(int(rng.integers(2**31))):
        group = cp.in_process_group(["cpu"] * world, timeout=60)
        got = run_threads(world, lambda r: cp_workers.rank_prefill(case, r, group[r], world))
        check_f32(unshard(case, world, got), cp_workers.single_prefill(case))


def test_ring_prefill_without_comm_is_prefill(rng):
    case = cp_workers.prefill_cases(int(rng.integers(2**31)))[0]
    plan = cp.ZigzagPlan(case["cu"], 1)
    out, lse = cp.ring_prefill(case["q"], case["k"], case["v"], plan, return_lse=True)
    want_out, want_lse = cp_workers.single_prefill(case)
    assert np.array_equal(out, want_out) and np.array_equal(lse, want_lse)
    # lse is optional: out alone, the same bits.
    assert np.array_equal(cp.ring_prefill(case["q"], case["k"], case["v"], plan), want_out)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_sharded_decode_threads_equal_decode(rng, world):
    script = cp_workers.decode_script(int(rng.integers(2**31)))
    want = cp_workers.single_decode(script)
    group = cp.in_process_group(["cpu"] * world, timeout=60)
    got = run_threads(world, lambda r: cp_workers.rank_decode(script, r, group[r], world))
    for step, expected in enumerate(want):
        check_f32(got[0][step], expected)
        for r in range(1, world):  # every rank: the same bits
            assert np.array_equal(got[r][step][0], got[0][step][0]), (step, r)
            assert np.array_equal(got[r][step][1], got[0][step][1]), (step, r)


# ---- plan, layout, communicators -----------------------------------------------------------------


def test_plan_shards_zigzag_and_unshards(rng):
    # Sequences of 5 and 7 tokens over 2 ranks: 4 chunks each (floor(c L / 4) boundaries);
    # rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2; slot 0 of every sequence, then slot 1.
    plan = cp.ZigzagPlan([0, 5, 12], 2)
    assert (plan.world_size, plan.num_sequences, plan.total_tokens) == (2, 2, 12)
    assert plan.global_rows(0).tolist() == [0, 5, 3, 4, 10, 11]
    assert plan.global_rows(1).tolist() == [1, 6, 7, 2, 8, 9]
    assert [plan.local_tokens(r) for r in (0, 1)] == [6, 6] and plan.max_local_tokens() == 6
    x = rng.standard_normal((12, 3, 4)).astype(np.float32)
    parts = [plan.shard(x, r) for r in (0, 1)]
    assert parts[0].flags["C_CONTIGUOUS"]
    assert np.array_equal(parts[1], x[[1, 6, 7, 2, 8, 9]])
    assert np.array_equal(plan.unshard(parts), x)
    if torch is not None:
        t = torch.from_numpy(x)
        assert torch.equal(plan.unshard([plan.shard(t, r) for r in (0, 1)]), t)
    # One rank: the global layout.
    one = cp.ZigzagPlan([0, 5, 12], 1)
    assert one.global_rows(0).tolist() == list(range(12))


def test_decode_layout_places_blocks_round_robin():
    layout = cp.DecodeShardLayout(3, 4)
    # Blocks of 4 tokens on ranks 0, 1, 2, 0, ...: position 13 is block 3 (rank 0), its second
    # local block, offset 1.
    assert [layout.rank_of_position(p) for p in (0, 3, 4, 8, 12, 13)] == [0, 0, 1, 2, 0, 0]
    assert layout.local_position(13) == 5
    assert [layout.local_length(r, 14) for r in range(3)] == [6, 4, 4]
    assert layout.local_tokens(1, 2, list(range(100, 110))) == [102, 103, 104, 105]


def test_communicator_handles():
    group = cp.in_process_group(["cpu", "cpu", "cpu"])
    assert [(c.rank, c.world_size, c.device, c.transport) for c in group] == [
        (r, 3, "cpu", "in_process") for r in range(3)
    ]
    assert group[0].comm_stream == 0


# ---- rejections ----------------------------------------------------------------------------------


def _raises(needle, call):
    with pytest.raises(attnkit.Error) as e:
        call()
    message = str(e.value)
    assert message.startswith(needle) or f": {needle}" in message, message
    assert "waited" not in message, message  # rejected before waiting for the other ranks
    return message


def test_ring_prefill_rejects_bad_arguments_before_communicating(rng):
    plan = cp.ZigzagPlan([0, 12, 17], 2)
    n = plan.local_tokens(0)
    q = rng.standard_normal((n, 4, 16)).astype(np.float32)
    k = rng.standard_normal((n, 2, 16)).astype(np.float32)
    v = rng.standard_normal((n, 2, 16)).astype(np.float32)
    out, lse = np.full((n, 4, 16), np.nan, np.float32), np.full((n, 4), np.nan, np.float32)
    # Rank 1 never calls: a check that let the call through would wait, and time out.
    group = cp.in_process_group(["cpu", "cpu"], timeout=5)
    good = dict(comm=group[0], out=out, lse=lse)

    def call(q=q, k=k, v=v, plan=plan, **kw):
        return lambda: cp.ring_prefill(q, k, v, plan, **{**good, **kw})

    _raises("plan", call(plan=cp.ZigzagPlan([0, 12, 17], 4)))
    _raises("plan", call(comm=None))  # a two-rank plan without a communicator
    _raises("plan: expected an attnkit.cp.ZigzagPlan", call(plan=[0, 12, 17]))
    _raises("comm: expected an attnkit.cp.Communicator", call(comm="nccl"))
    _raises("q", call(q=q[:-1]))
    _raises("k.shape[1]", call(k=rng.standard_normal((n, 3, 16)).astype(np.float32),
                               v=rng.standard_normal((n, 3, 16)).astype(np.float32)))
    _raises("k: must be contiguous", call(k=np.repeat(k, 2, axis=1)[:, ::2]))
    _raises("v", call(v=v.astype(np.float16)))
    _raises("out", call(out=np.full((n, 4, 16), np.nan, np.float16)))
    _raises("lse", call(lse=np.full((n - 1, 4), np.nan, np.float32)))
    _raises("backend", call(backend="fused"))
    _raises("softcap", call(softcap="big"))
    _raises("causal", call(causal=None))
    assert np.isnan(out).all() and np.isnan(lse).all()


def test_sharded_decode_rejects_bad_arguments(rng):
    cache = np.zeros((4, 2, 8, 16), np.float16)
    q = rng.standard_normal((2, 8, 16)).astype(np.float32)
    out = np.full((2, 8, 16), np.nan, np.float32)
    group = cp.in_process_group(["cpu", "cpu"], timeout=5)
    good = dict(k_cache=cache, v_cache=cache.copy(), seq_lens=[5, 9],
                block_table=[[0, 1], [2, 3]], comm=group[0], out=out)

    def call(**kw):
        return lambda: cp.sharded_decode(q, **{**good, **kw})

    _raises("comm: expected an attnkit.cp.Communicator", call(comm=object()))
    _raises("out", call(out=np.full((2, 8, 8), np.nan, np.float32)))
    _raises("k_cache", call(k_cache=cache[..., :8], v_cache=cache[..., :8]))
    _raises("block_table", call(seq_lens=[5]))
    _raises("seq_lens", call(seq_lens=[5, 2.5]))
    _raises("num_splits", call(num_splits=1.5))
    assert np.isnan(out).all()


def test_plan_layout_and_communicator_reject_bad_arguments():
    _raises("cu_seqlens", lambda: cp.ZigzagPlan([1, 4], 2))
    _raises("cu_seqlens", lambda: cp.ZigzagPlan([0, 4, 3], 2))
    _raises("cu_seqlens", lambda: cp.ZigzagPlan([0, 2.5], 2))
    _raises("world_size", lambda: cp.ZigzagPlan([0, 4], 0))
    plan = cp.ZigzagPlan([0, 4], 2)
    _raises("rank", lambda: plan.local_tokens(2))
    _raises("rank", lambda: plan.global_rows(-1))
    _raises("x: expected an array of total_tokens=4 rows", lambda: plan.shard(np.zeros(3), 0))
    _raises("parts", lambda: plan.unshard([np.zeros(2)]))
    _raises("parts[1]", lambda: plan.unshard([np.zeros(2), np.zeros(3)]))
    _raises("world_size", lambda: cp.DecodeShardLayout(0, 8))
    _raises("tokens_per_block", lambda: cp.DecodeShardLayout(2, 0))
    layout = cp.DecodeShardLayout(2, 8)
    _raises("position", lambda: layout.local_position(-1))
    _raises("rank", lambda: layout.local_length(2, 10))
    shared = attnkit.KvCache(num_kv_heads=2, head_dim=16, max_seq_len=64, max_tokens=256)
    _raises("cache: must be made with enable_prefix_reuse=False",
            lambda: cp.ShardedKvCache(shared, layout, 0))
    own = attnkit.KvCache(num_kv_heads=2, head_dim=16, max_seq_len=64, max_tokens=256,
                          enable_prefix_reuse=False)
    _raises("rank", lambda: cp.ShardedKvCache(own, layout, 2))
    _raises("layout", lambda: cp.ShardedKvCache(own, (2, 8), 0))
    _raises("devices", lambda: cp.in_process_group("cpu"))
    _raises("devices", lambda: cp.in_process_group([]))
    _raises("devices[1]", lambda: cp.in_process_group(["cpu", "gpu"]))
    _raises("timeout", lambda: cp.in_process_group(["cpu"], timeout=0))
    _raises("rank", lambda: cp.nccl_communicator(bytes(128), 1, 1))
    _raises("unique_id", lambda: cp.nccl_communicator(b"abc", 0, 1))
    _raises("unique_id", lambda: cp.nccl_communicator("id", 0, 1))
    if not cp.nccl_available():
        message = _raises("nccl_unique_id", cp.nccl_unique_id)
        assert "without NCCL" in message and "in_process_group" in message
        _raises("nccl_communicator", lambda: cp.nccl_communicator(bytes(128), 0, 1))


@needs_torch
def test_from_process_group_needs_torch_distributed():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    _raises("group: torch.distributed is not initialized", cp.from_process_group)


@needs_torch
def test_transport_exception_reaches_the_caller(rng):
    """An exception of the torch.distributed transport (a timeout, a rank that left) comes out of
    ring_prefill / sharded_decode unchanged; what the transport was given are uint8 torch
    tensors of the transfers' sizes."""
    seen = []

    class Failing:
        def ring_exchange(self, transfers, stream):
            seen.append([(s.dtype, s.numel(), r.dtype, r.numel()) for s, r in transfers])
            raise TimeoutError("rank 1 left")

        def all_gather(self, send, recv, stream):
            seen.append((send.numel(), recv.numel()))
            raise TimeoutError("rank 1 left")

    comm = attnkit._attnkit.cp_python_communicator(Failing(), 0, 2, "cpu", 0)
    assert (comm.transport, comm.rank, comm.world_size) == ("torch", 0, 2)
    plan = cp.ZigzagPlan([0, 12, 17], 2)
    n = plan.local_tokens(0)
    q = rng.standard_normal((n, 4, 16)).astype(np.float32)
    k = rng.standard_normal((n, 2, 16)).astype(np.float32)
    with pytest.raises(TimeoutError, match="rank 1 left"):
        cp.ring_prefill(q, k, k.copy(), plan, comm=comm)
    kv_bytes = 4 * 2 * 16  # a float32 row of K or V
    assert seen == [[(torch.uint8, n * kv_bytes, torch.uint8, plan.local_tokens(1) * kv_bytes)] * 2]
    cache = np.zeros((4, 2, 8, 16), np.float16)
    with pytest.raises(TimeoutError, match="rank 1 left"):
        cp.sharded_decode(q[:2], cache, cache.copy(), [5, 0], [[0, 1], [2, 3]], comm=comm)
    assert len(seen) == 2 and seen[1][1] == 2 * seen[1][0]


# ---- ranks as processes: torch.distributed -------------------------------------------------------


def spawn(world, backend, transport, tmp_path, seed, timeout=300):
    """cp_workers.distributed_worker on `world` spawned processes; returns the output folder."""
    import torch.multiprocessing as mp

    out_dir = tmp_path / f"{backend}-{transport}-{world}"
    out_dir.mkdir()
    store = str(tmp_path / f"store-{backend}-{transport}-{world}")
    ctx = mp.start_processes(cp_workers.distributed_worker,
                             args=(world, backend, transport, store, str(out_dir), seed),
                             nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{world} {backend} ranks did not finish within {timeout} s")
    return str(out_dir)


def check_distributed(out_dir, world, seed, check, device):
    """Every rank's saved results against the single-process calls on ``device``:
    check(got, want, op) for op "prefill" and "decode"; every rank's decode the same bits."""
    cases, script = cp_workers.cases(seed, device != "cpu")
    ranks = [cp_workers.load(out_dir, "prefill", r) for r in range(world)]
    for i, case in enumerate(cases):
        check(unshard(case, world, [ranks[r][i] for r in range(world)]),
              cp_workers.single_prefill(case, device), "prefill")
    decodes = [cp_workers.load(out_dir, "decode", r) for r in range(world)]
    for step, want in enumerate(cp_workers.single_decode(script, device)):
        check(decodes[0][step], want, "decode")
        for r in range(1, world):
            assert np.array_equal(decodes[r][step][0], decodes[0][step][0]), (step, r)
            assert np.array_equal(decodes[r][step][1], decodes[0][step][1]), (step, r)


@needs_torch
@pytest.mark.parametrize("world", [1, 2])
def test_gloo_group_equals_single_process(rng, tmp_path, world):
    seed = int(rng.integers(2**31))
    out_dir = spawn(world, "gloo", "auto", tmp_path, seed)
    for r in range(world):
        with open(os.path.join(out_dir, f"transport_{r}")) as f:
            assert f.read() == "torch"
        with open(os.path.join(out_dir, f"rejections_{r}")) as f:
            messages = f.read().split("\n")
        for (_, needle), message in zip(cp_workers.FROM_GROUP_REJECTIONS, messages, strict=True):
            assert message.startswith(needle), message
    check_distributed(out_dir, world, seed, lambda got, want, _: check_f32(got, want), "cpu")


# ---- CUDA ----------------------------------------------------------------------------------------


def check_bf16(got, want, op, world):
    """bf16 on the GPU against the single-GPU call. Each rounding to bf16 moves an element by at
    most half an ulp of a value bounded by max |v| = 1, 2^-9: the kernels' bf16 probabilities
    (one such error, the weights summing to one) and output (one) on both sides, and on the
    context-parallel side the merges of the partials (their own roundings, convex weights: one
    error together), each merge rounding once: 2R - 1 merges for a causal prefill slot's at most
    2R blocks, R - 1 for decode's R partials."""
    (out, lse), (want_out, want_lse) = got, want
    merges = 2 * world - 1 if op == "prefill" else world - 1
    assert max_diff(out, want_out) <= (merges + 4) * 2.0**-9
    assert max_diff(lse, want_lse) <= 1e-4
    assert np.array_equal(np.isinf(lse), np.isinf(want_lse))


@needs_cuda
@pytest.mark.parametrize("world", [1, 2, 4])
def test_cuda_threads_on_one_gpu_equal_single_gpu(rng, world):
    """R ranks as threads, each with its own stream on cuda:0 (the in-process transport's
    cudaMemcpyAsync ordered by events): the whole algorithm on one GPU."""
    cases, script = cp_workers.cases(int(rng.integers(2**31)), gpu=True)
    streams = [torch.cuda.Stream() for _ in range(world)]
    for case in cases:
        want = cp_workers.single_prefill(case, "cuda:0")
        group = cp.in_process_group(["cuda:0"] * world, timeout=120)
        got = run_threads(world, lambda r: cp_workers.rank_prefill(
            case, r, group[r], world, "cuda:0", stream=streams[r]))
        got = unshard(case, world, got)
        if world == 1:  # one prefill() call
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
        check_bf16(got, want, "prefill", world)
    want = cp_workers.single_decode(script, "cuda:0")
    group = cp.in_process_group(["cuda:0"] * world, timeout=120)
    got = run_threads(world, lambda r: cp_workers.rank_decode(
        script, r, group[r], world, "cuda:0", stream=streams[r]))
    for step, expected in enumerate(want):
        check_bf16(got[0][step], expected, "decode", world)
        for r in range(1, world):
            assert np.array_equal(got[r][step][0], got[0][step][0]), (step, r)


@needs_cuda
@needs_nccl
def test_cuda_nccl_one_rank_is_single_gpu(rng):
    """An NCCL communicator of one rank made in this process: ring_prefill is one prefill()
    call, sharded_decode is decode(): the same bits."""
    comm = cp.nccl_communicator(cp.nccl_unique_id(), 0, 1, "cuda:0")
    assert (comm.rank, comm.world_size, comm.device, comm.transport) == (0, 1, "cuda:0", "nccl")
    assert comm.comm_stream != 0
    cases, script = cp_workers.cases(int(rng.integers(2**31)), gpu=True)
    for case in cases:
        got = cp_workers.rank_prefill(case, 0, comm, 1, "cuda:0")
        want = cp_workers.single_prefill(case, "cuda:0")
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    for got, want in zip(cp_workers.rank_decode(script, 0, comm, 1, "cuda:0"),
                         cp_workers.single_decode(script, "cuda:0")):
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


@needs_cuda
@pytest.mark.parametrize("transport", ["nccl", "torch"])
@pytest.mark.parametrize("world", [1, 2])
def test_cuda_nccl_group_equals_single_gpu(rng, tmp_path, world, transport):
    """Processes of a torch.distributed NCCL group, one GPU each (NCCL refuses two ranks of one
    communicator on one GPU): attnkit's NCCL communicator, or the group's own operations."""
    if world > torch.cuda.device_count():
        pytest.skip(f"needs {world} GPUs (NCCL puts each rank on its own GPU)")
    if transport == "nccl" and not cp.nccl_available():
        pytest.skip("needs attnkit built with NCCL")
    seed = int(rng.integers(2**31))
    out_dir = spawn(world, "nccl", transport, tmp_path, seed)
    for r in range(world):
        with open(os.path.join(out_dir, f"transport_{r}")) as f:
            assert f.read() == transport

    def check(got, want, op):
        if world == 1:
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
        check_bf16(got, want, op, world)

    check_distributed(out_dir, world, seed, check, "cuda:0")
