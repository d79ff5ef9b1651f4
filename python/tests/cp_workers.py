"""The context-parallel runs of test_cp.py: the cases (fresh random data from a seed, the same
in every process that draws them), one rank's ring_prefill / sharded_decode, the single-process
results they must equal, and the entry points of the processes that test_cp.py spawns
(torch.multiprocessing pickles them by this module's name)."""

import datetime
import os

import numpy as np

import attnkit
from attnkit import cp

# ---- prefill ----------------------------------------------------------------------------------

# (Hq, Hkv, D, lengths, softcap): GQA with uneven, empty and one-token sequences; MQA with
# sequences shorter than 2R; one long sequence with soft-cap.
PREFILL_SHAPES = [
    (4, 2, 16, [37, 0, 1, 64, 9, 100], 0.0),
    (4, 1, 8, [3, 2, 1, 5], 0.0),
    (2, 2, 16, [129], 30.0),
]


def prefill_cases(seed, head_dim=None):
    """Every shape (with ``head_dim`` instead of its own where given: 128 on the GPU, where the
    fused kernels serve it), causal and unmasked: dicts of the spec and the global float32 q, k,
    v."""
    rng = np.random.default_rng(seed)
    cases = []
    for hq, hkv, d, lengths, softcap in PREFILL_SHAPES:
        d = head_dim or d
        for causal in (True, False):
            total = sum(lengths)
            # Wide q / k make some rows peaked, so a lost or doubled block shows.
            cases.append(dict(
                causal=causal, softcap=softcap, cu=np.cumsum([0] + lengths).tolist(),
                q=rng.uniform(-2, 2, (total, hq, d)).astype(np.float32),
                k=rng.uniform(-2, 2, (total, hkv, d)).astype(np.float32),
                v=rng.uniform(-1, 1, (total, hkv, d)).astype(np.float32)))
    return cases


def _on(x, device, dtype):
    """NumPy float32 ``x`` as the rank's tensor: NumPy float32 on the CPU, torch ``dtype`` on a
    CUDA device."""
    if device == "cpu":
        return x
    import torch

    return torch.from_numpy(x).to(device, getattr(torch, dtype))


def _host(x):
    return x.float().cpu().numpy() if hasattr(x, "cpu") else np.asarray(x)


def single_prefill(case, device="cpu", dtype="bfloat16"):
    """attnkit.prefill on the whole batch: (out, lse) as NumPy float32."""
    q, k, v = (_on(case[n], device, dtype) for n in "qkv")
    out, lse = attnkit.prefill(q, k, v, case["cu"], case["cu"], causal=case["causal"],
                               softcap=case["softcap"], return_lse=True)
    return _host(out), _host(lse)


def on_stream(stream):
    """torch's current stream set to ``stream`` (a torch.cuda.Stream: the rank's own when ranks
    are threads of one process) and synchronized at the end; nothing for None."""
    import contextlib

    if stream is None:
        return contextlib.nullcontext()
    import torch

    @contextlib.contextmanager
    def scope():
        with torch.cuda.stream(stream):
            yield
        stream.synchronize()

    return scope()


def rank_prefill(case, rank, comm, world_size, device="cpu", dtype="bfloat16", stream=None):
    """This rank's ring_prefill of ``case``: its local (out, lse) as NumPy float32."""
    plan = cp.ZigzagPlan(case["cu"], world_size)
    with on_stream(stream):
        q, k, v = (plan.shard(_on(case[n], device, dtype), rank) for n in "qkv")
        out, lse = cp.ring_prefill(q, k, v, plan, comm=comm, causal=case["causal"],
                                   softcap=case["softcap"], return_lse=True)
    return _host(out), _host(lse)


# ---- decode -----------------------------------------------------------------------------------

DECODE_HQ, DECODE_HKV = 8, 2
DECODE_SEQS = [11, 12, 13, 14]
DECODE_PROMPTS = [3, 70, 17, 200]
DECODE_STEPS = 3
DECODE_MAX_SEQ = 512


