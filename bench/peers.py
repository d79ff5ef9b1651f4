#!/usr/bin/env python3
"""attnkit next to its peers on the same shapes, in one run on one GPU (method: docs/bench.md).

Suites (each a grid of shapes; --quick takes a few rows of each):
  decode   paged GQA decode, TB/s of KV bytes read (bf16 cache: batch x context x Hkv x D x 2 x 2).
           Peers on dense KV of the same shape: PyTorch SDPA (cuDNN, flash) with enable_gqa,
           FlexAttention (torch.compile), FlashInfer BatchDecodeWithPagedKVCacheWrapper (paged,
           when `import flashinfer` works).
  prefill  packed context attention, TFLOP/s = 4 S^2 D H per sequence (halved when causal), on
           the grid D {64, 128, 256} x S {512 .. 16k} x causal / none, batch x S = 16k tokens,
           heads = 2048 / D. Peers: SDPA flash (FA2), cuDNN, efficient; FlexAttention.
  dense    diffusion shapes [1, S, 24, 128], no mask, S 4096 / 16384 / 32760. Peers: SDPA cuDNN,
           flash; FlexAttention.
  append   append_kv (fused QKV + RoPE + paged KV write), TB/s of bytes read + written. Peer: a
           torch copy of the same bytes (half read, half written).

attnkit's numbers come from the program itself: `attnkit bench <suite> ... --json FILE` (an older
program that only has the `--json` flag, printing a JSON array, is accepted too). The peers are
timed here with CUDA events: warm-up, median of >= 20 samples, several input sets rotated so the
60 MB L2 cannot serve them, random data; decode peers run as a CUDA graph of 16 calls (as attnkit
does), the others as back-to-back calls (>= 2 ms per sample).

Output in --out: results.json (every row, device, date, command, ceilings), peers.md (one markdown
table per suite with attnkit / best peer) and <suite>.png (matplotlib; skipped with a message when
it is missing). --render FILE rebuilds peers.md and the plots from a results.json without a GPU.

--write-docs DIR (docs/): the project's performance page. The measured suites replace their runs
in DIR/perf-results.json (one run per suite, the others kept), then DIR/performance.md (a table
per suite with the peers of the same run, the targets and the gaps) and DIR/perf-plots/<suite>.png
are written from it. With --render FILE (a results.json or a perf-results.json) no GPU is needed.

Usage: python3 bench/peers.py [--suite decode,prefill,dense,append] [--quick] [--out DIR]
                              [--attnkit-cli PATH] [--iters N] [--no-attnkit] [--render FILE]
                              [--write-docs DIR]
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

SUITES = ("decode", "prefill", "dense", "append", "fp8")
# The attnkit bench command of a suite (fp8: `attnkit bench prefill --dtype fp8_e4m3`).
BENCH_COMMAND = {"fp8": "prefill"}

# Per suite: the shape keys that identify a row (table columns, in order), their column titles,
# the metric and its unit, and how the plot groups rows (panels) and labels the x axis.
SUITE_INFO = {
    "decode": dict(
        keys=("batch", "context", "q_heads", "kv_heads", "head_dim", "page", "kv_dtype"),
        titles=("batch", "context", "Hq", "Hkv", "D", "page", "kv"),
        metric="tbps", unit="TB/s", panel=("head_dim",), plot="bar",
        x=("batch", "context", "kv_heads", "kv_dtype", "page"),
        what="paged decode: KV bytes read / time (peers on dense KV of the same shape, bf16)"),
    "prefill": dict(
        keys=("head_dim", "seqlen", "batch", "q_heads", "kv_heads", "causal", "page", "kv_dtype"),
        titles=("D", "S", "batch", "Hq", "Hkv", "causal", "page", "kv"),
        metric="tflops", unit="TFLOP/s", panel=("head_dim", "causal", "page", "kv_dtype"),
        x=("seqlen",),
        what="packed prefill: 4 S^2 D H per sequence (halved when causal) / time; page 0 = packed"),
    "dense": dict(
        keys=("batch", "seqlen", "q_heads", "head_dim"),
        titles=("batch", "S", "heads", "D"),
        metric="tflops", unit="TFLOP/s", panel=("q_heads", "head_dim"), x=("seqlen",),
        what="dense diffusion attention, no mask: 4 S^2 D H per batch element / time"),
    "fp8": dict(
        keys=("head_dim", "seqlen", "batch", "q_heads", "kv_heads", "causal", "page"),
        titles=("D", "S", "batch", "Hq", "Hkv", "causal", "page"),
        metric="tflops", unit="TFLOP/s", panel=("head_dim", "causal"), x=("seqlen", "page"),
        what="FP8 context FMHA (fp8 e4m3 q / k / v, bf16 out; page > 0: over an fp8 cache): "
             "4 S^2 D H per sequence (halved when causal) / time. SDPA has no fp8: its cuDNN and "
             "FlashAttention-2 columns run bf16; fa3-fp8 is FlashAttention-3's fp8 forward where "
             "flash_attn_interface imports"),
    "append": dict(
        keys=("tokens", "q_heads", "kv_heads", "head_dim", "page", "kv_dtype"),
        titles=("tokens", "Hq", "Hkv", "D", "page", "kv"),
        metric="tbps", unit="TB/s", panel=("head_dim",), x=("tokens", "kv_dtype"), plot="bar",
        what="append_kv: QKV read + rotated Q written + K/V written (cache dtype) / time; the "
             "peer copies the same bytes"),
}

# Column order of the implementations; others follow alphabetically.
IMPL_ORDER = ("attnkit", "sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "flex", "flashinfer",
              "fa3-fp8", "torch-copy")

TOKENS = 16384  # batch x S of the prefill grid
HIDDEN = 2048  # heads x D of the prefill grid


# ---- grids --------------------------------------------------------------------------------------


def decode_shape(batch, context, q_heads=32, kv_heads=8, head_dim=128, page=32, kv_dtype="bf16"):
    return dict(batch=batch, context=context, q_heads=q_heads, kv_heads=kv_heads,
                head_dim=head_dim, page=page, kv_dtype=kv_dtype)


def prefill_shape(head_dim, seqlen, causal):
    heads = HIDDEN // head_dim
    return dict(head_dim=head_dim, seqlen=seqlen, batch=max(1, TOKENS // seqlen), q_heads=heads,
                kv_heads=heads, causal=causal, page=0, kv_dtype="bf16")


def fp8_shape(head_dim, seqlen, causal, page=0):
    return dict(prefill_shape(head_dim, seqlen, causal), page=page)


def dense_shape(seqlen, batch, heads=24, head_dim=128):
    return dict(batch=batch, seqlen=seqlen, q_heads=heads, head_dim=head_dim)


def append_shape(tokens=16384, kv_dtype="bf16", q_heads=32, kv_heads=8, head_dim=128, page=64):
    return dict(tokens=tokens, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, page=page,
                kv_dtype=kv_dtype)


def grid(suite: str, quick: bool) -> list:
    """The shapes of a suite (the default grids; --quick: a few rows that still show the trend)."""
    if suite == "decode":
        if quick:
            return [decode_shape(64, 4096), decode_shape(1, 32768)]
        return [decode_shape(b, c) for b, c in ((64, 4096), (128, 2048), (256, 1024),
                                                 (32, 32768), (1, 32768))] + \
            [decode_shape(64, 4096, kv_heads=32), decode_shape(64, 4096, kv_heads=1)]
    if suite == "prefill":
        if quick:
            return [prefill_shape(128, s, c) for c in (False, True) for s in (2048, 8192)]
        return [prefill_shape(d, s, c) for d in (64, 128, 256) for c in (False, True)
                for s in (512, 1024, 2048, 4096, 8192, 16384)]
    if suite == "dense":
        # attnkit's grid: batch 2 at 4096 and 16384 tokens, 1 at 32760 (not a multiple of a tile).
        sizes = ((2, 4096), (1, 32760)) if quick else ((2, 4096), (2, 16384), (1, 32760))
        return [dense_shape(seqlen, batch) for batch, seqlen in sizes]
    if suite == "fp8":
        if quick:
            return [fp8_shape(128, 8192, c) for c in (False, True)]
        return [fp8_shape(d, s, c) for d in (128, 256) for c in (False, True)
                for s in (4096, 8192, 16384)] + [fp8_shape(128, 8192, c, page=64)
                                                 for c in (False, True)]
    if suite == "append":
        return [append_shape()] if quick else [append_shape(kv_dtype=k)
                                               for k in ("bf16", "fp8_e4m3", "int8")]
    raise ValueError(f"--suite: accepted {', '.join(SUITES)}; got '{suite}'")


# ---- arguments ----------------------------------------------------------------------------------


def parse_suites(text: str) -> list:
    suites = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in suites if s not in SUITES]
    if bad or not suites:
        raise argparse.ArgumentTypeError(
            f"accepted a comma-separated list of {', '.join(SUITES)}; got '{text}'")
    return list(dict.fromkeys(suites))


def default_cli() -> str:
    return os.environ.get("ATTNKIT_CLI") or os.path.join("build-gpu", "attnkit")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="peers.py", description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", type=parse_suites, default=list(SUITES),
                        help="comma-separated suites (default: all of " + ",".join(SUITES) + ")")
    parser.add_argument("--quick", action="store_true",
                        help="a few shapes per suite (about a minute on an H200)")
    parser.add_argument("--out", default="peers-out", help="output folder (default peers-out)")
    parser.add_argument("--attnkit-cli", default=None,
                        help="the attnkit program (default $ATTNKIT_CLI or build-gpu/attnkit)")
    parser.add_argument("--no-attnkit", action="store_true", help="measure the peers only")
    parser.add_argument("--iters", type=int, default=20, help="timed samples per row (>= 20)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="after this many seconds, skip FlexAttention / FlashInfer rows that "
                             "are still to come (compiles are slow); default 100 with --quick")
    parser.add_argument("--render", metavar="RESULTS_JSON", default=None,
                        help="no measurement: rebuild peers.md and the plots from a results.json")
    parser.add_argument("--write-docs", metavar="DIR", default=None,
                        help="also write DIR/performance.md, DIR/perf-results.json and "
                             "DIR/perf-plots/ (the measured suites replace theirs)")
    args = parser.parse_args(argv)
    if args.iters < 20:
        parser.error(f"--iters: at least 20 (median of >= 20 samples); got {args.iters}")
    if args.attnkit_cli is None:
        args.attnkit_cli = default_cli()
    if args.budget_s is None:
        args.budget_s = 100.0 if args.quick else 0.0
    return args


# ---- attnkit rows: run the program, read its JSON ----------------------------------------------

_ALIASES = {
    "heads": "q_heads", "num_heads": "q_heads", "hq": "q_heads", "seq_len": "seqlen",
    "kv": "kv_layout", "ms": "time_ms", "tb_per_s": "tbps",
}


def _parse_kv_layout(text: str) -> tuple:
    """Old prefill rows say kv "packed" or "paged64-fp8_e4m3": (page, kv_dtype)."""
    if text.startswith("paged"):
        page, _, dtype = text[len("paged"):].partition("-")
        return int(page or 0), dtype or "bf16"
    return 0, "bf16"


def normalize_row(suite: str, row: dict) -> dict:
    """One attnkit JSON row (new or old schema) in the keys of SUITE_INFO[suite]."""
    out = {}
    for key, value in row.items():
        out[_ALIASES.get(key, key)] = value
    if "time_ms" not in out and "time_us" in out:
        out["time_ms"] = out["time_us"] * 1e-3
    out.pop("time_us", None)
    out.setdefault("impl", "attnkit")
    # Variants of attnkit (dense: skip_softmax, sage_int8, ...; another backend) get their own
    # column; "attnkit" is the plain fused one that the ratio compares.
    variant, backend = out.get("variant"), out.get("backend")
    if out["impl"] == "attnkit":
        if variant not in (None, "", "default"):
            out["impl"] = f"attnkit-{variant}"
        if backend not in (None, "", "fused", "auto") and backend not in out["impl"]:
            out["impl"] += f"-{backend}"
    if suite == "fp8":
        out["page"] = int(out.get("page") or 0)
        out["causal"] = bool(out.get("causal", False))
        out.setdefault("kv_heads", out.get("q_heads"))
    if suite == "prefill":
        layout = out.pop("kv_layout", None)
        if layout is not None and "page" not in out:
            out["page"], out["kv_dtype"] = _parse_kv_layout(str(layout))
        out["page"] = int(out.get("page") or 0)
        out.setdefault("kv_dtype", "bf16")
        out["causal"] = bool(out.get("causal", False))
        out.setdefault("kv_heads", out.get("q_heads"))
    elif suite == "dense":
        out.setdefault("batch", 1)
    out.setdefault("suite", suite)
    for key in SUITE_INFO[suite]["keys"]:
        if key in out and isinstance(out[key], float) and out[key].is_integer():
            out[key] = int(out[key])
    return out


def load_attnkit_json(suite: str, text: str) -> dict:
    """attnkit's JSON (the object {"subcommand", "device", "date", "ceilings", "rows"} or the old
    bare array of rows) as {"rows": [normalized rows], "device": ..., "ceilings": ...}."""
    data = json.loads(text)
    meta = {}
    if isinstance(data, dict):
        rows = data.get("rows", [])
        meta = {k: data[k] for k in ("device", "date", "ceilings", "subcommand") if k in data}
    elif isinstance(data, list):
        rows = data
    else:
        raise ValueError(f"attnkit JSON: expected an object with 'rows' or an array, got "
                         f"{type(data).__name__}")
    return dict(rows=[normalize_row(suite, r) for r in rows], **meta)


def _json_in_stdout(text: str) -> str:
    """The JSON document in a program's stdout, which may carry progress lines before it."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith(("[", "{")):
            return "\n".join(lines[i:])
    raise ValueError("no JSON in the output")


