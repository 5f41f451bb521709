"""Registers, spills and stack of every compiled kernel, per configuration (no GPU needed).

Each configuration is cross-compiled in a child process that keeps its PTX (the DSL reads
its dump settings at start-up), then ``ptxas -v`` reports the resources of each entry.
Needs ``ptxas`` on PATH (the CUDA toolkit). ``python bench/kernel_resources.py``
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIGS = (  # (ratio, coff, head_dim, dtype): production shapes, odd dims, both families
    (4, 2, 128, "bfloat16"), (4, 2, 512, "bfloat16"), (4, 1, 128, "bfloat16"),
    (2, 2, 512, "bfloat16"), (16, 2, 128, "bfloat16"), (4, 2, 65, "float16"),
    (128, 1, 128, "bfloat16"), (128, 2, 512, "bfloat16"), (256, 2, 64, "float16"),
)
_PRECOMPILE = ("import torch, csa_ops.host as h; "
               "print(*h.precompile({r}, {d}, {c}, getattr(torch, '{t}'), arch='{a}'), sep='\\n')")
_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def _key_summary(key_repr: str) -> str:
    """'window vec 2 x256' plus the knobs, from a KernelKey repr."""
    fam, vec, threads, knobs = re.search(
        r"family='(\w+)'.*vec=(\d+), threads=(\d+), knobs=\((.*)\)\)$", key_repr).groups()
    knob_text = " ".join(f"{n}={v}" for n, v in re.findall(r"\('(\w+)', (\d+)\)", knobs))
    return f"{fam} vec {vec} x{threads} {knob_text}".strip()


def _kernel_role(entry: str) -> str:
    for role in ("combine", "finalize", "backward", "forward"):
        if role in entry:
            return role
    return "main"


def resources(ratio, coff, head_dim, dtype, arch):
    """[(direction, key summary, kernel role, registers, stack, spill stores, spill loads)]."""
    rows = []
    with tempfile.TemporaryDirectory() as dump:
        env = dict(os.environ, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=dump)
        code = _PRECOMPILE.format(r=ratio, d=head_dim, c=coff, t=dtype, a=arch)
        keys = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                              capture_output=True, text=True).stdout.splitlines()
        for ptx in sorted(Path(dump).glob("*.ptx")):
            # The host protocol passes 7 pointers forward and 10 backward (see host.py); the
            # DSL names each launch after its argument types.
            direction = "bwd" if ptx.name.count("Ptrgmem") >= 10 else "fwd"
            summary = _key_summary(keys[0 if direction == "fwd" else 1])
            report = subprocess.run(["ptxas", "-v", f"-arch={arch}", "-o", os.devnull, str(ptx)],
                                    capture_output=True, text=True).stderr
            for entry, spill, regs in zip(_ENTRY.findall(report), _SPILL.findall(report),
                                          _REGS.findall(report)):
                rows.append((direction, summary, _kernel_role(entry), int(regs), *map(int, spill)))
    return sorted(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", default="sm_90a", choices=("sm_90a", "sm_100a"))
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
