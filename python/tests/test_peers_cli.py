"""bench/peers.py without a GPU: argument parsing, grids, reading attnkit's JSON (new object and
old array schema, through a fake `attnkit` program), merging with peer rows and the markdown
table. torch is never imported here (the measuring part needs a GPU)."""

import importlib.util
import json
import os
import pathlib
import stat
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def peers():
    spec = importlib.util.spec_from_file_location("peers", ROOT / "bench" / "peers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# A stand-in for the `attnkit` program. FAKE_MODE: "new" (`--json FILE`, an object with rows),
# "old" (the `--json` flag, a bare array on stdout after a progress line), "grid-only" (new
# schema, but the shape options are rejected: only the default grid runs), "broken" (fails).
FAKE_CLI = textwrap.dedent(
    """
    import json, os, sys
    mode = os.environ["FAKE_MODE"]
    value = float(os.environ["FAKE_VALUE"])
    argv = sys.argv[1:]
    log = os.environ.get("FAKE_LOG")
    if log:
        with open(log, "a") as f:
            f.write(" ".join(argv) + "\\n")
    if mode == "broken" or argv[:1] != ["bench"]:
        print("bench decode: no CUDA device visible", file=sys.stderr)
        sys.exit(1)
    suite = argv[1]
    opts, flags, i, json_path = {}, set(), 2, None
    while i < len(argv):
        a = argv[i]
        if a == "--json":
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                if mode == "old":
                    print("The following argument was not expected: " + argv[i + 1],
                          file=sys.stderr)
                    sys.exit(106)
                json_path = argv[i + 1]
                i += 2
                continue
            if mode != "old":
                print("--json: 1 required FILE missing", file=sys.stderr)
                sys.exit(109)
            json_path = "-"
            i += 1
        elif a in ("--causal", "--no-ceilings"):
            flags.add(a)
            i += 1
        else:
            opts[a] = argv[i + 1]
            i += 2
    if mode == "grid-only" and opts:
        print("The following arguments were not expected: " + " ".join(opts), file=sys.stderr)
        sys.exit(106)
    def num(key, default):
        return int(opts.get(key, default))
    if suite == "dense":
        row = {"label": "default 2x4k", "batch": num("--batch", 2), "seqlen": num("--seqlen", 4096),
               "q_heads": num("--heads", 24), "kv_heads": num("--heads", 24),
               "head_dim": num("--head-dim", 128), "variant": opts.get("--variants", "default")}
        metric = "tflops"
    elif suite == "append":
        row = {"label": "bf16 cache", "tokens": num("--tokens", 16384),
               "q_heads": num("--q-heads", 32), "kv_heads": num("--kv-heads", 8),
               "head_dim": num("--head-dim", 128), "page": num("--page", 64),
               "kv_dtype": opts.get("--kv-dtype", "bf16"), "copy_same_bytes_tbps": 4.1}
        metric = "tbps"
    elif suite == "decode":
        row = {"batch": num("--batch", 64), "context": num("--context", 4096),
               "q_heads": num("--q-heads", 32), "kv_heads": num("--kv-heads", 8),
               "head_dim": num("--head-dim", 128), "page": num("--page", 32),
               "kv_dtype": opts.get("--kv-dtype", "bf16")}
        metric = "tbps" if mode != "old" else "tb_per_s"
    else:
        row = {"head_dim": num("--head-dim", 128), "seqlen": num("--seqlen", 4096),
               "batch": num("--batch", 4), "heads": num("--heads", 16),
               "kv_heads": num("--kv-heads", 16), "causal": "--causal" in flags}
        metric = "tflops"
        if mode == "old":
            row["kv"] = "packed"
    row.update({"impl": "attnkit", metric: value})
    row["ms" if mode == "old" else "time_ms"] = 1.5
    if mode == "old":
        print("device: fake (132 SMs)")
        print(json.dumps([row], indent=1))
    else:
        row["backend"] = "fused"
        ceilings = {"copy_tbps": 4.2, "gemm_bf16_tflops": 800.0}
        if "--no-ceilings" in flags:
            ceilings = {"copy_tbps": None, "gemm_bf16_tflops": None}
        doc = {"subcommand": suite, "device": {"name": "Fake H200"}, "date": "2026-11-29",
               "ceilings": ceilings, "rows": [row]}
        with open(json_path, "w") as f:
            json.dump(doc, f)
    """
)


@pytest.fixture
def fake_cli(tmp_path, monkeypatch):
    path = tmp_path / "attnkit"
    path.write_text(f"#!{sys.executable}\n{FAKE_CLI}")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "calls.txt"))
    return path