def cli_shape_args(suite: str, shape: dict, quick: bool = False) -> list:
    """The attnkit bench options that select one shape (dense: the plain variant, and without
    --quick also skip-softmax and SAGE, each an impl column of its own)."""
    if suite == "decode":
        pairs = [("--batch", "batch"), ("--context", "context"), ("--q-heads", "q_heads"),
                 ("--kv-heads", "kv_heads"), ("--head-dim", "head_dim"), ("--page", "page"),
                 ("--kv-dtype", "kv_dtype")]
    elif suite in ("prefill", "fp8"):
        pairs = [("--batch", "batch"), ("--seqlen", "seqlen"), ("--heads", "q_heads"),
                 ("--kv-heads", "kv_heads"), ("--head-dim", "head_dim")]
    elif suite == "dense":
        pairs = [("--batch", "batch"), ("--seqlen", "seqlen"), ("--heads", "q_heads"),
                 ("--head-dim", "head_dim")]
    else:
        pairs = [("--tokens", "tokens"), ("--q-heads", "q_heads"), ("--kv-heads", "kv_heads"),
                 ("--head-dim", "head_dim"), ("--page", "page")]
    args = []
    for flag, key in pairs:
        args += [flag, str(shape[key])]
    if suite == "prefill":
        if shape.get("causal"):
            args.append("--causal")
        if shape.get("page"):
            args += ["--page", str(shape["page"]), "--kv-dtype", shape["kv_dtype"]]
    if suite == "fp8":
        args += ["--dtype", "fp8_e4m3"]
        if shape.get("causal"):
            args.append("--causal")
        if shape.get("page"):
            args += ["--page", str(shape["page"]), "--kv-dtype", "fp8_e4m3"]
    if suite == "append":
        args += ["--kv-dtype", shape["kv_dtype"]]
    if suite == "dense":
        args += ["--variants", "default" if quick else "default,skip_softmax,sage_int8,sage_fp8"]
    return args


