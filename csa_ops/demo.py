"""The main job: a DeepSeek-V4-style Compressor block on the op, eager and compiled.

Run with ``python -m csa_ops.demo``. Uses CUDA when present (bf16), else the CPU (fp32).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from . import reference
from .module import Compressor, offsets_for


def _reference_block(block: Compressor, x, cu, cuc, total_comp):
    """The same block with the op replaced by the fp32-intermediate reference."""
    pooled = reference.compressor_reference(block.wkv(x), block.wgate(x), block.ape, cu, cuc,
                                            block.ratio, block.coff, total_comp)
    return F.rms_norm(pooled, (block.head_dim,), block.norm.weight, block.norm.eps)


def _time_ms(fn, device, iters: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def add_block_options(parser: argparse.ArgumentParser, dim: int) -> None:
    """The Compressor block's shape, shared by the demos."""
    parser.add_argument("--dim", type=int, default=dim)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--ratio", type=int, default=4)
    parser.add_argument("--coff", type=int, default=2)


def demo_device() -> tuple[torch.device, torch.dtype]:
    """(device, dtype) of a demo: bf16 on the GPU, fp32 on the CPU; seeds torch."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    return device, torch.bfloat16 if device.type == "cuda" else torch.float32


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", default="1000,3,2047,517", help="segment lengths of the pack")
    add_block_options(parser, dim=512)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    device, dtype = demo_device()
    lengths = [int(v) for v in args.lengths.split(",")]
    cu, cuc = offsets_for(lengths, args.ratio, device)
    total_comp = int(cuc[-1]) + 8  # a static capacity with padding rows, as in a CUDA graph
    block = Compressor(args.dim, args.head_dim, args.ratio, args.coff, device=device, dtype=dtype)
    x = torch.randn(sum(lengths), args.dim, device=device, dtype=dtype)
    compiled = torch.compile(block, fullgraph=True)

    with torch.no_grad():
        expected = _reference_block(block, x, cu, cuc, total_comp)
        eager = block(x, cu, cuc, total_comp)
        fused = compiled(x, cu, cuc, total_comp)
    # The check is of the block's wiring (the test suite pins the op's bits). In fp32 the two
    # evaluations of each projection may round differently: CPU BLAS picks its kernels by
    # buffer alignment and thread count, so equal GEMMs agree to ~1e-6, not bitwise.
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(eager, expected, atol=tol, rtol=tol)
    torch.testing.assert_close(fused, expected, atol=tol, rtol=tol)
    print(f"device {device}, dtype {dtype}, pack {lengths}, ratio {args.ratio}, coff {args.coff}, "
          f"head_dim {args.head_dim}: {int(cuc[-1])} rows (+8 padding), eager and compiled match "
          f"the reference (max abs err {float((fused - expected).abs().max()):.2e})")

    # A fixed projection as the loss (mean(y^2) after RMSNorm has a near-zero gradient).
    probe = torch.randn(total_comp, args.head_dim, device=device)

    def train_step(fn):
        def step():
            block.zero_grad(set_to_none=True)
            (fn(x, cu, cuc, total_comp).float() * probe).sum().backward()
        return step

    with torch.no_grad():
        rows = [("forward", _time_ms(lambda: block(x, cu, cuc, total_comp), device, args.iters),
                 _time_ms(lambda: compiled(x, cu, cuc, total_comp), device, args.iters))]
    rows.append(("forward+backward", _time_ms(train_step(block), device, args.iters),
                 _time_ms(train_step(compiled), device, args.iters)))
    print("\n| Compressor block | eager ms | torch.compile ms |\n|---|---|---|")
    for name, eager_ms, compiled_ms in rows:
        print(f"| {name} | {eager_ms:.3f} | {compiled_ms:.3f} |")


if __name__ == "__main__":
    main()