def test_parse_args_defaults_and_suites(peers, monkeypatch):
    monkeypatch.delenv("ATTNKIT_CLI", raising=False)
    args = peers.parse_args([])
    assert args.suite == ["decode", "prefill", "dense", "append", "fp8"]
    assert args.attnkit_cli == os.path.join("build-gpu", "attnkit")
    assert not args.quick and args.budget_s == 0
    monkeypatch.setenv("ATTNKIT_CLI", "/opt/attnkit")
    args = peers.parse_args(["--suite", "prefill,decode,prefill", "--quick", "--out", "x"])
    assert args.suite == ["prefill", "decode"] and args.quick and args.out == "x"
    assert args.attnkit_cli == "/opt/attnkit" and args.budget_s > 0
    assert peers.parse_args(["--attnkit-cli", "a/b"]).attnkit_cli == "a/b"


@pytest.mark.parametrize("argv", [["--suite", "decode,sparse"], ["--suite", ""],
                                  ["--iters", "5"], ["--bogus"]])
def test_parse_args_rejects(peers, argv, capsys):
    with pytest.raises(SystemExit):
        peers.parse_args(argv)
    assert "usage" in capsys.readouterr().err


def test_grids_follow_the_issue(peers):
    full = peers.grid("prefill", quick=False)
    assert len(full) == 36
    assert {(s["head_dim"], s["seqlen"], s["causal"]) for s in full} == {
        (d, s, c) for d in (64, 128, 256) for s in (512, 1024, 2048, 4096, 8192, 16384)
        for c in (False, True)}
    for s in full:
        assert s["batch"] * s["seqlen"] == 16384 and s["q_heads"] * s["head_dim"] == 2048
    assert {(s["batch"], s["seqlen"]) for s in peers.grid("dense", quick=False)} == {
        (2, 4096), (2, 16384), (1, 32760)}
    for suite in peers.SUITES:
        quick = peers.grid(suite, quick=True)
        assert quick and all(s in peers.grid(suite, quick=False) for s in quick)
    with pytest.raises(ValueError):
        peers.grid("sparse", quick=True)


def test_cli_shape_args(peers):
    shape = peers.prefill_shape(128, 2048, True)
    args = peers.cli_shape_args("prefill", shape)
    assert args[args.index("--seqlen") + 1] == "2048" and "--causal" in args
    assert "--causal" not in peers.cli_shape_args("prefill", peers.prefill_shape(64, 512, False))
    args = peers.cli_shape_args("decode", peers.decode_shape(1, 32768, kv_dtype="int8"))
    assert args[args.index("--kv-dtype") + 1] == "int8"
    dense = peers.grid("dense", quick=True)[0]
    args = peers.cli_shape_args("dense", dense, quick=True)
    assert args[args.index("--variants") + 1] == "default"
    assert "sage_int8" in peers.cli_shape_args("dense", dense)[-1]