def _first_error_line(text: str) -> str:
    """The line of a failed run that says why (CLI11 ends with "Run with --help ...")."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("Run with --help")] or lines
    return lines[0][:200] if lines else "no output"


def run_attnkit(cli: str, suite: str, extra: list, timeout: float = 600) -> dict:
    """Runs `attnkit bench <suite> <extra> --json FILE` (then the old `--json` flag) and returns
    load_attnkit_json's dict, or {"rows": [], "error": why}."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "attnkit.json")
        command = BENCH_COMMAND.get(suite, suite)
        attempts = [[cli, "bench", command, *extra, "--json", path],
                    [cli, "bench", command, *extra, "--json"]]
        errors = []
        for cmd in attempts:
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            except (OSError, subprocess.TimeoutExpired) as error:
                return dict(rows=[], error=f"{shlex.join(cmd)}: {error}")
            if proc.returncode == 0:
                try:
                    if cmd[-1] == path:
                        with open(path) as f:
                            result = load_attnkit_json(suite, f.read())
                    else:
                        result = load_attnkit_json(suite, _json_in_stdout(proc.stdout))
                    result["command"] = shlex.join(cmd)
                    return result
                except (OSError, ValueError) as error:
                    errors.append(f"{shlex.join(cmd)}: unreadable JSON ({error})")
                    continue
            errors.append(f"{shlex.join(cmd)}: rc={proc.returncode}: "
                          f"{_first_error_line(proc.stderr or proc.stdout)}")
        return dict(rows=[], error=" | ".join(errors))


def same_shape(suite: str, a: dict, b: dict) -> bool:
    """True when b agrees with a on every shape key that both give (None = any)."""
    for key in SUITE_INFO[suite]["keys"]:
        va, vb = a.get(key), b.get(key)
        if va is not None and vb is not None and va != vb:
            return False
    return True


def attnkit_rows(cli: str, suite: str, shapes: list, quick: bool = False, log=print) -> tuple:
    """attnkit's rows for the shapes (one program run per shape; when the program does not take
    the shape options, one run of its default grid). Returns (rows, meta, notes)."""
    rows, notes, meta = [], [], {}
    failed, measured = [], []
    for shape in shapes:
        # --no-ceilings: the ceilings' 8192^3 GEMMs right before a short measurement lowered the
        # kernel's rate by 3-13% on the H200 (prefill S=512/1k); they are measured in
        # one more run after the rows.
        result = run_attnkit(cli, suite, cli_shape_args(suite, shape, quick) + ["--no-ceilings"],
                             timeout=180)
        if result.get("error"):
            failed.append((shape, result["error"]))
            continue
        measured.append(shape)
        meta = {k: v for k, v in result.items() if k != "rows"} or meta
        got = [r for r in result["rows"] if same_shape(suite, shape, r)] or result["rows"]
        rows += got
        metric = SUITE_INFO[suite]["metric"]
        log(f"  {'attnkit':<15} {shape_label(suite, shape)}: " + ", ".join(
            f"{r['impl']} {r[metric]:.3f}" if r.get(metric) is not None
            else f"{r['impl']} {r.get('note', '-')}" for r in got))
    if failed and len(failed) == len(shapes):
        result = run_attnkit(cli, suite, [])
        if result.get("error"):
            notes.append(f"attnkit bench {suite}: {result['error']}")
            for shape, _ in failed:
                rows.append(dict(shape, suite=suite, impl="attnkit", note="not measured"))
            return rows, meta, notes
        notes.append(f"attnkit bench {suite}: the shape options failed ({failed[0][1]}); "
                     "its default grid was run instead")
        meta = {k: v for k, v in result.items() if k != "rows"}
        return result["rows"], meta, notes
    if measured:
        # The ceilings (and the device) of the report: the first measured shape once more, its
        # rows not kept.
        result = run_attnkit(cli, suite, cli_shape_args(suite, measured[0], quick), timeout=180)
        if not result.get("error"):
            meta = {k: v for k, v in result.items() if k != "rows"} or meta
    for shape, error in failed:
        notes.append(f"attnkit {suite} {shape_label(suite, shape)}: {error}")
        rows.append(dict(shape, suite=suite, impl="attnkit", note="failed"))
    return rows, meta, notes


# ---- tables ---------------------------------------------------------------------------------------


def shape_label(suite: str, shape: dict) -> str:
    info = SUITE_INFO[suite]
    return " ".join(f"{t}={shape.get(k)}" for k, t in zip(info["keys"], info["titles"])
                    if shape.get(k) is not None)


def _impl_rank(impl: str) -> tuple:
    return (IMPL_ORDER.index(impl) if impl in IMPL_ORDER else len(IMPL_ORDER), impl)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _metric_text(value, unit: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.2f}" if unit == "TB/s" else f"{value:.0f}"


def table_rows(suite: str, rows: list) -> tuple:
    """Groups the rows of a suite by shape: (impls, [(shape, {impl: row})]). attnkit rows define
    the shapes; a peer row (whose None keys match anything) joins every shape it agrees with, or
    gets its own line."""
    keys = SUITE_INFO[suite]["keys"]
    shapes = []  # [(shape dict, {impl: row})]

    def find(row, exact):
        hits = []
        for shape, cells in shapes:
            if exact and all(shape.get(k) == row.get(k) for k in keys):
                hits.append(cells)
            elif not exact and same_shape(suite, shape, row):
                hits.append(cells)
        return hits

    mine = [r for r in rows if r.get("suite", suite) == suite]
    for row in (r for r in mine if str(r.get("impl", "")).startswith("attnkit")):
        hit = find(row, exact=True)
        if hit:
            hit[0][row["impl"]] = row
        else:
            shapes.append(({k: row.get(k) for k in keys}, {row["impl"]: row}))
    for row in (r for r in mine if not str(r.get("impl", "")).startswith("attnkit")):
        hits = find(row, exact=False)
        if not hits:
            shapes.append(({k: row.get(k) for k in keys}, {}))
            hits = [shapes[-1][1]]
        for cells in hits:
            cells.setdefault(row["impl"], row)
    impls = sorted({impl for _, cells in shapes for impl in cells}, key=_impl_rank)
    return impls, shapes


def best_peer(cells: dict, metric: str) -> tuple:
    best = (None, None)
    for impl, row in cells.items():
        value = row.get(metric)
        if impl.startswith("attnkit") or value is None or not math.isfinite(value):
            continue
        if best[1] is None or value > best[1]:
            best = (impl, value)
    return best


