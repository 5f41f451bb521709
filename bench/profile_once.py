"""One forward and one backward launch per shape, for `ncu`.

    ncu --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats python3 bench/profile_once.py

Inputs are built and the kernels compiled before the profiled launches, so the only
kernels after the marker range are ours (forward; backward and its grad_ape finalize).
``--only r128`` keeps the shapes whose label has it, ``--numerics fast`` profiles the fast
forward, ``--forward`` skips the backward.
"""

from __future__ import annotations

import argparse

import torch

import csa_ops

SHAPES = (  # (segments, tokens per segment, head_dim, ratio, coff)
    (3, 8192, 512, 4, 2),
    (1, 8192, 128, 4, 2),
    (1, 131072, 512, 128, 2),
)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="shapes whose label (1x131072_d512_r128_c2) has it")
    p.add_argument("--numerics", default="certified", choices=("certified", "fast"))
    p.add_argument("--forward", action="store_true", help="forward launches only")
    args = p.parse_args(argv)
    csa_ops.set_forward_numerics(args.numerics)
    runs = []
    for segs, seqlen, head_dim, ratio, coff in SHAPES:
        if args.only not in f"{segs}x{seqlen}_d{head_dim}_r{ratio}_c{coff}":
            continue
        cu, cuc = csa_ops.offsets_for([seqlen] * segs, ratio, "cuda")
        kv = torch.randn(segs * seqlen, coff * head_dim, device="cuda", dtype=torch.bfloat16)
        score = torch.randn_like(kv)
        ape = torch.randn(ratio, coff * head_dim, device="cuda")
        rows = segs * (seqlen // ratio)
        grad_out = torch.randn(rows, head_dim, device="cuda", dtype=torch.bfloat16)
        csa_ops.precompile(ratio, head_dim, coff, torch.bfloat16)
        runs.append((kv, score, ape, cu, cuc, ratio, coff, rows, grad_out))
    torch.cuda.synchronize()
    for kv, score, ape, cu, cuc, ratio, coff, rows, grad_out in runs:
        torch.ops.csa.compressor(kv, score, ape, cu, cuc, ratio, coff, rows)
        if not args.forward:
            torch.ops.csa.compressor_backward(grad_out, kv, score, ape, cu, cuc, ratio, coff)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
