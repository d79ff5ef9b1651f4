#!/usr/bin/env python3
"""compare_sass.py A.o B.o (CUOBJDUMP=path to cuobjdump): per-kernel comparison of the sm_90a SASS of two objects, addresses and
encodings stripped (instructions, registers, order and branch targets as offsets must match)."""
import re, subprocess, sys
import os
# cuobjdump: CUDA's, or the one in a triton wheel (triton/backends/nvidia/bin/cuobjdump).
CUOBJDUMP = os.environ.get("CUOBJDUMP", "cuobjdump")

def kernels(obj):
    out = subprocess.run([CUOBJDUMP, "--dump-sass", obj], capture_output=True, text=True, check=True).stdout
    funcs, name, body = {}, None, []
    for line in out.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            if name: funcs[name] = body
            # anonymous namespaces are named by a hash of the source path
            name, body = re.sub(r"_GLOBAL__N__[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]+", "_GLOBAL__N_", m.group(1)), []
            continue
        if name is None: continue
        s = re.sub(r"/\*[0-9a-f]{4,}\*/", "", line)        # addresses
        s = re.sub(r"/\* 0x[0-9a-f]+ \*/", "", s)           # encodings
        s = s.strip()
        if not s or s.startswith(".") or s.startswith("..."): continue
        body.append(s)
    if name: funcs[name] = body
    return funcs

a, b = kernels(sys.argv[1]), kernels(sys.argv[2])
same = diff = 0
for k in sorted(set(a) | set(b)):
    if k not in a or k not in b:
        print("ONLY IN", "A" if k in a else "B", k); diff += 1; continue
    if a[k] == b[k]:
        same += 1
    else:
        diff += 1
        n = next((i for i, (x, y) in enumerate(zip(a[k], b[k])) if x != y), min(len(a[k]), len(b[k])))
        print(f"DIFF {k}: {len(a[k])} vs {len(b[k])} instructions, first at {n}: {a[k][n] if n < len(a[k]) else '-'} | {b[k][n] if n < len(b[k]) else '-'}")
total_instr = sum(len(v) for v in a.values())
print(f"{sys.argv[1]}: {same} kernels identical, {diff} differ ({len(a)} kernels, {total_instr} instructions in A)")
sys.exit(1 if diff else 0)