def markdown_table(suite: str, rows: list) -> str:
    """One markdown table: the shape columns, one column per impl ("-": not measured, see the
    notes), and attnkit / best peer."""
    info = SUITE_INFO[suite]
    metric, unit = info["metric"], info["unit"]
    impls, shapes = table_rows(suite, rows)
    if not shapes:
        return f"(no {suite} rows)\n"
    head = list(info["titles"]) + [f"{i} {unit}" for i in impls] + ["attnkit / best peer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for shape, cells in shapes:
        line = [_cell(shape.get(k)) for k in info["keys"]]
        line += [_metric_text(cells[i].get(metric), unit) if i in cells else "-" for i in impls]
        mine = cells.get("attnkit", {}).get(metric)
        peer, value = best_peer(cells, metric)
        if mine is not None and value:
            line.append(f"{mine / value:.2f} ({peer})")
        else:
            line.append("-")
        lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines) + "\n"


def row_notes(suite: str, rows: list) -> list:
    out = []
    for row in rows:
        if row.get("suite", suite) == suite and row.get("note"):
            out.append(f"{row.get('impl')} ({shape_label(suite, row)}): {row['note']}")
    return out


def render_markdown(results: dict) -> str:
    """peers.md: a header (date, device, command, ceilings) and one table per suite."""
    device = results.get("device", {})
    ceilings = results.get("ceilings", {})
    out = ["# attnkit and its peers", ""]
    out.append(f"- date: {results.get('date', '?')}")
    out.append(f"- device: {device.get('name', '?')}; torch {device.get('torch', '?')}, cuDNN "
               f"{device.get('cudnn', '?')}, FlashInfer {device.get('flashinfer') or 'not importable'}")
    out.append(f"- command: `{results.get('command', '?')}`")
    if ceilings:
        out.append("- ceilings measured in the same run: " + ", ".join(
            f"{k} {v:.2f}" if isinstance(v, (int, float)) else f"{k} {v}"
            for k, v in sorted(ceilings.items())))
    out.append("")
    for suite in results.get("suites", SUITES):
        info = SUITE_INFO[suite]
        out.append(f"## {suite} ({info['unit']})")
        out.append("")
        out.append(info["what"] + ".")
        out.append("")
        out.append(markdown_table(suite, results.get("rows", [])))
        notes = row_notes(suite, results.get("rows", []))
        notes += [n for n in results.get("notes", []) if n.startswith(f"attnkit {suite}")
                  or n.startswith(f"attnkit bench {suite}")]
        if notes:
            out.append("Notes:")
            out += [f"- {n}" for n in notes]
            out.append("")
    other = [n for n in results.get("notes", [])
             if not any(n.startswith(f"attnkit {s}") or n.startswith(f"attnkit bench {s}")
                        for s in SUITES)]
    if other:
        out.append("## Notes")
        out.append("")
        out += [f"- {n}" for n in other]
        out.append("")
    return "\n".join(out)


def write_plots(results: dict, out_dir: str, log=print, dpi: int = 110, max_cols: int = 0) -> list:
    """One PNG per suite: the metric against the x keys, one line per impl, one panel per group
    (max_cols > 0: at most that many panels a row)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib: not importable, writing the markdown only")
        return []
    written = []
    for suite in results.get("suites", SUITES):
        info = SUITE_INFO[suite]
        impls, shapes = table_rows(suite, results.get("rows", []))
        if not shapes:
            continue
        panels = {}
        for shape, cells in shapes:
            panels.setdefault(tuple(shape.get(k) for k in info["panel"]), []).append((shape, cells))
        cols = min(len(panels), max_cols) if max_cols > 0 else len(panels)
        rows_n = (len(panels) + cols - 1) // cols
        # Bars need room per shape; lines fit any count.
        most = max(len(m) for m in panels.values())
        panel_width = max(4.5, 0.5 * most + 1.5) if info.get("plot") == "bar" else 4.5
        fig, axes = plt.subplots(rows_n, cols, figsize=(panel_width * cols + 1.5, 3.6 * rows_n + 0.4),
                                 squeeze=False)
        flat = [ax for line in axes for ax in line]
        for ax in flat[len(panels):]:
            ax.axis("off")
        for ax, (panel, members) in zip(flat, panels.items()):
            labels = ["/".join(_cell(s.get(k)) for k in info["x"]) for s, _ in members]
            series = []
            for impl in impls:
                ys = [c[impl].get(info["metric"]) if impl in c else None for _, c in members]
                ys = [float("nan") if y is None else y for y in ys]
                if not all(math.isnan(y) for y in ys):
                    series.append((impl, ys))
            # Shapes without an order (decode, append) as grouped bars; S sweeps as lines.
            width = 0.8 / max(1, len(series))
            for n, (impl, ys) in enumerate(series):
                color = f"C{impls.index(impl) % 10}"  # one color per impl in every panel
                if info.get("plot") == "bar":
                    ax.bar([i - 0.4 + width * (n + 0.5) for i in range(len(labels))], ys, width,
                           label=impl, color=color)
                else:
                    ax.plot(range(len(labels)), ys, marker="o", label=impl, color=color)
            ax.set_xticks(range(len(labels)))
            ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
            ax.set_title(", ".join(f"{k}={_cell(v)}" for k, v in zip(info["panel"], panel)),
                         fontsize=9)
            ax.set_xlabel("/".join(info["x"]))
            ax.set_ylabel(info["unit"])
            ax.grid(alpha=0.3)
            ax.set_ylim(bottom=0)
        legend = {}
        for ax in flat:
            for handle, label in zip(*ax.get_legend_handles_labels()):
                legend.setdefault(label, handle)
        axes[0][cols - 1].legend(list(legend.values()), list(legend.keys()), fontsize=8,
                                 loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.suptitle(f"{suite}: {results.get('device', {}).get('name', '')} "
                     f"{results.get('date', '')}", fontsize=10)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{suite}.png")
        fig.savefig(path, dpi=dpi, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written


def write_outputs(results: dict, out_dir: str, log=print, plots: bool = True) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(os.path.join(out_dir, "peers.md"), "w") as f:
        f.write(render_markdown(results))
    if plots:
        write_plots(results, out_dir, log=log)


def merge_meta(results: dict, meta: dict) -> None:
    """Takes the device description and ceilings of attnkit's JSON into the results."""
    for key, value in (meta.get("ceilings") or {}).items():
        results["ceilings"][f"attnkit {key}"] = value
    if isinstance(meta.get("device"), dict):
        results["device"].setdefault("attnkit", meta["device"])


# ---- the performance page (docs/performance.md) -------------------------------------------------

DOCS_RESULTS = "perf-results.json"  # in the docs folder: one run per suite, what the page shows
DOCS_PAGE = "performance.md"
DOCS_PLOTS = "perf-plots"  # <suite>.png beside the page

SUITE_TITLES = {"prefill": "Prefill", "fp8": "FP8 prefill", "dense": "Dense (diffusion)",
                "decode": "Decode", "append": "append_kv"}
DOCS_ORDER = ("prefill", "fp8", "dense", "decode", "append")
PEER_NAMES = {"sdpa-cudnn": "cuDNN", "sdpa-flash": "FA2", "sdpa-efficient": "SDPA efficient",
              "flex": "FlexAttention", "flashinfer": "FlashInfer", "torch-copy": "copy"}


