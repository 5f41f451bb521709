"""Inductor IR for both directions of csa::compressor: the "generate" path.

Windows of up to ``UNROLL_MAX`` entries are unrolled inside one Pointwise per output element
in ``csa_ops.reference``'s exact expression order (bit-identical on CUDA under
emulate_precision_casts where Inductor has mul_rn/div_rn; C++ exp may differ from ATen's by an
ulp), so a following RMSNorm fuses into the same kernel; longer windows use Reduction IR (max,
sum, weighted sum) and match within rounding. Nothing of window size (rows * W * d) is ever
materialized: the backward keeps three (rows, d) statistics and recomputes each entry. Inputs
and outputs are rounded to their dtypes like eager tensors also where Inductor fuses a producer
or consumer (``_rounded``): fusing adds or drops no rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch
from torch._inductor import ir
from torch._inductor.ops_handler import OpsHandler
from torch._inductor.virtualized import V, ops
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

from . import _versions

# Largest window (coff * ratio) computed as one unrolled expression per element: beyond it the
# per-thread live state (W exponentials) would spill; Reduction IR keeps it bounded. Not tuned.
UNROLL_MAX = 16

I64 = torch.int64
# Round-to-nearest mul/div where both ops exist (torch 2.12 on; 2.11 has no div_rn): a
# rounded product that Triton never contracts into an FMA, and IEEE division instead of
# Triton's approximate div.full. The version adapter is this feature test, not a version number.
EXACT_ROUNDING = hasattr(OpsHandler, "mul_rn") and hasattr(OpsHandler, "div_rn")


def _mul(a, b):
    return ops.mul_rn(a, b) if EXACT_ROUNDING else ops.mul(a, b)


def _div(a, b):
    return ops.div_rn(a, b) if EXACT_ROUNDING else ops.truediv(a, b)


def _i64(x):
    return ops.to_dtype(x, I64)


def _const(value, dtype=I64):
    return ops.constant(value, dtype)


def _index(expr):
    return ops.index_expr(sympy.sympify(expr), I64)


LOW_PRECISION = (torch.bfloat16, torch.float16)
# Before torch 2.13 the C++ backend answers a consumer's upcast of every fp32-to-bf16/fp16
# conversion, store-type casts included, from its CSE cache with the unrounded fp32 value.
CPP_CACHES_STORE_CASTS = _versions.release() < (2, 13)


def _rounded(x, dtype, device: torch.device):
    """x as a ``dtype`` value that stays rounded when Inductor fuses a consumer. A plain
    to_dtype to bf16/fp16 does not: Triton computes it in fp32, and the C++ backend answers the
    consumer's upcast from its CSE cache with the unrounded x. A store-type cast
    (use_compute_types=False) rounds and is not cached, as in emulate_precision_casts."""
    if dtype not in LOW_PRECISION:
        return ops.to_dtype(x, dtype)
    stored = ops.to_dtype(x, dtype, use_compute_types=False)
    if device.type == "cpu":
        if CPP_CACHES_STORE_CASTS:
            # Through fp64 and back (both exact): a new value that no cache entry maps back
            # to x, so the consumer's upcast converts the rounded bits.
            return ops.to_dtype(ops.to_dtype(stored, torch.float64), dtype)
        # C++ keeps it a bf16/fp16 value; a second to_dtype would be merged into this one.
        return stored
    return ops.to_dtype(stored, dtype)  # back to Triton's compute type, still rounded


def _acc_loader(buffer, acc):
    """Loader of buffer's elements in acc. Each is rounded to the buffer's dtype first: a fused
    producer may hand over its wider value, but the op's inputs are rounded tensors."""
    load, dtype, device = buffer.make_loader(), buffer.get_dtype(), buffer.get_device()
    return lambda index: ops.to_dtype(_rounded(load(index), dtype, device), acc)


@dataclass
class Problem:
    """Loaders, sizes and the specialised ints of one call, in lowering form."""

    kv: object         # kv, score, ape load in acc
    score: object
    ape: object
    cu: object
    cuc: object
    ratio: int
    coff: int
    head_dim: int | sympy.Expr
    tokens: sympy.Expr
    segments: sympy.Expr
    device: torch.device
    dtype: torch.dtype
    acc: torch.dtype
    ape_dtype: torch.dtype

    @property
    def window(self) -> int:
        return self.coff * self.ratio

    @property
    def unrolled(self) -> bool:
        return self.window <= UNROLL_MAX


