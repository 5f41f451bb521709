"""Shared test utilities: pack builders and the eager region, the op's comparator.

`eager_region` is the op's formula as models write it (gathered windows,
`torch.softmax`, a weighted sum, autograd for the backward), run on its inputs' device; it
shares no code with csa_ops.reference, so agreement between the two is evidence, not
tautology. No expecttest import here: the GPU machine lacks it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import itertools
import math
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"

EPS = {torch.float64: 2.0**-52, torch.float32: 2.0**-23, torch.float16: 2.0**-10,
       torch.bfloat16: 2.0**-7}
# Smallest normal exponent per dtype: below it the spacing of representable values is fixed.
MIN_EXP = {torch.float64: -1022, torch.float32: -126, torch.float16: -14, torch.bfloat16: -126}


def offsets(lengths, ratio: int, device="cpu"):
    """(cu_seqlens, cu_seqlens_comp) int32 computed in plain Python."""
    cu, cuc = [0], [0]
    for length in lengths:
        cu.append(cu[-1] + length)
        cuc.append(cuc[-1] + length // ratio)
    as_int32 = {"dtype": torch.int32, "device": device}
    return torch.tensor(cu, **as_int32), torch.tensor(cuc, **as_int32)


@dataclasses.dataclass(frozen=True)
class PackSpec:
    """A THD pack: segment lengths plus spare token capacity and spare output rows."""

    lengths: tuple
    ratio: int
    coff: int
    head_dim: int
    extra_tokens: int = 0  # token capacity beyond cu_seqlens[-1]
    extra_rows: int = 0    # static capacity beyond the true row count

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths) + self.extra_tokens

    @property
    def true_rows(self) -> int:
        return sum(length // self.ratio for length in self.lengths)

    @property
    def capacity(self) -> int:
        return self.true_rows + self.extra_rows


@dataclasses.dataclass
class Pack:
    spec: PackSpec
    kv: torch.Tensor
    score: torch.Tensor
    ape: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_comp: torch.Tensor

    @property
    def ratio(self) -> int:
        return self.spec.ratio

    @property
    def coff(self) -> int:
        return self.spec.coff

    def tensors(self):
        return self.kv, self.score, self.ape, self.cu_seqlens, self.cu_seqlens_comp

    def args(self, total_comp="capacity"):
        """Positional arguments of torch.ops.csa.compressor; total_comp defaults to capacity."""
        if total_comp == "capacity":
            total_comp = self.spec.capacity
        return (*self.tensors(), self.ratio, self.coff, total_comp)

    def rows(self, total_comp="capacity") -> int:
        return self.spec.capacity if total_comp == "capacity" else (
            self.spec.true_rows if total_comp is None else total_comp)

    def grad_out(self, total_comp="capacity", seed: int = 1):
        gen = torch.Generator().manual_seed(seed)
        shape = (self.rows(total_comp), self.spec.head_dim)
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(
            device=self.kv.device, dtype=self.kv.dtype)

    def leaves(self):
        """Fresh requires-grad copies of kv, score, ape."""
        return tuple(t.detach().clone().requires_grad_(True) for t in (self.kv, self.score,
                                                                         self.ape))


def make_pack(spec: PackSpec, dtype=torch.float32, device="cpu", seed: int = 0,
              score_scale: float = 2.0, ape_dtype=torch.float32) -> Pack:
    """Random pack; values drawn in fp64 so every dtype sees the same numbers (rounded)."""
    gen = torch.Generator().manual_seed(seed)
    width = spec.coff * spec.head_dim

    def draw(rows, scale):
        return torch.randn(rows, width, generator=gen, dtype=torch.float64) * scale

    kv = draw(spec.num_tokens, 1.0).to(device=device, dtype=dtype)
    score = draw(spec.num_tokens, score_scale).to(device=device, dtype=dtype)
    ape = draw(spec.ratio, 0.5).to(device=device, dtype=ape_dtype)
    cu, cuc = offsets(spec.lengths, spec.ratio, device=device)
    return Pack(spec, kv, score, ape, cu, cuc)


def config_id(cfg) -> str:
    """Test id of a (ratio, coff, head_dim, torch dtype) configuration."""
    ratio, coff, head_dim, dtype = cfg
    return f"r{ratio}_c{coff}_d{head_dim}_{str(dtype).split('.')[-1]}"


def spec_id(spec: PackSpec) -> str:
    lengths = "-".join(str(n) for n in spec.lengths) or "none"
    return (f"r{spec.ratio}_c{spec.coff}_d{spec.head_dim}_L{lengths}"
            f"_t{spec.extra_tokens}_p{spec.extra_rows}")


def spec_params(specs, marks=()):
    return [pytest.param(spec, id=spec_id(spec), marks=marks) for spec in specs]


# Every ratio, coff and head_dim of the test matrix appears at least once; every pack has
# at least one of: empty segment, segment shorter than ratio, tail, spare rows, spare tokens.
MATRIX = (
    PackSpec((3, 0, 5), ratio=1, coff=1, head_dim=7, extra_tokens=2, extra_rows=2),
    PackSpec((4, 1, 0, 2), ratio=1, coff=2, head_dim=1, extra_rows=1),
    PackSpec((5, 0, 1, 8), ratio=2, coff=2, head_dim=65, extra_tokens=3, extra_rows=1),
    PackSpec((7, 1), ratio=2, coff=1, head_dim=128, extra_rows=3),
    PackSpec((7, 2, 0, 9), ratio=3, coff=1, head_dim=128, extra_rows=3),
    PackSpec((11, 2, 6), ratio=3, coff=2, head_dim=7, extra_tokens=1),
    PackSpec((9, 3, 0, 16), ratio=4, coff=2, head_dim=128, extra_tokens=4, extra_rows=2),
    PackSpec((13, 4, 0), ratio=4, coff=1, head_dim=1, extra_tokens=2),
    PackSpec((35, 15, 0, 16), ratio=16, coff=1, head_dim=65, extra_rows=1),
    PackSpec((50, 0, 16, 9), ratio=16, coff=2, head_dim=7, extra_tokens=5, extra_rows=2),
    PackSpec((300, 127, 0, 128), ratio=128, coff=1, head_dim=7, extra_tokens=3, extra_rows=2),
    PackSpec((260, 50, 129), ratio=128, coff=2, head_dim=1, extra_rows=1),
)


def _window_tokens(cu_seqlens, ratio: int, coff: int):
    """(rows, W) token of every window entry and whether the entry is real. Row of
    block b of a segment, t0 = its first token: tokens t0 + k (coff 1), or t0 - ratio + k
    (coff 2: entries k < ratio are the previous block, which a segment's first block lacks)."""
    starts = [torch.zeros(0, dtype=torch.int64)]
    first = [torch.zeros(0, dtype=torch.bool)]
    for start, end in itertools.pairwise(int(x) for x in cu_seqlens.tolist()):
        blocks = torch.arange((end - start) // ratio)
        starts.append(start + blocks * ratio)
        first.append(blocks == 0)
    t0, first = torch.cat(starts), torch.cat(first)
    k = torch.arange(coff * ratio)
    if coff == 1:
        return t0[:, None] + k, torch.ones(t0.shape[0], ratio, dtype=torch.bool)
    return t0[:, None] - ratio + k, ~(first[:, None] & (k < ratio))


def region_windows(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio: int, coff: int):
    """(sg, kvg) of the eager region, the numerics contract's comparator: the gathered
    (rows, W, d) windows in fp32 (fp64 for fp64 kv), sg = score upcast + ape upcast, -inf/0
    where a segment's first block has no previous block."""
    acc = torch.float64 if kv.dtype == torch.float64 else torch.float32
    head_dim = kv.shape[1] // coff
    token, valid = (t.to(kv.device) for t in _window_tokens(cu_seqlens, ratio, coff))
    true_rows = int(cu_seqlens_comp[-1])
    if token.shape[0] != true_rows:
        raise AssertionError(f"test pack inconsistent: {token.shape[0]} rows, cuc[-1]={true_rows}")
    k = torch.arange(coff * ratio, device=kv.device)
    half = k // ratio  # which coff-half of the columns entry k reads
    token = token.clamp(min=0)  # the entries this moves are masked below

    def gather(x):
        return x.reshape(x.shape[0], coff, head_dim)[token, half].to(acc)

    ape_w = ape.to(acc).reshape(ratio, coff, head_dim)[k % ratio, half]
    real = valid[:, :, None]
    sg = torch.where(real, gather(score) + ape_w, float("-inf"))
    kvg = torch.where(real, gather(kv), 0.0)
    return sg, kvg


def cancel_in_pairs(kv: torch.Tensor, score: torch.Tensor) -> None:
    """Makes windows that nearly cancel, in place: token pairs (2t, 2t + 1) get opposite kv
    and logits 0 and 2**-9 (with ape zero), so |out| is about 2**-9 sum(p|v|) / sqrt(W): no
    column certifies, and the roundings do not cancel symmetrically (exact pairs would sum
    to 0 in any order). Windows hold whole pairs where ratio and segment starts are even."""
    pairs = kv.shape[0] // 2
    kv[1:2 * pairs:2] = -kv[0:2 * pairs:2]
    score.zero_()
    score[1::2] = 2.0**-9


def cancel_near_threshold(pack: Pack, seed: int) -> torch.Tensor:
    """Makes every output column cancel to a chosen degree, in place, and returns the
    degrees reached: (rows, d) fp64 |out| / sum(p|v|) of the eager region. Logits are
    uniform in [-1, 0] (ape zero) and each window's last entry (the row's own last token,
    column half coff-1) is set so that the ratio would be log-uniform in [1e-4, 1e-1]
    before its rounding to kv's dtype: a range across the fast forwards' certificates
    (about 2e-3 at window 8 in bf16), where a column's path flips between fast and exact."""
    spec, kv = pack.spec, pack.kv
    gen = torch.Generator(device=kv.device).manual_seed(seed)
    pack.ape.zero_()
    pack.score.copy_(-torch.rand(pack.score.shape, device=kv.device, generator=gen))
    token, _ = _window_tokens(pack.cu_seqlens, spec.ratio, spec.coff)
    sg, kvg = region_windows(*pack.tensors(), spec.ratio, spec.coff)
    p, v = torch.softmax(sg.double(), dim=1), kvg.double()
    partial = (p[:, :-1] * v[:, :-1]).sum(1)
    mag = (p[:, :-1] * v[:, :-1].abs()).sum(1)
    shape = partial.shape
    degree = 10.0 ** (-4 + 3 * torch.rand(shape, device=kv.device, generator=gen,
                                          dtype=torch.float64))
    sign = torch.where(torch.rand(shape, device=kv.device, generator=gen) < 0.5, -1.0, 1.0)
    last = (sign * degree * mag - partial) / p[:, -1]
    halves = kv.view(kv.shape[0], spec.coff, spec.head_dim)
    halves[token[:, -1].to(kv.device), spec.coff - 1] = last.to(kv.dtype)
    v = region_windows(*pack.tensors(), spec.ratio, spec.coff)[1].double()  # same logits, p
    return (p * v).sum(1).abs() / (p * v.abs()).sum(1)


def eager_region(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio: int, coff: int,
                 total_comp=None):
    """The eager region: w = softmax(sg, dim=1); out = (kvg * w).sum(dim=1) over region_windows,
    padding rows zero, rounded once to kv's dtype. Differentiable: the backward is torch
    autograd of this expression."""
    sg, kvg = region_windows(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff)
    w = torch.softmax(sg, dim=1)
    out = (kvg * w).sum(dim=1)
    true_rows, head_dim = out.shape
    if total_comp is not None:
        out = torch.cat([out, out.new_zeros(total_comp - true_rows, head_dim)])
    return out.to(kv.dtype)


def eager_forward_backward(pack: Pack, grad_out, total_comp="capacity", dtype=None):
    """(out, grad_kv, grad_score, grad_ape) of eager_region (grad_out upcast to fp32 by the
    autograd of its final cast, grads in the inputs' dtypes); optionally upcast inputs."""
    leaves = [t.detach().clone() for t in (pack.kv, pack.score, pack.ape)]
    if dtype is not None:
        leaves = [t.to(dtype) for t in leaves]
        grad_out = grad_out.to(dtype)
    for leaf in leaves:
        leaf.requires_grad_(True)
    tc = pack.spec.capacity if total_comp == "capacity" else total_comp
    out = eager_region(*leaves, pack.cu_seqlens, pack.cu_seqlens_comp, pack.ratio, pack.coff, tc)
    grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True, materialize_grads=True)
    return (out.detach(), *grads)


def op_forward_backward(pack: Pack, grad_out, total_comp="capacity"):
    """(out, grad_kv, grad_score, grad_ape) of torch.ops.csa.compressor through autograd."""
    kv, score, ape = pack.leaves()
    tc = pack.spec.capacity if total_comp == "capacity" else total_comp
    out = torch.ops.csa.compressor(kv, score, ape, pack.cu_seqlens, pack.cu_seqlens_comp,
                                   pack.ratio, pack.coff, tc)
    grads = torch.autograd.grad(out, (kv, score, ape), grad_out, allow_unused=True,
                                materialize_grads=True)
    return (out.detach(), *grads)


def cast_op_upcast(kv, score, ape, cu, cuc, ratio, coff, total_comp, dtype):
    """fp32 leaves cast to ``dtype`` (producers Inductor fuses into the op's loads), the op,
    an upcasting consumer; the casts' backward upcasts the op's gradients the same way. An
    elementwise consumer: a reduction would add Inductor's own summation order."""
    out = torch.ops.csa.compressor(kv.to(dtype), score.to(dtype), ape.to(dtype), cu, cuc, ratio,
                                   coff, total_comp)
    return out.float().square()


def consumed_step(fn, pack, dtype):
    """The consumer's output and the fp32 leaves' gradients for a fixed probe."""
    leaves = [t.float().requires_grad_(True) for t in (pack.kv, pack.score, pack.ape)]
    y = fn(*leaves, *pack.args()[3:], dtype)
    probe = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(y.device)
    return (y.detach(), *torch.autograd.grad(y, leaves, probe))


def assert_rounded_once(y, grads, dtype):
    """Values the consumers saw are values of ``dtype``: y = x^2 of a ``dtype`` x is exact in
    fp32, so its root is x again; the upcast gradients round-trip through ``dtype``."""
    root = y.sqrt()
    assert_bitwise_equal(root.to(dtype).float(), root, "consumer of the output")
    for name, grad in zip(("grad_kv", "grad_score", "grad_ape"), grads):
        assert_bitwise_equal(grad.to(dtype).float(), grad, f"consumer of {name}")


def train_block(model, fn, x, cu_seqlens, cu_seqlens_comp, total_comp, steps=3, lr=0.1):
    """(loss per step, final parameters) of SGD on sum(y * probe) for y = fn(x, ...), fn the
    block itself or a compiled one; a fixed probe, not sum(y^2) (RMSNorm rows have nearly
    constant norm, so that loss's gradient through the op would be rounding noise)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(7)
    probe, losses = None, []
    for _ in range(steps):
        torch.compiler.cudagraph_mark_step_begin()  # a no-op unless fn replays CUDA graphs
        optimizer.zero_grad()
        y = fn(x, cu_seqlens, cu_seqlens_comp, total_comp)
        if probe is None:
            probe = torch.randn(y.shape, generator=generator).to(y.device)
        loss = (y.float() * probe).sum()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().clone())
    return torch.stack(losses), {n: p.detach().clone() for n, p in model.named_parameters()}


def window(pack_or_spec) -> int:
    spec = getattr(pack_or_spec, "spec", pack_or_spec)
    return spec.ratio * spec.coff


def sum_tolerance(dtype, terms: int, scale: float) -> float:
    """Worst-case difference of two summation orders of `terms` values of size `scale`,
    both accumulated in `dtype` (linear in the term count, plus the exp/div roundings)."""
    return 4.0 * (terms + 4) * EPS[dtype] * scale


def ulp(x: torch.Tensor, dtype) -> torch.Tensor:
    """Spacing of `dtype` values at |x| (fp64 result), flushed to the subnormal spacing."""
    mantissa = round(-math.log2(EPS[dtype]))
    mag = x.detach().double().abs()
    exponent = torch.floor(torch.log2(mag.clamp_min(2.0 ** MIN_EXP[dtype])))
    return torch.exp2(exponent - mantissa)


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's elements as same-size integers: equal bits, not equal values (-0 differs from +0)."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def assert_bitwise_equal(actual, expected, name=""):
    """The same bits everywhere (a zero's sign included), except that NaN matches any NaN."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, name
    same = (bits(actual) == bits(expected)) | (torch.isnan(actual) & torch.isnan(expected))
    if not bool(same.all()):
        bad = (~same).nonzero()[:5].tolist()
        raise AssertionError(f"{name}: {int((~same).sum())} elements differ, first at {bad}")


def assert_within_one_step(actual, expected, name, max_fraction=None, atol=0.0):
    """|a - e| <= one rounding step of the output dtype (+ atol) everywhere; if max_fraction
    is given, at most max(1, max_fraction * numel) elements may differ at all."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, name
    if actual.numel() == 0:
        return
    a, e = actual.double(), expected.double()
    step = ulp(torch.maximum(a.abs(), e.abs()), actual.dtype)
    both_nan = torch.isnan(a) & torch.isnan(e)
    bad = ~(((a - e).abs() <= step + atol) | both_nan | (a == e))
    assert not bool(bad.any()), f"{name}: {int(bad.sum())} elements beyond one rounding step"
    if max_fraction is not None:
        differing = int(((a != e) & ~both_nan).sum())
        allowed = max(1, int(max_fraction * actual.numel()))
        assert differing <= allowed, f"{name}: {differing} elements differ (allowed {allowed})"


def tokens_beyond_cu(pack: Pack) -> slice:
    return slice(int(pack.cu_seqlens[-1]), pack.kv.shape[0])


def unconsumed_mask(spec: PackSpec) -> torch.Tensor:
    """(T, coff*d) bool: input elements that feed no window (tails, short segments, the
    first half of each segment's last block, tokens beyond cu_seqlens[-1])."""
    width = spec.coff * spec.head_dim
    mask = torch.ones(spec.num_tokens, width, dtype=torch.bool)
    start = 0
    for length in spec.lengths:
        blocks = length // spec.ratio
        used = slice(start, start + blocks * spec.ratio)
        if spec.coff == 1:
            mask[used] = False
        else:
            mask[used, spec.head_dim:] = False
            # First halves feed the next block: every block but the last one.
            mask[start:start + max(blocks - 1, 0) * spec.ratio, :spec.head_dim] = False
        start += length
    return mask


@contextlib.contextmanager
def use_lowering_mode(mode: str):
    """csa_ops.lowering policy inside the block, restored afterwards."""
    from csa_ops import lowering

    previous = lowering.get_mode()
    lowering.set_mode(mode)
    try:
        yield mode
    finally:
        lowering.set_mode(previous)


def bench_module(name: str):
    """A bench/ module, imported the way the scripts import their neighbours (bench/ on
    sys.path)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))
