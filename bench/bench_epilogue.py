"""The fused training epilogue against the op followed by the epilogue in torch.

    python bench/bench_epilogue.py                 # the README's shapes (CUDA)
    python bench/bench_epilogue.py --quick         # a tiny set, any device

Per shape, bf16 rows with RMSNorm and RoPE on the last 64 columns (``--rotate`` adds the
indexer's rotation), forward and forward+backward (gradients of kv, score, ape and the norm
weight), side by side in one run:
- ``eager``: csa::compressor, then the epilogue as torch ops (csa_ops.reference_epilogue);
- ``op + compiled epilogue``: csa::compressor, then torch.compile of the epilogue;
- ``compiled block``: torch.compile of both (the op an opaque call under the "auto" mode);
- ``fused op``: csa::compressor_epilogue as the package runs it by default (forward and
  backward in one kernel each where the register-window family pools them), and beside it
  with its row epilogue forced to the kernels (``kernel epilogue``), to torch ops (``torch
  epilogue``) and to the row-epilogue kernels beside the pooling kernels (``unfused``: the
  forward as two launches, the backward staged; csa_ops.row_epilogue's routes);
- ``op alone``: csa::compressor with no epilogue (gradients of kv, score and ape), the time
  the fused op's targets are stated against (not checked: other outputs);
- on CUDA each but ``eager`` also from CUDA-graph replays (device time);
- ``floor``: the fused op's traffic at the measured copy bandwidth: kv and score read and the
  rows written once forward, and backward kv, score and grad_out read, grad_kv and
  grad_score written (it recomputes the rows).
Every variant is checked against the fused op on input set 0. Writes results.json,
results.md and results.png under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report
import timing
import torch
from variants import Case, Shape, algorithmic_bytes, check, tolerance

import csa_ops  # noqa: F401  (registers torch.ops.csa.*)
from csa_ops import reference_epilogue, row_epilogue

SHAPES = ("r4c2_1x8192_d128", "r4c2_3x8192_d512", "r4c2_1x65536_d512", "r128c1_1x65536_d512",
          "r128c1_1x131072_d512", "r128c2_1x65536_d512")
QUICK_SHAPES = ("r4c2_2x64_d128",)
ROPE_DIM = 64
EPS = 1e-6
OP_ALONE = "op alone"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", default=None, help="comma-separated r<ratio>c<coff>_<B>x<len>_d<d>")
    p.add_argument("--quick", action="store_true", help="a tiny shape set (smoke run)")
    p.add_argument("--rotate", action="store_true", help="add the Hadamard rotation")
    p.add_argument("--variants", default=None,
                   help="semicolon-separated variant names to run (default: all)")
    p.add_argument("--directions", default="fwd,fwd+bwd", help="comma-separated: fwd, fwd+bwd")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--batch", type=int, default=None,
                   help="calls per timed sample (default: 20 on CUDA, 2 on CPU)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "epilogue"))
    return p.parse_args(argv)


class Epilogue:
    """One shape's inputs (variants.Case) with RoPE tables and a norm weight, and the
    regions every variant times: ``pool`` (the op), ``finish`` (the epilogue of pooled
    rows) and ``fused`` (the fused op)."""

    def __init__(self, case: Case, rotate: bool) -> None:
        s = case.shape
        self.case, self.shape = case, s
        angles = torch.arange(s.seqlen, dtype=torch.float64)[:, None] * 10000.0 ** (
            -torch.arange(0, ROPE_DIM, 2, dtype=torch.float64) / ROPE_DIM)
        self.cos, self.sin = (f(angles).float().to(case.device) for f in (torch.cos, torch.sin))
        self.weight = case.norm_weight.float().detach().requires_grad_()
        self.rotate = rotate
        self.positions, self.valid = reference_epilogue.training_positions(
            case.cuc, None, case.total_comp, s.ratio)

    def params(self, weight):
        return reference_epilogue.EpilogueParams(weight, EPS, self.cos, self.sin, ROPE_DIM,
                                                 self.rotate)

    def pool(self, kv, score, ape):
        s = self.shape
        return torch.ops.csa.compressor(kv, score, ape, self.case.cu, self.case.cuc, s.ratio,
                                        s.coff, self.case.total_comp)

    def finish(self, pooled, weight):
        return reference_epilogue.epilogue_rows(pooled, self.positions, self.valid,
                                                self.params(weight))

    def fused(self, kv, score, ape, weight):
        s = self.shape
        return torch.ops.csa.compressor_epilogue(
            kv, score, ape, self.case.cu, self.case.cuc, s.ratio, s.coff, weight, EPS,
            self.cos, self.sin, ROPE_DIM, None, self.rotate, self.case.total_comp)


@contextlib.contextmanager
def _unfused():
    """The row epilogue by its kernels, but not fused into the pooling kernels: the forward
    as two launches, the backward staged."""
    with row_epilogue.two_launch_forward(), row_epilogue.staged_backward():
        yield


def _routed(region, route):
    """``region`` run, forward and backward, under ``route`` (see _step)."""
    def call(*args):
        return region(*args)
    call.route = route
    return call


def _variants(e: Epilogue):
    """name -> region(kv, score, ape, weight) -> rows; ``op alone`` ignores the weight."""
    finish = torch.compile(e.finish, fullgraph=True, dynamic=False)

    def block(kv, score, ape, weight):
        return e.finish(e.pool(kv, score, ape), weight)

    return {
        "eager": block,
        "op + compiled epilogue": lambda kv, score, ape, w: finish(e.pool(kv, score, ape), w),
        "compiled block": torch.compile(block, fullgraph=True, dynamic=False),
        "fused op": e.fused,
        "fused op, kernel epilogue": _routed(e.fused, row_epilogue.kernel_route),
        "fused op, unfused": _routed(e.fused, _unfused),
        "fused op, torch epilogue": _routed(e.fused, row_epilogue.torch_route),
        OP_ALONE: lambda kv, score, ape, w: e.pool(kv, score, ape),
    }


def _step(e: Epilogue, region, direction: str, weighted: bool = True):
    """One call of ``region``: its rows, or the gradients of its leaves (the norm weight's
    only where ``weighted``)."""
    case = e.case
    leaves = [case.args(i, grad=True)[:3] for i in range(case.num_sets)]
    route = getattr(region, "route", contextlib.nullcontext)  # the backward's too

    def forward(i):
        kv, score, ape, _, _ = case.args(i)
        with route():
            return region(kv, score, ape, e.weight.detach())

    def forward_backward(i):
        kv, score, ape = leaves[i % case.num_sets]
        inputs = (kv, score, ape) + ((e.weight,) if weighted else ())
        with route():
            rows = region(kv, score, ape, e.weight)
            return torch.autograd.grad(rows, inputs, case.grad_out(i))

    return forward if direction == "fwd" else forward_backward


def run_shape(shape: Shape, args, bandwidth: float) -> list[dict]:
    device = torch.device(args.device)
    # Each shape compiles its own functions: without a reset, the shapes' recompilations of
    # the same code object pass dynamo's recompile limit.
    torch._dynamo.reset()
    itemsize = torch.bfloat16.itemsize
    set_bytes = algorithmic_bytes(shape, itemsize)["fwd"]
    case = Case(shape, device, torch.bfloat16, timing.num_input_sets(set_bytes, device))
    e = Epilogue(case, args.rotate)
    batch = args.batch or (20 if device.type == "cuda" else 2)
    batch = max(batch, case.num_sets)
    rows = []
    variants = _variants(e)
    if args.variants:
        variants = {name: variants[name] for name in args.variants.split(";")}
    for direction in args.directions.split(","):
        floor = algorithmic_bytes(shape, itemsize)[direction] / bandwidth
        rows.append({"shape": shape.name, "direction": direction, "variant": "floor",
                     "timing": "floor", "us": floor * 1e6})
        expected = _step(e, e.fused, direction)(0)
        for name, region in variants.items():
            step = _step(e, region, direction, weighted=name != OP_ALONE)
            ok, errors = None, []
            if name != OP_ALONE:
                ok, errors = check(step(0), expected if direction == "fwd+bwd" else (expected,),
                                   tolerance(torch.bfloat16, direction))
            timings = [("wall", lambda: timing.time_calls(step, batch, args.warmup, args.iters,
                                                          device))]
            if device.type == "cuda" and name != "eager":
                timings.append(("graph", lambda: timing.time_graph(
                    timing.capture_graph(step, batch, args.warmup)[0], batch, args.warmup,
                    args.iters)))
            for kind, measure in timings:
                median, _ = measure()
                rows.append({"shape": shape.name, "direction": direction, "variant": name,
                             "timing": kind, "us": median * 1e6, "ok": ok, "errors": errors,
                             "x_floor": median / floor})
                verdict = {True: "ok", False: "WRONG"}.get(ok, "")
                print(f"{shape.name} {direction:8s} {name:26s} {kind:5s} {median * 1e6:10.2f} us"
                      f"  x{median / floor:6.2f} floor  {verdict}", flush=True)
    return rows


def markdown(results: dict) -> str:
    meta = results["meta"]
    lines = [f"csa::compressor_epilogue on {meta['device_name']} (torch {meta['torch']}, "
             f"bf16, RoPE {ROPE_DIM}{', rotate' if results['rotate'] else ''}); us per call",
             "", "| shape | direction | variant | timing | us | x floor | checked |",
             "|---|---|---|---|---|---|---|"]
    for r in results["results"]:
        x = f"{r['x_floor']:.2f}" if "x_floor" in r else ""
        ok = {True: "ok", False: "WRONG"}.get(r.get("ok"), "")
        lines.append(f"| {r['shape']} | {r['direction']} | {r['variant']} | {r['timing']} | "
                     f"{r['us']:.2f} | {x} | {ok} |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    plt = report.pyplot()
    directions = ("fwd", "fwd+bwd")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, direction in zip(axes, directions):
        rows = [r for r in results["results"] if r["direction"] == direction]
        shapes = list(dict.fromkeys(r["shape"] for r in rows))
        labels = list(dict.fromkeys(f"{r['variant']} ({r['timing']})" for r in rows))
        width = 0.8 / max(len(labels), 1)
        for k, label in enumerate(labels):
            us = [next((r["us"] for r in rows if r["shape"] == s
                        and f"{r['variant']} ({r['timing']})" == label), 0.0) for s in shapes]
            ax.bar([i + k * width for i in range(len(shapes))], us, width, label=label)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))], shapes, rotation=20,
                      fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("us per call")
        ax.set_title(direction)
    axes[0].legend(fontsize=6)
    report.save_figure(fig, results, "csa::compressor_epilogue", path)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    names = args.shapes.split(",") if args.shapes else (QUICK_SHAPES if args.quick else SHAPES)
    bandwidth = timing.copy_bandwidth(device, (2048 if device.type == "cuda" else 64) << 20)
    results = {"meta": report.environment(device) | {"dtype": "bfloat16"},
               "rotate": args.rotate, "bandwidth_bytes_per_s": bandwidth, "results": []}
    for name in names:
        results["results"] += run_shape(Shape.parse(name), args, bandwidth)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    table = markdown(results)
    (out / "results.md").write_text(table + "\n")
    report.draw_if_available(plot, results, out / "results.png")
    print(table)
    return results


if __name__ == "__main__":
    main()
