"""Shared test utilities: pack builders and an independent eager model of the op.

`eager_compressor` is written from SPEC section 1 alone (per-segment block views,
`torch.softmax`, autograd for the backward); it shares no code with csa_ops.reference,
so agreement between the two is evidence, not tautology. No expecttest import here: the
GPU machine lacks it.
"""

from __future__ import annotations

import contextlib

import dataclasses
import itertools
import math

import pytest
import torch

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


def spec_id(spec: PackSpec) -> str:
    lengths = "-".join(str(n) for n in spec.lengths) or "none"
    return (f"r{spec.ratio}_c{spec.coff}_d{spec.head_dim}_L{lengths}"
            f"_t{spec.extra_tokens}_p{spec.extra_rows}")


def spec_params(specs, marks=()):
    return [pytest.param(spec, id=spec_id(spec), marks=marks) for spec in specs]


# Every ratio, coff and head_dim of the matrix appears at least once; every pack has
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


def eager_compressor(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio: int, coff: int,
                     total_comp=None):
    """SPEC section 1 written directly: per segment, (blocks, window, d) logits and values,
    torch.softmax over the window, weighted sum. Differentiable through autograd."""
    acc = torch.float64 if kv.dtype == torch.float64 else torch.float32
    cu = [int(x) for x in cu_seqlens.tolist()]
    true_rows = int(cu_seqlens_comp[-1])
    head_dim = kv.shape[1] // coff
    ape_halves = ape.to(acc).reshape(ratio, coff, head_dim)
    rows = []
    for start, end in itertools.pairwise(cu):
        blocks = (end - start) // ratio
        if blocks == 0:
            continue
        take = slice(start, start + blocks * ratio)
        kv_blocks = kv[take].to(acc).reshape(blocks, ratio, coff, head_dim)
        score_blocks = score[take].to(acc).reshape(blocks, ratio, coff, head_dim)
        # The own block's tokens sit in the last coff-half of the columns.
        logits = score_blocks[:, :, -1] + ape_halves[:, -1]
        values = kv_blocks[:, :, -1]
        if coff == 2:
            # Block b also sees block b-1's first half; block 0 sees constants instead.
            no_logit = torch.full((1, ratio, head_dim), float("-inf"), dtype=acc,
                                  device=kv.device)
            no_value = torch.zeros((1, ratio, head_dim), dtype=acc, device=kv.device)
            prev_logits = torch.cat([no_logit, score_blocks[:-1, :, 0] + ape_halves[:, 0]])
            prev_values = torch.cat([no_value, kv_blocks[:-1, :, 0]])
            logits = torch.cat([prev_logits, logits], dim=1)
            values = torch.cat([prev_values, values], dim=1)
        rows.append((torch.softmax(logits, dim=1) * values).sum(dim=1))
    # An empty slice of kv keeps the graph connected when no segment has a block.
    out = torch.cat(rows) if rows else kv[:0, :head_dim].to(acc)
    if out.shape[0] != true_rows:
        raise AssertionError(f"test pack inconsistent: {out.shape[0]} rows, cuc[-1]={true_rows}")
    if total_comp is not None:
        out = torch.cat([out, out.new_zeros(total_comp - true_rows, head_dim)])
    return out.to(kv.dtype)


def eager_forward_backward(pack: Pack, grad_out, total_comp="capacity", dtype=None):
    """(out, grad_kv, grad_score, grad_ape) of eager_compressor; optionally upcast inputs."""
    leaves = [t.detach().clone() for t in (pack.kv, pack.score, pack.ape)]
    if dtype is not None:
        leaves = [t.to(dtype) for t in leaves]
        grad_out = grad_out.to(dtype)
    for leaf in leaves:
        leaf.requires_grad_(True)
    tc = pack.spec.capacity if total_comp == "capacity" else total_comp
    out = eager_compressor(*leaves, pack.cu_seqlens, pack.cu_seqlens_comp, pack.ratio, pack.coff,
                           tc)
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


def assert_bitwise_equal(actual, expected, name=""):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, name
    same = (actual == expected) | (torch.isnan(actual) & torch.isnan(expected))
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
