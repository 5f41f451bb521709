"""Where an output row or a token of a call lies: the binary searches over cu_seqlens and
cu_seqlens_comp that every kernel family shares (CuTe DSL, arch-generic).

Every index a search loads lies inside the offsets whatever their contents (non-monotonic,
negative, past the token count), so no input can move an access out of bounds; for
offsets that are not sorted the results are unspecified, and the kernels check what they
derive from them before any access.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
from cutlass import Boolean, Int32, Int64, cute


class RowLookup(NamedTuple):
    """Output row n's segment s as the reference's segment_of finds it (the last s below
    num_segs with cuc[s] <= n; 0 where none is), and what a kernel derives a row from: its
    segment's rows [row_begin, row_end) = [cuc[s], cuc[s+1]) and tokens [token_begin,
    token_end) = [cu[s], cu[s+1]). real: n is a row of the call (n < cuc[-1]), as the
    reference's row_valid with at least one segment."""

    real: Boolean
    segment: Int32
    row_begin: Int32
    row_end: Int32
    token_begin: Int32
    token_end: Int32


@cute.jit
def lookup_row(cu: cute.Tensor | None, cuc: cute.Tensor, num_segs: Int32, n: Int32) -> RowLookup:
    """RowLookup of row n (cu None: the token bounds are not loaded and read 0).

    A bracketing search: [lo, hi) narrows with cuc[lo] <= n < cuc[hi] (for sorted offsets
    and a real row), each probe loading cuc and cu at the same index, so the segment's four
    bounds are known when the search ends: no round trip after it, and none at all for
    one segment."""
    lo = Int32(0)
    hi = num_segs
    row_begin = cuc[0]
    row_end = cuc[num_segs]
    rows = row_end
    token_begin = Int32(0)
    token_end = Int32(0)
    if cutlass.const_expr(cu is not None):
        token_begin = cu[0]
        token_end = cu[num_segs]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        c = cuc[mid]
        u = Int32(0)
        if cutlass.const_expr(cu is not None):
            u = cu[mid]
        if c <= n:
            lo = mid
            row_begin = c
            token_begin = u
        else:
            hi = mid
            row_end = c
            token_end = u
    real = n < rows and num_segs > 0
    return RowLookup(real, lo, row_begin, row_end, token_begin, token_end)


@cute.jit
def locate_row(
    cu: cute.Tensor,
    cuc: cute.Tensor,
    num_segs: Int32,
    num_tokens: Int32,
    n: Int32,
    ratio: cutlass.Constexpr[int],
):
    """(valid, t0, first_block, s, u0, u1) of output row n: row_window's of its lookup_row;
    s >= 0 and u0 >= 0 whenever (u0, u1) = (cu[s], cu[s+1]); else s = -1."""
    row = lookup_row(cu, cuc, num_segs, n)
    seg = segment_of(row, num_segs)
    valid, t0, first = row_window(row, num_tokens, n, ratio)
    return valid, t0, first, seg, row.token_begin, row.token_end


@cute.jit
def segment_of(row: RowLookup, num_segs: Int32) -> Int32:
    """locate_row's s of a lookup with token bounds: its segment, -1 where none is."""
    return cutlass.select_(row.token_begin >= 0 and num_segs > 0, row.segment, Int32(-1))


@cute.jit
def row_window(row: RowLookup, num_tokens: Int32, n: Int32, ratio: cutlass.Constexpr[int]):
    """(valid, t0, first_block) of output row n from its lookup (token bounds loaded).

    valid needs n inside its segment's row range and the row's `ratio` tokens inside both
    the segment and [0, num_tokens); t0 is then the row's first own token.
    """
    u0 = row.token_begin
    valid = Boolean(False)
    t0 = Int32(0)
    first = Boolean(False)
    # The DSL has no chained compares.
    if row.row_begin <= n and n < row.row_end and u0 >= 0:  # noqa: PLR1716
        block = Int64(n) - Int64(row.row_begin)
        end = Int64(u0) + (block + 1) * ratio
        if end <= Int64(row.token_end) and end <= Int64(num_tokens):
            valid = Boolean(True)
            t0 = Int32(end - ratio)
            first = block == 0
    return valid, t0, first


@cute.jit
def count_le(arr: cute.Tensor, count: Int32, value: Int32) -> Int32:
    """Binary search: how many of arr[0:count] are <= value (arr sorted ascending).

    Every probe index lies in [0, count), whatever the contents of arr.
    """
    lo = Int32(0)
    n = count
    while n > 0:
        half = n // 2
        if arr[lo + half] <= value:
            lo = lo + half + 1
            n = n - half - 1
        else:
            n = half
    return lo


@cute.jit
def segment_bounds(
    cuc: cute.Tensor,
    s: Int32,
    u0: Int32,
    u1: Int32,
    num_tokens: Int32,
    num_rows: Int32,
    ratio: cutlass.Constexpr[int],
):
    """(seg_end, own_from, prev_from) of segment s with tokens [u0, u1), u0 >= 0.

    Tokens t in [u0, seg_end) feed no row with their own-block columns iff t >= own_from,
    and none with their previous-half columns (coff 2) iff t >= prev_from. The exact
    mirror of locate_row: rows need c0 <= n < min(c1, num_rows) and whole blocks in
    [u0, min(u1, num_tokens)).
    """
    end = cutlass.min(u1, num_tokens)
    c0 = Int64(cuc[s])
    blocks = cutlass.min(Int64(cuc[s + 1]) - c0, Int64((end - u0) // ratio))
    blocks = cutlass.min(blocks, Int64(num_rows) - c0)
    blocks = cutlass.max(blocks, Int64(0))
    own_from = u0 + Int32(blocks) * ratio
    return end, own_from, own_from - ratio


@cute.jit
def token_bounds(
    cu: cute.Tensor,
    cuc: cute.Tensor,
    num_segs: Int32,
    num_tokens: Int32,
    num_rows: Int32,
    t: Int32,
    ratio: cutlass.Constexpr[int],
):
    """segment_bounds of token t's segment (binary search); (t + 1, t, t) outside all."""
    seg_end = t + 1
    own_from = t
    prev_from = t
    s = count_le(cu, num_segs, t) - 1
    if s >= 0:
        u0 = cu[s]
        u1 = cu[s + 1]
        if u0 >= 0 and u0 <= t and t < u1:  # noqa: PLR1716
            seg_end, own_from, prev_from = segment_bounds(
                cuc, s, u0, u1, num_tokens, num_rows, ratio)
    return seg_end, own_from, prev_from