def decode_splits(step):
    """The split-KV count of a step's (local) decode: the heuristic's, or 2."""
    return 2 if step == 1 else 0


def decode_script(seed, head_dim=16, tokens_per_block=8):
    """Token ids, K / V (float16 values) and per-step queries of sequences that start with their
    prompts and then grow by one token per decode step (the GPU tests: head_dim 128, blocks of
    16 tokens)."""
    rng = np.random.default_rng(seed)
    d = head_dim
    script = dict(ids=[], k=[], v=[], q=[], d=d, t=tokens_per_block)
    for prompt in DECODE_PROMPTS:
        n = prompt + DECODE_STEPS
        script["ids"].append(rng.integers(0, 30000, n).tolist())
        script["k"].append(rng.uniform(-2, 2, (n, DECODE_HKV, d)).astype(np.float16))
        script["v"].append(rng.uniform(-1, 1, (n, DECODE_HKV, d)).astype(np.float16))
    for _ in range(DECODE_STEPS):
        script["q"].append(rng.uniform(-2, 2, (len(DECODE_SEQS), DECODE_HQ, d)).astype(np.float32))
    return script


def _cache(script, device, max_seq_len):
    return attnkit.KvCache(num_kv_heads=DECODE_HKV, head_dim=script["d"], max_seq_len=max_seq_len,
                           tokens_per_block=script["t"],
                           dtype="f16" if device == "cpu" else "bf16", device=device,
                           max_tokens=4096, enable_prefix_reuse=False)


def _write(view, positions, row, k, v, device, dtype):
    """K / V of one row's new tokens into the cache at ``positions`` (rope none: the stored K is
    the given one)."""
    if not positions:
        return
    n = len(positions)
    q = np.zeros((n, DECODE_HQ, k.shape[-1]), np.float16)
    if device != "cpu":
        import torch

        q, k, v = (torch.from_numpy(np.asarray(x, np.float32)).to(device, getattr(torch, dtype))
                   for x in (q, k, v))
    attnkit.append_kv(view, positions, [row] * n, q=q, k=k, v=v)


def _decode_steps(extend, decode):
    """Prompts, then DECODE_STEPS steps of one token per sequence and a decode call each; the
    (out, lse) of every step as NumPy float32."""
    for row in range(len(DECODE_SEQS)):
        extend(row, 0, DECODE_PROMPTS[row])
    results = []
    for step in range(DECODE_STEPS):
        for row in range(len(DECODE_SEQS)):
            extend(row, DECODE_PROMPTS[row] + step, DECODE_PROMPTS[row] + step + 1)
        results.append(decode(step))
    return results


def single_decode(script, device="cpu", dtype="bfloat16"):
    """attnkit.decode over one cache holding the whole sequences."""
    cache = _cache(script, device, DECODE_MAX_SEQ)

    def extend(row, begin, end):
        seq = DECODE_SEQS[row]
        ids = script["ids"][row][begin:end]
        if begin == 0:
            cache.add(seq, ids)
        else:
            cache.append(seq, ids)
        _write(cache.view(0, [seq]), list(range(begin, end)), 0,
               script["k"][row][begin:end], script["v"][row][begin:end], device, dtype)

    def decode(step):
        out, lse = attnkit.decode(_on(script["q"][step], device, dtype),
                                  cache.view(0, DECODE_SEQS), num_splits=decode_splits(step),
                                  return_lse=True)
        return _host(out), _host(lse)

    return _decode_steps(extend, decode)


def rank_decode(script, rank, comm, world_size, device="cpu", dtype="bfloat16", stream=None):
    """This rank's share of the sequences in a ShardedKvCache (K / V written at the local
    positions), sharded_decode at every step."""
    with on_stream(stream):
        return _rank_decode(script, rank, comm, world_size, device, dtype)


