"""The main job: a DeepSeek-V4-style Compressor block on the op beside the same block on
``csa_ops.reference`` (eager and torch.compile), forward and forward+backward, checked.

Run with ``python -m csa_ops.demo``. On CUDA (bf16): 32768 tokens, dim 4096, head_dim 512,
ratio 4 coff 2 and ratio 128 coff 1, ours also under CUDA graphs (reduce-overhead). On the CPU
(fp32), in under a minute: 1024 tokens and ratio 16 for 128 (compiling the reference's
128-entry windows forward and backward takes Inductor minutes there); --configs picks others.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from . import reference
from .module import Compressor, offsets_for

# (name, whose block, torch.compile mode or None for eager): the table's columns.
IMPLEMENTATIONS = (
    ("reference eager", "reference", None),
    ("reference compiled", "reference", "default"),
    ("ours eager", "ours", None),
    ("ours compiled", "ours", "default"),
    ("ours reduce-overhead", "ours", "reduce-overhead"),
)
SIZES = {  # device type: (segment lengths, dim, head_dim, RATIOxCOFF rows, timed calls)
    "cuda": ("8192,4093,12291,8192", 4096, 512, "4x2,128x1", 20),
    "cpu": ("301,3,517,203", 256, 64, "4x2,16x1", 3),
}


class ReferenceBlock(nn.Module):
    """``block`` with the op replaced by the fp32-intermediate reference (plain torch, so
    autograd differentiates it); it shares the block's parameters."""

    def __init__(self, block: Compressor):
        super().__init__()
        self.block = block

    def forward(self, x, cu, cuc, total_comp):
        b = self.block
        pooled = reference.compressor_reference(b.wkv(x), b.wgate(x), b.ape, cu, cuc, b.ratio,
                                                b.coff, total_comp)
        return F.rms_norm(pooled, (b.head_dim,), b.norm.weight, b.norm.eps)


def _without_cache_trace_warning(fn):
    """fn without Dynamo's warning that it traces through a functools.cache: on the CPU the
    reference settles torch's exp kernel once per dtype (a one-element exp) behind one, which
    compiled code, with an exp of its own, does not need; tracing it is harmless."""

    def call(*args):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Dynamo detected a call to a "
                                    "`functools.lru_cache`-wrapped function", category=UserWarning)
            return fn(*args)

    return call


def _time_ms(fn, device, iters: int, warmup: int = 3) -> float:
    """Mean wall time of fn() in ms. Three warm-up calls: a compile, then CUDA graphs'
    warm-up and recording (reduce-overhead) happen before the clock starts."""
    for _ in range(warmup):
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


def _configs(text: str) -> list[tuple[int, int]]:
    """"4x2,128x1" -> [(4, 2), (128, 1)]: the table's rows, (ratio, coff) each."""
    try:
        configs = [tuple(int(v) for v in item.split("x")) for item in text.split(",")]
    except ValueError:
        configs = []
    if not configs or any(len(c) != 2 or c[0] < 1 or c[1] not in (1, 2) for c in configs):
        raise argparse.ArgumentTypeError(
            f"--configs takes RATIOxCOFF[,RATIOxCOFF...] with ratio >= 1 and coff 1 or 2, "
            f"got {text!r}")
    return configs


def _parser(device: torch.device) -> argparse.ArgumentParser:
    lengths, dim, head_dim, configs, iters = SIZES[device.type]
    parser = argparse.ArgumentParser(prog="python -m csa_ops.demo", description=__doc__)
    parser.add_argument("--lengths", default=lengths, help="segment lengths of the pack")
    parser.add_argument("--dim", type=int, default=dim)
    parser.add_argument("--head-dim", type=int, default=head_dim)
    parser.add_argument("--configs", type=_configs, default=_configs(configs),
                        help=f"the table's rows, RATIOxCOFF (default here {configs})")
    parser.add_argument("--iters", type=int, default=iters, help="timed calls per cell")
    return parser


def _relative_error(actual, expected) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(
        1e-30))


