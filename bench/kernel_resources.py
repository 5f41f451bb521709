"""Registers, spills and stack of every compiled kernel, per configuration (no GPU needed).

Each direction of a configuration's heuristic key is cross-compiled to PTX (host.ptx), then
``ptxas -v`` reports the resources of each entry in launch order: the family's main kernel,
then the deferred ratio-128 forward's exact columns or the backward's fixed-order sum.
Where the register-window family fuses the training op's epilogue into the pooling (RoPE
64, an fp32 norm weight), its two kernels too (``fepi``, ``bepi``: the fused backward's sum
takes grad_weight's partials as well). Needs ``ptxas`` on PATH (the CUDA toolkit).
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
from csa_ops.kernels.epilogue import plan as epilogue_plan

CONFIGS = (  # (ratio, coff, head_dim, dtype): production shapes, odd dims, both families
    (4, 2, 128, "bfloat16"), (4, 2, 512, "bfloat16"), (4, 1, 128, "bfloat16"),
    (2, 2, 512, "bfloat16"), (16, 2, 128, "bfloat16"), (4, 2, 65, "float16"),
    (128, 1, 128, "bfloat16"), (128, 2, 512, "bfloat16"), (256, 2, 64, "float16"),
)
# A launch after the main kernel, by the class or function its symbol names.
ROLES = {"_sum_parts": "fixed-order sum", "ExactColumns": "exact columns"}
TRAINING = ((Direction.FORWARD_EPILOGUE, host.training_forward_key),
            (Direction.BACKWARD_EPILOGUE, host.training_backward_key))
_PTX_ENTRY = re.compile(r"^\.visible \.entry (\w+)\(", re.MULTILINE)
_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def key_summary(key: KernelKey) -> str:
    """'window vec 2 x256' plus the knobs that differ from their defaults."""
    knobs = getattr(key, "pooling", key).knobs  # a fused key's: its pooling key's
    extra = [f"{f.name}={int(v) if isinstance(v, bool) else v}"
             for f in dataclasses.fields(knobs)
             if f.name not in ("vec", "threads") and (v := getattr(knobs, f.name)) != f.default]
    return " ".join([f"{key.family} vec {knobs.vec} x{knobs.threads}", *extra])


def role(entry: str, order: list[str]) -> str:
    if order.index(entry) == 0:
        return "main"
    return next((name for marker, name in ROLES.items() if marker in entry), entry[:40])


def kernel_keys(ratio, coff, head_dim, dtype, arch):
    """(direction, key) of each kernel a configuration runs: csa::compressor's two
    directions, then the fused training kernels where there are any."""
    keys = [(Direction(d), select_key(ratio, coff, head_dim, dtype, arch, Direction(d)))
            for d in host.DIRECTIONS]
    epilogue = epilogue_plan.configure(dtype, "float32", head_dim, 64, False, "none", 1e-6,
                                       arch, False)
    if epilogue_plan.supports(epilogue):
        keys += [(d, fused) for d, key_of in TRAINING
                 if (fused := key_of(epilogue, ratio, coff)) is not None]
    return keys


def ptxas_resources(text: str, arch: str) -> list[tuple[str, int, int, int, int]]:
    """(entry, registers, stack, spill stores, spill loads) of each entry of a PTX module,
    in the module's order (launch order), from ``ptxas -v``."""
    order = _PTX_ENTRY.findall(text)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp, "module.ptx")
        ptx.write_text(text)
        report = subprocess.run(["ptxas", "-v", f"-arch={arch}", "-o", os.devnull, str(ptx)],
                                capture_output=True, text=True, check=True).stderr
    found = zip(_ENTRY.findall(report), _REGS.findall(report), _SPILL.findall(report))
    return sorted(((entry, int(regs), *map(int, spill)) for entry, regs, spill in found),
                  key=lambda row: order.index(row[0]))


def resources(ratio, coff, head_dim, dtype, arch):
    """[(direction, key summary, kernel role, registers, stack, spill stores, spill loads)]."""
    rows = []
    for direction, key in kernel_keys(ratio, coff, head_dim, dtype, arch):
        found = ptxas_resources(host.ptx(direction, key), arch)
        order = [entry for entry, *_ in found]
        for entry, regs, stack, st, ld in found:
            rows.append((direction.value, key_summary(key), role(entry, order), regs, stack,
                         st, ld))
    return rows


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
