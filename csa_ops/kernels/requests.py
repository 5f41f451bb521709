"""Device helpers of csa::compressor_extend shared by its two kernels (extend.py for register
windows, streaming.py for large ones): a request's validity and row count as the reference
defines them, the batch's row offsets by one block-wide scan, the two sums a CTA whose
requests pool their own rows needs instead, and, for batches of at most 32 requests, the
whole batch held in one warp's lanes.

A request is `ok` when its tokens lie in [0, num_tokens), its slot in [0, num_slots),
0 <= start and start + length fits int32. Other requests still count their rows (the
reference counts them, so the offsets agree), but those rows are zeros and their slots stay
untouched: no content of cu_seqlens, start_pos or slots moves an access out of bounds.
"""

from __future__ import annotations

import cutlass
from cutlass import Int32, Int64, cute

INT32_MAX = 2**31 - 1


def head_rows(rows, coff: int):
    """A request's head rows: its first min(rows, coff), whose windows reach back into the
    state. The request's own item pools them; a row item never does."""
    return cutlass.min(rows, Int32(coff))


class Batch:
    """The requests of one extend call, seen from a CTA of `threads` threads (whole warps)."""

    def __init__(self, ratio: int, threads: int) -> None:
        self.r = ratio
        self.nt = threads
        self.warps = threads // 32

    def count(self, start, length):
        """A request's rows as the reference counts them (int64, truncated to int32)."""
        p = Int64(cutlass.max(start, Int32(0)))
        n = Int64(cutlass.max(length, Int32(0)))
        return Int32((p + n) // self.r - p // self.r)

    @cute.jit
    def request(self, cu, starts, slots, b, num_tokens, num_slots):
        """(ok, first token, start, length, slot, rows) of request b."""
        tok0 = cu[b]
        tok1 = cu[b + 1]
        start = starts[b]
        slot = slots[b]
        length = tok1 - tok0  # int32 arithmetic, like the reference's difference
        ok = (slot >= 0) & (slot < num_slots) & (start >= 0) & (tok0 >= 0) & (tok0 <= tok1)
        ok = ok & (tok1 <= num_tokens) & (Int64(start) + Int64(length) <= Int64(INT32_MAX))
        return ok, tok0, start, length, slot, self.count(start, length)

    @cute.jit
    def scan(self, cu, starts, num_reqs, tid, sWarp):
        """(b_lo, b_hi, running, total): thread tid's contiguous run of requests
        [b_lo, b_hi), the first row of that run and the batch's row count (int32, wrapping
        like the reference's cast). Ends with a CTA barrier; sWarp holds one int32 per warp."""
        per = (num_reqs + (self.nt - 1)) // self.nt
        b_lo = cutlass.min(tid * per, num_reqs)
        b_hi = cutlass.min(b_lo + per, num_reqs)
        local = Int32(0)
        for b in cutlass.range(b_lo, b_hi, unroll=4):  # unrolled: the loads overlap
            local = local + self.count(starts[b], cu[b + 1] - cu[b])
        lane = tid % 32
        incl = warp_prefix(local, lane)
        if lane == 31:
            sWarp[tid // 32] = incl
        cute.arch.sync_threads()
        running = incl - local
        total = Int32(0)
        for w in cutlass.range_constexpr(self.warps):
            part = sWarp[w]
            if w < tid // 32:
                running = running + part
            total = total + part
        return b_lo, b_hi, running, total

    @cute.jit
    def hold_in_lanes(self, cu, starts, slots, b_count, num_tokens, num_slots, lane):
        """A batch of at most 32 requests held by one warp, no barrier: lane b gets request
        b's (ok, first token, start, rows) and the rows before it (int32, wrapping like the
        reference's cast); also the batch's rows. Lanes past the batch hold empty requests
        that start at the total."""
        ok = cutlass.Boolean(False)
        tok0 = Int32(0)
        start = Int32(0)
        rows = Int32(0)
        if lane < b_count:
            ok, tok0, start, _, _, rows = self.request(cu, starts, slots, lane, num_tokens,
                                                       num_slots)
        incl = warp_prefix(rows, lane)
        return ok, tok0, start, rows, incl - rows, cute.arch.shuffle_sync(incl, 31)

    @cute.jit
    def lane_of_row(self, n, held):
        """(found, first row, ok, first token, start, rows) of the request whose rows hold
        output row n, from hold_in_lanes' values `held` (shuffles only; every lane takes
        part, each with its own n). A binary search finds the last lane whose rows start at
        or before n; found checks that its rows hold n (they may not where the int32 count
        wraps, or n lies past the batch's rows)."""
        ok, tok0, start, rows, before, _ = held
        lane = lane_at(n, before)
        first = cute.arch.shuffle_sync(before, lane)
        rows_b = cute.arch.shuffle_sync(rows, lane)
        found = Int64(first) <= Int64(n) and Int64(n) < Int64(first) + Int64(rows_b)
        return (found, first, cute.arch.shuffle_sync(Int32(ok), lane) != 0,
                cute.arch.shuffle_sync(tok0, lane), cute.arch.shuffle_sync(start, lane), rows_b)

    @cute.jit
    def row_sums(self, cu, starts, num_reqs, limit, tid, sWarp):
        """(rows of requests [0, limit), rows of all requests), int32 wrapping like the
        reference's cast: requests strided over the CTA (coalesced loads), then one CTA
        reduction that ends with a barrier; sWarp holds two int32 per warp."""
        below = Int32(0)
        total = Int32(0)
        for b in cutlass.range(tid, num_reqs, self.nt, unroll=2):
            rows = self.count(starts[b], cu[b + 1] - cu[b])
            total = total + rows
            if b < limit:
                below = below + rows
        below = cute.arch.warp_redux_sync(below, "add")
        total = cute.arch.warp_redux_sync(total, "add")
        if tid % 32 == 0:
            sWarp[tid // 32] = below
            sWarp[self.warps + tid // 32] = total
        cute.arch.sync_threads()
        below = Int32(0)
        total = Int32(0)
        for w in cutlass.range_constexpr(self.warps):
            below = below + sWarp[w]
            total = total + sWarp[self.warps + w]
        return below, total


@cute.jit
def lane_at(n, first):
    """The last lane whose `first` is at or below n, for `first` nondecreasing over the
    lanes from lane 0's (taken where lane 0's is above n): a binary search by shuffles, every
    lane taking part, each with its own n."""
    lane = Int32(0)
    for j in cutlass.range_constexpr(5):
        probe = lane + (16 >> j)
        if cute.arch.shuffle_sync(first, probe) <= n:
            lane = probe
    return lane


@cute.jit
def warp_prefix(value, lane):
    """Inclusive prefix sum of `value` over the lanes of a warp."""
    incl = value
    for j in cutlass.range_constexpr(5):
        up = cute.arch.shuffle_sync_up(incl, 1 << j)
        if lane >= (1 << j):
            incl = incl + up
    return incl
