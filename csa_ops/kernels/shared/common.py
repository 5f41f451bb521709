"""Device helpers shared by the compressor kernel families (CuTe DSL, arch-generic).

Float helpers pin IEEE round-to-nearest per operation: the kernels must reproduce the reference
bit for bit, and an FMA contracted by the compiler would change the rounding.
"""

from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, cute
from cutlass._mlir.dialects import llvm
from cutlass._mlir_helpers.math import RoundingMode

from ...config import CAPACITY_MESSAGE, TYPES
from . import torch_order

_RN = RoundingMode.NEAREST_EVEN
LOG2E = 1.4426950408889634  # exp(x) = 2**(x * LOG2E), for the ex2.approx softmax paths


def dsl_type(name: str) -> type:
    """The DSL element type of a config.TYPES name ("bfloat16" -> cutlass.BFloat16)."""
    return getattr(cutlass, TYPES[name].dsl)


@cute.jit
def add_rn(a: Float32, b: Float32) -> Float32:
    return cute.math.add(a, b, rounding=_RN)


@cute.jit
def sub_rn(a: Float32, b: Float32) -> Float32:
    # a - b == a + (-b) exactly (same rounding, same zero signs); the DSL's sub has no
    # rounding pin, and an unpinned sub after a mul may be contracted into an FMA.
    return cute.math.add(a, -b, rounding=_RN)


@cute.jit
def mul_rn(a: Float32, b: Float32) -> Float32:
    return cute.math.mul(a, b, rounding=_RN)


@cute.jit
def div_rn(a: Float32, b: Float32) -> Float32:
    return cute.math.div(a, b, rounding=_RN)


@cute.jit
def fma_rn(a: Float32, b: Float32, c: Float32) -> Float32:
    return cute.math.fma(a, b, c, rounding=_RN)


def torch_sum(terms: list) -> Float32:
    """sum(terms) in the order torch's CUDA sum over a short, non-innermost dimension uses
    (one thread per output, torch_order.ACCUMULATORS accumulators from +0, term k into
    accumulator k % 4 in passes of four, then ((a0 + a1) + a2) + a3). Trace-time Python: the
    terms are unrolled values."""
    n = torch_order.ACCUMULATORS
    acc = [Float32(0.0)] * n
    for k, term in enumerate(terms):
        acc[k % n] = add_rn(acc[k % n], term)
    total = acc[0]
    for a in acc[1:]:
        total = add_rn(total, a)
    return total


@cute.jit
def max_nan(a: Float32, b: Float32) -> Float32:
    # torch.amax propagates NaN (max.NaN.f32; plain max.f32 would drop it). The sign of a
    # zero maximum may differ from torch's, which cannot change exp(l - m) for any l.
    return cute.arch.fmax(a, b, nan=True)


# Below this, quotient residuals may underflow and the reciprocal shortcut may misround.
_MARKSTEIN_MIN = 2.0**-96


@cute.jit
def divide_into(rE: cute.Tensor, rP: cute.Tensor, s: Float32, n: cutlass.Constexpr[int]):
    """rP[k] = RN(rE[k] / s) for s in [1, inf) (a softmax denominator), as div.rn would.

    One IEEE reciprocal r = RN(1/s) per column; per k, q = RN(e*r) and two corrections
    q <- RN(q + RN(e - q*s)*r): the first makes q faithful, the second correctly rounded
    (Markstein's theorem; it needs no underflow, so a column holding a tiny e_k, zeros
    included, takes div.rn throughout).
    """
    # One compare per column; zeros (invalid entries) also take the exact path: rare.
    low = rE[0]
    for k in cutlass.range_constexpr(1, n):
        low = cute.arch.fmin(low, rE[k])
    if low < _MARKSTEIN_MIN:
        for k in cutlass.range_constexpr(n):
            rP[k] = div_rn(rE[k], s)
    else:
        r = div_rn(Float32(1.0), s)
        for k in cutlass.range_constexpr(n):
            q = mul_rn(rE[k], r)
            q = fma_rn(fma_rn(-q, s, rE[k]), r, q)  # now faithful
            rP[k] = fma_rn(fma_rn(-q, s, rE[k]), r, q)  # Markstein: correctly rounded


