"""Device helpers of csa::compressor_extend shared by its two kernels (window/extend.py for
register windows, streaming/extend.py for large ones): a request's validity and row count as
the reference defines them, the batch's row offsets by one block-wide scan (and `place`, the
walk over a thread's scanned run that places its requests' rows), the two sums a CTA whose
requests pool their own rows needs instead (`row_sums`, over `strided`), all loading the row
counts' inputs a chunk of requests per round trip (`load_counts`), and, for batches of at
most 32 requests, the whole batch held in one warp's lanes.

A request is `ok` when its tokens lie in [0, num_tokens), its slot in [0, num_slots),
0 <= start and start + length fits int32. Other requests still count their rows (the
reference counts them, so the offsets agree), but those rows are zeros and their slots stay
untouched: no content of cu_seqlens, start_pos or slots moves an access out of bounds.

Row offsets saturate at INT32_MAX (`add_rows`), as the reference's cu_seqlens_comp does:
invalid requests can count rows past int32, and a wrapped offset would land a later
request's rows on an earlier one's. Saturated, the offsets stay sorted and exact below
INT32_MAX, so every row of the output has one request (or none), whichever way it is found.
"""

from __future__ import annotations

import cutlass
from cutlass import Int32, Int64, Uint32, cute

INT32_MAX = 2**31 - 1
# Requests whose row counts' loads a thread issues at once (load_counts): two take a
# 128-thread CTA over a batch of 256 in one round trip; four cost the register-window step
# kernel 18 registers (112 against 94: a CTA less per SM).
COUNTS_AHEAD = 2


@cute.jit
def add_rows(a, b):
    """a + b for row counts in [0, INT32_MAX], saturating at INT32_MAX."""
    total = a + b  # int32: negative exactly when the true sum passes INT32_MAX
    return cutlass.select_(total < 0, Int32(INT32_MAX), total)


def saturated(rows):
    """An int64 sum of row counts as an int32 offset, saturating like add_rows. Sums of
    several counts accumulate in int64 and saturate once: one add each, not add_rows'
    three dependent operations."""
    return Int32(cutlass.min(rows, Int64(INT32_MAX)))


def head_rows(rows, coff: int):
    """A request's head rows: its first min(rows, coff), whose windows reach back into the
    state. The request's own item pools them; a row item never does."""
    return cutlass.min(rows, Int32(coff))


def block_token(q, start, tok0, ratio: int):
    """The new token that begins block q of a request whose new tokens start at position
    `start` (token tok0)."""
    return tok0 + (q * ratio - start)


@cute.jit
def request_of(cu, starts, slots, b, num_tokens, num_slots):
    """(ok, first token, start, length, slot) of request b: ok as the module docstring says
    (the reference's valid_requests)."""
    tok0 = cu[b]
    tok1 = cu[b + 1]
    start = starts[b]
    slot = slots[b]
    length = tok1 - tok0  # int32 arithmetic, like the reference's difference
    ok = (slot >= 0) & (slot < num_slots) & (start >= 0) & (tok0 >= 0) & (tok0 <= tok1)
    ok = ok & (tok1 <= num_tokens) & (Int64(start) + Int64(length) <= Int64(INT32_MAX))
    return ok, tok0, start, length, slot