def make_problem(kv, score, ape, cu, cuc, ratio: int, coff: int) -> Problem:
    tokens, width = kv.get_size()
    dtype = kv.get_dtype()
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return Problem(
        kv=_acc_loader(kv, acc), score=_acc_loader(score, acc), ape=_acc_loader(ape, acc),
        cu=cu.make_loader(), cuc=cuc.make_loader(), ratio=ratio, coff=coff,
        head_dim=V.graph.sizevars.simplify(FloorDiv(sympy.sympify(width), coff)),
        tokens=tokens, segments=cu.get_size()[0] - 1, device=kv.get_device(), dtype=dtype,
        acc=acc, ape_dtype=ape.get_dtype(),
    )


def is_empty(p: Problem, rows) -> bool:
    """Statically no work: the reference returns zeros for all of these."""
    known = V.graph.sizevars.statically_known_equals
    return known(rows, 0) or known(p.tokens, 0) or known(p.segments, 0)


def zeros(p: Problem, size, dtype):
    return ir.Pointwise.create(device=p.device, dtype=dtype,
                               inner_fn=lambda idx: ops.constant(0, dtype), ranges=list(size))


# ---------------------------------------------------------------------------------------
# Where rows and tokens sit in the pack


# Packs of at most this many segments (static shapes) find a segment by an unrolled
# comparison count inside the consuming kernel instead of a separate map kernel.
INLINE_SEGMENTS_MAX = 16


def _segment_map(p: Problem, bounds, positions):
    """Loader of seg[x] = #{s in 1..B : bounds[s] <= x}, the reference's
    searchsorted(right=True) before its clamp. A comparison count because Inductor's bucketize
    is not implemented on CPU: unrolled in the consumer for a few static segments, else one
    small (positions x B) reduction kernel."""
    static = sympy.sympify(p.segments)
    if static.is_number and int(static) <= INLINE_SEGMENTS_MAX:
        segments = int(static)

        def inline(idx):
            x = _index(idx[0])
            count = _const(0)
            for s in range(1, segments + 1):
                count = ops.add(count, _i64(ops.le(_i64(bounds([s])), x)))
            return count

        return inline

    def inner(idx, ridx):
        bound = _i64(bounds([ridx[0] + 1]))
        return ops.to_dtype(ops.le(bound, _index(idx[0])), torch.int32)

    seg = ir.Reduction.create(device=p.device, dst_dtype=torch.int32, src_dtype=torch.int32,
                              inner_fn=inner, ranges=[positions], reduction_ranges=[p.segments],
                              reduction_type="sum")
    seg.realize()
    return seg.make_loader()


def _segment(p: Problem, seg_loader, x):
    """Indirect index of the segment owning position x (clamped like the reference)."""
    seg = ops.minimum(_i64(seg_loader([x])), _index(p.segments - 1))
    return ops.indirect_indexing(seg, p.segments, check=False, wrap_neg=False)


@dataclass
class Row:
    block: object      # local block b of row n (int64 value)
    t0: object         # first own token cu[s] + b*ratio
    valid: object      # n < cuc[B]


def row_of(p: Problem, row_seg, n) -> Row:
    s = _segment(p, row_seg, n)
    n_v = _index(n)
    block = ops.sub(n_v, _i64(p.cuc([s])))
    t0 = ops.add(_i64(p.cu([s])), ops.mul(block, _const(p.ratio)))
    valid = ops.lt(n_v, _i64(p.cuc([p.segments])))
    return Row(block, t0, valid)


def entry(p: Problem, row: Row, krow, half, j):
    """(logit, value, valid) of window entry (krow, half) of a row at column j, in acc dtype.

    krow and half are ints (unrolled) or index expressions (reduction axes). Invalid entries
    get logit -inf and value 0 exactly as in the reference; their loads stay in bounds."""
    offset = krow + (half - 1) * p.ratio if p.coff == 2 else krow
    token = ops.add(row.t0, _index(offset) if not isinstance(offset, int) else _const(offset))
    valid = ops.and_(row.valid, ops.and_(ops.ge(token, _const(0)),
                                         ops.lt(token, _index(p.tokens))))
    if p.coff == 2:
        if isinstance(half, int):
            if half == 0:
                valid = ops.and_(valid, ops.gt(row.block, _const(0)))
        else:
            # half == 1 or block > 0 (block >= 0 on valid rows); one compare, no or_ (the
            # C++ vectorizer cannot or a vector mask with a scalar bool).
            valid = ops.and_(valid, ops.gt(ops.add(row.block, _index(half)), _const(0)))
    t = ops.indirect_indexing(ops.where(valid, token, _const(0)), p.tokens, check=False,
                              wrap_neg=False)
    col = half * p.head_dim + j
    logit = ops.add(p.score([t, col]), p.ape([krow, col]))
    logit = ops.where(valid, logit, ops.constant(float("-inf"), p.acc))
    value = ops.where(valid, p.kv([t, col]), ops.constant(0.0, p.acc))
    return logit, value, valid


