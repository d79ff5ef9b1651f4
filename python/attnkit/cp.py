"""Context parallelism: one batch split by tokens across the ranks of a group (the C++
``attnkit::cp``, docs/context_parallel.md).

- A :class:`Communicator` is one rank of a group: :func:`from_process_group` (a
  ``torch.distributed`` process group), :func:`nccl_communicator` (an NCCL unique id, as in C++)
  or :func:`in_process_group` (threads of one process).
- Prefill: :class:`ZigzagPlan` says which tokens of a packed batch each rank holds;
  :func:`ring_prefill` computes a rank's shard, K/V travelling around the ring.
- Decode: :class:`DecodeShardLayout` / :class:`ShardedKvCache` shard every sequence's KV cache
  by blocks across the ranks; :func:`sharded_decode` attends a rank's shard and merges every
  rank's partial result, so that every rank gets the same output.

Without a communicator (``comm=None``) each function runs as the only rank of a group of one:
``ring_prefill`` with a one-rank plan is ``attnkit.prefill`` on the whole batch,
``sharded_decode`` is ``attnkit.decode``. Every rejected call raises :class:`attnkit.Error`
naming the argument, before any rank communicates when the bad argument is the same on every
rank (they see the same global arguments).
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Optional, Sequence

from . import _attnkit as _C
from . import (
    DecodeWorkspace,
    Error,
    KvCache,
    KvView,
    _as_view,
    _empty,
    _host_int32,
    _library,
    _mask,
    _shape,
    _spec,
    _stream,
    _workspace,
)
from ._arguments import INT32, INT64, bool_arg, describe, float_arg, int_arg, int_list, str_arg

__all__ = [
    "Communicator",
    "from_process_group",
    "nccl_available",
    "nccl_unique_id",
    "nccl_communicator",
    "in_process_group",
    "ZigzagPlan",
    "ring_prefill",
    "DecodeShardLayout",
    "ShardedKvCache",
    "sharded_decode",
]

Communicator = _C.Communicator  # one rank of a group (its docstring: help(cp.Communicator))


def _rank(rank: Any, world_size: int, name: str = "rank") -> int:
    rank = int_arg(rank, name)
    if not 0 <= rank < world_size:
        raise Error(f"{name}: must be in [0, {world_size}) (world_size), got {rank}")
    return rank


def _comm(comm: Any) -> Optional[Communicator]:
    if comm is None or isinstance(comm, Communicator):
        return comm
    raise Error(
        f"comm: expected an attnkit.cp.Communicator (from from_process_group, nccl_communicator "
        f"or in_process_group) or None, got {describe(comm)}"
    )


# ---- communicators ----------------------------------------------------------------------------


def nccl_available() -> bool:
    """Whether attnkit was built with NCCL (``ATTNKIT_WITH_NCCL``) and libnccl loads."""
    return _C.cp_nccl_available()


def nccl_unique_id() -> bytes:
    """A new NCCL unique id (128 bytes). Rank 0 makes it and sends it to the other ranks out of
    band; :func:`from_process_group` does that over the process group."""
    return _C.cp_nccl_unique_id()


def _cuda_device_name(device: Any, name: str = "device") -> str:
    """'cuda:N' of a device argument: None (torch's current device, else 0), an int ordinal, a
    str or a torch.device."""
    if device is None:
        import sys

        torch = sys.modules.get("torch")
        cuda = torch is not None and torch.cuda.is_available()
        return f"cuda:{torch.cuda.current_device() if cuda else 0}"
    if isinstance(device, int) and not isinstance(device, bool):
        return f"cuda:{int_arg(device, name, (0, 2**31 - 1))}"
    text = str(device) if type(device).__name__ == "device" else str_arg(device, name)
    return "cuda:0" if text == "cuda" else text


def nccl_communicator(
    unique_id: bytes, rank: int, world_size: int, device: Any = None
) -> Communicator:
    """An NCCL communicator of rank ``rank`` in a group of ``world_size`` on CUDA ``device``
    ("cuda:N", an ordinal or a torch.device; None: torch's current device). A collective: every
    rank calls it with the same ``unique_id`` (from :func:`nccl_unique_id` on rank 0), and it
    returns once all have. The communicator owns its NCCL communicator and a communication
    stream; attnkit must be built with NCCL (:func:`nccl_available`)."""
    world_size = int_arg(world_size, "world_size", (1, 2**31 - 1))
    rank = _rank(rank, world_size)
    return _C.cp_nccl_communicator(unique_id, rank, world_size, _cuda_device_name(device))


def in_process_group(devices: Sequence[Any], *, timeout: float = 300.0) -> list:
    """One communicator per entry of ``devices`` ("cpu", or "cuda:N" for every rank: several
    ranks may share one GPU), for ranks that are threads of this process. Each rank must call
    from its own thread (a collective waits until every rank has called it; the calls release
    the GIL). A rank that waits more than ``timeout`` seconds raises, and the group then refuses
    every later call. Keep every rank's communicator alive while any rank calls."""
    if isinstance(devices, (str, bytes)) or not hasattr(devices, "__iter__"):
        raise Error(f"devices: expected a sequence of device names, got {describe(devices)}")
    names = [
        str(d) if type(d).__name__ == "device" else str_arg(d, f"devices[{i}]")
        for i, d in enumerate(devices)
    ]
    for i, name in enumerate(names):
        if not re.fullmatch(r"cpu|cuda(:[0-9]{1,9})?", name):
            raise Error(f"devices[{i}]: expected 'cpu', 'cuda' or 'cuda:N', got '{name}'")
    timeout = float_arg(timeout, "timeout")
    if not timeout > 0:
        raise Error(f"timeout: must be > 0 seconds, got {timeout}")
    return list(_C.cp_in_process_group(names, timeout))


class _TorchTransport:
    """The collectives of a Communicator over ``torch.distributed`` (transport "torch"), called
    by the C++ driver with uint8 tensors over its own buffers (no copy) and the stream to order
    them on. CUDA: the operations are issued with that stream as torch's current stream and end
    with ``Work.wait()``, which makes the stream wait for them (no host synchronization); CPU:
    they are complete when the method returns."""

    def __init__(self, group: Any, device: Any) -> None:
        import torch
        import torch.distributed as dist

        self._torch, self._dist, self._group, self._device = torch, dist, group, device
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.rank, self.world_size = rank, world
        self._next = dist.get_global_rank(group, (rank + 1) % world)
        self._prev = dist.get_global_rank(group, (rank + world - 1) % world)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _on(self, stream: int) -> Any:
        torch = self._torch
        if self._device.type != "cuda":
            return contextlib.nullcontext()
        s = (
            torch.cuda.ExternalStream(stream, device=self._device)
            if stream
            else torch.cuda.default_stream(self._device)
        )
        return torch.cuda.stream(s)

    def ring_exchange(self, transfers: list, stream: int) -> None:
        dist = self._dist
        with self._on(stream):
            if self.world_size == 1:  # to itself
                for send, recv in transfers:
                    if recv is not None:
                        recv.copy_(send)
                return
            ops = []
            for send, recv in transfers:
                if send is not None:
                    ops.append(dist.P2POp(dist.isend, send, self._next, self._group))
                if recv is not None:
                    ops.append(dist.P2POp(dist.irecv, recv, self._prev, self._group))
            for work in dist.batch_isend_irecv(ops) if ops else []:
                work.wait()

    def all_gather(self, send: Any, recv: Any, stream: int) -> None:
        if send is None:
            return
        with self._on(stream):
            if self.world_size == 1:
                recv.copy_(send)
                return
            self._dist.all_gather_into_tensor(recv, send, group=self._group)


def from_process_group(
    group: Any = None, *, transport: str = "auto", device: Any = None
) -> Communicator:
    """The communicator of this process's rank in a ``torch.distributed`` process group (None:
    the default group). A collective over the group: every member calls it.

    device: where this rank's tensors live: None gives torch's current CUDA device for a group
    with an NCCL backend, else "cpu"; or "cpu", "cuda:N", an ordinal, a torch.device.
    transport:

    - "nccl": attnkit's own NCCL communicator (as :func:`nccl_communicator`), its unique id sent
      from the group's rank 0 with ``broadcast_object_list``. Transfers are NCCL calls on the
      communicator's stream, without Python in the loop. CUDA devices; attnkit built with NCCL.
    - "torch": the group's own ``torch.distributed`` operations (batched isend / irecv,
      all_gather_into_tensor) on tensors over attnkit's buffers, no copies; any backend that
      has them for the device (gloo on CPU, NCCL on CUDA).
    - "auto": "nccl" for a CUDA device when :func:`nccl_available`, else "torch".
    """
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise Error(
            "group: torch.distributed is not initialized (call "
            "torch.distributed.init_process_group first)"
        )
    if group is None:
        group = dist.group.WORLD
    try:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    except (RuntimeError, ValueError, AttributeError, TypeError) as e:
        raise Error(
            f"group: expected a torch.distributed ProcessGroup, got {describe(group)} ({e})"
        ) from None
    if rank < 0:
        raise Error("group: this process is not a member of the group")
    transport = str_arg(transport, "transport")
    if transport not in ("auto", "nccl", "torch"):
        raise Error(f"transport: expected 'auto', 'nccl' or 'torch', got '{transport}'")
    if device is None:
        nccl_backend = "nccl" in str(dist.get_backend(group))
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if nccl_backend and torch.cuda.is_available()
            else torch.device("cpu")
        )
    elif isinstance(device, int) and not isinstance(device, bool):
        device = torch.device("cuda", int_arg(device, "device", (0, 2**31 - 1)))
    else:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError):
            raise Error(
                f"device: expected 'cpu', 'cuda:N', an ordinal or a torch.device, got "
                f"{describe(device)}"
            ) from None
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise Error(f"device: expected a cpu or cuda device, got '{device}'")
    if transport == "auto":
        transport = "nccl" if device.type == "cuda" and nccl_available() else "torch"
    if transport == "nccl":
        # Checked on every rank before the collective, so that no rank is left waiting.
        if device.type != "cuda":
            raise Error("transport: 'nccl' needs a CUDA device, got device='cpu'")
        if not nccl_available():
            raise Error(
                "transport: 'nccl' needs attnkit built with NCCL (cp.nccl_available() is False); "
                "use transport='torch'"
            )
        box = [nccl_unique_id() if rank == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        return nccl_communicator(box[0], rank, world, f"cuda:{device.index}")
    impl = _TorchTransport(group, device)
    name = "cpu" if device.type == "cpu" else f"cuda:{device.index}"
    return _C.cp_python_communicator(
        impl, rank, world, name, impl.stream.cuda_stream if impl.stream is not None else 0
    )


# ---- prefill ----------------------------------------------------------------------------------


def _index(rows: Any, like: Any) -> Any:
    """The int64 row indices ``rows`` (NumPy) in ``like``'s library, on its device."""
    lib = _library(like)
    if lib == "numpy":
        return rows
    if lib == "torch":
        import torch

        return torch.from_numpy(rows).to(like.device)
    if lib == "cupy":
        import cupy

        return cupy.asarray(rows)
    raise Error(
        f"x: expected a numpy, torch or cupy array, got "
        f"{type(like).__module__}.{type(like).__name__}"
    )


class ZigzagPlan:
    """The prefill sharding of a packed batch over ``world_size`` ranks (C++ ``cp::ZigzagPlan``).

    cu_seqlens: int32 [B + 1] global token offsets (a list, or a NumPy / CPU torch array). With
    world_size R > 1 each sequence is cut into 2R chunks of lengths differing by at most one,
    rank r holding chunks r and 2R-1-r (causal load balance). A rank's local tensors hold its
    first chunk of every sequence in batch order, then its second chunk of every sequence;
    ``global_rows(rank)`` maps them to the global packed rows, ``shard`` / ``unshard`` apply it.
    With R = 1 the local layout is the global one. Every rank builds the same plan.
    """

    def __init__(self, cu_seqlens: Any, world_size: int) -> None:
        cu = _host_int32(cu_seqlens, "cu_seqlens")
        if cu.ndim != 1:
            raise Error(f"cu_seqlens: expected 1 dimension [B + 1], got shape {list(cu.shape)}")
        self._plan = _C.ZigzagPlan(cu.tolist(), int_arg(world_size, "world_size"))

    @property
    def world_size(self) -> int:
        return self._plan.world_size

    @property
    def num_sequences(self) -> int:
        return self._plan.num_sequences

    @property
    def total_tokens(self) -> int:
        return self._plan.total_tokens

    @property
    def cu_seqlens(self) -> list:
        return list(self._plan.cu_seqlens)

    def local_tokens(self, rank: int) -> int:
        """Rows of ``rank``'s local q, k, v, out."""
        return self._plan.local_tokens(_rank(rank, self.world_size))

    def max_local_tokens(self) -> int:
        return self._plan.max_local_tokens()

    def global_rows(self, rank: int) -> Any:
        """int64 NumPy array [local_tokens(rank)]: local row i of ``rank`` is global row
        ``global_rows(rank)[i]``."""
        import numpy as np

        return self._plan.global_rows(_rank(rank, self.world_size)).astype(np.int64)

    def shard(self, x: Any, rank: int) -> Any:
        """``rank``'s rows of a global packed array x [total_tokens, ...] (NumPy, torch or
        CuPy), contiguous, in x's library and on its device."""
        rows = self.global_rows(rank)
        shape = getattr(x, "shape", None)
        if shape is None or len(shape) < 1 or int(shape[0]) != self.total_tokens:
            raise Error(
                f"x: expected an array of total_tokens={self.total_tokens} rows, got "
                f"{'shape ' + str(list(shape)) if shape is not None else describe(x)}"
            )
        if _library(x) == "torch":
            return x.index_select(0, _index(rows, x)).contiguous()
        import numpy as np

        picked = x[_index(rows, x)]
        return np.ascontiguousarray(picked) if _library(x) == "numpy" else picked

    def unshard(self, parts: Sequence[Any]) -> Any:
        """The global array [total_tokens, ...] from every rank's local array (``parts[r]``:
        rank r's [local_tokens(r), ...], all of one library, dtype and device)."""
        if isinstance(parts, (str, bytes)) or not hasattr(parts, "__len__"):
            raise Error(f"parts: expected a sequence of world_size arrays, got {describe(parts)}")
        if len(parts) != self.world_size:
            raise Error(
                f"parts: expected one array per rank (world_size={self.world_size}), got "
                f"{len(parts)}"
            )
        first = parts[0]
        tail = tuple(int(s) for s in _shape_any(first, "parts[0]")[1:])
        for r, part in enumerate(parts):
            shape = tuple(int(s) for s in _shape_any(part, f"parts[{r}]"))
            if shape != (self.local_tokens(r),) + tail:
                raise Error(
                    f"parts[{r}]: expected shape {[self.local_tokens(r), *tail]}, got "
                    f"{list(shape)}"
                )
        shape = (self.total_tokens,) + tail
        if _library(first) == "torch":
            out = first.new_empty(shape)
        elif _library(first) == "numpy":
            import numpy as np

            out = np.empty(shape, dtype=first.dtype)
        else:
            out = _empty(first, shape)
        for r, part in enumerate(parts):
            out[_index(self.global_rows(r), first)] = part
        return out


def _shape_any(x: Any, name: str) -> tuple:
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) < 1:
        raise Error(f"{name}: expected an array, got {describe(x)}")
    return tuple(shape)


