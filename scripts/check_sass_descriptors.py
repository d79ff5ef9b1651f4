#!/usr/bin/env python3
"""Checks the SASS of a CUDA binary for memory instructions that name an unwritten descriptor.

Usage: check_sass_descriptors.py FILE...   (a cubin, object or shared library with sm_90a code;
       `cuobjdump` is found next to nvcc, on PATH, or in $CUOBJDUMP)
       check_sass_descriptors.py --has-cuobjdump   (exit 0 if the check can run here, else 77)

On sm_90, global memory instructions take a 64-bit descriptor in a uniform register pair
(`desc[URn]`): the default one from the constant bank, or one built from an L2 cache policy. ptxas
of CUDA 13.0 emitted the hinted `cp.async` of some decode kernels (the K / V copies carry an L2
evict_first policy) as `LDGSTS [R + UR0 + imm], desc[UR1]` where nothing in the kernel writes UR1:
an illegal instruction at run time (docs/decode_design.md, "L2 evict_first"). This check fails on every
function with an `LDGSTS`, `LDG` or `STG` whose descriptor register no instruction of that
function writes. Exit status: 0 clean, 1 findings, 77 no cuobjdump (skipped), 2 usage errors.
"""
import os
import re
import shutil
import subprocess
import sys

INSTRUCTION = re.compile(
    r'^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z0-9_.]+)\s*([^;]*);', re.M)
DESCRIPTOR = re.compile(r'desc\[UR(\d+)\]')
UNIFORM_DEST = re.compile(r'UR(\d+)$')


def find_cuobjdump():
    if os.environ.get('CUOBJDUMP'):
        return os.environ['CUOBJDUMP']
    found = shutil.which('cuobjdump')
    if found:
        return found
    nvcc = shutil.which('nvcc')
    if nvcc:
        candidate = os.path.join(os.path.dirname(nvcc), 'cuobjdump')
        if os.path.exists(candidate):
            return candidate
    return None


def check_function(name, body):
    """The descriptor registers of the function's memory instructions that nothing writes."""
    written = set()
    used = set()
    for opcode, operands in INSTRUCTION.findall(body):
        first = operands.split(',')[0].strip()
        dest = UNIFORM_DEST.match(first)
        if dest and not opcode.startswith(('LDGSTS', 'STG', 'STS', 'UBLKPF', 'UTMA', 'SYNCS')):
            n = int(dest.group(1))
            written.add(n)
            if '.64' in opcode or '.WIDE' in opcode:
                written.add(n + 1)
        if opcode.startswith(('LDGSTS', 'LDG', 'STG')):
            used.update(int(n) for n in DESCRIPTOR.findall(operands))
    return sorted(n for n in used if n not in written)


def main(paths):
    if paths == ['--has-cuobjdump']:
        return 0 if find_cuobjdump() else 77
    if not paths:
        print(__doc__)
        return 2
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        print('check_sass_descriptors: no cuobjdump (set CUOBJDUMP): skipped')
        return 77
    functions = findings = instructions = 0
    for path in paths:
        sass = subprocess.run([cuobjdump, '-sass', path], capture_output=True, text=True,
                              check=True).stdout
        for chunk in sass.split('Function : ')[1:]:
            name, body = chunk.split('\n', 1)
            functions += 1
            instructions += len(DESCRIPTOR.findall(body))
            missing = check_function(name, body)
            if missing:
                findings += 1
                print('%s: %s names descriptor register(s) %s that nothing writes' %
                      (path, name.strip()[:160], ', '.join('UR%d' % n for n in missing)))
    print('check_sass_descriptors: %d functions, %d descriptor operands, %d with findings' %
          (functions, instructions, findings))
    if functions == 0:
        print('check_sass_descriptors: no sm_90 SASS found: the check would be vacuous')
        return 1
    return 1 if findings else 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