def _split(p: Problem, k):
    """(krow, half) of window entry k (an int or an index expression)."""
    if p.coff == 1:
        return k, 0
    if isinstance(k, int):
        return k % p.ratio, k // p.ratio
    return ModularIndexing(k, 1, p.ratio), FloorDiv(k, p.ratio)


# ---------------------------------------------------------------------------------------
# Window statistics over (rows, d)


def _unrolled_window(p: Problem, row_seg, n, j):
    row = row_of(p, row_seg, n)
    entries = [entry(p, row, *_split(p, k), j) for k in range(p.window)]
    logits = [e[0] for e in entries]
    m = logits[0]
    for logit in logits[1:]:
        m = ops.maximum(m, logit)
    exps = [ops.exp(ops.sub(logit, m)) for logit in logits]
    total = exps[0]
    for e in exps[1:]:
        total = ops.add(total, e)
    probs = [_div(e, total) for e in exps]
    return row, m, total, probs, [e[1] for e in entries]


def _sequential_dot(a, b):
    acc = _mul(a[0], b[0])
    for x, y in zip(a[1:], b[1:]):
        acc = ops.add(acc, _mul(x, y))
    return acc


def _reduce(p: Problem, rows, inner, kind):
    red = ir.Reduction.create(device=p.device, dst_dtype=p.acc, src_dtype=p.acc, inner_fn=inner,
                              ranges=[rows, p.head_dim], reduction_ranges=[p.window],
                              reduction_type=kind)
    red.realize()
    return red.make_loader()


def _reduced_stats(p: Problem, row_seg, rows):
    """Loaders of the row max and exp-sum over the window, via Reduction IR."""

    def logit(idx, ridx):
        row = row_of(p, row_seg, idx[0])
        return entry(p, row, *_split(p, ridx[0]), idx[1])[:2]

    m = _reduce(p, rows, lambda idx, ridx: logit(idx, ridx)[0], "max")

    def exp_term(idx, ridx):
        return ops.exp(ops.sub(logit(idx, ridx)[0], m(idx)))

    s = _reduce(p, rows, exp_term, "sum")

    def prob_value(idx, ridx):
        return _div(exp_term(idx, ridx), s(idx)), logit(idx, ridx)[1]

    return m, s, prob_value


def forward(p: Problem, rows):
    """(rows, d) output in kv's dtype; rows past cuc[B] are exact zeros."""
    if is_empty(p, rows):
        return zeros(p, [rows, p.head_dim], p.dtype)
    row_seg = _segment_map(p, p.cuc, rows)
    if p.unrolled:
        def inner(idx):
            row, _, _, probs, values = _unrolled_window(p, row_seg, *idx)
            out = ops.where(row.valid, _sequential_dot(probs, values), ops.constant(0.0, p.acc))
            return _rounded(out, p.dtype, p.device)
    else:
        _, _, prob_value = _reduced_stats(p, row_seg, rows)
        out_acc = _reduce(p, rows, lambda idx, ridx: _mul(*prob_value(idx, ridx)), "sum")

        def inner(idx):
            row = row_of(p, row_seg, idx[0])
            return _rounded(ops.where(row.valid, out_acc(idx), ops.constant(0.0, p.acc)),
                            p.dtype, p.device)
    return ir.Pointwise.create(device=p.device, dtype=p.dtype, inner_fn=inner,
                               ranges=[rows, p.head_dim])


# ---------------------------------------------------------------------------------------
# Backward


def _realized(p: Problem, rows, inner):
    box = ir.Pointwise.create(device=p.device, dtype=p.acc, inner_fn=inner,
                              ranges=[rows, p.head_dim])
    box.realize()
    return box.make_loader()


def _backward_stats(p: Problem, row_seg, rows, grad):
    """Loaders of m, s and dot = sum_k (g*v_k)*p_k per (row, column); grad loads in acc."""
    if p.unrolled:
        def stat(which):
            def inner(idx):
                _, m, total, probs, values = _unrolled_window(p, row_seg, *idx)
                if which == "m":
                    return m
                if which == "s":
                    return total
                g = grad(idx)
                return _sequential_dot([_mul(g, v) for v in values], probs)
            return _realized(p, rows, inner)

        return stat("m"), stat("s"), stat("dot")
    m, s, prob_value = _reduced_stats(p, row_seg, rows)

    def dot_term(idx, ridx):
        prob, value = prob_value(idx, ridx)
        return _mul(_mul(grad(idx), value), prob)

    return m, s, _reduce(p, rows, dot_term, "sum")


