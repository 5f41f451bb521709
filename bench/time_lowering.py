"""Kernel time of csa::compressor compiled under each lowering mode, with and without RMSNorm.

`time_lowering(shapes)` returns rows the bench can add to its table;
`python bench/time_lowering.py [--quick]` prints them. Times are median microseconds per call
in CUDA-graph replays (bench/timing.py), per-call wall time where the step syncs the host.
"""

from __future__ import annotations

import argparse
import json

import timing  # bench/ is the script's folder, so on sys.path
import torch
import torch.nn.functional as F

import csa_ops
from csa_ops import lowering, offsets_for

MODES = ("extern", "generate", "auto")
SHAPES = [  # (segments x tokens, head_dim, ratio, coff)
    ((8192,), 128, 4, 2),
    ((8192,) * 3, 512, 4, 2),
    ((65536,), 512, 4, 2),
    ((8192,), 128, 4, 1),
    ((65536,), 512, 128, 1),
]


def _inputs(lengths, head_dim, ratio, coff, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens, width = sum(lengths), coff * head_dim
    kv = torch.randn(tokens, width, device="cuda", dtype=dtype, generator=gen)
    score = torch.randn(tokens, width, device="cuda", dtype=dtype, generator=gen)
    ape = torch.randn(ratio, width, device="cuda", generator=gen)
    cu, cuc = offsets_for(lengths, ratio, "cuda")
    rows = int(cuc[-1])
    grad_out = torch.randn(rows, head_dim, device="cuda", dtype=dtype, generator=gen)
    weight = torch.ones(head_dim, device="cuda", dtype=dtype)
    return kv, score, ape, cu, cuc, rows, grad_out, weight


def _variants(ratio, coff):
    def fwd(kv, score, ape, cu, cuc, rows, grad_out, weight):
        return torch.ops.csa.compressor(kv, score, ape, cu, cuc, ratio, coff, rows)

    def fwd_norm(kv, score, ape, cu, cuc, rows, grad_out, weight):
        out = torch.ops.csa.compressor(kv, score, ape, cu, cuc, ratio, coff, rows)
        return F.rms_norm(out, (out.shape[-1],), weight, 1e-6)

    def bwd(kv, score, ape, cu, cuc, rows, grad_out, weight):
        return torch.ops.csa.compressor_backward(grad_out, kv, score, ape, cu, cuc, ratio, coff)

    def bwd_norm(kv, score, ape, cu, cuc, rows, grad_out, weight):
        # RMSNorm's backward (recomputed from the op's output) feeding the op's backward.
        out = torch.ops.csa.compressor(kv, score, ape, cu, cuc, ratio, coff, rows).float()
        rstd = torch.rsqrt(out.square().mean(-1, keepdim=True) + 1e-6)
        g = grad_out.float() * weight
        dx = rstd * (g - out * rstd.square() * (g * out).mean(-1, keepdim=True))
        return torch.ops.csa.compressor_backward(dx.to(kv.dtype), kv, score, ape, cu, cuc,
                                                 ratio, coff)

    return {"fwd": fwd, "fwd+rmsnorm": fwd_norm, "bwd": bwd, "fwd+rmsnorm-bwd+bwd": bwd_norm}


def _bench(fn, args):
    fn(*args)  # compile (and JIT the extern kernel) outside the graph capture
    torch.cuda.synchronize()
    if timing.syncs_host(lambda: fn(*args)) is None:
        return 1e6 * timing.graph_time_per_call(lambda _: fn(*args), [None])
    median, _ = timing.time_calls(lambda _: fn(*args), batch=20, warmup=2, iters=10,
                                  device=args[0].device)
    return 1e6 * median


def time_lowering(shapes=SHAPES, modes=MODES, variants=None, dtype=torch.bfloat16):
    """[{shape, variant, mode, us}] for every combination (one torch.compile each)."""
    rows = []
    previous = lowering.mode
    try:
        for lengths, head_dim, ratio, coff in shapes:
            args = _inputs(lengths, head_dim, ratio, coff, dtype)
            name = f"{len(lengths)}x{lengths[0]} d{head_dim} r{ratio} c{coff}"
            for variant, fn in _variants(ratio, coff).items():
                if variants and variant not in variants:
                    continue
                for mode in modes:
                    lowering.mode = mode  # resets torch.compile's caches
                    compiled = torch.compile(fn, fullgraph=True)
                    us = _bench(compiled, args)
                    rows.append({"shape": name, "variant": variant, "mode": mode, "us": us})
                    print(f"{name:28s} {variant:22s} {mode:8s} {us:9.1f} us", flush=True)
    finally:
        lowering.mode = previous
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="two shapes, extern/generate, no fused backward")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, "csa_ops", csa_ops.__file__)
    if args.quick:
        rows = time_lowering([SHAPES[0], SHAPES[4]], modes=("extern", "generate"),
                             variants=("fwd", "fwd+rmsnorm", "bwd"))
    else:
        rows = time_lowering()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
