"""SHA-256 of every kernel's PTX over a fixed key set, and a comparison against saved hashes.

Proves that a refactor leaves a kernel's generated code alone. Cross-compiles without a GPU.
Per key and direction, each `.entry` of the PTX is hashed twice: as written, and with its
symbol (which names the Python function and class) replaced, so a moved or renamed kernel
with the same code still matches. Entry 0 is a family's main kernel, entry 1 the backward's
grad_ape sum (kernels/reduce.py). "ext" is csa::compressor_extend's kernel, compiled from the
forward's key.

    python bench/ptx_hashes.py --out before.json
    python bench/ptx_hashes.py --arch sm_90a --compare before.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys

from csa_ops import host
from csa_ops.config import ARCHS, Direction, with_knobs
from csa_ops.kernels import FAMILIES
from csa_ops.kernels.epilogue import plan as epilogue_plan

# (family, ratio, coff, head_dim, dtype, directions, knob overrides of the heuristic key)
CASES = (
    ("window", 4, 2, 128, "bfloat16", "fb", {}),
    ("window", 4, 2, 512, "bfloat16", "fb", {}),
    ("window", 2, 2, 512, "bfloat16", "fb", {}),
    ("window", 4, 1, 128, "bfloat16", "fb", {}),
    ("window", 16, 2, 128, "bfloat16", "fb", {}),
    ("window", 4, 2, 128, "float16", "fb", {}),
    ("window", 4, 2, 512, "float16", "fb", {}),
    ("window", 4, 2, 128, "float32", "fb", {}),
    ("window", 3, 2, 65, "float16", "fb", {}),
    ("window", 4, 2, 512, "bfloat16", "f", {"fast_exp": 0}),
    ("window", 4, 2, 128, "bfloat16", "f", {"linear": 0}),
    ("window", 4, 2, 512, "bfloat16", "b", {"min_ctas": 3}),
    ("window", 4, 2, 128, "bfloat16", "b", {"pdl": 0, "balance": 0}),
    ("streaming", 128, 1, 128, "bfloat16", "fb", {}),
    ("streaming", 128, 1, 512, "bfloat16", "fb", {}),
    ("streaming", 128, 2, 512, "bfloat16", "fb", {}),
    ("streaming", 128, 1, 128, "float16", "fb", {}),
    ("streaming", 128, 1, 128, "bfloat16", "fb", {"lean": 1}),
    ("streaming", 128, 2, 512, "bfloat16", "f", {"pdl": 1}),
    ("window", 4, 2, 512, "bfloat16", "e", {}),
    ("window", 4, 2, 512, "bfloat16", "e", {"vec": 2, "threads": 128}),
    ("window", 4, 2, 512, "bfloat16", "e", {"vec": 2, "threads": 128, "preload_decode": 1}),
    ("window", 4, 1, 128, "bfloat16", "e", {"vec": 2, "threads": 128, "preload_decode": 1}),
    ("window", 4, 2, 512, "bfloat16", "e",
     {"vec": 2, "threads": 128, "preload_decode": 1, "request_rows": 1}),
    ("window", 3, 2, 65, "float16", "e", {"request_rows": 1}),
    ("window", 4, 2, 512, "bfloat16", "e", {"part": 1}),
    ("window", 4, 2, 512, "bfloat16", "e", {"part": 2}),
    ("window", 4, 2, 512, "bfloat16", "e", {"part": 2, "lane_requests": 1}),
    ("window", 3, 2, 65, "float16", "e", {"part": 2}),
    ("window", 4, 1, 256, "float16", "e", {}),
    ("window", 5, 2, 65, "float32", "e", {}),
    ("streaming", 128, 1, 512, "bfloat16", "e", {}),
    ("streaming", 128, 2, 128, "float16", "e", {}),
    ("streaming", 128, 1, 512, "bfloat16", "e", {"part": 1}),
    ("streaming", 128, 1, 512, "bfloat16", "e", {"part": 2}),
    ("streaming", 128, 1, 512, "bfloat16", "e", {"part": 2, "lane_requests": 1}),
)
# The letters of CASES' direction column: the pooling kernels' three directions.
_DIRECTIONS = {"f": Direction.FORWARD, "b": Direction.BACKWARD, "e": Direction.EXTEND}
# The row-epilogue kernels: (direction, dtype, weight dtype, head_dim, rope_dim, rotate,
# cache format, position offsets).
EPILOGUE_CASES = (
    (Direction.STORE, "bfloat16", "float32", 512, 64, False, "fp8_ds_mla", False),
    (Direction.STORE, "bfloat16", "bfloat16", 128, 64, True, "mxfp4", False),
    (Direction.STORE, "float16", "float32", 128, 0, False, "fp8_block128", False),
    (Direction.STORE, "float32", "float32", 512, 64, True, "none", False),
    (Direction.EPILOGUE, "bfloat16", "float32", 512, 64, False, "none", True),
    (Direction.EPILOGUE, "float16", "bfloat16", 128, 64, True, "none", False),
    (Direction.EPILOGUE_BACKWARD, "bfloat16", "float32", 512, 64, False, "none", True),
    (Direction.EPILOGUE_BACKWARD, "float16", "bfloat16", 128, 64, True, "none", False),
)
ROLES = ("main", "grad_ape sum")
_ENTRY = re.compile(r"^\.visible \.entry (\w+)\(", re.MULTILINE)


def entries(ptx: str) -> list[tuple[str, str]]:
    """(symbol, text) of each kernel entry, in the module's order: from `.visible .entry` to
    the function's closing brace, the only brace in column 0."""
    spans = [(m.group(1), m.start(), ptx.index("\n}\n", m.start()) + 3)
             for m in _ENTRY.finditer(ptx)]
    return [(name, ptx[start:end]) for name, start, end in spans]