def _grad_entry(p: Problem, stats, grad, n, j, logit, value):
    """(grad of value, grad of logit) of one window entry, in the reference's order."""
    m, s, dot = stats
    prob = _div(ops.exp(ops.sub(logit, m([n, j]))), s([n, j]))
    g = grad([n, j])
    grad_logit = ops.mul(prob, ops.sub(_mul(g, value), dot([n, j])))
    return ops.mul(prob, g), grad_logit


def _token_grads(p: Problem, stats, grad, rows):
    """grad_kv, grad_score over (T, coff*d): each element finds the one entry consuming it."""
    tok_seg = _segment_map(p, p.cu, p.tokens)

    def consumer(idx):
        t, c = idx
        half = FloorDiv(c, p.head_dim) if p.coff == 2 else 0
        s = _segment(p, tok_seg, t)
        start = _i64(p.cuc([s]))
        local = ops.sub(_index(t), _i64(p.cu([s])))
        safe = ops.maximum(local, _const(0))
        block = ops.floordiv(safe, _const(p.ratio))
        if p.coff == 2:
            # First-half columns of a token feed the next block's window.
            block = ops.add(block, ops.sub(_const(1), _index(half)))
        n = ops.add(start, block)
        in_row = ops.and_(ops.lt(n, _i64(p.cuc([s + 1]))), ops.lt(n, _index(rows)))
        valid = ops.and_(ops.and_(ops.ge(local, _const(0)), ops.ge(n, _const(0))), in_row)
        return valid, n, ops.remainder(safe, _const(p.ratio))

    def make(which):
        def inner(idx):
            t, c = idx

            def grads():
                # Masked: rows may be 0 at run time (an unbacked count), so nothing indexed by
                # the row is read unless an entry really consumes this element. A masked body
                # is its own subgraph: it recomputes the (cheap) index math.
                valid, n, krow = consumer(idx)
                row = ops.indirect_indexing(ops.where(valid, n, _const(0)), rows, check=False,
                                            wrap_neg=False)
                kr = ops.indirect_indexing(krow, p.ratio, check=False, wrap_neg=False)
                j = ModularIndexing(c, 1, p.head_dim) if p.coff == 2 else c
                logit = ops.add(p.score([t, c]), p.ape([kr, c]))
                value = p.kv([t, c])
                return _grad_entry(p, stats, grad, row, j, logit, value)[which]

            return _rounded(ops.masked(consumer(idx)[0], grads, 0.0), p.dtype, p.device)

        return ir.Pointwise.create(device=p.device, dtype=p.dtype, inner_fn=inner,
                                   ranges=[p.tokens, p.coff * p.head_dim])

    return make(0), make(1)


def _grad_ape(p: Problem, stats, grad, row_seg, rows):
    """Sum over rows of each entry's logit gradient (fixed-order reduction, no atomics)."""
    width = p.coff * p.head_dim

    def inner(idx, ridx):
        krow, c = idx
        n = ridx[0]
        half = FloorDiv(c, p.head_dim) if p.coff == 2 else 0
        j = ModularIndexing(c, 1, p.head_dim) if p.coff == 2 else c
        row = row_of(p, row_seg, n)
        logit, value, valid = entry(p, row, krow, half, j)
        grad_logit = _grad_entry(p, stats, grad, n, j, logit, value)[1]
        return ops.where(valid, grad_logit, ops.constant(0.0, p.acc))

    total = ir.Reduction.create(device=p.device, dst_dtype=p.acc, src_dtype=p.acc,
                                inner_fn=inner, ranges=[p.ratio, width], reduction_ranges=[rows],
                                reduction_type="sum")
    total.realize()
    if p.ape_dtype == p.acc:
        return total
    loader = total.make_loader()
    # Reduced in acc, rounded once to ape's dtype (bf16 after a model.to(torch.bfloat16)).
    return ir.Pointwise.create(device=p.device, dtype=p.ape_dtype,
                               inner_fn=lambda idx: _rounded(loader(idx), p.ape_dtype, p.device),
                               ranges=[p.ratio, width])


def backward(p: Problem, grad_out):
    """(grad_kv, grad_score, grad_ape) with the shapes and dtypes of the inputs."""
    rows = grad_out.get_size()[0]
    width = p.coff * p.head_dim
    if is_empty(p, rows):
        return (zeros(p, [p.tokens, width], p.dtype), zeros(p, [p.tokens, width], p.dtype),
                zeros(p, [p.ratio, width], p.ape_dtype))
    grad = _acc_loader(grad_out, p.acc)
    row_seg = _segment_map(p, p.cuc, rows)
    stats = _backward_stats(p, row_seg, rows, grad)
    grad_kv, grad_score = _token_grads(p, stats, grad, rows)
    return grad_kv, grad_score, _grad_ape(p, stats, grad, row_seg, rows)
