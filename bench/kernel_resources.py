"""Registers, spills and stack of every compiled kernel, per configuration (no GPU needed).

Each direction of a configuration's heuristic key is cross-compiled to PTX (host.ptx), then
``ptxas -v`` reports the resources of each entry: the family's main kernel and, in the
backward, the grad_ape sum. Needs ``ptxas`` on PATH (the CUDA toolkit).
``python bench/kernel_resources.py``
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from csa_ops import host
from csa_ops.config import ARCHS, Direction, KernelKey
from csa_ops.kernels import select_key

CONFIGS = (  # (ratio, coff, head_dim, dtype): production shapes, odd dims, both families
    (4, 2, 128, "bfloat16"), (4, 2, 512, "bfloat16"), (4, 1, 128, "bfloat16"),
    (2, 2, 512, "bfloat16"), (16, 2, 128, "bfloat16"), (4, 2, 65, "float16"),
    (128, 1, 128, "bfloat16"), (128, 2, 512, "bfloat16"), (256, 2, 64, "float16"),
)
ROLES = ("main", "grad_ape sum")  # entries in launch order
_PTX_ENTRY = re.compile(r"^\.visible \.entry (\w+)\(", re.MULTILINE)
_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def key_summary(key: KernelKey) -> str:
    """'window vec 2 x256' plus the knobs that differ from their defaults."""
    knobs = key.knobs
    extra = [f"{f.name}={int(v) if isinstance(v, bool) else v}"
             for f in dataclasses.fields(knobs)
             if f.name not in ("vec", "threads") and (v := getattr(knobs, f.name)) != f.default]
    return " ".join([f"{key.family} vec {knobs.vec} x{knobs.threads}", *extra])


def resources(ratio, coff, head_dim, dtype, arch):
    """[(direction, key summary, kernel role, registers, stack, spill stores, spill loads)]."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for direction in host.DIRECTIONS:
            key = select_key(ratio, coff, head_dim, dtype, arch, Direction(direction))
            text = host.ptx(direction, key)
            order = _PTX_ENTRY.findall(text)  # the module's order is launch order
            ptx = Path(tmp, f"{direction}.ptx")
            ptx.write_text(text)
            report = subprocess.run(["ptxas", "-v", f"-arch={arch}", "-o", os.devnull, str(ptx)],
                                    capture_output=True, text=True, check=True).stderr
            found = zip(_ENTRY.findall(report), _SPILL.findall(report), _REGS.findall(report))
            for entry, spill, regs in found:
                rows.append((direction, key_summary(key), ROLES[order.index(entry)], int(regs),
                             *map(int, spill)))
    return sorted(rows, key=lambda row: (row[0] == "bwd", ROLES.index(row[2])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", default="sm_90a", choices=ARCHS)
    args = parser.parse_args()
    if shutil.which("ptxas") is None:
        sys.exit("kernel_resources: ptxas not found on PATH (install the CUDA toolkit)")
    print(f"| config ({args.arch}) | dir | key | kernel | registers | stack B | spill st/ld B |")
    print("|---|---|---|---|---|---|---|")
    for ratio, coff, head_dim, dtype in CONFIGS:
        for direction, key, role, regs, stack, st, ld in resources(ratio, coff, head_dim, dtype,
                                                                    args.arch):
            print(f"| r{ratio} c{coff} d{head_dim} {dtype} | {direction} | {key} | {role} | "
                  f"{regs} | {stack} | {st}/{ld} |", flush=True)


if __name__ == "__main__":
    main()