def hashes(arch: str, only: str = ""):
    """{label: {"key": repr(key), "kernels": [{name, sha256, sha256_unnamed}]}}."""
    result = {}
    for family, ratio, coff, head_dim, dtype, dirs, knobs in CASES:
        for letter, direction in _DIRECTIONS.items():
            if letter not in dirs:
                continue
            settings = "".join(f" {k}={v}" for k, v in sorted(knobs.items()))
            label = (f"{arch} {family} r{ratio}c{coff} d{head_dim} {dtype} {direction}"
                     f"{settings}")
            if only not in label:
                continue
            key = FAMILIES[family].configure(ratio, coff, head_dim, dtype, arch,
                                             Direction(direction))
            key = with_knobs(key, **knobs)
            kernels = _kernels(host.ptx(direction, key))
            result[label] = {"key": repr(key), "kernels": kernels}
            print(label, " ".join(k["sha256"][:12] for k in kernels), flush=True)
    for direction, dtype, weight, head_dim, rope, rotate, fmt, offsets in EPILOGUE_CASES:
        label = (f"{arch} epilogue {direction} {dtype} w{weight} d{head_dim} rope{rope}"
                 f"{' rot' if rotate else ''} {fmt}{' offsets' if offsets else ''}")
        if only not in label:
            continue
        key = epilogue_plan.configure(dtype, weight, head_dim, rope, rotate, fmt, 1e-6, arch,
                                      offsets)
        result[label] = {"key": repr(key), "kernels": _kernels(host.ptx(direction, key))}
        print(label, " ".join(k["sha256"][:12] for k in result[label]["kernels"]), flush=True)
    return result


def _kernels(ptx: str) -> list[dict]:
    return [{"name": name, "sha256": hashlib.sha256(text.encode()).hexdigest(),
             "sha256_unnamed": hashlib.sha256(text.replace(name, "ENTRY").encode()).hexdigest()}
            for name, text in entries(ptx)]


def compare(now: dict, before: dict) -> bool:
    """Prints one line per kernel; True when every kernel of `now` is in `before` unchanged."""
    same = True
    for label in sorted(now):
        if label not in before:
            print(f"new      {label}")
            same = False
            continue
        old = before[label]["kernels"]
        for i, kernel in enumerate(now[label]["kernels"]):
            role = ROLES[i] if i < len(ROLES) else f"entry {i}"
            if i >= len(old):
                verdict = "added"
            elif kernel["sha256"] == old[i]["sha256"]:
                verdict = "same"
            elif kernel["sha256_unnamed"] == old[i]["sha256_unnamed"]:
                verdict = "same code, renamed"
            else:
                verdict = "CHANGED"
            # A moved or renamed kernel keeps its code: only its symbol changed.
            same = same and verdict in ("same", "same code, renamed")
            print(f"{verdict:<19}{label} [{role}]")
        if len(old) > len(now[label]["kernels"]):
            print(f"{'removed':<19}{label} [{len(old) - len(now[label]['kernels'])} entries]")
            same = False
    return same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", nargs="+", default=list(ARCHS), choices=ARCHS)
    parser.add_argument("--only", default="", help="only labels containing this text")
    parser.add_argument("--out", help="write the hashes to this JSON file")
    parser.add_argument("--compare", help="compare against hashes saved by --out")
    args = parser.parse_args()
    now = {}
    for arch in args.arch:
        now.update(hashes(arch, args.only))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(now, f, indent=1, sort_keys=True)
    if args.compare:
        with open(args.compare) as f:
            before = json.load(f)
        sys.exit(0 if compare(now, before) else 1)


if __name__ == "__main__":
    main()
