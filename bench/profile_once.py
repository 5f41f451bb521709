"""One forward and one backward launch per shape, for `ncu`.

    ncu --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats python3 bench/profile_once.py

Inputs are built and the kernels compiled before the profiled launches, so the only
kernels after the marker range are ours (forward; backward and its grad_ape finalize).
"""

from __future__ import annotations

import torch

import csa_ops

SHAPES = (  # (segments, tokens per segment, head_dim, ratio, coff)
    (3, 8192, 512, 4, 2),
    (1, 8192, 128, 4, 2),
    (1, 131072, 512, 128, 2),
)


def main() -> None:
    runs = []
    for segs, seqlen, head_dim, ratio, coff in SHAPES:
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
        torch.ops.csa.compressor_backward(grad_out, kv, score, ape, cu, cuc, ratio, coff)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