def _plan(plan: Any) -> ZigzagPlan:
    if not isinstance(plan, ZigzagPlan):
        raise Error(f"plan: expected an attnkit.cp.ZigzagPlan, got {describe(plan)}")
    return plan


def ring_prefill(
    q: Any,
    k: Any,
    v: Any,
    plan: ZigzagPlan,
    *,
    comm: Optional[Communicator] = None,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    softcap: float = 0.0,
    backend: str = "auto",
    kernel: str = "auto",
    out: Any = None,
    return_lse: bool = False,
    lse: Any = None,
    checked: bool = False,
    stream: Optional[int] = None,
) -> Any:
    """Ring-attention prefill of this rank's shard (C++ ``cp::ring_prefill``): causal (or
    unmasked) self-attention of every sequence of ``plan``, each rank holding the rows the plan
    gives it.

    q: [plan.local_tokens(rank), Hq, D] f32 (CPU) / f16 / bf16 on ``comm.device``; k, v:
    [plan.local_tokens(rank), Hkv, D] of q's dtype, contiguous (they are sent as bytes); the
    rows are ``plan.shard(global, rank)``. comm: this rank's Communicator (None: a group of one,
    which needs a plan of world_size 1: then this is ``attnkit.prefill`` on the whole batch).
    causal=False: no mask. Windows and ALiBi are not offered (they need absolute positions the
    per-block calls do not see), nor skip-softmax. backend / kernel choose each block's kernel
    as for ``attnkit.prefill``. out: [local, Hq, D] (allocated if None); lse / return_lse:
    float32 [local, Hq]. ``plan.unshard`` puts every rank's out back in global order.
    Enqueued on ``stream`` (torch's current stream for CUDA torch tensors); the K/V transfers
    run on the communicator's stream, ordered with it by events, overlapped with the attention
    of the block in hand. A collective: every rank calls it with its own shard.
    Returns out, or (out, lse) when return_lse or lse is given.
    """
    total, hq, d = _shape(q, "q", 3)
    hkv = _shape(k, "k", 3)[1]
    _shape(v, "v", 3)
    plan = _plan(plan)
    comm = _comm(comm)
    spec = _spec(hq, hkv, d, softmax_scale, False, softcap, backend, kernel)
    spec.update(_mask(causal, None, 0))
    checked = bool_arg(checked, "checked")
    stream = _stream(q, stream)
    if out is None:
        out = _empty(q, (total, hq, d))
    if lse is None and bool_arg(return_lse, "return_lse"):
        lse = _empty(q, (total, hq), float32=True)
    _C.cp_ring_prefill(
        spec, plan._plan, q, k, v, out, lse=lse, comm=comm, checked=checked, stream=stream
    )
    return (out, lse) if lse is not None else out


