"""One csa::compressor_epilogue forward and backward inside a profiler range, for `ncu`:

    ncu --profile-from-start off --section SpeedOfLight python3 bench/profile_epilogue.py

bf16 r4 c2 3 x 8192 tokens d512, RoPE 64, fp32 norm weight; the step runs twice before the
range opens, so the profiled kernels are one training step's: by default the fused forward,
then the fused backward and its sum of partials (under csa_ops.row_epilogue's
two_launch_forward() and staged_backward(): the pooling forward and the row epilogue, then
the backward's recomputed pooling, its row epilogue and the pooling backward).
"""

from __future__ import annotations

import torch

import csa_ops
from csa_ops.epilogue import compressor_epilogue

SEGMENTS, TOKENS, HEAD_DIM, RATIO, COFF, ROPE_DIM = 3, 8192, 512, 4, 2, 64


def main() -> None:
    cu, cuc = csa_ops.offsets_for([TOKENS] * SEGMENTS, RATIO, "cuda")
    width = COFF * HEAD_DIM
    kv = torch.randn(SEGMENTS * TOKENS, width, device="cuda", dtype=torch.bfloat16)
    score = torch.randn_like(kv)
    ape = torch.randn(RATIO, width, device="cuda")
    weight = 1 + 0.1 * torch.randn(HEAD_DIM, device="cuda")
    angles = torch.arange(TOKENS, device="cuda")[:, None] * 1e-3 * torch.arange(
        1, ROPE_DIM // 2 + 1, device="cuda")
    cos, sin = angles.cos(), angles.sin()
    leaves = [t.requires_grad_() for t in (kv, score, ape, weight)]

    def step():
        out = compressor_epilogue(
            kv, score, ape, cu, cuc, ratio=RATIO, coff=COFF, norm_weight=weight, cos=cos,
            sin=sin, rope_dim=ROPE_DIM, total_comp=SEGMENTS * TOKENS // RATIO)
        torch.autograd.grad(out, leaves, torch.ones_like(out))

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
