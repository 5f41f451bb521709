"""Benchmark cases (shape + rotating input sets) and the registry of timed variants.

A variant is a name, a direction, a timing method and a builder ``build(case) -> step``,
where ``step(i)`` runs one call on input set ``i`` and returns its outputs (``fwd``: the
output rows; ``bwd`` and ``fwd+bwd``: ``(grad_kv, grad_score, grad_ape)``). Adding a row is
one ``register(...)`` call.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import baselines
import torch

from csa_ops import offsets_for, reference

DIRECTIONS = ("fwd", "bwd", "fwd+bwd")
_SHAPE_RE = re.compile(r"^r(\d+)c([12])_(\d+)x(\d+)_d(\d+)$")


@dataclass(frozen=True)
class Shape:
    ratio: int
    coff: int
    segments: int
    seqlen: int
    head_dim: int

    @classmethod
    def parse(cls, text: str) -> Shape:
        match = _SHAPE_RE.match(text.strip())
        if match is None:
            raise ValueError(f"shape {text!r} is not of the form r<ratio>c<coff>_<B>x<len>_d<d>, "
                             "e.g. r4c2_3x8192_d512")
        return cls(*(int(g) for g in match.groups()))

    @property
    def name(self) -> str:
        return f"r{self.ratio}c{self.coff}_{self.segments}x{self.seqlen}_d{self.head_dim}"

    @property
    def tokens(self) -> int:
        return self.segments * self.seqlen

    @property
    def rows(self) -> int:
        return self.segments * (self.seqlen // self.ratio)


def algorithmic_bytes(shape: Shape, itemsize: int) -> dict[str, int]:
    """The DRAM floor's bytes: each input read once, each output written once (ape and offsets
    ignored)."""
    inputs = 2 * shape.tokens * shape.coff * shape.head_dim * itemsize  # kv + score
    rows = shape.rows * shape.head_dim * itemsize
    fwd = inputs + rows
    bwd = fwd + inputs  # + grad_out (same size as out) read, grad_kv/grad_score written
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}


@dataclass
class Case:
    """One shape's inputs on one device: ``num_sets`` independent input sets to rotate over."""

    shape: Shape
    device: torch.device
    dtype: torch.dtype
    num_sets: int
    cu: torch.Tensor = field(init=False)
    cuc: torch.Tensor = field(init=False)
    sets: list[dict[str, torch.Tensor]] = field(init=False)
    norm_weight: torch.Tensor = field(init=False)

    def __post_init__(self):
        s = self.shape
        self.cu, self.cuc = offsets_for([s.seqlen] * s.segments, s.ratio, device=self.device)
        width = s.coff * s.head_dim
        gen = torch.Generator(device=self.device).manual_seed(0)

        def randn(*size, dtype=self.dtype, scale=1.0):
            return (torch.randn(*size, generator=gen, device=self.device) * scale).to(dtype)

        # Random data, never zeros: zeros hide unwritten outputs and time differently.
        self.sets = [{"kv": randn(s.tokens, width), "score": randn(s.tokens, width),
                      "ape": randn(s.ratio, width, dtype=torch.float32, scale=0.5),
                      "grad_out": randn(s.rows, s.head_dim)} for _ in range(self.num_sets)]
        self.norm_weight = randn(s.head_dim, scale=0.1) + 1.0

    @property
    def total_comp(self) -> int:
        return self.shape.rows

    def args(self, i: int, grad: bool = False):
        """(kv, score, ape, cu, cuc) of set ``i``; ``grad`` gives fresh leaves needing grad."""
        t = self.sets[i % self.num_sets]
        kv, score, ape = t["kv"], t["score"], t["ape"]
        if grad:
            kv, score, ape = (x.detach().requires_grad_() for x in (kv, score, ape))
        return kv, score, ape, self.cu, self.cuc

    def grad_out(self, i: int) -> torch.Tensor:
        return self.sets[i % self.num_sets]["grad_out"]

    def expected(self, direction: str, rms_norm: bool = False):
        """csa_ops.reference's answer on set 0 (the correctness comparator of every variant)."""
        kv, score, ape, cu, cuc = self.args(0)
        s = self.shape
        out = reference.compressor_reference(kv, score, ape, cu, cuc, s.ratio, s.coff,
                                             self.total_comp)
        if direction == "fwd":
            return (baselines.rms_norm(out, self.norm_weight),) if rms_norm else (out,)
        grad_out = self.grad_out(0)
        if rms_norm:  # chain rule through the norm, then the reference backward
            out = out.detach().requires_grad_()
            grad_out, = torch.autograd.grad(baselines.rms_norm(out, self.norm_weight), out,
                                            grad_out)
        return reference.compressor_backward_reference(grad_out, kv, score, ape, cu, cuc,
                                                       s.ratio, s.coff)