# ---- decode -----------------------------------------------------------------------------------


class DecodeShardLayout:
    """Every sequence's KV cache sharded by blocks (C++ ``cp::DecodeShardLayout``): block i of a
    sequence (tokens [i T, (i + 1) T), T = ``tokens_per_block``) lives on rank i mod
    ``world_size``. On its rank, position p is local position ``local_position(p)`` =
    (p // T // R) T + p % T: each rank's cache holds a local sequence made of its blocks in
    order, written there (append_kv) at the local positions."""

    def __init__(self, world_size: int, tokens_per_block: int) -> None:
        self._layout = _C.DecodeShardLayout(
            int_arg(world_size, "world_size", (1, INT32[1])),
            int_arg(tokens_per_block, "tokens_per_block", (1, INT32[1])),
        )

    @property
    def world_size(self) -> int:
        return self._layout.world_size

    @property
    def tokens_per_block(self) -> int:
        return self._layout.tokens_per_block

    def rank_of_position(self, position: int) -> int:
        """The rank that holds the token at global ``position``."""
        return self._layout.rank_of_position(int_arg(position, "position", (0, INT64[1])))

    def local_position(self, position: int) -> int:
        """Where the token at global ``position`` sits in its rank's local sequence."""
        return self._layout.local_position(int_arg(position, "position", (0, INT64[1])))

    def local_length(self, rank: int, length: int) -> int:
        """Tokens of a sequence of ``length`` tokens that ``rank`` holds."""
        return self._layout.local_length(
            _rank(rank, self.world_size), int_arg(length, "length", (0, INT64[1]))
        )

    def local_tokens(self, rank: int, begin: int, tokens: Sequence[int]) -> list:
        """The tokens of positions [begin, begin + len(tokens)) that ``rank`` holds, in order."""
        return list(
            self._layout.local_tokens(
                _rank(rank, self.world_size),
                int_arg(begin, "begin", (0, INT64[1])),
                int_list(tokens, "tokens"),
            )
        )