def docs_results(results: dict, existing: dict = None) -> dict:
    """The page's results: `existing` ({"runs": {suite: run}}) with each suite of `results` (a
    peers results.json, or another page results) replacing that suite's run. A run is the header
    of the measurement (date, command, device, ceilings, notes) with its own suite's rows."""
    runs = dict((existing or {}).get("runs", {}))
    if "runs" in results:
        runs.update(results["runs"])
        return {"runs": runs}
    for suite in results.get("suites", SUITES):
        rows = [r for r in results.get("rows", []) if r.get("suite", suite) == suite]
        if not rows:
            continue
        run = {k: results[k] for k in ("date", "command", "seed", "device", "ceilings")
               if k in results}
        run["notes"] = [n for n in results.get("notes", [])
                        if not any(n.startswith(f"attnkit {s}") or n.startswith(f"attnkit bench {s}")
                                   for s in SUITES if s != suite)]
        run["suites"] = [suite]
        run["rows"] = rows
        runs[suite] = run
    return {"runs": runs}


def _ratio(cells: dict, impl: str, metric: str):
    mine = cells.get("attnkit", {}).get(metric)
    other = cells.get(impl, {}).get(metric)
    return mine / other if mine is not None and other else None


def _cells_of(shapes: list, shape: dict, **changes) -> dict:
    want = dict(shape, **changes)
    for other, cells in shapes:
        if all(other.get(k) == v for k, v in want.items()):
            return cells
    return {}


def row_targets(suite: str, shape: dict, cells: dict, shapes: list) -> list:
    """The targets of one row: [(what, achieved, goal)] with achieved and goal as ratios (or
    rates, for an absolute target); achieved None when the row or its yardstick is missing. The
    targets are the project's performance contract on one H200 (docs/bench.md); a row without
    one is reported only."""
    metric = SUITE_INFO[suite]["metric"]
    out = []
    if suite == "decode":
        bits8 = shape.get("kv_dtype") in ("fp8_e4m3", "int8")
        gqa = (shape.get("q_heads"), shape.get("kv_heads"), shape.get("head_dim")) == (32, 8, 128)
        batch = shape.get("batch") or 0
        if not gqa:
            return out
        if not bits8 and shape.get("page") == 32 and (batch >= 32 or batch == 1):
            out.append((">= 1.00x cuDNN", _ratio(cells, "sdpa-cudnn", metric), 1.0))
        elif not bits8 and shape.get("page") != 32:
            base = _cells_of(shapes, shape, page=32).get("attnkit", {}).get(metric)
            mine = cells.get("attnkit", {}).get(metric)
            out.append((">= 0.95x page 32", mine / base if mine and base else None, 0.95))
        elif bits8:
            base = _cells_of(shapes, shape, kv_dtype="bf16").get("attnkit", {}).get(metric)
            mine = cells.get("attnkit", {}).get(metric)
            ratio = mine / base if mine and base else None
            if batch >= 32:
                out.append((">= 0.97x bf16's TB/s", ratio, 0.97))
            elif batch == 1:
                # Half the bytes a token: tokens/s ratio = 2 x the TB/s ratio.
                out.append((">= 1.6x bf16's tokens/s", 2 * ratio if ratio else None, 1.6))
    elif suite == "prefill":
        d, s, causal, page = (shape.get("head_dim"), shape.get("seqlen") or 0,
                              shape.get("causal"), shape.get("page") or 0)
        if page:
            base = _cells_of(shapes, shape, page=0, kv_dtype="bf16").get("attnkit", {})
            mine = cells.get("attnkit", {}).get(metric)
            out.append((">= 0.90x packed", mine / base[metric]
                        if mine and base.get(metric) else None, 0.9))
            return out
        if s <= 2048:
            out.append((">= 0.95x cuDNN", _ratio(cells, "sdpa-cudnn", metric), 0.95))
        elif d == 128:
            out.append((">= 1.05x cuDNN", _ratio(cells, "sdpa-cudnn", metric), 1.05))
            if s == 16384 and not causal:
                out.append((">= 700 TFLOP/s", cells.get("attnkit", {}).get(metric), 700.0))
        elif s >= 4096:
            out.append((">= 1.00x cuDNN", _ratio(cells, "sdpa-cudnn", metric), 1.0))
    elif suite == "fp8":
        d, s, page = shape.get("head_dim"), shape.get("seqlen") or 0, shape.get("page") or 0
        mine = cells.get("attnkit", {}).get(metric)
        if page:
            base = _cells_of(shapes, shape, page=0).get("attnkit", {}).get(metric)
            out.append((">= 0.90x packed", mine / base if mine and base else None, 0.9))
        elif s >= 4096:
            goal = 1100.0 if d == 256 else 1000.0
            out.append((f">= {goal:.0f} TFLOP/s", mine, goal))
    elif suite == "dense":
        out.append((">= 1.05x cuDNN", _ratio(cells, "sdpa-cudnn", metric), 1.05))
    elif suite == "append":
        out.append((">= 0.85x a copy of the bytes", _ratio(cells, "torch-copy", metric), 0.85))
    return out


def target_text(targets: list) -> str:
    """One cell: each target with the row's value and its gap (met, or how far below)."""
    parts = []
    for what, achieved, goal in targets:
        if achieved is None:
            parts.append(f"{what}: not measured")
            continue
        value = f"{achieved:.0f}" if goal >= 100 else f"{achieved:.2f}x"
        gap = (achieved / goal - 1.0) * 100
        if gap >= -0.05:
            parts.append(f"{what}: {value}, met")
        else:  # one decimal for gaps under 10%
            parts.append(f"{what}: {value}, gap {gap:.1f}%" if round(gap, 1) > -10 else
                         f"{what}: {value}, gap {gap:.0f}%")
    return "; ".join(parts) if parts else "reported"