class Batch:
    """The requests of one extend call, seen from a CTA of `threads` threads (whole warps)."""

    def __init__(self, ratio, threads: int, ahead: int = COUNTS_AHEAD) -> None:
        """`ratio`: a compile-time int (the extend kernels) or a run-time Int32 (the store
        kernel); `ahead`: requests whose row counts' loads a thread issues at once."""
        self.r = ratio
        self.nt = threads
        self.warps = threads // 32
        self.ahead = ahead

    def count(self, start, length):
        """A request's rows as the reference counts them (int64, truncated to int32)."""
        if cutlass.const_expr(not isinstance(self.r, int)):
            # Both terms lie in [0, 2**31), so their sum fits uint32 and 32-bit unsigned
            # division is exact: a run-time divisor costs a few instructions, not a
            # 64-bit division's call.
            p = Uint32(cutlass.max(start, Int32(0)))
            n = Uint32(cutlass.max(length, Int32(0)))
            r = Uint32(self.r)
            return Int32((p + n) // r - p // r)
        p = Int64(cutlass.max(start, Int32(0)))
        n = Int64(cutlass.max(length, Int32(0)))
        return Int32((p + n) // self.r - p // self.r)

    @cute.jit
    def request(self, cu, starts, slots, b, num_tokens, num_slots):
        """(ok, first token, start, length, slot, rows) of request b."""
        ok, tok0, start, length, slot = request_of(cu, starts, slots, b, num_tokens,
                                                   num_slots)
        return ok, tok0, start, length, slot, self.count(start, length)

    def run_of(self, num_reqs, tid):
        """(b_lo, b_hi): thread tid's contiguous run of requests in a scan."""
        per = (num_reqs + (self.nt - 1)) // self.nt
        b_lo = cutlass.min(tid * per, num_reqs)
        return b_lo, cutlass.min(b_lo + per, num_reqs)

    def counts(self):
        """Registers for load_counts."""
        return cute.make_rmem_tensor((3, self.ahead), Int32)

    def run_counts(self, cu, starts, num_reqs, tid):
        """load_counts of the first requests of thread tid's run: scan's and place's
        `held`."""
        held = self.counts()
        self.load_counts(held, cu, starts, num_reqs, self.run_of(num_reqs, tid)[0], 1)
        return held

    def strided_counts(self, cu, starts, num_reqs, tid):
        """load_counts of thread tid's first requests, strided over the CTA: row_sums'
        `held`."""
        held = self.counts()
        self.load_counts(held, cu, starts, num_reqs, tid, self.nt)
        return held

    @cute.jit
    def load_counts(self, held, cu, starts, num_reqs, first, stride):
        """Loads into `held` (counts()) the row counts' inputs (start, first token, end
        token) of requests first + i * stride, i < self.ahead, every load issued before
        any is used: one round trip for all of them, where a loop over requests takes one
        each. A request past the batch loads its last one (in bounds; held_rows drops it);
        an empty batch loads nothing. Kernels issue the loads of a thread's first requests
        ahead of their other work."""
        if num_reqs > 0:
            for i in cutlass.range_constexpr(self.ahead):
                b = cutlass.min(first + i * stride, num_reqs - 1)
                held[0, i] = starts[b]
                held[1, i] = cu[b]
                held[2, i] = cu[b + 1]

    def held_count(self, held, i):
        """The rows of load_counts' request i."""
        return self.count(held[0, i], held[2, i] - held[1, i])

    def held_rows(self, held, i, real):
        """The rows of load_counts' request i, 0 unless `real`."""
        return cutlass.select_(real, self.held_count(held, i), Int32(0))

    @cute.jit
    def scan(self, cu, starts, num_reqs, tid, sWarp, held):
        """(b_lo, b_hi, running, total): thread tid's run of requests [b_lo, b_hi)
        (run_of), the first row of that run and the batch's row count (saturating,
        add_rows). `held`: load_counts of the run's first requests (stride 1), issued
        early; a run of at most one chunk leaves them there, for `place`. Ends with a CTA
        barrier; sWarp holds one int32 per warp."""
        b_lo, b_hi = self.run_of(num_reqs, tid)
        local = Int64(0)
        for b0 in cutlass.range(b_lo, b_hi, self.ahead, unroll=1):
            if b0 != b_lo:
                self.load_counts(held, cu, starts, num_reqs, b0, 1)
            for i in cutlass.range_constexpr(self.ahead):
                local = local + Int64(self.held_rows(held, i, b0 + i < b_hi))
        lane = tid % 32
        incl = warp_prefix(saturated(local), lane)
        running = warp_exclusive(incl, lane)  # the shuffle is in flight during the barrier
        if lane == 31:
            sWarp[tid // 32] = incl
        cute.arch.sync_threads()
        before = Int64(running)
        total = Int64(0)
        for w in cutlass.range_constexpr(self.warps):
            part = Int64(sWarp[w])
            if w < tid // 32:
                before = before + part
            total = total + part
        return b_lo, b_hi, saturated(before), saturated(total)

    @cute.jit
    def place(self, cu, starts, num_reqs, b_lo, b_hi, running, held, visit):
        """visit(b, first row, rows) for each request b of the run scan returned ([b_lo,
        b_hi), its first row `running`), in order; the rows saturate as scan's do. A run of
        one chunk finds its counts' inputs in `held`, where scan left them; a longer one
        loads them again, a chunk per round trip."""
        reload = b_hi - b_lo > self.ahead
        for b0 in cutlass.range(b_lo, b_hi, self.ahead, unroll=1):
            if reload:
                self.load_counts(held, cu, starts, num_reqs, b0, 1)
            for i in cutlass.range_constexpr(self.ahead):
                if b0 + i < b_hi:
                    rows = self.held_count(held, i)
                    visit(b0 + i, running, rows)
                    running = add_rows(running, rows)

    @cute.jit
    def strided(self, cu, starts, num_reqs, tid, held, visit):
        """visit(b, rows) for the requests b = tid, tid + threads, ... of the batch, a chunk
        per round trip (`held`: the first chunk, strided_counts'); b may pass the batch,
        with rows 0."""
        for b0 in cutlass.range(tid, num_reqs, self.ahead * self.nt, unroll=1):
            if b0 != tid:
                self.load_counts(held, cu, starts, num_reqs, b0, self.nt)
            for i in cutlass.range_constexpr(self.ahead):
                b = b0 + i * self.nt
                visit(b, self.held_rows(held, i, b < num_reqs))

    @cute.jit
    def hold_in_lanes(self, cu, starts, slots, b_count, num_tokens, num_slots, lane):
        """A batch of at most 32 requests held by one warp, no barrier: lane b gets request
        b's (ok, first token, start, rows) and the rows before it (saturating, add_rows); also
        the batch's rows. Lanes past the batch hold empty requests that start at the
        total."""
        ok = cutlass.Boolean(False)
        tok0 = Int32(0)
        start = Int32(0)
        rows = Int32(0)
        if lane < b_count:
            ok, tok0, start, _, _, rows = self.request(cu, starts, slots, lane, num_tokens,
                                                       num_slots)
        incl = warp_prefix(rows, lane)
        return (ok, tok0, start, rows, warp_exclusive(incl, lane),
                cute.arch.shuffle_sync(incl, 31))

    @cute.jit
    def lane_of_row(self, n, held):
        """(found, first row, ok, first token, start, rows, request) of the request whose
        rows hold output row n, from hold_in_lanes' values `held` (shuffles only; every
        lane takes part, each with its own n). A binary search finds the last lane whose
        rows start at or before n; found checks that its rows hold n (they do not where n
        lies past the batch's rows)."""
        ok, tok0, start, rows, before, _ = held
        lane = lane_at(n, before)
        first = cute.arch.shuffle_sync(before, lane)
        rows_b = cute.arch.shuffle_sync(rows, lane)
        found = Int64(first) <= Int64(n) and Int64(n) < Int64(first) + Int64(rows_b)
        return (found, first, cute.arch.shuffle_sync(Int32(ok), lane) != 0,
                cute.arch.shuffle_sync(tok0, lane), cute.arch.shuffle_sync(start, lane), rows_b,
                lane)

    @cute.jit
    def row_sums(self, cu, starts, num_reqs, limit, tid, sWarp, held):
        """(rows of requests [0, limit), rows of all requests), saturating (add_rows):
        requests strided over the CTA (coalesced loads; `held`: load_counts of the
        thread's first ones, stride `threads`, issued early), then one CTA reduction that
        ends with a barrier; sWarp holds two int32 per warp. The sums run in int32, as exact as
        int64 unless the batch can count more than INT32_MAX rows, which only invalid
        requests can: each thread keeps its largest count, and where that many rows in every
        request could pass INT32_MAX the CTA sums again, saturating. (Decode steps call this:
        int64 sums throughout took an H200 d512 r4c2 step of 1024 requests 15.45 us against
        14.58, graph replay.)"""
        sums = cute.make_rmem_tensor((3,), Int32)  # below, total, largest
        sums.fill(0)
        self.strided(cu, starts, num_reqs, tid, held,
                     lambda b, rows: _add_row_sums(sums, b, rows, limit))
        below, total, largest = sums[0], sums[1], sums[2]
        could_pass = Int64(largest) * Int64(num_reqs) > Int64(INT32_MAX)
        below = cute.arch.warp_redux_sync(below, "add")
        total = cute.arch.warp_redux_sync(total, "add")
        if cute.arch.vote_any_sync(could_pass):
            total = Int32(-1)  # no exact total is negative: it marks the warp
        self._share_warp_sums(sWarp, tid, below, total)
        below = Int32(0)
        total = Int32(0)
        exact = cutlass.Boolean(True)
        for w in cutlass.range_constexpr(self.warps):
            part = sWarp[self.warps + w]
            exact = exact & (part >= 0)
            below = below + sWarp[w]
            total = total + part
        if not exact:  # the same for every thread: they all read sWarp
            cute.arch.sync_threads()  # every thread has read sWarp before it is rewritten
            below, total = self._saturated_row_sums(cu, starts, num_reqs, limit, tid, sWarp)
        return below, total

    @cute.jit
    def _saturated_row_sums(self, cu, starts, num_reqs, limit, tid, sWarp):
        """row_sums in int64, saturating once per sum (the reductions' high and low bits
        apart: redux.sync adds in int32)."""
        sums = cute.make_rmem_tensor((3,), Int64)  # below, total, largest (unused here)
        sums.fill(0)
        self.strided(cu, starts, num_reqs, tid, self.strided_counts(cu, starts, num_reqs, tid),
                     lambda b, rows: _add_row_sums(sums, b, Int64(rows), limit))
        self._share_warp_sums(sWarp, tid, warp_row_sum(saturated(sums[0])),
                              warp_row_sum(saturated(sums[1])))
        below = Int64(0)
        total = Int64(0)
        for w in cutlass.range_constexpr(self.warps):
            below = below + Int64(sWarp[w])
            total = total + Int64(sWarp[self.warps + w])
        return saturated(below), saturated(total)

    @cute.jit
    def _share_warp_sums(self, sWarp, tid, below, total):
        """Each warp's two sums (lane 0's) into sWarp, published by a CTA barrier."""
        if tid % 32 == 0:
            sWarp[tid // 32] = below
            sWarp[self.warps + tid // 32] = total
        cute.arch.sync_threads()


def _add_row_sums(sums, b, rows, limit):
    """Batch.row_sums' accumulation of request b's rows into `sums`: the rows of requests
    below limit, of all requests, and the largest count."""
    sums[0] = sums[0] + cutlass.select_(b < limit, rows, sums.element_type(0))
    sums[1] = sums[1] + rows
    sums[2] = cutlass.max(sums[2], rows)


@cute.jit
def lane_at(n, first):
    """The last lane whose `first` is at or below n, where those lanes are a prefix of the
    warp (`first` nondecreasing will do; lane 0 is taken where none is): a binary search by
    shuffles, every lane taking part, each with its own n."""
    lane = Int32(0)
    for j in cutlass.range_constexpr(5):
        probe = lane + (16 >> j)
        if cute.arch.shuffle_sync(first, probe) <= n:
            lane = probe
    return lane


@cute.jit
def warp_prefix(value, lane):
    """Inclusive prefix sum of counts `value` (>= 0) over the lanes of a warp, saturating
    (add_rows)."""
    incl = value
    for j in cutlass.range_constexpr(5):
        up = cute.arch.shuffle_sync_up(incl, 1 << j)
        if lane >= (1 << j):
            incl = add_rows(incl, up)
    return incl


@cute.jit
def warp_exclusive(incl, lane):
    """The exclusive prefix from warp_prefix's inclusive one: the previous lane's (0 in lane
    0). Not incl - value: where incl saturated, that is below the true prefix."""
    before = cute.arch.shuffle_sync_up(incl, 1)
    if lane == 0:
        before = Int32(0)
    return before


@cute.jit
def warp_row_sum(value):
    """Sum of counts `value` (>= 0) over a warp, saturating (add_rows). redux.sync adds in
    wrapping int32, so it sums the counts' high and low bits apart: neither sum can wrap
    (32 * 2**23 < 2**31), both reductions are in flight at once."""
    high = cute.arch.warp_redux_sync(value >> 8, "add")
    low = cute.arch.warp_redux_sync(value & 255, "add")
    return saturated(Int64(high) * 256 + Int64(low))
