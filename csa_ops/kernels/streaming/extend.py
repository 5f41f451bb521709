"""csa::compressor_extend's streaming kernel: the rows of the blocks that new tokens complete,
and every request's new state, through the streaming forward's own row code (bit-identical
rows). The design is the class docstring's.
"""

from __future__ import annotations

import math

import cutlass
from cutlass import Float32, Int32, Int64, const_expr, cute

from ...config import KernelKey, Part
from ..shared import common as cm
from ..shared import requests
from .kernels import StreamingKernel
from .plan import MAX_ROWS, RED_KINDS, quiet_lanes
from .rows import RowFlag, RowTensors, RowTiles, flat

QUIET_UNROLL = 4  # pieces of a quiet request's update loaded before their stores
# An extend CTA's item table holds a row's request, or NO_REQUEST: a row no request holds
# (padding: zeros), or ITEM_DONE: an item finished before the CTA's loop over its items (a
# request whose quiet update ran, a head row, which its request's item pools).
NO_REQUEST = -1
ITEM_DONE = -2


class StreamingExtend(StreamingKernel):
    """csa::compressor_extend for large windows, compiled from the forward's key.

    Work items as in the register-window extend kernel: per request, its state-reading rows
    (its first min(rows, coff)) and then its state update; then one per output row (windows
    of new tokens only; padding: zeros). A CTA owns a column block and a strided set of
    items; every CTA scans the batch's row counts to place its items (requests.Batch). Then
    its subwarps take the items that need no more (requests that complete no block, padding
    rows) all at once, and the whole CTA runs the rest one after another (`_run_item`); a
    CTA of a single item runs it without the subwarps' pass. A row gathers its window into
    the forward's tile, kv from the new tokens or the state, and logits into an fp32 tile:
    fp32(score) + ape as the forward adds them (ape read from L2, not staged: a decode CTA
    needs a single entry of it), or the state's stored logit. It then pools through the
    forward's own `_row`, so rows are bit-identical to the CUDA csa::compressor's. A
    request's rows and its update run in one CTA per column block, so CTA barriers order
    every state read before the writes.

    A split call (the part knob, for calls past decode-sized ones) is two launches: part 1
    has the requests' items only; part 2 (`rows_kernel`) every other row, whose window
    lies in the new tokens, through the forward's own pipelined loop (`_pipeline`), beside
    part 1 (PDL: it reads nothing part 1 writes).
    """

    def __init__(self, key: KernelKey):
        if key.knobs.deferred:
            raise ValueError(f"an extend key computes its failing columns in their rows "
                             f"(plan.extend_key), got {key!r}")
        super().__init__(key, backward=False)
        self.batch = requests.Batch(self.ratio, self.threads)
        self.quiet_lanes = quiet_lanes(key)
        self.part = key.knobs.part
        self.has_rows = self.part != Part.REQUESTS  # this launch has row items
        self.lanes = key.knobs.lane_requests  # part 2 places its rows by lanes

    @cute.jit
    def _new_logits(self, gSc, gApe, t, gc, k, colc):
        """fp32(score) + ape of new token t (window entry k, column vector colc of its
        coff-half), ape read where it lies (L2): a decode CTA needs one entry of it."""
        sc = self._load_f32(gSc[(None, (t, gc))])
        ap = cute.make_rmem_tensor((self.vec,), Float32)
        half = k // self.ratio
        for h in cutlass.range_constexpr(self.ape_chunks):
            chunk = self._ape_chunk(half, colc, h)
            flat(ap, self.ape_vec, h).store(gApe[(None, (k - half * self.ratio, chunk))].load())
        lg = cute.make_rmem_tensor((self.vec,), Float32)
        for v in cutlass.range_constexpr(self.vec):
            lg[v] = sc[v] + ap[v]
        return lg

    @cute.jit
    def _gather_window(self, sTile, sLg, gApe, gKV, gSc, gKVs, gSs, q, tok0, start, slot, tid,
                       cb):
        """Block q's window: entry k holds position (q - coff + 1) * ratio + k; from the new
        tokens at positions >= start, else from the state (entry e holds position
        (start // ratio - coff + 1) * ratio + e); before the sequence, nothing (masked).
        The state's entries go by cp.async, all in flight at once (one round trip to DRAM,
        not one per entry a thread gathers). New tokens, whose logits add ape in registers,
        are the window's last entries: a thread reaches them after its copies are issued."""
        R, W = self.ratio, self.window
        win0 = (q - (self.coff - 1)) * R
        st0 = (start // R - (self.coff - 1)) * R
        kv_atom = self._g2s_atom(self.dtype, self.vec)
        logit_atom = self._g2s_atom(Float32, self.ape_vec)
        for r in cutlass.range_constexpr(self.loads):
            idx = tid + self.threads * r
            k, c = idx // self.col_vectors, idx % self.col_vectors
            colc, pos = cb * self.col_vectors + c, win0 + k
            if k < W and colc < self.half_vectors and pos >= 0:
                ph = self._phys(c, k)
                gc = (k // R) * self.half_vectors + colc
                if pos >= start:
                    t = tok0 + (pos - start)
                    sTile[(None, ph, k, 1, 0)].store(gKV[(None, (t, gc))].load())
                    sLg[(None, ph, k)].store(self._new_logits(gSc, gApe, t, gc, k, colc).load())
                else:
                    entry = slot * W + cutlass.max(cutlass.min(pos - st0, Int32(W - 1)),
                                                   Int32(0))
                    self._copy(kv_atom, gKVs[(None, (entry, gc))], sTile[(None, ph, k, 1, 0)])
                    src, dst = gSs[(None, (entry, gc))], sLg[(None, ph, k)]
                    for h in cutlass.range_constexpr(self.ape_chunks):
                        cute.copy(logit_atom, flat(src, self.ape_vec, h),
                                  flat(dst, self.ape_vec, h))
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def _pool(self, sTile, sLg, gApe, sRed, sScr, gKV, gSc, gKVs, gSs, gOut, n, q, tok0, start,
              slot, thr):
        """Row n = block q of a request (uniform over the CTA)."""
        tid, cb = thr.tid, thr.cb
        self._gather_window(sTile, sLg, gApe, gKV, gSc, gKVs, gSs, q, tok0, start, slot, tid,
                            cb)
        cute.arch.barrier()
        # Entries exist from position 0 on: flags "real row, has a previous block", and no
        # token bound, so the mask is the forward's block-0 mask. (No ape tile: the logits
        # are in sLg.)
        self._row(RowTiles(sTile, None, sRed, sScr, sLg),
                  RowTensors(gKV, gSc, gApe, gOut, gOut, gOut, gOut), None, 0, n,
                  (q - (self.coff - 1)) * self.ratio, Int32(RowFlag.REAL | RowFlag.PREVIOUS),
                  Int32(requests.INT32_MAX), thr, True)
        cute.arch.barrier()  # the tile is free for the next row

    def _rows_here(self, first_row, rows_b, row0, groups, num_rows):
        """(n0, hi): a request's output rows [first_row, first_row + rows_b) that are this
        CTA's, whose rows are row0, row0 + groups, ... (row0 may be negative), are n0, n0 +
        groups, ... below hi. lo is clamped to num_rows: a first row saturated at INT32_MAX
        (adversarial cu_seqlens) must not overflow n0 into a negative row."""
        lo = cutlass.min(first_row, num_rows)
        n0 = lo + ((row0 - lo) % groups + groups) % groups
        return n0, cutlass.min(requests.add_rows(first_row, rows_b), num_rows)

    @cute.jit
    def _list_pending(self, sItem, sList, sCount, ni, rg, groups, num_reqs, tid):
        """sList[:sCount[0]]: the CTA's items (in order) that the whole CTA still runs, the
        requests not marked done and the rows whose request pools them here. The first warp
        takes 32 items at a time and a warp prefix sum places them; the caller's barrier
        publishes the list."""
        if tid < 32:
            count = Int32(0)
            for j0 in cutlass.range(0, ni, 32, unroll=1):
                j = j0 + tid
                keep = Int32(0)
                if j < ni:
                    if rg + j * groups < num_reqs:
                        keep = Int32(sItem[j] != ITEM_DONE)
                    else:
                        keep = Int32(sItem[j] >= 0)
                incl = requests.warp_prefix(keep, tid)
                if keep != 0:
                    sList[count + incl - 1] = j
                count = count + cute.arch.shuffle_sync(incl, 31)
            if tid == 0:
                sCount[0] = count

    def _slot_entry(self, r, tid, cb, st1):
        """(entry, column vector, position) of a thread's r-th (entry, column vector) pair of
        a slot in the state update; the entry holds position st1 + entry."""
        idx = tid + self.threads * r
        e = idx // self.col_vectors
        return e, cb * self.col_vectors + idx % self.col_vectors, st1 + e

    def _store_initial(self, gKVs, gSs, entry, gc):
        """The initial state of a slot entry's column vector gc: value 0, logit -inf (the
        forward's constants for the entries before a sequence)."""
        zero = cute.make_rmem_tensor((self.vec,), self.dtype)
        zero.fill(0.0)
        ninf = cute.make_rmem_tensor((self.vec,), Float32)
        ninf.fill(-math.inf)
        gKVs[(None, (entry, gc))].store(zero.load())
        gSs[(None, (entry, gc))].store(ninf.load())

    @cute.jit
    def _update(self, gApe, gKV, gSc, gKVs, gSs, tok0, start, end, slot, tid, cb):
        """The serving state for `end` tokens, this CTA's columns: entry e then holds position
        (end // ratio - coff + 1) * ratio + e where that is < end (a new token, a moved
        entry, or the initial state before position 0); other entries stay. Per coff-half,
        every thread loads its entries' sources, a barrier, then every thread stores (a
        moved entry's source is another entry of the slot)."""
        R, W, VEC = self.ratio, self.window, self.vec
        shift = (end // R - start // R) * R
        st1 = (end // R - (self.coff - 1)) * R
        for h in cutlass.range_constexpr(self.coff):
            rK = cute.make_rmem_tensor((VEC, self.loads), self.dtype)
            rF = cute.make_rmem_tensor((VEC, self.loads), Float32)
            for r in cutlass.range_constexpr(self.loads):
                e, colc, pos = self._slot_entry(r, tid, cb, st1)
                if e < W and colc < self.half_vectors and pos < end:
                    gc = h * self.half_vectors + colc
                    if pos >= start:
                        t = tok0 + (pos - start)
                        rK[None, r].store(gKV[(None, (t, gc))].load())
                        rF[None, r].store(
                            self._new_logits(gSc, gApe, t, gc, h * R + e % R, colc).load())
                    elif pos >= 0 and shift != 0:
                        src = slot * W + cutlass.min(e + shift, Int32(W - 1))
                        rK[None, r].store(gKVs[(None, (src, gc))].load())
                        rF[None, r].store(gSs[(None, (src, gc))].load())
            cute.arch.barrier()
            for r in cutlass.range_constexpr(self.loads):
                e, colc, pos = self._slot_entry(r, tid, cb, st1)
                if e < W and colc < self.half_vectors and pos < end:
                    dst = slot * W + e
                    gc = h * self.half_vectors + colc
                    if pos >= start or (pos >= 0 and shift != 0):
                        gKVs[(None, (dst, gc))].store(rK[None, r].load())
                        gSs[(None, (dst, gc))].store(rF[None, r].load())
                    elif pos < 0:  # before the sequence (coff 2, no complete block yet)
                        self._store_initial(gKVs, gSs, dst, gc)
            cute.arch.barrier()

    def _quiet_piece(self, u, tok0, start, st1, cb):
        """(slot entry, token, state column, column vector, ape entry) of piece u of a quiet
        update: the pieces run over the new tokens' (column vector, coff-half) pairs."""
        per_entry = self.col_vectors * self.coff
        e = start - st1 + u // per_entry
        h = (u // self.col_vectors) % self.coff
        colc = cb * self.col_vectors + u % self.col_vectors
        return (e, tok0 + (st1 + e - start), h * self.half_vectors + colc, colc,
                h * self.ratio + e % self.ratio)

    @cute.jit
    def _quiet_update(self, gApe, gKV, gSc, gKVs, gSs, tok0, start, end, slot, lane, cb):
        """`_update` for a request that completes no block (end // ratio == start // ratio,
        a decode step's usual case), by the quiet_lanes lanes of one subwarp (`lane` among
        them): no entry moves, so no store can clobber another entry's source and no
        barrier is needed. Entry e holds position st1 + e: the new tokens at [start, end)
        and, for coff 2 before the first block completes, the initial state at negative
        positions; other entries stay. QUIET_UNROLL pieces load before any stores, so a
        longer request's loads overlap."""
        R, W, CV, L, U = self.ratio, self.window, self.col_vectors, self.quiet_lanes, QUIET_UNROLL
        st1 = (end // R - (self.coff - 1)) * R
        per_entry = CV * self.coff  # (column vector, coff-half) pairs of one entry
        pieces = (end - start) * per_entry
        for u0 in cutlass.range(lane, pieces, L * U, unroll=1):
            rK = cute.make_rmem_tensor((self.vec, U), self.dtype)
            rF = cute.make_rmem_tensor((self.vec, U), Float32)
            for i in cutlass.range_constexpr(U):
                e, t, gc, colc, k = self._quiet_piece(u0 + i * L, tok0, start, st1, cb)
                if u0 + i * L < pieces and colc < self.half_vectors:
                    rK[None, i].store(gKV[(None, (t, gc))].load())
                    rF[None, i].store(self._new_logits(gSc, gApe, t, gc, k, colc).load())
            for i in cutlass.range_constexpr(U):
                e, t, gc, colc, k = self._quiet_piece(u0 + i * L, tok0, start, st1, cb)
                if u0 + i * L < pieces and colc < self.half_vectors:
                    gKVs[(None, (slot * W + e, gc))].store(rK[None, i].load())
                    gSs[(None, (slot * W + e, gc))].store(rF[None, i].load())
        if const_expr(self.coff == 2):
            for u in cutlass.range(lane, cutlass.min(cutlass.max(-st1, Int32(0)), Int32(W))
                                   * per_entry, L, unroll=1):
                e = u // per_entry
                gc = ((u // CV) % self.coff) * self.half_vectors + cb * CV + u % CV
                if cb * CV + u % CV < self.half_vectors:
                    self._store_initial(gKVs, gSs, slot * W + e, gc)

    @cute.jit
    def _place_item(self, sItem, sBase, mCuc, b, first_row, rows_b, rg, groups, ni, num_reqs,
                    num_rows, bid):
        """Request b, whose rows start at first_row: its offset in cu_seqlens_comp (by one
        CTA), its own item's base and, for the CTA's row items it covers, its request
        (ITEM_DONE for its head rows, which its own item pools) and base."""
        if bid == 0:
            mCuc[b] = first_row
        if b >= rg and (b - rg) % groups == 0 and (b - rg) // groups < ni:
            sBase[(b - rg) // groups] = first_row
        if const_expr(self.has_rows):
            n0, hi = self._rows_here(first_row, rows_b, rg - num_reqs, groups, num_rows)
            heads = requests.head_rows(rows_b, self.coff)
            for n in cutlass.range(n0, hi, groups, unroll=1):
                j = (num_reqs + n - rg) // groups
                if j < ni:
                    sItem[j] = b
                    if n - first_row < heads:
                        sItem[j] = ITEM_DONE
                    sBase[j] = first_row

    @cute.kernel
    def extend_kernel(self, gKV: cute.Tensor, gSc: cute.Tensor, gApe: cute.Tensor,
                      mCu: cute.Tensor, mStart: cute.Tensor, mSlots: cute.Tensor,
                      gKVs: cute.Tensor, gSs: cute.Tensor, gOut: cute.Tensor, mCuc: cute.Tensor,
                      num_tokens: Int32, num_rows: Int32, num_reqs: Int32, num_slots: Int32,
                      groups: Int32):
        CV = self.col_vectors
        cm.await_upstream(self.pdl)
        thr = self._coordinates()
        tid, bid, cb, rg = thr.tid, thr.bid, thr.cb, thr.rg

        smem = cutlass.memory.SmemAllocator()
        # The forward's tile layout, kv in slot 1; the score slot aliases it (stride 0): the
        # logits live in sLg, and the smem saved lets more CTAs share an SM.
        tile = (self.vec, CV, self.window_padded, 2, 1)
        sTile = smem.allocate_tensor(self.dtype, cute.make_layout(
            tile, stride=(1, self.vec, self.vec * CV, 0, 0)), 128)
        sLg = smem.allocate_tensor(Float32,
                                   cute.make_layout((self.vec, CV, self.window_padded)), 16)
        sRed = smem.allocate_tensor(
            Float32, cute.make_layout((self.vec, self.warps_per_col, CV, RED_KINDS)), 16)
        sItem = smem.allocate_tensor(Int32, cute.make_layout(MAX_ROWS), 16)
        sBase = smem.allocate_tensor(Int32, cute.make_layout(MAX_ROWS), 16)
        sWarp = smem.allocate_tensor(Int32, cute.make_layout(self.batch.warps), 16)
        sList = smem.allocate_tensor(Int32, cute.make_layout(MAX_ROWS), 16)
        sCount = smem.allocate_tensor(Int32, cute.make_layout(1), 4)

        # Items rg, rg + groups, ...: request b is item b, output row n item num_reqs + n.
        items = num_reqs
        if const_expr(self.has_rows):
            items = num_reqs + num_rows
        ni = Int32(0)
        if rg < items:
            ni = cutlass.min((items - rg + groups - 1) // groups, MAX_ROWS)
        for j in cutlass.range(tid, ni, self.threads, unroll=1):
            sItem[j] = Int32(NO_REQUEST)
        # The scan's first row counts load first, then the thread's first item (its
        # subwarp's, or the CTA's only one) loads its request, in flight with them rather
        # than after the scan (the CTA's only item then finds it in L1).
        held = self.batch.run_counts(mCu, mStart, num_reqs, tid)
        j0 = Int32(0)
        if ni > 1:
            j0 = tid // self.quiet_lanes
        first = self._preload_request(mCu, mStart, mSlots, rg + j0 * groups, num_reqs,
                                      num_tokens, num_slots)
        # The scan's barrier publishes sItem before the placement below overwrites any.
        b_lo, b_hi, running, total = self.batch.scan(mCu, mStart, num_reqs, tid, sWarp, held)
        self.batch.place(mCu, mStart, num_reqs, b_lo, b_hi, running, held,
                         lambda b, first_row, rows_b: self._place_item(
                             sItem, sBase, mCuc, b, first_row, rows_b, rg, groups, ni,
                             num_reqs, num_rows, bid))
        if bid == 0 and tid == 0:
            cm.store_row_total(mCuc, num_reqs, total, num_rows)
        cute.arch.barrier()

        tiles = (sTile, sLg, gApe, sRed, self._scratch(smem, sRed), gKV, gSc, gKVs, gSs, gOut)
        work = (tiles, sItem, sBase, mCu, mStart, mSlots, rg, groups, num_tokens, num_rows,
                num_reqs, num_slots, thr)
        pending = ni  # a CTA of one item (a prefill's usual CTA) runs it: no subwarps, no list
        if ni > 1:
            # Items a subwarp does, all of the CTA's at once: requests that complete no
            # block (they only write their new tokens' entries; each marks its item done)
            # and rows that no request holds (zeros). The items left need the whole CTA,
            # one at a time: a decode step's CTA lists at most a few among many.
            L = self.quiet_lanes
            for j in cutlass.range(tid // L, ni, self.threads // L, unroll=1):
                item = rg + j * groups
                if item < num_reqs:
                    ok, tok0, start, length, slot, rows = self._request_of(
                        mCu, mStart, mSlots, item, num_tokens, num_slots, j == j0, first)
                    if ok and rows == 0:
                        self._quiet_update(gApe, gKV, gSc, gKVs, gSs, tok0, start,
                                           start + length, slot, tid % L, cb)
                        if tid % L == 0:
                            sItem[j] = ITEM_DONE
                elif const_expr(self.has_rows):  # noqa: SIM102 (compile-time, then run-time)
                    # Padding, or a row no request covers.
                    if sItem[j] == NO_REQUEST and tid % L < CV:
                        self._zero_vector(gOut, item - num_reqs, cb * CV + tid % L)
            cute.arch.barrier()
            self._list_pending(sItem, sList, sCount, ni, rg, groups, num_reqs, tid)
            cute.arch.barrier()
            pending = sCount[0]
        for k in cutlass.range(pending, unroll=1):
            j = Int32(0)
            if ni > 1:
                j = sList[k]
            self._run_item(j, *work)

    @cute.kernel
    def rows_kernel(self, gKV: cute.Tensor, gSc: cute.Tensor, gApe: cute.Tensor,
                    mCu: cute.Tensor, mStart: cute.Tensor, mSlots: cute.Tensor,
                    gOut: cute.Tensor, num_tokens: Int32, num_rows: Int32, num_reqs: Int32,
                    num_slots: Int32, groups: Int32):
        """Part 2 of a split call: every output row but the requests' heads (part 1's), in
        the forward's own pipelined loop: a row's window lies in the new tokens, so it is
        the forward's row, tiles staged `stages - 1` rows ahead. Rows of requests that are
        not ok and padding rows get zeros. Rows go to the CTAs strided (row n to group
        n % groups) after a batch scan, or by lanes (`_place_by_lanes`)."""
        # This launch reads only the call's inputs and writes only rows part 1 does not
        # (no state, no head row, no cu_seqlens_comp): nothing part 1 reads or writes. It
        # starts only once every part-1 CTA has passed its wait, so the grids before the
        # call are complete.
        cm.release_dependents(self.pdl)
        thr = self._coordinates()
        tid, bid, rg, lane = thr.tid, thr.bid, thr.rg, thr.lane
        smem = cutlass.memory.SmemAllocator()
        tables = self._row_tables(smem)
        _, _, _, sT0, sFl, _ = tables
        sRow = None
        if const_expr(self.lanes):
            sRow = smem.allocate_tensor(Int32, cute.make_layout(MAX_ROWS), 16)
            nr = self._place_by_lanes(sRow, sT0, sFl, rg, groups, mCu, mStart, mSlots,
                                      num_tokens, num_rows, num_reqs, num_slots, tid, lane)
        else:
            sWarp = smem.allocate_tensor(Int32, cute.make_layout(self.batch.warps), 16)
            nr = self._place_by_scan(sT0, sFl, rg, groups, mCu, mStart, mSlots, num_tokens,
                                     num_rows, num_reqs, num_slots, tid, sWarp)
        self._pipeline(nr, tables, RowTensors(gKV, gSc, gApe, gOut, gOut, gOut, gOut), None, thr,
                       groups, num_tokens, True, sRow)
        cm.complete_after_upstream(self.pdl, bid)

    @cute.jit
    def _place_by_scan(self, sT0, sFl, rg, groups, mCu, mStart, mSlots, num_tokens, num_rows,
                       num_reqs, num_slots, tid, sWarp):
        """rows_kernel's row table, rows rg, rg + groups, ...: a batch scan, then each
        request's rows that are this CTA's. Returns the CTA's row count."""
        held = self.batch.run_counts(mCu, mStart, num_reqs, tid)
        nr = self._rows_owned(rg, num_rows, groups)
        for j in cutlass.range(tid, nr, self.threads, unroll=1):
            sFl[j] = Int32(0)  # zeros, unless a request holds the row
        # The scan's barrier publishes sFl before the placement below overwrites any.
        b_lo, b_hi, running, _ = self.batch.scan(mCu, mStart, num_reqs, tid, sWarp, held)
        self.batch.place(mCu, mStart, num_reqs, b_lo, b_hi, running, held,
                         lambda b, first_row, rows_b: self._place_rows(
                             sT0, sFl, b, first_row, rows_b, rg, groups, nr, mCu, mStart,
                             mSlots, num_tokens, num_rows, num_slots))
        return nr

    @cute.jit
    def _place_rows(self, sT0, sFl, b, first_row, rows_b, rg, groups, nr, mCu, mStart, mSlots,
                    num_tokens, num_rows, num_slots):
        """Request b's rows (from first_row) that are the CTA's, in its row table."""
        n0, hi = self._rows_here(first_row, rows_b, rg, groups, num_rows)
        if n0 < hi:
            ok, tok0, start, _, _, _ = self.batch.request(mCu, mStart, mSlots, b, num_tokens,
                                                          num_slots)
            for n in cutlass.range(n0, hi, groups, unroll=1):
                j = (n - rg) // groups
                if j < nr:
                    t0, fl = self._later_row(n - first_row, rows_b, ok, tok0, start, num_tokens)
                    sT0[j] = t0
                    sFl[j] = fl

    @cute.jit
    def _place_by_lanes(self, sRow, sT0, sFl, rg, groups, mCu, mStart, mSlots, num_tokens,
                        num_rows, num_reqs, num_slots, tid, lane):
        """rows_kernel's row table for at most 32 requests (lane_requests): the rows part 1
        leaves, in order (each request's rows past its heads, then the padding rows), are
        places 0, 1, ...; the CTA takes places rg, rg + groups, ... (sRow: their rows), so
        the groups' place counts differ by one at most. Every warp holds the batch in its
        lanes (Batch.hold_in_lanes) and finds a place's request by shuffles: no scan, no
        barrier. Returns the CTA's place count."""
        held = self.batch.hold_in_lanes(mCu, mStart, mSlots, num_reqs, num_tokens, num_slots,
                                        lane)
        ok, tok0, start, rows, before, total = held
        heads = requests.head_rows(rows, self.coff)
        heads_before = requests.warp_prefix(heads, lane) - heads  # at most 64: exact
        # Each lane's places: the first and how many (its rows past the heads). lane_first
        # is nondecreasing up to the lanes whose offsets saturated (requests.add_rows), and
        # theirs lie above every place (at least INT32_MAX - 62 > num_rows): the lanes at or
        # below a place are a prefix of the warp, as lane_at needs.
        lane_first, lane_places = before - heads_before, rows - heads
        # Heads below num_rows, summed over the lanes (each lane's clamped): they take no
        # place. The padding's places come after the requests'.
        heads_kept = (cutlass.min(requests.add_rows(before, heads), num_rows)
                      - cutlass.min(before, num_rows))
        places = num_rows - cute.arch.shuffle_sync(requests.warp_prefix(heads_kept, lane), 31)
        request_places = total - cute.arch.shuffle_sync(heads_before + heads, 31)
        nr = self._rows_owned(rg, places, groups)
        for j0 in cutlass.range(0, nr, self.threads, unroll=1):  # warp-uniform: shuffles inside
            j = j0 + tid
            place = rg + j * groups
            at = requests.lane_at(place, lane_first)
            first, count, skip, base, rows_at, ok_at, tok0_at, start_at = [
                cute.arch.shuffle_sync(v, at)
                for v in (lane_first, lane_places, heads, before, rows, Int32(ok), tok0,
                          start)]
            found = Int64(first) <= Int64(place) and Int64(place) < Int64(first) + Int64(count)
            h = skip + (place - first)  # the row's index among its request's
            n = total + (place - request_places)  # a padding row, unless a request's
            t0 = Int32(0)
            fl = Int32(0)  # padding: zeros
            if found:
                n = base + h
                t0, fl = self._later_row(h, rows_at, ok_at != 0, tok0_at, start_at, num_tokens)
            if n < 0 or n >= num_rows:  # defensive: no place maps past the output
                fl = Int32(RowFlag.SKIP)
            if j < nr:
                sRow[j] = n
                sT0[j] = t0
                sFl[j] = fl
        return nr

    @cute.jit
    def _later_row(self, h, rows_b, ok, tok0, start, num_tokens):
        """(first window token, flags) of a request's row h for the forward's row loop: a
        head row (h < coff) is RowFlag.SKIP, a row of a request that is not ok not real (zeros);
        else block q = start // ratio + h, whose window lies in the new tokens (positions
        past start): real, with a previous block. An ok request's window is always whole;
        the "whole" flag, which lets a lean key drop the masks, is still tested here so
        that it can never be set on a window that is not."""
        t0 = Int32(0)
        fl = Int32(RowFlag.SKIP)
        if h >= requests.head_rows(rows_b, self.coff):
            fl = Int32(0)
            if ok:
                q = start // self.ratio + h
                t0 = tok0 + ((q - (self.coff - 1)) * self.ratio - start)
                full = Int32(t0 >= 0 and t0 + self.window <= num_tokens)
                fl = (RowFlag.REAL | RowFlag.PREVIOUS) + full * RowFlag.FULL
        return t0, fl

    @cute.jit
    def _preload_request(self, mCu, mStart, mSlots, item, num_reqs, num_tokens, num_slots):
        """Batch.request of item `item` if it is a request, else a request that is not ok
        (no load)."""
        ok, tok0, start, length, slot, rows = (cutlass.Boolean(False), Int32(0), Int32(0),
                                               Int32(0), Int32(0), Int32(0))
        if item < num_reqs:
            ok, tok0, start, length, slot, rows = self.batch.request(
                mCu, mStart, mSlots, item, num_tokens, num_slots)
        return ok, tok0, start, length, slot, rows

    @cute.jit
    def _request_of(self, mCu, mStart, mSlots, item, num_tokens, num_slots, loaded, first):
        """Request `item`'s Batch.request: `first` where `loaded` (the thread's first item,
        loaded before the scan), else loaded now."""
        ok, tok0, start, length, slot, rows = first
        if not loaded:
            ok, tok0, start, length, slot, rows = self.batch.request(
                mCu, mStart, mSlots, item, num_tokens, num_slots)
        return ok, tok0, start, length, slot, rows

    @cute.jit
    def _run_item(self, j, tiles, sItem, sBase, mCu, mStart, mSlots, rg, groups, num_tokens,
                  num_rows, num_reqs, num_slots, thr):
        """The CTA's item j by the whole CTA, whatever its kind: a request pools its first
        min(rows, coff) rows (zeros if it is not ok) and updates its slot; a row past its
        request's heads pools (or zeros); padding is zeroed; a head row (ITEM_DONE) is its
        request's."""
        tid, cb = thr.tid, thr.cb
        R, C = self.ratio, self.coff
        _, _, gApe, _, _, gKV, gSc, gKVs, gSs, gOut = tiles
        item = rg + j * groups
        if item < num_reqs:
            ok, tok0, start, length, slot, rows = self.batch.request(
                mCu, mStart, mSlots, item, num_tokens, num_slots)
            base = sBase[j]
            for h in cutlass.range(requests.head_rows(rows, C), unroll=1):
                n = base + h
                if n >= 0 and n < num_rows:
                    if ok:
                        self._pool(*tiles, n, start // R + h, tok0, start, slot, thr)
                    else:
                        self._zero_row(gOut, n, thr)
            keeps = ok
            if const_expr(C == 1):  # a request that ends on a block boundary keeps no entry
                keeps = ok and (start + length) % R != 0
            if keeps:
                self._update(gApe, gKV, gSc, gKVs, gSs, tok0, start, start + length, slot, tid,
                             cb)
        elif const_expr(self.has_rows):
            b = sItem[j]
            n = item - num_reqs
            if b >= 0:  # a row of request b past its heads
                ok, tok0, start, _, slot, rows = self.batch.request(
                    mCu, mStart, mSlots, b, num_tokens, num_slots)
                h = n - sBase[j]
                if ok and h < rows:
                    self._pool(*tiles, n, start // R + h, tok0, start, slot, thr)
                else:
                    self._zero_row(gOut, n, thr)
            elif b == NO_REQUEST:  # padding, or a row no request covers
                self._zero_row(gOut, n, thr)

    @cute.jit
    def __call__(self, p_kv: cute.Pointer, p_score: cute.Pointer, p_ape: cute.Pointer,
                 p_cu: cute.Pointer, p_starts: cute.Pointer, p_slots: cute.Pointer,
                 p_kvs: cute.Pointer, p_ss: cute.Pointer, p_out: cute.Pointer,
                 p_cuc: cute.Pointer, num_tokens: Int32, num_rows: Int32, num_reqs: Int32,
                 num_slots: Int32, grid: Int32, stream):
        width = self.coff * self.head_dim
        gApe = cute.zipped_divide(
            cute.make_tensor(p_ape, cute.make_layout((self.ratio, width), stride=(width, 1))),
            (1, self.ape_vec))
        gKV, gSc = self._rows(p_kv, num_tokens, width), self._rows(p_score, num_tokens, width)
        mCu, mStart, mSlots, mCuc = [cute.make_tensor(p, cute.make_layout(num_reqs + 1))
                                     for p in (p_cu, p_starts, p_slots, p_cuc)]
        gOut = self._rows(p_out, num_rows, self.head_dim)
        if const_expr(self.part == Part.ROWS):
            launched = self.rows_kernel(gKV, gSc, gApe, mCu, mStart, mSlots, gOut, num_tokens,
                                        num_rows, num_reqs, num_slots, grid // self.col_blocks)
        else:
            entries = num_slots * self.window
            gSs = cute.zipped_divide(
                cute.make_tensor(p_ss, cute.make_layout((entries, width), stride=(width, 1))),
                (1, self.vec))
            launched = self.extend_kernel(
                gKV, gSc, gApe, mCu, mStart, mSlots, self._rows(p_kvs, entries, width), gSs,
                gOut, mCuc, num_tokens, num_rows, num_reqs, num_slots, grid // self.col_blocks)
        launched.launch(grid=(grid, 1, 1), block=(self.threads, 1, 1), stream=stream,
                        min_blocks_per_mp=self.ctas, preferred_smem_carveout=100,
                        use_pdl=self.pdl)