def test_normalize_old_and_new_rows(peers):
    old_prefill = {"impl": "attnkit", "head_dim": 64, "seqlen": 512, "batch": 32, "heads": 32,
                   "kv_heads": 32, "causal": 1, "kv": "paged64-fp8_e4m3", "ms": 0.5,
                   "tflops": 133.0}
    row = peers.normalize_row("prefill", old_prefill)
    assert row["q_heads"] == 32 and row["causal"] is True and row["time_ms"] == 0.5
    assert (row["page"], row["kv_dtype"]) == (64, "fp8_e4m3")
    old_decode = {"impl": "attnkit", "batch": 1, "context": 32768, "time_us": 250.0,
                  "tb_per_s": 2.8}
    row = peers.normalize_row("decode", old_decode)
    assert row["tbps"] == 2.8 and row["time_ms"] == pytest.approx(0.25)
    new = {"impl": "attnkit", "backend": "vanilla", "batch": 2.0, "seqlen": 4096, "q_heads": 24,
           "head_dim": 128, "time_ms": 3.0, "tflops": 500.0}
    row = peers.normalize_row("dense", new)
    assert row["impl"] == "attnkit-vanilla" and row["batch"] == 2 and isinstance(row["batch"], int)
    for variant, backend, impl in (("default", "fused", "attnkit"),
                                   ("sage_int8", "fused", "attnkit-sage_int8"),
                                   ("vanilla", "vanilla", "attnkit-vanilla")):
        row = peers.normalize_row("dense", dict(new, variant=variant, backend=backend))
        assert row["impl"] == impl


def test_load_attnkit_json_both_schemas(peers):
    doc = {"subcommand": "decode", "device": {"name": "H200"}, "date": "2026-11-29",
           "ceilings": {"copy_tbps": 4.21}, "rows": [{"impl": "attnkit", "batch": 64,
                                                      "tbps": 4.0}]}
    got = peers.load_attnkit_json("decode", json.dumps(doc))
    assert got["ceilings"] == {"copy_tbps": 4.21} and got["rows"][0]["tbps"] == 4.0
    got = peers.load_attnkit_json("decode", json.dumps([{"batch": 1, "tb_per_s": 2.0}]))
    assert got["rows"][0]["impl"] == "attnkit" and got["rows"][0]["tbps"] == 2.0
    with pytest.raises(ValueError):
        peers.load_attnkit_json("decode", "3")
    with pytest.raises(ValueError):
        peers.load_attnkit_json("decode", "not json")


@pytest.mark.parametrize("mode", ["new", "old"])
def test_run_attnkit_reads_the_program_json(peers, fake_cli, monkeypatch, mode, rng):
    value = float(rng.uniform(1, 5))
    monkeypatch.setenv("FAKE_MODE", mode)
    monkeypatch.setenv("FAKE_VALUE", repr(value))
    shape = peers.decode_shape(128, 2048)
    rows, meta, notes = peers.attnkit_rows(str(fake_cli), "decode", [shape], log=lambda *a: None)
    assert notes == []
    assert len(rows) == 1 and rows[0]["tbps"] == pytest.approx(value)
    assert rows[0]["batch"] == 128 and rows[0]["context"] == 2048
    if mode == "new":
        assert meta["ceilings"]["copy_tbps"] == 4.2
    # The row is measured without the ceilings' GEMMs in front of it; they run once afterwards.
    calls = open(os.environ["FAKE_LOG"]).read().splitlines()
    assert "--no-ceilings" in calls[0] and "--no-ceilings" not in calls[-1]


@pytest.mark.parametrize("suite", ["dense", "append"])
def test_new_schema_rows_of_dense_and_append(peers, fake_cli, monkeypatch, suite, rng):
    value = float(rng.uniform(1, 500))
    monkeypatch.setenv("FAKE_MODE", "new")
    monkeypatch.setenv("FAKE_VALUE", repr(value))
    shapes = peers.grid(suite, quick=True)
    rows, meta, notes = peers.attnkit_rows(str(fake_cli), suite, shapes, quick=True,
                                           log=lambda *a: None)
    assert notes == [] and len(rows) == len(shapes)
    metric = peers.SUITE_INFO[suite]["metric"]
    for shape, row in zip(shapes, rows):
        assert row["impl"] == "attnkit" and row[metric] == pytest.approx(value)
        assert all(row[k] == shape[k] for k in peers.SUITE_INFO[suite]["keys"])
    name = "torch-copy" if suite == "append" else "sdpa-cudnn"
    peer = dict(shapes[0], suite=suite, impl=name, **{metric: value * 2})
    table = peers.markdown_table(suite, rows + [peer])
    assert f"| 0.50 ({name}) |" in table


