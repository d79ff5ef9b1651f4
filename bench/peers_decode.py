#!/usr/bin/env python3
"""Decode peer: PyTorch SDPA with the cuDNN backend on dense KV of the shapes of
`attnkit bench decode` (same grid, same table format).

Effective TB/s = KV bytes of the Hkv heads (bf16) / kernel time. When cuDNN takes GQA directly
(enable_gqa=True) that is what it reads; otherwise K/V are expanded to Hq heads beforehand (not
timed) and the row says "expanded": it then reads group-size times more than the bytes counted.
CUDA events around a CUDA graph of 16 calls (eager when capture fails), warm-up, median of
>= 20 samples, inputs rotated across enough buffers to defeat the
60 MB L2, random data.

Usage: python3 bench/peers_decode.py [--json] [--iters 30] [--backend cudnn|flash|efficient]
"""
import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# (batch, context, Hq, Hkv, D, page, kv dtype): page and dtype rows mirror attnkit's grid; the
# peer has no paged or fp8/int8 path, so those rows run (or are skipped) as dense bf16.
GRID = [
    (64, 4096, 32, 8, 128, 32, "bf16"),
    (128, 2048, 32, 8, 128, 32, "bf16"),
    (256, 1024, 32, 8, 128, 32, "bf16"),
    (32, 32768, 32, 8, 128, 32, "bf16"),
    (1, 32768, 32, 8, 128, 32, "bf16"),
    (64, 4096, 32, 32, 128, 32, "bf16"),
    (64, 4096, 32, 1, 128, 32, "bf16"),
]

BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def copy_bandwidth():
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(7)
    dst = torch.empty_like(src)
    times = []
    for i in range(23):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        stop.record()
        stop.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(stop) * 1e-3)
    return 2.0 * n / statistics.median(times)


def run_one(batch, context, hq, hkv, d, backend, iters):
    kv_bytes = batch * context * hkv * d * 2 * 2
    pools = max(1, min(8, (240 << 20) // kv_bytes + 1))
    q = torch.randn(batch, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    ks = [torch.randn(batch, hkv, context, d, device="cuda", dtype=torch.bfloat16) for _ in range(pools)]
    vs = [torch.randn(batch, hkv, context, d, device="cuda", dtype=torch.bfloat16) for _ in range(pools)]
    mode = "gqa"

    def call(i):
        with sdpa_kernel(BACKENDS[backend]):
            if mode == "gqa":
                return F.scaled_dot_product_attention(q, ks[i % pools], vs[i % pools],
                                                      enable_gqa=hkv != hq)
            return F.scaled_dot_product_attention(q, ks[i % pools], vs[i % pools])

    try:
        call(0)
        torch.cuda.synchronize()
    except Exception:  # cuDNN without GQA support: expand K/V to Hq heads
        mode = "expanded"
        ks = [k.repeat_interleave(hq // hkv, dim=1) for k in ks]
        vs = [v.repeat_interleave(hq // hkv, dim=1) for v in vs]
        call(0)
        torch.cuda.synchronize()
    for i in range(3):
        call(i)
    torch.cuda.synchronize()
    # A CUDA graph of 16 calls keeps PyTorch's host overhead out of the kernel time (as for
    # attnkit); eager timing is the fallback when capture fails.
    calls = 16
    run = None
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            with torch.cuda.graph(graph, stream=stream):
                for i in range(calls):
                    call(i)
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        torch.cuda.synchronize()
        run = graph.replay
        mode += "+graph"
    except Exception:
        calls = 1
        run = lambda: call(0)  # noqa: E731
    times = []
    for i in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e-3 / calls)
    del ks, vs
    torch.cuda.empty_cache()
    return statistics.median(times), kv_bytes, mode


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--backend", default="cudnn", choices=sorted(BACKENDS))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("peers_decode: no CUDA device", file=sys.stderr)
        return 1
    copy_bw = copy_bandwidth()
    rows = []
    if not args.json:
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN "
              f"{torch.backends.cudnn.version()}, measured copy bandwidth (read+write) "
              f"{copy_bw * 1e-12:.2f} TB/s")
        print(f"{'impl':<22} {'batch':>6} {'ctx':>6} {'Hq':>4} {'Hkv':>4} {'D':>4} {'page':>5} "
              f"{'kv':<9} {'splits':>6} {'time_us':>10} {'TB/s':>8} {'%copy':>7}")
    for batch, context, hq, hkv, d, page, kv in GRID:
        impl = f"sdpa-{args.backend} dense"
        try:
            seconds, kv_bytes, mode = run_one(batch, context, hq, hkv, d, args.backend, args.iters)
        except Exception as e:  # report, keep going
            print(f"{impl:<22} {batch:>6} {context:>6} {hq:>4} {hkv:>4} {d:>4}   failed: {e}")
            continue
        tbs = kv_bytes / seconds * 1e-12
        row = dict(impl=impl, mode=mode, batch=batch, context=context, q_heads=hq, kv_heads=hkv,
                   head_dim=d, kv_dtype=kv, time_us=seconds * 1e6, tb_per_s=tbs,
                   copy_fraction=kv_bytes / seconds / copy_bw)
        rows.append(row)
        if not args.json:
            label = impl if mode.startswith("gqa") else impl + "*"
            print(f"{label:<22} {batch:>6} {context:>6} {hq:>4} {hkv:>4} {d:>4} {'-':>5} "
                  f"{kv:<9} {'-':>6} {seconds * 1e6:>10.1f} {tbs:>8.3f} "
                  f"{100 * row['copy_fraction']:>6.1f}%", flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
    elif any(r["mode"].startswith("expanded") for r in rows):
        print("* K/V expanded to Hq heads (no GQA in this backend): TB/s counts the Hkv bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