def tolerance(dtype: torch.dtype, direction: str) -> float:
    """Max error over max |expected|: a couple of output rounding steps (softmax order differs)."""
    eps = torch.finfo(dtype).eps
    return max((2 if direction == "fwd" else 4) * eps, 1e-5)


def check(outputs, expected, tol: float) -> tuple[bool, list[float]]:
    """(ok, per-output scaled max error); NaN or a shape mismatch never passes."""
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    errors = []
    for got, want in zip(outputs, expected, strict=True):
        if got.shape != want.shape:
            return False, [float("inf")]
        got, want = got.detach().double(), want.detach().double()
        scale = want.abs().max().item() if want.numel() else 1.0
        err = (got - want).abs().max().item() / max(scale, 1e-30) if want.numel() else 0.0
        errors.append(float("nan") if got.isnan().any().item() else err)
    return all(e <= tol for e in errors), errors


# ---------------------------------------------------------------------------------------
# Registry


@dataclass(frozen=True)
class Variant:
    name: str
    direction: str                 # "fwd" | "bwd" | "fwd+bwd"
    timing: str                    # "wall": events around back-to-back calls; "graph": replay
    build: Callable[[Case], Callable[[int], Any]]
    rms_norm: bool = False         # the step applies RMSNorm after the compressor
    compiled: bool = False         # first call compiles (its time is reported separately)
    role: str | None = None        # "eager" / "compiled": the speedup baselines

    @property
    def cuda_only(self) -> bool:
        return self.timing == "graph"


VARIANTS: dict[str, Variant] = {}


def register(variant: Variant) -> Variant:
    if variant.direction not in DIRECTIONS or variant.timing not in ("wall", "graph"):
        raise ValueError(f"bad variant {variant}")
    VARIANTS[variant.name] = variant
    return variant


def _op(kv, score, ape, cu, cuc, ratio, coff, total_comp):
    return torch.ops.csa.compressor(kv, score, ape, cu, cuc, ratio, coff, total_comp)


def region(compressor, rms_norm: bool):
    """The timed region: the compressor alone, or followed by RMSNorm (the fusion target)."""
    if not rms_norm:
        return compressor

    def compressor_then_norm(kv, score, ape, cu, cuc, ratio, coff, total_comp, weight):
        return baselines.rms_norm(compressor(kv, score, ape, cu, cuc, ratio, coff, total_comp),
                                  weight)
    return compressor_then_norm


def compiled(fn):
    # Static shapes: the honest best case of torch.compile for one production shape.
    return torch.compile(fn, fullgraph=True, dynamic=False)


def forward_step(case: Case, fn, rms_norm: bool = False):
    """``fn`` is a region (see ``region``) taking the weight of RMSNorm when ``rms_norm``."""
    s = case.shape
    extra = (case.norm_weight,) if rms_norm else ()

    def step(i):
        kv, score, ape, cu, cuc = case.args(i)
        return fn(kv, score, ape, cu, cuc, s.ratio, s.coff, case.total_comp, *extra)
    return step