def _rank_decode(script, rank, comm, world_size, device, dtype):
    layout = cp.DecodeShardLayout(world_size, script["t"])
    cache = _cache(script, device, layout.local_length(0, DECODE_MAX_SEQ))
    shard = cp.ShardedKvCache(cache, layout, rank)

    def extend(row, begin, end):
        shard.extend(DECODE_SEQS[row], script["ids"][row][begin:end])
        mine = [p for p in range(begin, end) if layout.rank_of_position(p) == rank]
        _write(shard.view(0, DECODE_SEQS), [layout.local_position(p) for p in mine], row,
               script["k"][row][mine], script["v"][row][mine], device, dtype)
        assert shard.local_length(DECODE_SEQS[row]) == layout.local_length(rank, end)

    def decode(step):
        out, lse = cp.sharded_decode(_on(script["q"][step], device, dtype),
                                     shard.view(0, DECODE_SEQS), comm=comm,
                                     num_splits=decode_splits(step), return_lse=True)
        return _host(out), _host(lse)

    results = _decode_steps(extend, decode)
    shard.release(DECODE_SEQS[0])
    assert DECODE_SEQS[0] not in cache and shard.length(DECODE_SEQS[0]) == 0
    cache.check_invariants()
    return results


# ---- spawned processes ------------------------------------------------------------------------


def save(out_dir, name, rank, results):
    """results: a list of (out, lse) pairs, saved as <name>_<rank>.npz."""
    arrays = {}
    for i, (out, lse) in enumerate(results):
        arrays[f"out{i}"], arrays[f"lse{i}"] = out, lse
    np.savez(os.path.join(out_dir, f"{name}_{rank}.npz"), **arrays)


def load(out_dir, name, rank):
    data = np.load(os.path.join(out_dir, f"{name}_{rank}.npz"))
    return [(data[f"out{i}"], data[f"lse{i}"]) for i in range(len(data.files) // 2)]


def cases(seed, gpu):
    """The prefill cases and the decode script of a seed, in the GPU tests' shapes or not."""
    if gpu:
        return prefill_cases(seed, head_dim=128), decode_script(seed, 128, 16)
    return prefill_cases(seed), decode_script(seed)


# Bad arguments of from_process_group on a CPU (gloo) rank, and what each message must start with.
FROM_GROUP_REJECTIONS = [
    (dict(transport="nccl"), "transport: 'nccl' needs a CUDA device"),
    (dict(transport="mpi"), "transport: expected 'auto', 'nccl' or 'torch'"),
    (dict(device="tpu:0"), "device: expected"),
    (dict(device=True), "device: expected"),
    (dict(group="WORLD"), "group: expected a torch.distributed ProcessGroup"),
]


def from_group_rejections():
    """The message of each FROM_GROUP_REJECTIONS call (each must raise attnkit.Error, on every
    rank alike, before any collective)."""
    messages = []
    for kwargs, _ in FROM_GROUP_REJECTIONS:
        try:
            cp.from_process_group(**kwargs)
            messages.append("accepted")
        except attnkit.Error as e:
            messages.append(str(e))
    return messages


def distributed_worker(rank, world_size, backend, transport, store, out_dir, seed):
    """One rank of a torch.distributed group (gloo on the CPU, NCCL on cuda:rank): its
    communicator from the group, every prefill case and the decode script, saved to out_dir."""
    import torch
    import torch.distributed as dist

    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=120))
    try:
        if backend == "gloo":
            with open(os.path.join(out_dir, f"rejections_{rank}"), "w") as f:
                f.write("\n".join(from_group_rejections()))
        comm = cp.from_process_group(transport=transport)
        assert (comm.rank, comm.world_size, comm.device) == (rank, world_size, device)
        prefill, script = cases(seed, backend == "nccl")
        save(out_dir, "prefill", rank,
             [rank_prefill(case, rank, comm, world_size, device) for case in prefill])
        save(out_dir, "decode", rank, rank_decode(script, rank, comm, world_size, device))
        with open(os.path.join(out_dir, f"transport_{rank}"), "w") as f:
            f.write(comm.transport)
        del comm
        dist.barrier()
    finally:
        dist.destroy_process_group()
