"""csa::compressor_extend kernel (SPEC 8): the rows of the blocks that new tokens complete,
and every request's new state, in one launch (or two: a split call, below).

Work items: per request, its state and its first min(rows, coff) rows (the only rows that
read the state); then one per output row (windows of new tokens only; padding: zeros). With
the `request_rows` knob (decode steps) a request's item pools all of its rows and the items
zero the padding rows: no row items. A CTA holds `rpc` items x `cvc` column vectors of one
column chunk (the forward's Geometry).
Columns are independent, so one thread owns a request's state and state-reading rows in its
columns and reads before it writes, in program order: no barrier, no other thread involved.
Every CTA first scans the batch's row counts to place its items' output rows (with
request_rows: sums the rows before its requests and in all). Rows pool
through window.py's per-column softmax with the forward key's flags: bit-identical rows.

A split call (the `part` knob) is two launches of this kernel: part 1 has the requests'
items, part 2 the row items. The row items read no state and write only their own rows, and
the requests' items hold windows in registers across the scan: apart, the row items run at
the forward's registers per thread, and part 2 starts without waiting for part 1 (PDL; it
waits at its end instead), so the two overlap. A split call of at most 32 requests
(lane_requests) runs its row items through `lane_rows`, whose warps hold the whole batch.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import Float32, Int16, Int32, Int64, cute
from cutlass.memory import SmemAllocator

from ..config import KernelKey
from . import common as cm
from . import requests, window

DECODE_MOVED = 7  # most state entries a decode request's update keeps in registers


def _column_fast(g, logit, value, first):
    logits, m = window._window_logits(g, logit, first)
    return window._pool_fast(g, logits, m, value, first)


def _column_exact(g, logit, value, first):
    logits, m = window._window_logits(g, logit, first)
    return window._pool_exact(g, *window._softmax(g, logits, m, value))


def _build(key: KernelKey):
    g = window._Geometry(key)
    R, C, D, V, W = g.R, g.C, g.D, g.V, g.W
    row_elems = C * D  # one token, or one state entry
    slot_elems = W * row_elems
    nt = -(-g.threads // 32) * 32  # whole warps: the scan shuffles over full warps
    warps = nt // 32
    batch = requests.Batch(R, nt)
    part = key.knobs.part
    # State entries update_state loads before it stores any: all of them in a split call's
    # first part (a few CTAs, whose chain of dependent loads sets its time), else as many
    # as keep registers at the forward's.
    group = W if part == 1 else max(1, min(W, 32 // (C * V)))
    load_window, _, _ = window._window_io(g)
    # Per-warp partial sums: Batch.row_sums keeps two per warp (request_rows), Batch.scan one.
    warp_sums = 2 * warps if key.knobs.request_rows else warps
    smem_bytes = (W * g.cvc * V + 2 * g.rpc + warp_sums) * 4 + 64

    def slot_offset(slot, cv):
        """Element offset of column vector cv in entry 0 of a state slot."""
        return Int64(slot) * slot_elems + cv * V

    def token_offset(t, cv):
        """Element offset of column vector cv in token t (its coff-half 0)."""
        return Int64(t) * row_elems + cv * V

    def ape_row(k):
        # ape offset of window entry k (row k % R, column half k // R), k known at run time.
        if cutlass.const_expr(C == 1):
            return k * D
        return (k % R) * (2 * D) + (k // R) * D

    # A register fragment of V elements as 32-bit words where it fills whole words (fp32,
    # or 2-byte types with V even): loaded and merged across branches as words, its elements
    # unpack where they are read. As 16-bit registers every branch's merge would unpack them,
    # before the row sums' barrier, and the barrier would wait for the loads.
    as_words = (V * g.dtype.width) % 32 == 0

    def packed(t):
        return cute.recast_tensor(t, Int32) if cutlass.const_expr(as_words) else t

    def load_vector(p, off, t):
        """t (a fragment of V elements of the kernel's type) = the V at p + off."""
        cute.autovec_copy(packed(cute.make_tensor(p + off, V)), packed(t))

    def zero_vector(t):
        if cutlass.const_expr(as_words):
            packed(t).fill(0)
        else:
            t.fill(0.0)

    def store_vector(t, p, off):
        """The V at p + off = fragment t."""
        cute.autovec_copy(packed(t), packed(cute.make_tensor(p + off, V)))

    def element(t, i):
        """Element i of fragment t in fp32, taken from its 32-bit word here, where it is
        read: a bf16 by bit operations (it is the top half of its fp32), an fp16 by
        converting the half it truncates to. No 16-bit register then exists where branches
        merge, so none is unpacked there."""
        if cutlass.const_expr(not as_words or g.dtype.width != 16):
            return Float32(t[i])
        word = packed(t)[i // 2]
        if cutlass.const_expr(g.dtype is cutlass.BFloat16):
            bits = cute.make_rmem_tensor((1,), Int32)
            bits[0] = word << 16 if i % 2 == 0 else word & Int32(-65536)
            return cute.recast_tensor(bits, Float32)[0]
        half = cute.make_rmem_tensor((1,), Int16)
        half[0] = Int16(word if i % 2 == 0 else word >> 16)
        return Float32(cute.recast_tensor(half, g.dtype)[0])

    @cute.jit
    def gather(p_kv, p_score, p_kvs, p_ss, rKV, rSc, rL, q, start, tok0, slot, cv):
        """Loads of block q's window, no arithmetic (so all are in flight at once). Entries
        at positions >= start come from the new tokens (score into rSc), earlier ones from
        the state (fp32 logit into rL; entry e holds position (start // R - C + 1) * R + e),
        and those of block -1 are the forward's constants (value 0)."""
        win0 = (q - (C - 1)) * R
        st0 = (start // R - (C - 1)) * R
        slot_base = slot_offset(slot, cv)
        for k in cutlass.range_constexpr(W):
            col = g.entries[k][1]
            pos = win0 + k
            if pos >= start:
                off = cute.assume(token_offset(tok0 + (pos - start), cv) + col,
                                  divby=V)
                load_vector(p_kv, off, rKV[None, k])
                load_vector(p_score, off, rSc[None, k])
            elif pos >= 0:
                e = cutlass.max(cutlass.min(pos - st0, Int32(W - 1)), Int32(0))
                off = cute.assume(slot_base + e * row_elems + col, divby=V)
                load_vector(p_kvs, off, rKV[None, k])
                cute.autovec_copy(cute.make_tensor(p_ss + off, V), rL[None, k])
            else:
                zero_vector(rKV[None, k])
                rL[None, k].fill(0.0)

    def window_registers():
        """(kv, new tokens' scores, logits) of one window, gather's destinations."""
        return (cute.make_rmem_tensor((V, W), g.dtype), cute.make_rmem_tensor((V, W), g.dtype),
                cute.make_rmem_tensor((V, W), Float32))

    @cute.jit
    def finish_logits(rSc, rL, sApe, q, start, cvl):
        """The new tokens' logits, fp32(score) + ape as the forward adds them."""
        win0 = (q - (C - 1)) * R
        for k in cutlass.range_constexpr(W):
            if win0 + k >= start:
                for i in cutlass.range_constexpr(V):
                    rL[i, k] = cm.add_rn(element(rSc[None, k], i), sApe[k, cvl * V + i])

    def batch_views(p_cu, p_starts, p_slots, p_cuc, num_reqs):
        """cu_seqlens, start_pos, slots and cu_seqlens_comp as tensors (num_reqs + 1 long:
        the bound only shapes the view, indices are the kernel's to keep in range)."""
        return tuple(cute.make_tensor(p, num_reqs + 1) for p in (p_cu, p_starts, p_slots, p_cuc))

    @cute.jit
    def stage_ape(p_ape, sApe, by, tid):
        """The CTA's column chunk of ape, (W, cvc*V) fp32, as the forward stages it, over all
        `nt` threads; the caller's barrier publishes it."""
        for kk in cutlass.range_constexpr(-(-(W * g.cvc) // nt)):
            idx = tid + kk * nt
            k = idx // g.cvc
            c = idx % g.cvc
            col_v = by * g.cvc + c
            if idx < W * g.cvc and (not g.ragged_cols or col_v < g.tpr):
                src = cute.assume(ape_row(k) + col_v * V, divby=V)
                dst = cute.assume(k * (g.cvc * V) + c * V, divby=V)
                cute.autovec_copy(cute.make_tensor(p_ape + src, V),
                                  cute.make_tensor(sApe.iterator + dst, V))

    @cute.jit
    def store_row(p_out, rO, n, cv):
        off = cute.assume(Int64(n) * D + cv * V, divby=V)
        cute.autovec_copy(rO, cute.make_tensor(p_out + off, V))

    @cute.jit
    def zero_row(p_out, n, cv):
        rO = cute.make_rmem_tensor((V,), g.dtype)
        rO.fill(0.0)
        store_row(p_out, rO, n, cv)

    @cute.jit
    def pool_store(p_out, rKV, rL, n, q, cv):
        """Row n = block q from gathered values and logits, as the forward pools it. (A
        first-block flag the compiler could fold would let it contract a multiply-add the
        forward keeps apart: tests/test_extend_kernel.py audits the operations.)"""
        first = q == 0

        def column(i):
            return (lambda k: Float32(rL[i, k]), lambda k: element(rKV[None, k], i), first)

        rO = cute.make_rmem_tensor((V,), g.dtype)
        window.pool_columns(g, rO, lambda i: _column_fast(g, *column(i)),
                            lambda i: _column_exact(g, *column(i)))
        store_row(p_out, rO, n, cv)

    @cute.jit
    def body_row(p_kv, p_score, p_out, sApe, n, q, t0, cv, cvl):
        """Row n = block q, whose window lies in the new tokens from t0 - (C-1)*R on: the
        forward's code."""
        first = q == 0
        rKV = cute.make_rmem_tensor((V, W), g.dtype)
        rS = cute.make_rmem_tensor((V, W), g.dtype)
        load_window(p_kv, p_score, rKV, rS, t0, first, cv)
        pool_row(p_out, rKV, rS, sApe, n, first, cv, cvl)

    @cute.jit
    def pool_row(p_out, rKV, rS, sApe, n, first, cv, cvl):
        """body_row's pooling and store, of a window load_window loaded."""
        rO = cute.make_rmem_tensor((V,), g.dtype)
        window.pool_columns(g, rO, lambda i: window._output_fast(g, rKV, rS, sApe, i, cvl, first),
                            lambda i: window._output_exact(g, rKV, rS, sApe, i, cvl, first))
        store_row(p_out, rO, n, cv)

    @cute.jit
    def update_state(p_kv, p_score, p_kvs, p_ss, sApe, tok0, start, end, slot, cv, cvl):
        """SPEC 8's state for `end` tokens: entry e then holds position
        (end // R - C + 1) * R + e where that is < end (new tokens, a moved entry, or the
        initial state before position 0); other entries stay. Ascending e, loads of a group
        before its stores: a moved entry's source, e + (end // R - start // R) * R > e, is
        read before anything writes it."""
        shift = (end // R - start // R) * R
        st1 = (end // R - (C - 1)) * R
        slot_base = slot_offset(slot, cv)
        for e0 in cutlass.range_constexpr(0, W, group):
            span = min(group, W - e0)
            rK = cute.make_rmem_tensor((V, span, C), g.dtype)
            rN = cute.make_rmem_tensor((V, span, C), g.dtype)
            rF = cute.make_rmem_tensor((V, span, C), Float32)
            for j in cutlass.range_constexpr(span):
                pos = st1 + (e0 + j)
                if pos < end:
                    if pos >= start:
                        tok = token_offset(tok0 + (pos - start), cv)
                        for h in cutlass.range_constexpr(C):
                            off = cute.assume(tok + h * D, divby=V)
                            cute.autovec_copy(cute.make_tensor(p_kv + off, V), rK[None, j, h])
                            cute.autovec_copy(cute.make_tensor(p_score + off, V),
                                              rN[None, j, h])
                    elif pos >= 0 and shift != 0:
                        src = cutlass.min(shift + (e0 + j), Int32(W - 1))
                        for h in cutlass.range_constexpr(C):
                            off = cute.assume(slot_base + src * row_elems + h * D, divby=V)
                            cute.autovec_copy(cute.make_tensor(p_kvs + off, V), rK[None, j, h])
                            cute.autovec_copy(cute.make_tensor(p_ss + off, V), rF[None, j, h])
            for j in cutlass.range_constexpr(span):
                e = e0 + j
                pos = st1 + e
                if pos < end:
                    dst = slot_base + e * row_elems
                    if pos >= start:
                        for h in cutlass.range_constexpr(C):
                            for i in cutlass.range_constexpr(V):
                                rF[i, j, h] = cm.add_rn(Float32(rN[i, j, h]),
                                                        sApe[h * R + e % R, cvl * V + i])
                    if pos >= start or (pos >= 0 and shift != 0):
                        for h in cutlass.range_constexpr(C):
                            off = cute.assume(dst + h * D, divby=V)
                            cute.autovec_copy(rK[None, j, h], cute.make_tensor(p_kvs + off, V))
                            cute.autovec_copy(rF[None, j, h], cute.make_tensor(p_ss + off, V))
                    elif pos < 0:  # before the sequence (coff 2, no complete block yet)
                        rZ = cute.make_rmem_tensor((V,), g.dtype)
                        rZ.fill(0.0)
                        rI = cute.make_rmem_tensor((V,), Float32)
                        rI.fill(float("-inf"))
                        for h in cutlass.range_constexpr(C):
                            off = cute.assume(dst + h * D, divby=V)
                            cute.autovec_copy(rZ, cute.make_tensor(p_kvs + off, V))
                            cute.autovec_copy(rI, cute.make_tensor(p_ss + off, V))

    # One-token requests (decode) update their slot from values loaded before the row
    # scan: the token's coff halves and, when the token completes a block at coff 2, the
    # half-0 values of that block's state entries (its half 1 is the window's). No load then
    # stands between a decode request's row and its update. Up to DECODE_MOVED entries.
    moved = R - 1 if C == 2 and R - 1 <= DECODE_MOVED else 0
    preload = key.knobs.preload_decode
    request_rows = key.knobs.request_rows
    # Head-row windows gathered before the scan: the first; every one in a split call's
    # first part (registers cost nothing there).
    early_heads = C if part == 1 else 1
    has_requests = part != 2  # this launch has the requests' items
    has_rows = part != 1 and not request_rows  # ... and row items

    def is_decode(ok, start, length, heads):
        """A one-token request whose new state starts at a position >= 0 (no initial-state
        entries to write), and that moves no more entries than `moved`: update_state's work,
        done by preload_decode and store_decode."""
        decode = ok & (length == 1) & (start + 1 >= (C - 1) * R)
        if cutlass.const_expr(C == 2 and moved == 0):
            decode = decode & (heads == 0)
        return decode

    @cute.jit
    def preload_decode(p_kv, p_score, p_kvs, p_ss, rNK, rNS, rMK, rML, tok0, slot, heads, cv):
        """store_decode's sources: the token's kv and score per coff-half (rNK, rNS) and the
        moved entries' half-0 kv and logits (rMK, rML)."""
        tok = token_offset(tok0, cv)
        for h in cutlass.range_constexpr(C):
            off = cute.assume(tok + h * D, divby=V)
            load_vector(p_kv, off, rNK[None, h])
            load_vector(p_score, off, rNS[None, h])
        if cutlass.const_expr(moved > 0):  # noqa: SIM102 (compile-time, then run-time test)
            if heads > 0:  # entry R + e holds the completed block's position e
                slot_base = slot_offset(slot, cv)
                for e in cutlass.range_constexpr(moved):
                    off = cute.assume(slot_base + (R + e) * row_elems, divby=V)
                    load_vector(p_kvs, off, rMK[None, e])
                    cute.autovec_copy(cute.make_tensor(p_ss + off, V), rML[None, e])

    @cute.jit
    def store_decode(p_kvs, p_ss, sApe, rKV, rL, rNK, rNS, rMK, rML, start, slot, heads, cv,
                     cvl):
        """update_state's stores for a decode request (is_decode): the token's entry and,
        for a completed block at coff 2, the block's entries moved to 0..R-1 (half 0
        preloaded, half 1 the window's entries R..2R-1: the same values update_state loads
        from the old state). At coff 1 a completed block leaves no entry below `end`."""
        slot_base = slot_offset(slot, cv)
        if heads == 0 or cutlass.const_expr(C == 2):
            e_new = start - ((start + 1) // R - (C - 1)) * R
            for h in cutlass.range_constexpr(C):
                rF = cute.make_rmem_tensor((V,), Float32)
                for i in cutlass.range_constexpr(V):
                    rF[i] = cm.add_rn(element(rNS[None, h], i),
                                      sApe[h * R + e_new % R, cvl * V + i])
                off = cute.assume(slot_base + e_new * row_elems + h * D, divby=V)
                store_vector(rNK[None, h], p_kvs, off)
                cute.autovec_copy(rF, cute.make_tensor(p_ss + off, V))
        if cutlass.const_expr(moved > 0):  # noqa: SIM102 (compile-time, then run-time test)
            if heads > 0:
                for e in cutlass.range_constexpr(moved):
                    off = cute.assume(slot_base + e * row_elems, divby=V)
                    store_vector(rMK[None, e], p_kvs, off)
                    cute.autovec_copy(rML[None, e], cute.make_tensor(p_ss + off, V))
                    off = cute.assume(off + D, divby=V)
                    store_vector(rKV[None, R + e], p_kvs, off)
                    cute.autovec_copy(rL[None, R + e], cute.make_tensor(p_ss + off, V))

    def later_rows(base, rows, num_rows):
        """[lo, hi): the output rows base + h, h in [coff, rows), that lie in [0, num_rows)
        (bounds in int64: garbage row counts must not wrap into range)."""
        lo = cutlass.max(Int64(base) + C, Int64(0))
        hi = cutlass.min(Int64(base) + Int64(rows), Int64(num_rows))
        return Int32(cutlass.min(lo, hi)), Int32(hi)

    def block_token(q, start, tok0):
        """The new token that begins block q of a request whose new tokens start at
        position `start` (token tok0)."""
        return tok0 + (q * R - start)

    def is_head_row(h, rows):
        return h < requests.head_rows(rows, C)

    @cute.jit
    def pool_later_rows(p_kv, p_score, p_out, sApe, base, rows, q0, start, tok0, num_rows, cv,
                        cvl):
        """A request's rows past its first coff (request_rows), one after another: their
        windows lie in the new tokens, so the forward's row code pools them."""
        lo, hi = later_rows(base, rows, num_rows)
        for n in cutlass.range(lo, hi, unroll=1):
            q = q0 + (n - base)
            body_row(p_kv, p_score, p_out, sApe, n, q, block_token(q, start, tok0), cv, cvl)

    @cute.jit
    def zero_rows(p_out, lo, hi, step, cv):
        for n in cutlass.range(lo, hi, step):
            zero_row(p_out, n, cv)

    @cute.jit
    def place_request(cuc, sReq, sBase, b, first_row, rows_b, item0, row_lo, row_hi, num_reqs,
                      bid):
        """Request b, whose rows start at first_row: its offset in cu_seqlens_comp (by one
        CTA), its own item's base and its rows' request and base for the CTA's row items it
        covers."""
        if cutlass.const_expr(has_rows):  # noqa: SIM102 (compile-time, then run-time)
            if bid == 0:
                cuc[b] = first_row
        if b >= item0 and b < item0 + g.rpc:
            sBase[b - item0] = first_row
        for n in cutlass.range(cutlass.max(first_row, row_lo),
                               cutlass.min(requests.add_rows(first_row, rows_b), row_hi)):
            sReq[n + num_reqs - item0] = b
            sBase[n + num_reqs - item0] = first_row

    @cute.kernel
    def kernel(p_kv, p_score, p_ape, p_cu, p_starts, p_slots, p_kvs, p_ss, p_out, p_cuc,
               num_tokens: Int32, num_rows: Int32, num_reqs: Int32, num_slots: Int32):
        if cutlass.const_expr(part == 2):
            # This launch reads only the call's inputs and writes only row items' rows:
            # nothing part 1 reads or writes. It starts only once every part-1 CTA has
            # passed its wait, so the grids before the call are complete.
            cm.release_dependents(g.pdl)
        else:
            cm.await_upstream(g.pdl)
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        bx = bid // g.ny
        by = bid % g.ny
        ry = tid // g.cvc
        cvl = tid % g.cvc
        cv = by * g.cvc + cvl
        item0 = bx * g.rpc
        if cutlass.const_expr(part == 2):
            item0 = item0 + num_reqs  # row items only
        item = item0 + ry  # < num_reqs: request `item`; else output row item - num_reqs
        cu, starts, slots, cuc = batch_views(p_cu, p_starts, p_slots, p_cuc, num_reqs)
        smem = SmemAllocator()
        sApe = smem.allocate_tensor(Float32, window._ape_layout(g), 16)
        sReq = smem.allocate_tensor(Int32, cute.make_layout(g.rpc), 4)
        sBase = smem.allocate_tensor(Int32, cute.make_layout(g.rpc), 4)
        sWarp = smem.allocate_tensor(Int32, cute.make_layout(warp_sums), 4)
        active = tid < g.threads and (not g.ragged_cols or cv < g.tpr)

        # The batch's first row counts load first: the CTA's sums wait on them, and its
        # requests' loads, issued next, are in flight meanwhile.
        if cutlass.const_expr(request_rows):
            held = batch.strided_counts(cu, starts, num_reqs, tid)
        else:
            held = batch.run_counts(cu, starts, num_reqs, tid)
        # A request's first row issues its window loads before the scan (latency); a split
        # call's first part issues every head row's.
        windows = [window_registers() for _ in range(early_heads)]
        ok = cutlass.Boolean(False)
        tok0 = Int32(0)
        start = Int32(0)
        length = Int32(0)
        slot = Int32(0)
        heads = Int32(0)
        rows = Int32(0)
        decode = cutlass.Boolean(False)
        rNK = cute.make_rmem_tensor((V, C), g.dtype)
        rNS = cute.make_rmem_tensor((V, C), g.dtype)
        rMK = cute.make_rmem_tensor((V, max(moved, 1)), g.dtype)
        rML = cute.make_rmem_tensor((V, max(moved, 1)), Float32)
        if cutlass.const_expr(not has_requests):
            pass
        elif active and item < num_reqs:
            ok, tok0, start, length, slot, rows = batch.request(cu, starts, slots, item,
                                                                num_tokens, num_slots)
            heads = requests.head_rows(rows, C)
            for h in cutlass.range_constexpr(early_heads):
                if ok and heads > h:
                    gather(p_kv, p_score, p_kvs, p_ss, *windows[h], start // R + h, start, tok0,
                           slot, cv)
            if cutlass.const_expr(preload):
                decode = is_decode(ok, start, length, heads)
            if decode:
                preload_decode(p_kv, p_score, p_kvs, p_ss, rNK, rNS, rMK, rML, tok0, slot, heads,
                               cv)

        stage_ape(p_ape, sApe, by, tid)
        own_base = Int32(0)
        total = Int32(0)
        if cutlass.const_expr(request_rows):
            # Each request pools its own rows: the CTA needs the rows before its first
            # request and the batch's total, two sums, not a scan and a placement.
            sRows = sReq  # no row items: the items' own row counts (0 past the batch)
            counter = cvl == 0 and tid < g.threads  # one thread per item
            if counter:
                sRows[ry] = rows
            below, total = batch.row_sums(cu, starts, num_reqs, item0, tid, sWarp, held)
            rows_before = Int64(below)
            for j in cutlass.range_constexpr(g.rpc - 1):
                if j < ry:
                    rows_before = rows_before + Int64(sRows[j])
            own_base = requests.saturated(rows_before)
            if counter and by == 0 and item < num_reqs:
                cuc[item] = own_base
            if bid == 0 and tid == 0:
                cuc[num_reqs] = total
        else:
            if tid < g.rpc:
                sReq[tid] = Int32(-1)

            # Row offsets: thread t counts the rows of a contiguous run of requests, a block
            # scan gives each run its first row.
            b_lo, b_hi, running, total = batch.scan(cu, starts, num_reqs, tid, sWarp, held)
            # Each request records its first row for its own item and its request for the
            # CTA's row items it covers (at most rpc iterations per CTA in all).
            row_lo = cutlass.max(item0 - num_reqs, Int32(0))
            row_hi = cutlass.min(item0 + g.rpc - num_reqs, num_rows)
            batch.place(cu, starts, num_reqs, b_lo, b_hi, running, held,
                        lambda b, first_row, rows_b: place_request(
                            cuc, sReq, sBase, b, first_row, rows_b, item0, row_lo, row_hi,
                            num_reqs, bid))
            if cutlass.const_expr(has_rows):  # noqa: SIM102 (compile-time, then run-time)
                if bid == 0 and tid == 0:
                    cuc[num_reqs] = total
            cute.arch.sync_threads()

        if active:
            if cutlass.const_expr(not has_requests):
                pass
            elif item < num_reqs:
                base = own_base
                if cutlass.const_expr(not request_rows):
                    base = sBase[ry]
                if ok:
                    q0 = start // R
                    for h in cutlass.range_constexpr(C):
                        if h < heads:
                            rKV, rSc, rL = windows[min(h, early_heads - 1)]
                            if cutlass.const_expr(h >= early_heads):
                                gather(p_kv, p_score, p_kvs, p_ss, rKV, rSc, rL, q0 + h, start,
                                       tok0, slot, cv)
                            finish_logits(rSc, rL, sApe, q0 + h, start, cvl)
                            if base + h >= 0 and base + h < num_rows:
                                pool_store(p_out, rKV, rL, base + h, q0 + h, cv)
                    if decode:  # its one head row's window
                        store_decode(p_kvs, p_ss, sApe, windows[0][0], windows[0][2], rNK, rNS,
                                     rMK, rML, start, slot, heads, cv, cvl)
                    else:
                        update_state(p_kv, p_score, p_kvs, p_ss, sApe, tok0, start,
                                     start + length, slot, cv, cvl)
                    if cutlass.const_expr(request_rows):  # after the update: no state read
                        pool_later_rows(p_kv, p_score, p_out, sApe, base, rows, q0, start, tok0,
                                        num_rows, cv, cvl)
                else:
                    for h in cutlass.range_constexpr(C):
                        if h < heads and base + h >= 0 and base + h < num_rows:
                            zero_row(p_out, base + h, cv)
                    if cutlass.const_expr(request_rows):
                        lo, hi = later_rows(base, rows, num_rows)
                        zero_rows(p_out, lo, hi, Int32(1), cv)
            if cutlass.const_expr(request_rows):
                # Padding rows [total, num_rows), strided over the grid's item slots.
                pad0 = cutlass.min(cutlass.max(total, Int32(0)), num_rows)
                zero_rows(p_out, pad0 + item, num_rows, cute.arch.grid_dim()[0] // g.ny * g.rpc,
                          cv)
            elif cutlass.const_expr(not has_rows):
                pass
            elif item >= num_reqs:
                n = item - num_reqs
                if n < num_rows:
                    b = sReq[ry]
                    if b < 0:  # padding, or a row no request covers
                        zero_row(p_out, n, cv)
                    else:
                        ok_b, tok_b, start_b, _, _, rows_b = batch.request(cu, starts, slots, b,
                                                                           num_tokens,
                                                                           num_slots)
                        h = n - sBase[ry]
                        if not is_head_row(h, rows_b):  # else the request's item
                            if ok_b and h < rows_b:
                                q = start_b // R + h
                                body_row(p_kv, p_score, p_out, sApe, n, q,
                                         block_token(q, start_b, tok_b), cv, cvl)
                            else:
                                zero_row(p_out, n, cv)
        if cutlass.const_expr(part == 2):
            cm.complete_after_upstream(g.pdl, bid)

    @cute.kernel
    def lane_rows(p_kv, p_score, p_ape, p_cu, p_starts, p_slots, p_out, p_cuc,
                  num_tokens: Int32, num_rows: Int32, num_reqs: Int32, num_slots: Int32):
        """Part 2 of a split call of at most 32 requests (lane_requests), in the forward
        kernel's order: find the row's request, load its window, stage ape, pool. Each warp
        holds the whole batch in its lanes (Batch.hold_in_lanes), so a row's request and
        first row come by shuffles: no batch scan, barrier or reload before the window
        loads (the CTA-wide scan and placement cost part 2 9% more instructions than the
        forward's binary search)."""
        # As in `kernel`'s part 2: no wait here (cm.complete_after_upstream at the end).
        cm.release_dependents(g.pdl)
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        by = bid % g.ny
        cvl = tid % g.cvc
        cv = by * g.cvc + cvl
        n = (bid // g.ny) * g.rpc + tid // g.cvc
        cu, starts, slots, cuc = batch_views(p_cu, p_starts, p_slots, p_cuc, num_reqs)
        smem = SmemAllocator()
        sApe = smem.allocate_tensor(Float32, window._ape_layout(g), 16)
        lane = tid % 32
        held = batch.hold_in_lanes(cu, starts, slots, num_reqs, num_tokens, num_slots, lane)
        _, _, _, _, rows_before, total = held
        if bid == 0 and tid < 32:
            if lane < num_reqs:
                cuc[lane] = rows_before
            if lane == 0:
                cuc[num_reqs] = total
        found, base, ok_b, tok_b, start_b, rows_b = batch.lane_of_row(n, held)
        active = tid < g.threads and (not g.ragged_cols or cv < g.tpr) and n < num_rows
        rKV = cute.make_rmem_tensor((V, W), g.dtype)
        rS = cute.make_rmem_tensor((V, W), g.dtype)
        pooled = cutlass.Boolean(False)
        zero = cutlass.Boolean(active)  # padding, a row no request holds, an invalid one's
        first = cutlass.Boolean(False)
        if active and found:
            h = n - base
            if is_head_row(h, rows_b):  # part 1's
                zero = cutlass.Boolean(False)
            elif ok_b:
                q = start_b // R + h
                first = q == 0
                pooled = cutlass.Boolean(True)
                zero = cutlass.Boolean(False)
                load_window(p_kv, p_score, rKV, rS, block_token(q, start_b, tok_b), first, cv)
        stage_ape(p_ape, sApe, by, tid)
        cute.arch.sync_threads()
        if pooled:
            pool_row(p_out, rKV, rS, sApe, n, first, cv, cvl)
        if zero:
            zero_row(p_out, n, cv)
        cm.complete_after_upstream(g.pdl, bid)

    @cute.jit
    def launch(p_kv: cute.Pointer, p_score: cute.Pointer, p_ape: cute.Pointer,
               p_cu: cute.Pointer, p_starts: cute.Pointer, p_slots: cute.Pointer,
               p_kvs: cute.Pointer, p_ss: cute.Pointer, p_out: cute.Pointer,
               p_cuc: cute.Pointer, num_tokens: Int32, num_rows: Int32, num_reqs: Int32,
               num_slots: Int32, grid: Int32, stream: cuda.CUstream):
        if cutlass.const_expr(part == 2 and key.knobs.lane_requests):
            launched = lane_rows(p_kv, p_score, p_ape, p_cu, p_starts, p_slots, p_out, p_cuc,
                                 num_tokens, num_rows, num_reqs, num_slots)
        else:
            launched = kernel(p_kv, p_score, p_ape, p_cu, p_starts, p_slots, p_kvs, p_ss,
                              p_out, p_cuc, num_tokens, num_rows, num_reqs, num_slots)
        launched.launch(
            grid=(grid * g.ny, 1, 1), block=(nt, 1, 1), smem=smem_bytes, stream=stream,
            use_pdl=g.pdl, min_blocks_per_mp=g.min_ctas,
            # a carveout spares the DSL a device query when min_ctas caps the registers
            preferred_smem_carveout=100 if g.min_ctas else None)

    return launch


def launch_entry(key: KernelKey):
    """The `@cute.jit` launch entry; its arguments are host.ARGUMENTS["ext"], the stream."""
    return _build(key)