class ShardedKvCache:
    """One rank's share of sharded sequences, kept in that rank's :class:`attnkit.KvCache`
    (C++ ``cp::ShardedKvCache``). The cache holds the rank's local sequence (its blocks in
    order) under the sequence's id; it must be made with ``enable_prefix_reuse=False`` (its
    prefix chains would see the rank's own blocks only). Every rank is given the same
    ``extend`` / ``release`` calls."""

    def __init__(self, cache: KvCache, layout: DecodeShardLayout, rank: int) -> None:
        if not isinstance(cache, KvCache):
            raise Error(f"cache: expected an attnkit.KvCache, got {describe(cache)}")
        if cache._prefix_reuse:
            raise Error(
                "cache: must be made with enable_prefix_reuse=False (a rank's prefix chain "
                "hashes its own blocks only, not the other ranks' tokens between them)"
            )
        if not isinstance(layout, DecodeShardLayout):
            raise Error(f"layout: expected an attnkit.cp.DecodeShardLayout, got {describe(layout)}")
        self.cache, self.layout = cache, layout
        self.rank = _rank(rank, layout.world_size)
        self._s = _C.ShardedKvCache(cache._m, layout._layout, self.rank)

    def extend(self, seq: int, tokens: Sequence[int]) -> None:
        """Adds tokens at the end of ``seq`` (a new sequence starts at position 0); this rank's
        share goes to its cache (``add`` at its first local token, ``append`` after)."""
        self._s.extend(int_arg(seq, "seq", INT64), int_list(tokens, "tokens"))

    def release(self, seq: int) -> None:
        self._s.release(int_arg(seq, "seq", INT64))

    def length(self, seq: int) -> int:
        """Global tokens of ``seq`` (0 for an unknown sequence)."""
        return self._s.length(int_arg(seq, "seq", INT64))

    def local_length(self, seq: int) -> int:
        """Tokens of ``seq`` on this rank."""
        return self._s.local_length(int_arg(seq, "seq", INT64))

    def block_tables(self, seqs: Sequence[int]) -> tuple:
        """(block_table int32 [len(seqs), max_blocks_per_seq], seq_lens int32 [len(seqs)]) of
        this rank's share: a sequence without a token here yet has a row of -1 and length 0."""
        return self._s.block_tables(int_list(seqs, "seqs", INT64))

    def view(
        self, layer: int, seqs: Sequence[int], *, k_scale: Any = None, v_scale: Any = None
    ) -> KvView:
        """The KvView of this rank's share of ``seqs`` in ``layer``, for :func:`sharded_decode`."""
        layer = int_arg(layer, "layer")
        table, lens = self.block_tables(seqs)
        return self.cache._view_of(layer, table, lens, k_scale, v_scale)