@cute.jit
def exp_accurate(x: Float32) -> Float32:
    # Lowers to libdevice expf (what torch.exp uses on CUDA), not ex2.approx.
    return cute.math.exp(x)


@cute.jit
def assert_rows_fit(rows: Int32, num_rows: Int32):
    """Stop the grid when a call has more rows than its output holds (a static capacity
    below the true count), whose rows past the capacity would otherwise be lost without a
    word. As torch's device-side asserts do: a message (config.CAPACITY_MESSAGE), then a
    trap, which fails the launch and leaves the CUDA context in error, so the next
    synchronization raises. The message has no arguments: printf's argument buffer would
    put local memory into every kernel. One thread per grid calls it (each caller prints)."""
    if rows > num_rows:
        cute.printf(CAPACITY_MESSAGE)
        llvm.intr_trap()


@cute.jit
def store_row_total(cuc: cute.Tensor, num_reqs: Int32, total: Int32, num_rows: Int32):
    """cu_seqlens_comp[-1] of a serving call (the rows its requests complete), written by
    the one thread that writes it, and assert_rows_fit of it."""
    cuc[num_reqs] = total
    assert_rows_fit(total, num_rows)


@cute.jit
def assert_offsets_fit(cuc: cute.Tensor, num_segs: Int32, num_rows: Int32):
    """assert_rows_fit of cu_seqlens_comp[-1] (cuc holds num_segs + 1 offsets), checked by
    the first thread of the grid's first CTA: one load, after the PDL wait."""
    tid, _, _ = cute.arch.thread_idx()
    bx, by, bz = cute.arch.block_idx()
    if tid == 0 and bx == 0 and by == 0 and bz == 0:
        assert_rows_fit(cuc[num_segs], num_rows)


@cute.jit
def await_upstream(pdl: cutlass.Constexpr[bool]):
    """Programmatic dependent launch: block until the grids this launch depends on have
    finished and flushed their writes, then let the next PDL launch in the stream start
    its CTAs as ours retire. Must precede the kernel's first global read or write (an
    upstream kernel may produce our inputs, or still read memory we write). A launch
    without the PDL attribute returns from the wait at once.
    """
    if cutlass.const_expr(pdl):
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()


@cute.jit
def release_dependents(pdl: cutlass.Constexpr[bool]):
    """Programmatic dependent launch without the wait: let the next PDL launch in the stream
    start its CTAs as ours retire. Only for a launch that reads and writes nothing the grid
    before it (or any before that) still writes or reads, because that grid waited for all
    earlier ones before this launch could start (the second launch of a split
    csa::compressor_extend call). Such a kernel ends with complete_after_upstream (its last
    CTA waits), so that it completes after the grid before it, and a grid that waits on it
    sees both."""
    if cutlass.const_expr(pdl):
        cute.arch.griddepcontrol_launch_dependents()


@cute.jit
def complete_after_upstream(pdl: cutlass.Constexpr[bool], bid):
    """For a launch that started with release_dependents and no wait (the second launch of
    a split csa::compressor_extend call): its grid must complete after the grid before it,
    so that a grid that waits on it sees both. One CTA waiting suffices; the last one,
    because waiting holds its SM slot, which in any earlier CTA would keep later CTAs
    waiting behind it."""
    if bid == cute.arch.grid_dim()[0] - 1:
        await_upstream(pdl)


@cute.jit
def pick(cond: cutlass.Boolean, a: Float32, b: Float32) -> Float32:
    """cond ? a : b without a branch."""
    return Float32(cutlass.select_(cond, a, b))
