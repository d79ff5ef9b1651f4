#!/usr/bin/env python3
"""Peer prefill throughput on the grid of `attnkit bench prefill`, in the same table format.

PyTorch SDPA with the flash (FlashAttention-2) and cuDNN backends, bf16, D in {64, 128, 256},
S in {512 .. 16k}, causal and not, batch x S = 16k tokens, heads = 2048 / D. TFLOP/s counts
4 * S * S * D * H per sequence (halved for causal). CUDA events, 3 warm-up calls, median of
>= 20 timed calls, inputs rotated across 3 sets (each larger than the 60 MB L2), random data.
The torch bf16 GEMM rate (8192^3) measured in the same run gives the "% GEMM" column.

Usage: python3 bench/peers_prefill.py [--json] [--iters N] [--head-dim D] [--seqlen S]
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

TOKENS = 16384
HIDDEN = 2048
SETS = 3


def time_ms(fn, sets, iters):
    for i in range(3):
        fn(*sets[i % len(sets)])
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(max(iters, 20)):
        start.record()
        fn(*sets[i % len(sets)])
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def gemm_tflops():
    n = 8192
    sets = [(torch.rand(n, n, device="cuda", dtype=torch.bfloat16) - 0.5,
             torch.rand(n, n, device="cuda", dtype=torch.bfloat16) - 0.5) for _ in range(2)]
    ms = time_ms(lambda a, b: a @ b, sets, 20)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def grid(args):
    for d in ([args.head_dim] if args.head_dim else [64, 128, 256]):
        for causal in (False, True):
            for s in ([args.seqlen] if args.seqlen else [512, 1024, 2048, 4096, 8192, 16384]):
                yield d, s, max(1, TOKENS // s), HIDDEN // d, causal


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--head-dim", type=int, default=0)
    parser.add_argument("--seqlen", type=int, default=0)
    args = parser.parse_args()

    gemm = gemm_tflops()
    backends = [("torch-flash", SDPBackend.FLASH_ATTENTION),
                ("torch-cudnn", SDPBackend.CUDNN_ATTENTION)]
    rows = []
    if not args.json:
        print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
              f"{torch.cuda.get_device_name()}; torch bf16 GEMM 8192^3: {gemm:.1f} TFLOP/s")
        print("| impl | D | S | batch | heads | kv_heads | causal | kv | ms | TFLOP/s | % GEMM |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
    for d, s, b, h, causal in grid(args):
        # SDPA takes [B, H, S, D]; build it from [B, S, H, D] like a packed token layout.
        sets = []
        for _ in range(SETS):
            q, k, v = ((torch.rand(b, s, h, d, device="cuda", dtype=torch.bfloat16) - 0.5)
                       .transpose(1, 2) for _ in range(3))
            sets.append((q, k, v))
        flops = 4.0 * s * s * d * h * b / (2 if causal else 1)
        for name, backend in backends:
            def call(q, k, v):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            try:
                ms = time_ms(call, sets, args.iters)
                tflops = flops / (ms * 1e-3) / 1e12
            except RuntimeError as error:  # backend refuses the shape
                ms, tflops = float("nan"), float("nan")
                print(f"# {name} D={d} S={s}: {str(error).splitlines()[0]}")
            row = dict(impl=name, head_dim=d, seqlen=s, batch=b, heads=h, kv_heads=h,
                       causal=causal, kv="packed", ms=ms, tflops=tflops, gemm_tflops=gemm)
            rows.append(row)
            if not args.json:
                print(f"| {name} | {d} | {s} | {b} | {h} | {h} | {int(causal)} | packed | "
                      f"{ms:.3f} | {tflops:.1f} | {100 * tflops / gemm:.1f}% |", flush=True)
        del sets
        torch.cuda.empty_cache()
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