def sharded_decode(
    q: Any,
    k_cache: Any,
    v_cache: Any = None,
    seq_lens: Any = None,
    block_table: Any = None,
    *,
    comm: Optional[Communicator] = None,
    k_scale: Any = None,
    v_scale: Any = None,
    kv_dtype: Optional[str] = None,
    softmax_scale: Optional[float] = None,
    softcap: float = 0.0,
    backend: str = "auto",
    num_splits: int = 0,
    max_seq_len: int = 0,
    workspace: Optional[DecodeWorkspace] = None,
    deterministic: bool = True,
    batch_invariant: bool = False,
    out: Any = None,
    return_lse: bool = False,
    lse: Any = None,
    checked: bool = False,
    stream: Optional[int] = None,
) -> Any:
    """Decode over a KV cache sharded by blocks (C++ ``cp::sharded_decode``): this rank attends
    its shard, every rank's partial (out, lse) is all-gathered and merged in rank order, so
    every rank returns the same bits.

    q: [rows, Hq, D], the same rows on every rank. The cache as for ``attnkit.decode`` (a KvView,
    e.g. ``ShardedKvCache.view``, or k_cache / v_cache / seq_lens / block_table): this rank's
    shard, seq_lens the local lengths (0 for a row with no token here). comm: this rank's
    Communicator (None: ``attnkit.decode``). No sliding window, ALiBi or beams (they read
    absolute positions). num_splits, max_seq_len, workspace, deterministic, batch_invariant:
    the local decode's, as for ``attnkit.decode``. out: [rows, Hq, D]; lse: float32 [rows, Hq]:
    the full results. A collective: every rank calls it.
    Returns out, or (out, lse) when return_lse or lse is given.
    """
    rows, hq, d = _shape(q, "q", 3)
    view = _as_view(
        k_cache, v_cache, seq_lens, block_table, k_scale=k_scale, v_scale=v_scale,
        kv_dtype=kv_dtype,
    )
    comm = _comm(comm)
    spec = _spec(hq, view.num_kv_heads, d, softmax_scale, False, softcap, backend)
    spec.update(_mask(True, None, 0))
    options = dict(
        num_splits=int_arg(num_splits, "num_splits"),
        max_seq_len=int_arg(max_seq_len, "max_seq_len"),
        workspace=_workspace(workspace, "workspace"),
        deterministic=bool_arg(deterministic, "deterministic"),
        batch_invariant=bool_arg(batch_invariant, "batch_invariant"),
        checked=bool_arg(checked, "checked"),
        stream=_stream(q, stream),
    )
    if out is None:
        out = _empty(q, (rows, hq, d))
    if lse is None and bool_arg(return_lse, "return_lse"):
        lse = _empty(q, (rows, hq), float32=True)
    _C.cp_sharded_decode(spec, q, view._dict(), out, lse=lse, comm=comm, **options)
    return (out, lse) if lse is not None else out