def test_attnkit_rows_falls_back_to_the_default_grid(peers, fake_cli, monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_MODE", "grid-only")
    monkeypatch.setenv("FAKE_VALUE", "300")
    shapes = peers.grid("prefill", quick=True)
    rows, _, notes = peers.attnkit_rows(str(fake_cli), "prefill", shapes, log=lambda *a: None)
    assert len(rows) == 1 and rows[0]["tflops"] == 300.0
    assert any("default grid" in n for n in notes)
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert calls[-1].startswith("bench prefill --json")  # the last run has no shape options


def test_attnkit_rows_reports_a_broken_program(peers, fake_cli, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "broken")
    monkeypatch.setenv("FAKE_VALUE", "1")
    shape = peers.decode_shape(64, 4096)
    rows, _, notes = peers.attnkit_rows(str(fake_cli), "decode", [shape], log=lambda *a: None)
    assert rows[0]["note"] and "tbps" not in rows[0]
    assert "no CUDA device visible" in notes[0]
    rows, _, notes = peers.attnkit_rows("/nonexistent/attnkit", "decode", [shape],
                                        log=lambda *a: None)
    assert notes and "tbps" not in rows[0]


def test_table_merges_attnkit_and_peers(peers, rng):
    shape = peers.decode_shape(64, 4096)
    mine, cudnn, flex = (float(x) for x in rng.uniform(1.0, 5.0, size=3))
    rows = [
        dict(shape, suite="decode", impl="attnkit", tbps=mine),
        dict(shape, suite="decode", impl="attnkit", page=16, tbps=mine / 2),
        dict(shape, suite="decode", impl="attnkit", kv_dtype="fp8_e4m3", tbps=mine / 3),
        # Dense-KV peers match attnkit's bf16 rows of every page size.
        dict(shape, suite="decode", impl="sdpa-cudnn", page=None, tbps=cudnn),
        dict(shape, suite="decode", impl="flex", page=None, tbps=flex),
        dict(shape, suite="decode", impl="sdpa-flash", page=None, note="RuntimeError: no"),
        # A peer shape attnkit did not run gets its own line.
        dict(peers.decode_shape(1, 32768), suite="decode", impl="sdpa-cudnn", page=None,
             tbps=2.0),
        dict(shape, suite="prefill", impl="sdpa-cudnn", tbps=99.0),  # another suite: ignored
    ]
    impls, shapes = peers.table_rows("decode", rows)
    assert impls == ["attnkit", "sdpa-cudnn", "sdpa-flash", "flex"]
    assert len(shapes) == 4
    text = peers.markdown_table("decode", rows)
    lines = text.strip().splitlines()
    assert lines[0] == ("| batch | context | Hq | Hkv | D | page | kv | attnkit TB/s | "
                        "sdpa-cudnn TB/s | sdpa-flash TB/s | flex TB/s | attnkit / best peer |")
    best = max(cudnn, flex)
    name = "sdpa-cudnn" if cudnn >= flex else "flex"
    cells = [c.strip() for c in lines[2].split("|")[1:-1]]
    assert cells[:7] == ["64", "4096", "32", "8", "128", "32", "bf16"]
    assert cells[7] == f"{mine:.2f}" and cells[9] == "-"
    assert cells[-1] == f"{mine / best:.2f} ({name})"
    page16 = [c.strip() for c in lines[3].split("|")[1:-1]]
    assert page16[5] == "16" and page16[-1] == f"{mine / 2 / best:.2f} ({name})"
    fp8 = [c.strip() for c in lines[4].split("|")[1:-1]]
    assert fp8[6] == "fp8_e4m3" and fp8[8] == "-" and fp8[-1] == "-"
    lone = [c.strip() for c in lines[5].split("|")[1:-1]]
    assert lone[:2] == ["1", "32768"] and lone[5] == "-" and lone[7] == "-" and lone[8] == "2.00"
    notes = peers.row_notes("decode", rows)
    assert len(notes) == 1 and "sdpa-flash" in notes[0] and "RuntimeError" in notes[0]


def test_render_writes_markdown_without_torch(peers, tmp_path, rng):
    tflops = float(rng.uniform(100, 700))
    shape = peers.prefill_shape(128, 4096, False)
    results = dict(date="2026-11-29T12:00Z", command="python3 bench/peers.py --quick",
                   suites=["prefill", "dense"], device={"name": "NVIDIA H200", "torch": "2.11"},
                   ceilings={"torch copy_tbps": 4.2}, notes=["flashinfer: not importable"],
                   rows=[dict(shape, suite="prefill", impl="attnkit", tflops=tflops),
                         dict(shape, suite="prefill", impl="sdpa-cudnn", tflops=tflops * 2)])
    src = tmp_path / "results.json"
    src.write_text(json.dumps(results))
    out = tmp_path / "out"
    assert peers.main(["--render", str(src), "--out", str(out)]) == 0
    md = (out / "peers.md").read_text()
    assert "NVIDIA H200" in md and "python3 bench/peers.py --quick" in md
    assert "2026-11-29T12:00Z" in md and "flashinfer: not importable" in md
    assert f"| {tflops:.0f} | {tflops * 2:.0f} | 0.50 (sdpa-cudnn) |" in md
    assert "(no dense rows)" in md
    assert json.loads((out / "results.json").read_text())["rows"][0]["tflops"] == tflops


def test_plots_one_png_per_suite(peers, tmp_path):
    pytest.importorskip("matplotlib")
    rows = [dict(peers.decode_shape(64, 4096), suite="decode", impl="attnkit", tbps=3.9),
            dict(peers.decode_shape(64, 4096), suite="decode", impl="sdpa-cudnn", page=None,
                 tbps=4.4),
            dict(peers.prefill_shape(128, 2048, True), suite="prefill", impl="attnkit",
                 tflops=250.0),
            dict(peers.prefill_shape(128, 8192, True), suite="prefill", impl="flex",
                 note="compile failed")]
    results = dict(suites=["decode", "prefill", "dense"], rows=rows, device={}, date="today")
    written = peers.write_plots(results, str(tmp_path), log=lambda *a: None)
    assert sorted(os.path.basename(p) for p in written) == ["decode.png", "prefill.png"]
    for path in written:
        assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def _page_results(peers, tbps, tflops):
    """A small results.json of one decode and one prefill shape, with peers and a note."""
    decode = peers.decode_shape(64, 4096)
    fp8 = peers.decode_shape(64, 4096, kv_dtype="fp8_e4m3")
    prefill = peers.prefill_shape(128, 4096, False)
    return dict(date="2026-01-02T03:04Z", command="python3 bench/peers.py --suite decode,prefill",
                suites=["decode", "prefill"], notes=["flashinfer: not importable"],
                device={"name": "Fake GPU", "torch": "2.11", "cudnn": 91900, "cuda": "13.0",
                        "driver": "580.1", "attnkit": {"sms": 132, "cc": "9.0"}},
                ceilings={"attnkit read_tbps": 4.5},
                rows=[dict(decode, suite="decode", impl="attnkit", tbps=tbps),
                      dict(fp8, suite="decode", impl="attnkit", tbps=tbps * 0.9),
                      dict(decode, suite="decode", impl="sdpa-cudnn", page=None, tbps=tbps / 0.9),
                      dict(decode, suite="decode", impl="flex", page=None, note="skipped: budget"),
                      dict(prefill, suite="prefill", impl="attnkit", tflops=tflops),
                      dict(prefill, suite="prefill", impl="sdpa-cudnn", tflops=tflops / 2)])


def test_write_docs_page_from_a_results_json(peers, tmp_path, rng):
    tbps, tflops = float(rng.uniform(3, 4)), float(rng.uniform(300, 400))
    src = tmp_path / "results.json"
    src.write_text(json.dumps(_page_results(peers, tbps, tflops)))
    docs = tmp_path / "docs"
    assert peers.main(["--render", str(src), "--write-docs", str(docs)]) == 0
    page = (docs / "performance.md").read_text()
    # One section per family with its run's date, device, driver / toolkit and commands.
    assert page.index("## Prefill") < page.index("## Decode")
    assert "2026-01-02, Fake GPU (132 SMs, sm 9.0), driver 580.1, CUDA 13.0" in page
    assert "cuDNN 9.19.0" in page and "`python3 bench/peers.py --suite decode,prefill`" in page
    assert "--suite decode --attnkit-cli build-gpu/attnkit --write-docs docs/" in page
    # attnkit next to the peers of the same run, the target and the gap in one column.
    assert f"| {tbps:.2f} | {tbps / 0.9:.2f} | - | 0.90 (cuDNN) | >= 1.00x cuDNN: 0.90x, gap -10% |" \
        in page
    assert ">= 0.97x bf16's TB/s: 0.90x, gap -7.2%" in page
    assert f"| {tflops:.0f} | {tflops / 2:.0f} | 2.00 (cuDNN) | >= 1.05x cuDNN: 2.00x, met |" in page
    assert "FlexAttention: skipped: budget" in page and "03:04" not in page
    assert "history" not in page.lower()
    saved = json.loads((docs / "perf-results.json").read_text())
    assert sorted(saved["runs"]) == ["decode", "prefill"]
    assert all(r["suite"] == "decode" for r in saved["runs"]["decode"]["rows"])
    if importlib.util.find_spec("matplotlib"):
        assert "![decode](perf-plots/decode.png)" in page
        assert (docs / "perf-plots" / "prefill.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_write_docs_replaces_only_the_measured_families(peers, tmp_path):
    first = _page_results(peers, 3.0, 300.0)
    docs = tmp_path / "docs"
    peers.write_docs(first, str(docs), log=lambda *a: None)
    # A later decode-only run replaces the decode family and keeps prefill's run.
    later = dict(first, date="2026-02-03T00:00Z", suites=["decode"],
                 rows=[r for r in _page_results(peers, 4.0, 1.0)["rows"] if r["suite"] == "decode"])
    peers.write_docs(later, str(docs), log=lambda *a: None)
    saved = json.loads((docs / "perf-results.json").read_text())
    assert saved["runs"]["decode"]["date"].startswith("2026-02-03")
    assert saved["runs"]["prefill"]["date"].startswith("2026-01-02")
    page = (docs / "performance.md").read_text()
    assert "| 4.00 |" in page and "| 300 |" in page
    # Re-rendering the page's own results changes nothing.
    before = page
    assert peers.main(["--render", str(docs / "perf-results.json"), "--write-docs", str(docs)]) == 0
    assert (docs / "performance.md").read_text() == before


def test_fp8_suite_runs_the_prefill_bench_with_fp8_inputs(peers):
    shapes = peers.grid("fp8", False)
    packed = [s for s in shapes if not s["page"]]
    paged = [s for s in shapes if s["page"]]
    assert {s["head_dim"] for s in packed} == {128, 256} and paged
    args = peers.cli_shape_args("fp8", paged[0])
    assert args[args.index("--dtype") + 1] == "fp8_e4m3"
    assert args[args.index("--kv-dtype") + 1] == "fp8_e4m3"
    assert "--dtype" in peers.cli_shape_args("fp8", packed[0])
    row = peers.normalize_row("fp8", dict(packed[0], tflops=900.0, page=None))
    assert row["page"] == 0 and row["impl"] == "attnkit"
    cells = {"attnkit": {"tflops": 900.0}}
    (what, achieved, goal), = peers.row_targets("fp8", packed[0], cells, [(packed[0], cells)])
    assert achieved == 900.0 and goal == (1100.0 if packed[0]["head_dim"] == 256 else 1000.0)
    base = dict(paged[0], page=0)
    rows = [(base, {"attnkit": {"tflops": 1000.0}}), (paged[0], {"attnkit": {"tflops": 850.0}})]
    (what, achieved, goal), = peers.row_targets("fp8", paged[0], rows[1][1], rows)
    assert abs(achieved - 0.85) < 1e-9 and goal == 0.9