def fwd_bwd_step(case: Case, fn, rms_norm: bool = False):
    s = case.shape
    extra = (case.norm_weight,) if rms_norm else ()
    # Leaves made once per set so the timed loop holds no allocation of its own.
    leaves = [case.args(i, grad=True) for i in range(case.num_sets)]

    def step(i):
        kv, score, ape, cu, cuc = leaves[i % case.num_sets]
        out = fn(kv, score, ape, cu, cuc, s.ratio, s.coff, case.total_comp, *extra)
        return torch.autograd.grad(out, (kv, score, ape), case.grad_out(i))
    return step


def op_backward_step(case: Case):
    s = case.shape

    def step(i):
        kv, score, ape, cu, cuc = case.args(i)
        return torch.ops.csa.compressor_backward(case.grad_out(i), kv, score, ape, cu, cuc,
                                                 s.ratio, s.coff)
    return step


def _steps(direction: str):
    return forward_step if direction == "fwd" else fwd_bwd_step


def lowering_modes() -> tuple[str, ...]:
    """The Inductor lowering modes csa_ops.lowering offers (none when it is not registered)."""
    try:
        from csa_ops import lowering
    except ImportError:
        return ()
    if not getattr(lowering, "available", False) or not hasattr(lowering, "set_mode"):
        return ()
    modes = tuple(getattr(lowering, "MODES", ()))
    # "auto" picks extern or generate per call: timed last, it can reuse their Triton builds.
    return tuple(sorted(modes, key=lambda m: m == "auto"))


def lowering_mode() -> str | None:
    """The current lowering mode, or None when csa_ops.lowering offers no switch."""
    if not lowering_modes():
        return None
    from csa_ops import lowering
    return lowering.get_mode()


def set_lowering_mode(mode: str | None) -> None:
    if mode is not None:
        from csa_ops import lowering
        lowering.set_mode(mode)  # resets dynamo when the mode changes


def op_compiled_builder(direction: str, rms_norm: bool, mode: str | None):
    def build(case: Case):
        set_lowering_mode(mode)  # the compile happens at the first call, under this mode
        return _steps(direction)(case, compiled(region(_op, rms_norm)), rms_norm)
    return build


def _register_defaults() -> None:
    eager = baselines.compressor_eager
    for timing in ("wall", "graph"):
        suffix, role = ("", "eager") if timing == "wall" else (" (graph)", None)
        for direction in ("fwd", "fwd+bwd"):
            register(Variant(f"eager ref {direction}{suffix}", direction, timing,
                             lambda c, d=direction: _steps(d)(c, eager), role=role))
    for direction in ("fwd", "fwd+bwd"):
        register(Variant(f"compiled ref {direction}", direction, "wall",
                         lambda c, d=direction: _steps(d)(c, compiled(eager)), compiled=True,
                         role="compiled"))
    for timing in ("wall", "graph"):
        suffix = " call" if timing == "wall" else " kernel (graph)"
        register(Variant(f"op fwd{suffix}", "fwd", timing, lambda c: forward_step(c, _op)))
        register(Variant(f"op bwd{suffix}", "bwd", timing, op_backward_step))
        register(Variant(f"op fwd+bwd{suffix}", "fwd+bwd", timing,
                         lambda c: fwd_bwd_step(c, _op)))
    register(Variant("op fwd call +RMSNorm", "fwd", "wall",
                     lambda c: forward_step(c, region(_op, True), True), rms_norm=True))
    # One row set per lowering mode; without csa_ops.lowering the op compiles as an opaque
    # extern call.
    modes = lowering_modes()
    for mode in modes or (None,):
        tag = f" [{mode}]" if mode else ""
        rows = [("fwd", False), ("fwd", True), ("fwd+bwd", False)]
        for direction, norm in rows:
            name = f"op compiled{tag} {direction}" + (" +RMSNorm" if norm else "")
            # Wall time shows the host cost of each path; graph time (CUDA-graph replay,
            # as under mode="reduce-overhead") the device time the lowering decides on.
            for timing, suffix in (("wall", ""), ("graph", " (graph)")):
                register(Variant(name + suffix, direction, timing,
                                 op_compiled_builder(direction, norm, mode), rms_norm=norm,
                                 compiled=True))

_register_defaults()
