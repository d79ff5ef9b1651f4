#!/usr/bin/env python3
"""Per sm90 prefill kernel of a cubin or library: warpgroup MMAs (HGMMA; QGMMA for fp8) and local-memory
instructions (LDL / STL: spills) of the consumer and producer warpgroups. The consumers' code runs
before the producer's setmaxnreg.dec (USETMAXREG.DEALLOC) in the SASS of prefill_sm90_kernel.

    python3 scripts/sass_report_sm90.py build/libattnkit.so   # needs cuobjdump on PATH

docs/prefill_design.md shows its output.
"""
import re
import subprocess
import sys


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    sass = subprocess.run(["cuobjdump", "-sass", sys.argv[1]], capture_output=True, text=True,
                          check=True).stdout
    print("| kernel (head_dim, dtype, masked, logit mods, skip) | HGMMA / QGMMA | consumer LDL/STL | producer LDL/STL |")
    print("|---|---|---|---|")
    for func in re.split(r"\n\s*Function : ", sass)[1:]:
        name = func.split("\n", 1)[0]
        m = re.search(r"prefill_sm90_kernelILi(\d+)ELNS_5DTypeE(\d)ELb(\d)ELb(\d)ELb(\d)E", name)
        if not m:
            continue
        lines = func.split("\n")
        split = next((i for i, l in enumerate(lines) if "USETMAXREG.DEALLOC" in l), len(lines))
        spills = [bool(re.search(r"\b(LDL|STL)\b", l)) for l in lines]
        dtype = {"2": "bf16", "1": "f16", "3": "fp8"}.get(m.group(2), m.group(2))
        print(f"| {m.group(1)}, {dtype}, {'yes' if m.group(3) == '1' else 'no'}, "
              f"{'yes' if m.group(4) == '1' else 'no'}, {'yes' if m.group(5) == '1' else 'no'} | "
              f"{sum('HGMMA' in l or 'QGMMA' in l for l in lines)} | "
              f"{sum(spills[:split])} | {sum(spills[split:])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