def docs_table(suite: str, rows: list) -> str:
    """The page's table of a suite: shape columns that vary, one column per implementation, attnkit
    / best peer, and the targets with their gaps."""
    info = SUITE_INFO[suite]
    metric, unit = info["metric"], info["unit"]
    impls, shapes = table_rows(suite, rows)
    if not shapes:
        return f"(no {suite} rows)\n"
    keys = [(k, t) for k, t in zip(info["keys"], info["titles"])
            if len({_cell(s.get(k)) for s, _ in shapes}) > 1]
    constant = [(t, _cell(shapes[0][0].get(k))) for k, t in zip(info["keys"], info["titles"])
                if (k, t) not in keys]
    head = [t for _, t in keys] + [f"{PEER_NAMES.get(i, i)} {unit}" for i in impls]
    head += ["attnkit / best peer", "target: gap"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for shape, cells in shapes:
        line = [_cell(shape.get(k)) for k, _ in keys]
        line += [_metric_text(cells[i].get(metric), unit) if i in cells else "-" for i in impls]
        mine = cells.get("attnkit", {}).get(metric)
        peer, value = best_peer(cells, metric)
        line.append(f"{mine / value:.2f} ({PEER_NAMES.get(peer, peer)})" if mine is not None and
                    value else "-")
        line.append(target_text(row_targets(suite, shape, cells, shapes)))
        lines.append("| " + " | ".join(line) + " |")
    text = ""
    if constant:
        text = "Every row: " + ", ".join(f"{t} {v}" for t, v in constant) + ".\n\n"
    return text + "\n".join(lines) + "\n"


def _cudnn_text(version) -> str:
    if isinstance(version, int) and version > 10000:  # 91900 -> 9.19.0
        return f"{version // 10000}.{version // 100 % 100}.{version % 100}"
    return _cell(version)


def run_header(suite: str, run: dict) -> list:
    device = run.get("device", {})
    ak = device.get("attnkit") or {}
    gpu = device.get("name", "?")
    if ak.get("sms"):
        gpu += f" ({ak['sms']} SMs, sm {ak.get('cc', '?')})"
    date = str(run.get("date", "?"))[:10]  # the day of an ISO 8601 time
    out = [f"- measured: {date}, {gpu}, driver {device.get('driver') or '?'}, "
           f"CUDA {device.get('cuda') or '?'}; peers: torch {device.get('torch', '?')}, cuDNN "
           f"{_cudnn_text(device.get('cudnn'))}, FlashInfer "
           f"{device.get('flashinfer') or 'not installed'}",
           f"- by: `{run.get('command', '?')}`"]
    ceilings = run.get("ceilings") or {}
    if ceilings:
        out.append("- ceilings of the same run: " + ", ".join(
            f"{k} {v:.2f}" for k, v in sorted(ceilings.items()) if isinstance(v, (int, float))))
    out.append(f"- regenerate: `python3 bench/peers.py --suite {suite} --attnkit-cli "
               f"build-gpu/attnkit --write-docs docs/`")
    return out


def grouped_notes(suite: str, run: dict) -> list:
    """The run's notes for the page, identical row notes of one implementation counted once."""
    counts = {}
    for row in run.get("rows", []):
        if row.get("note"):
            key = f"{PEER_NAMES.get(row.get('impl'), row.get('impl'))}: {row['note']}"
            counts[key] = counts.get(key, 0) + 1
    out = [f"{k} ({n} rows)" if n > 1 else k for k, n in counts.items()]
    return out + [n for n in run.get("notes", []) if not n.startswith("flashinfer")]


def _wrap(text: str, bullet: bool = False) -> str:
    """Markdown prose at 100 columns (a "- " item continues two spaces in)."""
    import textwrap

    return textwrap.fill(text, width=100, subsequent_indent="  " if bullet else "",
                         break_on_hyphens=False, break_long_words=False)


def render_performance_page(docs: dict, plots: dict = None) -> str:
    """docs/performance.md from the page's results (docs_results): one section per suite with its
    run's header, the table with targets and gaps, and the plot (plots: {suite: relative path})."""
    runs = docs.get("runs", {})
    plots = plots or {}
    intro = (
        "attnkit next to the peers measured in the same run on the same GPU, one table per "
        "workload family. This page is generated by `bench/peers.py --write-docs docs/` from "
        f"`docs/{DOCS_RESULTS}` (one run per family): do not edit it by hand. Method "
        "(docs/bench.md): CUDA events, warm-up, the median of at least 20 samples, inputs rotated "
        "across buffers larger than the L2, random data; decode timed as a CUDA graph of 16 "
        "calls. Peers: PyTorch SDPA's cuDNN, flash (FA2) and memory-efficient backends, "
        "FlexAttention (torch.compile), and FlashInfer where it is installed. Targets: the "
        "project's performance goals on one H200; a gap is how far a row is below its target.")
    out = ["# Performance", "", _wrap(intro), "",
           _wrap("Regenerate every family on a machine with a GPU, PyTorch and a CUDA build of "
                 "attnkit (`scripts/gpu_check.sh` builds one into `build-gpu/`):"), "",
           "```sh",
           "python3 bench/peers.py --attnkit-cli build-gpu/attnkit --write-docs docs/",
           "```", "",
           _wrap("`--suite decode` (or any list) measures and replaces only those families; "
                 f"`python3 bench/peers.py --render docs/{DOCS_RESULTS} --write-docs docs/` "
                 "re-renders the page and the plots without a GPU."), ""]
    for suite in [s for s in DOCS_ORDER if s in runs]:
        run = runs[suite]
        info = SUITE_INFO[suite]
        out += [f"## {SUITE_TITLES[suite]}", "", _wrap(info["what"][0].upper() + info["what"][1:]
                                                       + "."), ""]
        # Commands stay on one line, to copy.
        out += [line if "`" in line else _wrap(line, bullet=True)
                for line in run_header(suite, run)] + [""]
        out.append(docs_table(suite, run.get("rows", [])))
        if suite in plots:
            out += [f"![{suite}]({plots[suite]})", ""]
        notes = grouped_notes(suite, run)
        if notes:
            out += ["Notes:", ""] + [_wrap(f"- {n}", bullet=True) for n in notes] + [""]
    return "\n".join(out).rstrip() + "\n"


def write_docs(results: dict, docs_dir: str, log=print) -> dict:
    """Merges `results` into docs_dir/perf-results.json and writes docs_dir/performance.md and the
    plots docs_dir/perf-plots/<suite>.png (small: 64 dpi, three panels a row). Returns the page's
    results."""
    path = os.path.join(docs_dir, DOCS_RESULTS)
    existing = None
    if os.path.exists(path):
        with open(path) as f:
            existing = json.load(f)
    docs = docs_results(results, existing)
    os.makedirs(docs_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump(docs, f, indent=1, default=str)
        f.write("\n")
    plots = {}
    plot_dir = os.path.join(docs_dir, DOCS_PLOTS)
    for suite, run in docs["runs"].items():
        os.makedirs(plot_dir, exist_ok=True)
        written = write_plots(dict(run, suites=[suite]), plot_dir, log=log, dpi=64, max_cols=3)
        if written:
            plots[suite] = f"{DOCS_PLOTS}/{suite}.png"
        elif os.path.exists(os.path.join(plot_dir, f"{suite}.png")):
            plots[suite] = f"{DOCS_PLOTS}/{suite}.png"  # no matplotlib here: keep the last plot
    with open(os.path.join(docs_dir, DOCS_PAGE), "w") as f:
        f.write(render_performance_page(docs, plots))
    log(f"peers.py: wrote {os.path.join(docs_dir, DOCS_PAGE)}, {path} and {len(plots)} plots")
    return docs


def driver_version():
    """The NVIDIA driver's version (nvidia-smi), or None."""
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = proc.stdout.strip().splitlines()
    return lines[0].strip() if proc.returncode == 0 and lines else None


# ---- peers (torch; imported only when measuring) -----------------------------------------------


class Peers:
    """The peer implementations, timed on the GPU."""

    def __init__(self, iters: int, budget_s: float, start: float, log=print):
        import torch

        self.torch = torch
        self.iters = iters
        self.budget_s = budget_s
        self.start = start
        self.log = log
        try:
            import torch._dynamo

            for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                         "accumulated_recompile_limit"):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, 4096)
        except Exception:  # noqa: BLE001 - older torch: keep the defaults
            pass
        self._flex = None
        self._flex_error = None
        try:
            import flashinfer

            self.flashinfer = flashinfer
        except Exception as error:  # noqa: BLE001 - any import failure means "not there"
            self.flashinfer = None
            log(f"flashinfer: not importable ({type(error).__name__})")

    def over_budget(self) -> bool:
        return self.budget_s > 0 and time.monotonic() - self.start > self.budget_s

    def flex(self):
        if self._flex is None and self._flex_error is None:
            try:
                from torch.nn.attention.flex_attention import flex_attention

                self._flex = self.torch.compile(flex_attention, dynamic=False)
            except Exception as error:  # noqa: BLE001
                self._flex_error = f"FlexAttention unavailable: {error}"
        if self._flex is None:
            raise RuntimeError(self._flex_error)
        return self._flex

    # -- timing -----------------------------------------------------------------------------------

    def events(self):
        cuda = self.torch.cuda
        return cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)

    def time_eager(self, call, sets: int) -> float:
        """Median ms per call over >= 20 samples of back-to-back calls (>= 2 ms per sample)."""
        torch = self.torch
        for i in range(3):
            call(i % sets)
        torch.cuda.synchronize()
        start, stop = self.events()
        start.record()
        call(0)
        stop.record()
        stop.synchronize()
        per_sample = max(1, min(64, math.ceil(2.0 / max(start.elapsed_time(stop), 1e-3))))
        times, k = [], 0
        for _ in range(self.iters):
            start.record()
            for _ in range(per_sample):
                call(k % sets)
                k += 1
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / per_sample)
        return statistics.median(times)

    def time_graph(self, call, sets: int) -> tuple:
        """Median ms per call of a CUDA graph of 16 calls (host overhead out, as in attnkit's
        decode bench); eager timing when capture fails. Returns (ms, mode)."""
        torch = self.torch
        for i in range(3):
            call(i % sets)
        torch.cuda.synchronize()
        calls = 16
        try:
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                with torch.cuda.graph(graph, stream=stream):
                    for i in range(calls):
                        call(i % sets)
            torch.cuda.current_stream().wait_stream(stream)
            graph.replay()
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - graph capture not supported by this call
            torch.cuda.synchronize()
            return self.time_eager(call, sets), "eager"
        start, stop = self.events()
        times = []
        for _ in range(self.iters):
            start.record()
            graph.replay()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / calls)
        del graph
        return statistics.median(times), "graph"

    def ceilings(self) -> dict:
        torch = self.torch
        n = 1 << 30
        src = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(7)
        dst = torch.empty_like(src)
        copy_ms = self.time_eager(lambda i: dst.copy_(src), 1)
        size = 8192
        mats = [(torch.randn(size, size, device="cuda", dtype=torch.bfloat16),
                 torch.randn(size, size, device="cuda", dtype=torch.bfloat16)) for _ in range(2)]
        gemm_ms = self.time_eager(lambda i: mats[i][0] @ mats[i][1], 2)
        out = {"torch copy_tbps": 2.0 * n / (copy_ms * 1e-3) / 1e12,
               "torch gemm_bf16_tflops": 2.0 * size ** 3 / (gemm_ms * 1e-3) / 1e12}
        try:  # the fp8 GEMM ceiling (torch._scaled_mm, e4m3 x e4m3 -> bf16)
            one = torch.ones((), device="cuda")
            f8 = [(a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t())
                  for a, b in mats]
            fp8_ms = self.time_eager(lambda i: torch._scaled_mm(
                f8[i][0], f8[i][1], scale_a=one, scale_b=one, out_dtype=torch.bfloat16), 2)
            out["torch gemm_fp8_tflops"] = 2.0 * size ** 3 / (fp8_ms * 1e-3) / 1e12
        except Exception as error:  # noqa: BLE001 - an older torch: no fp8 ceiling
            self.log(f"fp8 GEMM ceiling: {type(error).__name__}")
        torch.cuda.empty_cache()
        return out

    def device(self) -> dict:
        torch = self.torch
        return dict(name=torch.cuda.get_device_name(), torch=torch.__version__,
                    cudnn=torch.backends.cudnn.version(), cuda=torch.version.cuda,
                    driver=driver_version(),
                    flashinfer=getattr(self.flashinfer, "__version__", None)
                    if self.flashinfer else None)

    # -- suites -----------------------------------------------------------------------------------

    def measure(self, suite: str, shape: dict, impl: str, fn) -> dict:
        """Runs one peer measurement; a failure becomes a row with a note, never a crash."""
        row = dict(shape, suite=suite, impl=impl)
        if impl in ("flex", "flashinfer") and self.over_budget():
            row["note"] = f"skipped: past the time budget (--budget-s {self.budget_s:g})"
            return row
        began = time.monotonic()
        try:
            row.update(fn())
        except Exception as error:  # noqa: BLE001 - report, keep going
            text = str(error).strip().splitlines()
            row["note"] = f"{type(error).__name__}: {text[0][:160] if text else ''}"
        try:
            self.torch.cuda.synchronize()
            self.torch.cuda.empty_cache()
        except Exception as error:  # noqa: BLE001 - a sticky CUDA error: say so on the row
            row.setdefault("note", f"after the run: {error}")
        metric = SUITE_INFO[suite]["metric"]
        value = row.get(metric)
        self.log(f"  {impl:<15} {shape_label(suite, shape)}: "
                 + (f"{value:.3f} {SUITE_INFO[suite]['unit']}" if value is not None
                    else row.get("note", "")) + f"  ({time.monotonic() - began:.1f}s)")
        return row

    def suite_decode(self, s: dict) -> list:
        torch = self.torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        b, ctx, hq, hkv, d = s["batch"], s["context"], s["q_heads"], s["kv_heads"], s["head_dim"]
        kv_bytes = b * ctx * hkv * d * 2 * 2
        pools = max(1, min(8, (240 << 20) // kv_bytes + 1))
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
        ks = [torch.randn(b, hkv, ctx, d, device="cuda", dtype=torch.bfloat16)
              for _ in range(pools)]
        vs = [torch.randn(b, hkv, ctx, d, device="cuda", dtype=torch.bfloat16)
              for _ in range(pools)]
        peer = dict(s, page=None)  # dense KV: matches attnkit's row of any page size
        rows = []

        def sdpa(backend):
            def fn():
                def call(i):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, ks[i], vs[i], enable_gqa=hkv != hq)

                ms, mode = self.time_graph(call, pools)
                return dict(time_ms=ms, tbps=kv_bytes / (ms * 1e-3) / 1e12, mode=mode)

            return fn

        rows.append(self.measure("decode", peer, "sdpa-cudnn", sdpa(SDPBackend.CUDNN_ATTENTION)))
        rows.append(self.measure("decode", peer, "sdpa-flash", sdpa(SDPBackend.FLASH_ATTENTION)))

        def flex():
            attn = self.flex()

            def call(i):
                return attn(q, ks[i], vs[i], enable_gqa=hkv != hq)

            ms, mode = self.time_graph(call, pools)
            return dict(time_ms=ms, tbps=kv_bytes / (ms * 1e-3) / 1e12, mode=mode)

        rows.append(self.measure("decode", peer, "flex", flex))
        if self.flashinfer is not None:
            rows.append(self.measure("decode", dict(s), "flashinfer",
                                     lambda: self.flashinfer_decode(s, kv_bytes)))
        return rows

    def flashinfer_decode(self, s: dict, kv_bytes: int) -> dict:
        torch, fi = self.torch, self.flashinfer
        b, ctx, hq, hkv, d, page = (s["batch"], s["context"], s["q_heads"], s["kv_heads"],
                                    s["head_dim"], s["page"])
        per_seq = (ctx + page - 1) // page
        pools = max(1, min(8, (240 << 20) // kv_bytes + 1))
        workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND")
        indptr = torch.arange(b + 1, dtype=torch.int32, device="cuda") * per_seq
        indices = torch.randperm(b * per_seq, device="cuda").to(torch.int32)
        last = torch.full((b,), ctx - (per_seq - 1) * page, dtype=torch.int32, device="cuda")
        wrapper.plan(indptr, indices, last, hq, hkv, d, page, data_type=torch.bfloat16,
                     q_data_type=torch.bfloat16)
        q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
        caches = [torch.randn(b * per_seq, 2, hkv, page, d, device="cuda", dtype=torch.bfloat16)
                  for _ in range(pools)]
        ms, mode = self.time_graph(lambda i: wrapper.run(q, caches[i]), pools)
        return dict(time_ms=ms, tbps=kv_bytes / (ms * 1e-3) / 1e12, mode=mode)

    def _attention_peers(self, suite: str, s: dict, b: int, seqlen: int, h: int, d: int,
                         causal: bool, impls: list) -> list:
        """SDPA backends and FlexAttention on [b, h, seqlen, d] (strided views of [b, S, h, d],
        like a packed token layout), 3 input sets of > 60 MB each or more sets for small ones."""
        torch = self.torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        set_bytes = 3 * b * seqlen * h * d * 2
        sets_n = max(3, min(16, (200 << 20) // set_bytes + 1))
        sets = [tuple(torch.randn(b, seqlen, h, d, device="cuda", dtype=torch.bfloat16)
                      .transpose(1, 2) for _ in range(3)) for _ in range(sets_n)]
        flops = 4.0 * seqlen * seqlen * d * h * b / (2 if causal else 1)
        backends = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
                    "sdpa-flash": SDPBackend.FLASH_ATTENTION,
                    "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}
        rows = []
        for impl in impls:
            if impl == "flex":
                def fn():
                    attn = self.flex()
                    mask = None
                    if causal:
                        from torch.nn.attention.flex_attention import create_block_mask

                        mask = create_block_mask(lambda bb, hh, qi, ki: qi >= ki, None, None,
                                                 seqlen, seqlen, device="cuda")
                    ms = self.time_eager(lambda i: attn(*sets[i], block_mask=mask), sets_n)
                    return dict(time_ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
            else:
                def fn(backend=backends[impl]):
                    def call(i):
                        with sdpa_kernel(backend):
                            return F.scaled_dot_product_attention(*sets[i], is_causal=causal)

                    ms = self.time_eager(call, sets_n)
                    return dict(time_ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
            rows.append(self.measure(suite, s, impl, fn))
        return rows

    def suite_prefill(self, s: dict) -> list:
        return self._attention_peers("prefill", s, s["batch"], s["seqlen"], s["q_heads"],
                                     s["head_dim"], s["causal"],
                                     ["sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "flex"])

    def suite_dense(self, s: dict) -> list:
        return self._attention_peers("dense", s, s["batch"], s["seqlen"], s["q_heads"],
                                     s["head_dim"], False, ["sdpa-cudnn", "sdpa-flash", "flex"])

    def suite_fp8(self, s: dict) -> list:
        rows = []
        if not s.get("page"):
            rows = self._attention_peers("fp8", s, s["batch"], s["seqlen"], s["q_heads"],
                                         s["head_dim"], s["causal"], ["sdpa-cudnn", "sdpa-flash"])
        rows.append(self.measure("fp8", s, "fa3-fp8", lambda: self.fa3_fp8(s)))
        return rows

    def fa3_fp8(self, s: dict) -> dict:
        """FlashAttention-3's fp8 forward (flash_attn_interface), packed shapes only."""
        if s.get("page"):
            raise RuntimeError("fa3-fp8: packed rows only")
        torch = self.torch
        import flash_attn_interface  # noqa: PLC0415 - optional peer

        b, n, h, d = s["batch"], s["seqlen"], s["q_heads"], s["head_dim"]
        sets = [tuple(torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
                      .to(torch.float8_e4m3fn) for _ in range(3)) for _ in range(3)]
        flops = 4.0 * n * n * d * h * b / (2 if s["causal"] else 1)
        ms = self.time_eager(lambda i: flash_attn_interface.flash_attn_func(
            *sets[i], causal=s["causal"]), 3)
        return dict(time_ms=ms, tflops=flops / (ms * 1e-3) / 1e12)

    def suite_append(self, s: dict) -> list:
        torch = self.torch
        elt = 1 if s["kv_dtype"] in ("fp8_e4m3", "int8") else 2
        hq, hkv, d = s["q_heads"], s["kv_heads"], s["head_dim"]
        # The bytes attnkit's append moves: QKV read, rotated Q written, K and V written.
        nbytes = s["tokens"] * ((hq + 2 * hkv) * d * 2 + hq * d * 2 + 2 * hkv * d * elt)
        half = nbytes // 2
        sets_n = max(2, min(8, (240 << 20) // nbytes + 1))

        def fn():
            src = [torch.randint(0, 255, (half,), dtype=torch.uint8, device="cuda")
                   for _ in range(sets_n)]
            dst = [torch.empty_like(x) for x in src]
            ms = self.time_eager(lambda i: dst[i].copy_(src[i]), sets_n)
            return dict(time_ms=ms, tbps=2 * half / (ms * 1e-3) / 1e12)

        return [self.measure("append", s, "torch-copy", fn)]


# ---- main ---------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render:
        with open(args.render) as f:
            results = json.load(f)
        if args.write_docs:
            write_docs(results, args.write_docs)
            return 0
        write_outputs(results, args.out)
        print(render_markdown(results))
        return 0
    start = time.monotonic()
    try:
        import torch
    except ImportError:
        print("peers.py: torch is not importable (the peers need PyTorch with CUDA)",
              file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("peers.py: no CUDA device visible", file=sys.stderr)
        return 1
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    command = "python3 bench/peers.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    # ISO 8601 in UTC, as `attnkit bench` writes its date.
    results = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
                   command=command, seed=seed, suites=args.suite, device={}, ceilings={},
                   rows=[], notes=[])
    peers = Peers(args.iters, args.budget_s, start)
    results["device"] = peers.device()
    if peers.flashinfer is None:
        results["notes"].append("flashinfer: not importable")
    print(f"device: {results['device']}; seed {seed}", flush=True)
    results["ceilings"].update(peers.ceilings())
    print("ceilings: " + ", ".join(f"{k} {v:.2f}" for k, v in results["ceilings"].items()),
          flush=True)
    use_attnkit = not args.no_attnkit
    if use_attnkit and not os.access(args.attnkit_cli, os.X_OK):
        results["notes"].append(f"attnkit: {args.attnkit_cli} is not an executable (use "
                                "--attnkit-cli or $ATTNKIT_CLI); peers only")
        use_attnkit = False
    for suite in args.suite:
        shapes = grid(suite, args.quick)
        print(f"== {suite}: {len(shapes)} shapes ({time.monotonic() - start:.0f}s)", flush=True)
        if use_attnkit:
            rows, meta, notes = attnkit_rows(args.attnkit_cli, suite, shapes, args.quick)
            results["rows"] += rows
            results["notes"] += notes
            merge_meta(results, meta)
            for note in notes:
                print("  " + note, flush=True)
        for shape in shapes:
            results["rows"] += getattr(peers, f"suite_{suite}")(shape)
            # A run stopped by a time limit keeps what it measured.
            write_outputs(results, args.out, plots=False)
        write_outputs(results, args.out)
    results["elapsed_s"] = round(time.monotonic() - start, 1)
    write_outputs(results, args.out)
    print(render_markdown(results))
    print(f"peers.py: {results['elapsed_s']}s; wrote {args.out}/results.json, peers.md and plots")
    if args.write_docs:
        write_docs(results, args.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