class _Row:
    """One configuration: the block, its pack, and every implementation of it."""

    def __init__(self, args, device, dtype, ratio: int, coff: int):
        self.ratio, self.coff = ratio, coff
        self.lengths = [int(v) for v in args.lengths.split(",")]
        self.cu, self.cuc = offsets_for(self.lengths, ratio, device)
        self.rows = int(self.cuc[-1])
        self.total_comp = self.rows + 8  # a static capacity with padding rows, as in a graph
        self.block = Compressor(args.dim, args.head_dim, ratio, coff, device=device, dtype=dtype)
        self.x = torch.randn(sum(self.lengths), args.dim, device=device, dtype=dtype)
        # A fixed projection as the loss (mean(y^2) after RMSNorm has a near-zero gradient).
        self.probe = torch.randn(self.total_comp, args.head_dim, device=device)
        self.device = device
        blocks = {"ours": self.block, "reference": ReferenceBlock(self.block)}
        self.fns = {}
        for name, whose, mode in IMPLEMENTATIONS:
            if mode == "reduce-overhead" and device.type != "cuda":
                continue  # CUDA graphs need a GPU
            fn = blocks[whose]
            if mode is not None:
                fn = torch.compile(fn, mode=mode, fullgraph=True, dynamic=False)
                if whose == "reference" and device.type == "cpu":
                    fn = _without_cache_trace_warning(fn)
            self.fns[name] = fn

    def forward(self, name):
        """The block's output; under CUDA graphs it lives in the graph's memory until the next
        step (the check copies it, the timing does not)."""
        torch.compiler.cudagraph_mark_step_begin()  # a new step for CUDA graphs' outputs
        with torch.no_grad():
            return self.fns[name](self.x, self.cu, self.cuc, self.total_comp)

    def train_step(self, name):
        """Forward+backward into the parameters' .grad."""
        torch.compiler.cudagraph_mark_step_begin()
        self.block.zero_grad(set_to_none=True)
        out = self.fns[name](self.x, self.cu, self.cuc, self.total_comp)
        (out.float() * self.probe).sum().backward()

    def _grads(self, name) -> dict[str, torch.Tensor]:
        self.train_step(name)
        return {n: p.grad.clone() for n, p in self.block.named_parameters()}

    def check(self, dtype) -> str:
        """Every implementation against the reference block: outputs to the dtype's
        tolerance, gradients by relative error. The check is of the block's wiring (the test
        suite pins the op's bits). In fp32 the two evaluations of each projection may round
        differently: CPU BLAS picks its kernels by buffer alignment and thread count, so equal
        GEMMs agree to ~1e-6, not bitwise."""
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        grad_tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        expected = self.forward("reference eager").clone()
        expected_grads = self._grads("reference eager")
        out_err, grad_err = 0.0, 0.0
        for name in self.fns:
            out = self.forward(name).clone()
            torch.testing.assert_close(out, expected, atol=tol, rtol=tol,
                                       msg=lambda m, n=name: f"{n}: {m}")
            if not bool((out[self.rows:] == 0).all()):
                raise AssertionError(f"{name}: padding rows are not zero")
            out_err = max(out_err, float((out.float() - expected.float()).abs().max()))
            for param, grad in self._grads(name).items():
                err = _relative_error(grad, expected_grads[param])
                if not err <= grad_tol:
                    raise AssertionError(f"{name}: grad of {param} {err:.2e} from the reference")
                grad_err = max(grad_err, err)
        return (f"r{self.ratio} c{self.coff}: {self.rows} rows (+8 padding); eager and compiled "
                f"match the reference (max abs err {out_err:.2e}, gradients within "
                f"{grad_err:.2e} relative)")

    def times(self, iters: int) -> dict[str, dict[str, float]]:
        return {name: {"forward": _time_ms(lambda n=name: self.forward(n), self.device, iters),
                       "forward+backward": _time_ms(lambda n=name: self.train_step(n),
                                                    self.device, iters)}
                for name in self.fns}


def _cell(ms, reference_ms):
    if ms is None:
        return "n/a"
    if reference_ms is None:
        return f"{ms:.3f}"
    return f"{ms:.3f} (" + " / ".join(_speedup(other / ms) for other in reference_ms) + ")"


def _speedup(ratio: float) -> str:
    return f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.2g}x"


def format_table(results, head_dim: int) -> str:
    """results: [(ratio, coff, times)] -> the markdown table, ours with its speedups over
    the reference's eager and compiled block."""
    names = [name for name, _, _ in IMPLEMENTATIONS]
    lines = ["| block | pass | " + " | ".join(f"{n} ms" for n in names) + " |",
             "|---|---|" + "---|" * len(names)]
    for ratio, coff, times in results:
        for step in ("forward", "forward+backward"):
            reference_ms = (times["reference eager"][step], times["reference compiled"][step])
            cells = [_cell(times.get(name, {}).get(step),
                           reference_ms if name.startswith("ours") else None) for name in names]
            lines.append(f"| r{ratio} c{coff} d{head_dim} | {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    device, dtype = demo_device()
    args = _parser(device).parse_args(argv)
    lengths = [int(v) for v in args.lengths.split(",")]
    print(f"device {device}, dtype {dtype}, pack {lengths} ({sum(lengths)} tokens), dim "
          f"{args.dim}, head_dim {args.head_dim}", flush=True)
    results = []
    for ratio, coff in args.configs:
        torch._dynamo.reset()  # each configuration compiles afresh, with static shapes
        row = _Row(args, device, dtype, ratio, coff)
        print(row.check(dtype), flush=True)
        results.append((ratio, coff, row.times(args.iters)))
    print("\nCompressor block, ms per call; ours (speedup over the reference block eager / "
          "compiled):\n")
    print(format_table(results, args.head_dim))


if __name__ == "__main__":
    main()
