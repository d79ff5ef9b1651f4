"""scripts/plot_calibration.py on a hand-written `attnkit calibrate` report (docs/diffusion.md,
"Calibration"): a PNG with the sweep and the fitted curve; a clear message without matplotlib."""

import json
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "plot_calibration.py"


def _report(path):
    sweep = [dict(**{"lambda": l}, sparsity=s, tiles_total=64, tiles_skipped=int(64 * s),
                  rel_l2_error=e, cos_sim=1.0 - e, max_abs_error=e)
             for l, s, e in [(1e-6, 0.0, 0.0), (1e-4, 0.2, 1e-5), (1e-2, 0.4, 1e-3),
                             (0.5, 0.6, 3e-2)]]
    report = {"calibration": {"a": 2.0, "b": 9.0},
              "fit": {"model": "lambda = a * exp(b * s) / kv_len", "points": 3,
                      "rms_log_residual": 0.1},
              "tiles": {"block_m": 64, "block_n": 128, "order": "last_tile_first"},
              "backend": "reference",
              "samples": [{"name": "t9", "timestep": 0.9, "q_shape": [1, 256, 2, 64],
                           "k_shape": [1, 256, 2, 64], "sweep": sweep}]}
    path.write_text(json.dumps(report))


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    _report(tmp_path / "report.json")
    out = tmp_path / "calibration.png"
    subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "report.json"), str(out)],
                   check=True)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_usage_and_missing_matplotlib(tmp_path):
    bad = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        _report(tmp_path / "report.json")
        run = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "report.json"),
                              str(tmp_path / "x.png")], capture_output=True, text=True)
        assert run.returncode == 1 and "matplotlib is not installed" in run.stderr
