#!/usr/bin/env python3
"""Plots an `attnkit calibrate` report (docs/diffusion.md, "Calibration").

    python3 scripts/plot_calibration.py report.json calibration.png

Left: tile sparsity against lambda * kv_len per sample, with the fitted curve
s = ln(lambda kv_len / a) / b. Right: the output's relative L2 error against sparsity per sample.
Needs matplotlib.
"""
import json
import math
import sys


def main(argv):
    if len(argv) != 3:
        sys.stderr.write("usage: plot_calibration.py REPORT.json OUT.png\n")
        return 2
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.stderr.write("plot_calibration.py: matplotlib is not installed\n")
        return 1
    with open(argv[1]) as f:
        report = json.load(f)
    a = report["calibration"]["a"]
    b = report["calibration"]["b"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    scaled_all = []
    for sample in report["samples"]:
        kv_len = sample["k_shape"][1]
        label = sample["name"]
        if sample.get("timestep") is not None:
            label += " (t = %g)" % sample["timestep"]
        sweep = sample["sweep"]
        scaled = [p["lambda"] * kv_len for p in sweep]
        scaled_all += scaled
        left.plot(scaled, [p["sparsity"] for p in sweep], "o-", label=label, markersize=4)
        right.plot(
            [p["sparsity"] for p in sweep],
            [max(p["rel_l2_error"], 1e-12) for p in sweep],
            "o-",
            label=label,
            markersize=4,
        )
    if scaled_all and b != 0:
        lo, hi = min(scaled_all), max(scaled_all)
        xs = [lo * (hi / lo) ** (i / 99.0) for i in range(100)]
        fit = [(x, math.log(x / a) / b) for x in xs]
        fit = [(x, s) for x, s in fit if 0.0 <= s <= 1.0]
        if fit:
            left.plot(*zip(*fit), "k--", label="fit: a = %.3g, b = %.3g" % (a, b))
    tiles = report["tiles"]
    left.set_xscale("log")
    left.set_xlabel("lambda x kv_len")
    left.set_ylabel("tiles skipped")
    left.set_title("sparsity vs lambda (%s, %d x %d tiles)" %
                   (report["backend"], tiles["block_m"], tiles["block_n"]))
    left.legend(fontsize=7)
    right.set_yscale("log")
    right.set_xlabel("tiles skipped")
    right.set_ylabel("relative L2 error vs dense")
    right.set_title("error vs sparsity")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(argv[2], dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
