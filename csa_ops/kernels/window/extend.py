"""csa::compressor_extend's register-window kernel: the rows of the blocks that new tokens complete,
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
through the forward's per-column softmax (shared/softmax.py) with the forward key's flags:
bit-identical rows.

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

from ...config import KernelKey, Part
from ..shared import common as cm
from ..shared import requests, softmax
from .rows import WindowKernel

DECODE_MOVED = 7  # most state entries a decode request's update keeps in registers


class WindowExtend(WindowKernel):
    def __init__(self, key: KernelKey) -> None:
        super().__init__(key)
        knobs = key.knobs
        self.row_elems = self.C * self.D  # one token, or one state entry
        self.slot_elems = self.W * self.row_elems
        self.nt = -(-self.threads // 32) * 32  # whole warps: the scan shuffles over full warps
        self.warps = self.nt // 32
        self.batch = requests.Batch(self.R, self.nt)
        self.part = knobs.part
        # State entries update_state loads before it stores any: all of them in a split
        # call's first part (a few CTAs, whose chain of dependent loads sets its time), else
        # as many as keep registers at the forward's.
        self.group = (self.W if self.part == Part.REQUESTS
                      else max(1, min(self.W, 32 // (self.C * self.V))))
        # Per-warp partial sums: Batch.row_sums keeps two per warp (request_rows), Batch.scan
        # one.
        self.warp_sums = 2 * self.warps if knobs.request_rows else self.warps
        self.smem_bytes = (self.W * self.cvc * self.V + 2 * self.rpc + self.warp_sums) * 4 + 64
        # A register fragment of V elements as 32-bit words where it fills whole words
        # (fp32, or 2-byte types with V even): loaded and merged across branches as words,
        # its elements unpack where they are read. As 16-bit registers every branch's merge
        # would unpack them, before the row sums' barrier, and the barrier would wait for
        # the loads.
        self.as_words = (self.V * self.dtype.width) % 32 == 0
        # One-token requests (decode) update their slot from values loaded before the row
        # scan: the token's coff halves and, when the token completes a block at coff 2,
        # the half-0 values of that block's state entries (its half 1 is the window's). No
        # load then stands between a decode request's row and its update. Up to
        # DECODE_MOVED entries.
        self.moved = self.R - 1 if self.C == 2 and self.R - 1 <= DECODE_MOVED else 0
        self.preload = knobs.preload_decode
        self.request_rows = knobs.request_rows
        # Head-row windows gathered before the scan: the first; every one in a split call's
        # first part (registers cost nothing there).
        self.early_heads = self.C if self.part == Part.REQUESTS else 1
        self.has_requests = self.part != Part.ROWS  # this launch has the requests' items
        self.has_rows = self.part != Part.REQUESTS and not self.request_rows  # ... row items

    def slot_offset(self, slot, cv):
        """Element offset of column vector cv in entry 0 of a state slot."""
        return Int64(slot) * self.slot_elems + cv * self.V

    def token_offset(self, t, cv):
        """Element offset of column vector cv in token t (its coff-half 0)."""
        return Int64(t) * self.row_elems + cv * self.V

    def packed(self, t):
        return cute.recast_tensor(t, Int32) if cutlass.const_expr(self.as_words) else t

    def load_vector(self, p, off, t):
        """t (a fragment of V elements of the kernel's type) = the V at p + off."""
        cute.autovec_copy(self.packed(cute.make_tensor(p + off, self.V)), self.packed(t))

    def zero_vector(self, t):
        if cutlass.const_expr(self.as_words):
            self.packed(t).fill(0)
        else:
            t.fill(0.0)

    def store_vector(self, t, p, off):
        """The V at p + off = fragment t."""
        cute.autovec_copy(self.packed(t), self.packed(cute.make_tensor(p + off, self.V)))

    def element(self, t, i):
        """Element i of fragment t in fp32, taken from its 32-bit word here, where it is
        read: a bf16 by bit operations (it is the top half of its fp32), an fp16 by
        converting the half it truncates to. No 16-bit register then exists where branches
        merge, so none is unpacked there."""
        if cutlass.const_expr(not self.as_words or self.dtype.width != 16):
            return Float32(t[i])
        word = self.packed(t)[i // 2]
        if cutlass.const_expr(self.dtype is cutlass.BFloat16):
            bits = cute.make_rmem_tensor((1,), Int32)
            bits[0] = word << 16 if i % 2 == 0 else word & Int32(-65536)
            return cute.recast_tensor(bits, Float32)[0]
        half = cute.make_rmem_tensor((1,), Int16)
        half[0] = Int16(word if i % 2 == 0 else word >> 16)
        return Float32(cute.recast_tensor(half, self.dtype)[0])

    @cute.jit
    def gather(self, p_kv, p_score, p_kvs, p_ss, rKV, rSc, rL, q, start, tok0, slot, cv):
        """Loads of block q's window, no arithmetic (so all are in flight at once). Entries
        at positions >= start come from the new tokens (score into rSc), earlier ones from
        the state (fp32 logit into rL; entry e holds position (start // R - C + 1) * R + e),
        and those of block -1 are the forward's constants (value 0)."""
        win0 = (q - (self.C - 1)) * self.R
        st0 = (start // self.R - (self.C - 1)) * self.R
        slot_base = self.slot_offset(slot, cv)
        for k in cutlass.range_constexpr(self.W):
            col = self.entries[k][1]
            pos = win0 + k
            if pos >= start:
                off = cute.assume(self.token_offset(tok0 + (pos - start), cv) + col,
                                  divby=self.V)
                self.load_vector(p_kv, off, rKV[None, k])
                self.load_vector(p_score, off, rSc[None, k])
            elif pos >= 0:
                e = cutlass.max(cutlass.min(pos - st0, Int32(self.W - 1)), Int32(0))
                off = cute.assume(slot_base + e * self.row_elems + col, divby=self.V)
                self.load_vector(p_kvs, off, rKV[None, k])
                cute.autovec_copy(cute.make_tensor(p_ss + off, self.V), rL[None, k])
            else:
                self.zero_vector(rKV[None, k])
                rL[None, k].fill(0.0)

    def window_registers(self):
        """(kv, new tokens' scores, logits) of one window, gather's destinations."""
        shape = (self.V, self.W)
        return (cute.make_rmem_tensor(shape, self.dtype), cute.make_rmem_tensor(shape, self.dtype),
                cute.make_rmem_tensor((self.V, self.W), Float32))

    @cute.jit
    def finish_logits(self, rSc, rL, sApe, q, start, cvl):
        """The new tokens' logits, fp32(score) + ape as the forward adds them."""
        win0 = (q - (self.C - 1)) * self.R
        for k in cutlass.range_constexpr(self.W):
            if win0 + k >= start:
                for i in cutlass.range_constexpr(self.V):
                    rL[i, k] = cm.add_rn(self.element(rSc[None, k], i), sApe[k, cvl * self.V + i])

    def batch_views(self, p_cu, p_starts, p_slots, p_cuc, num_reqs):
        """cu_seqlens, start_pos, slots and cu_seqlens_comp as tensors (num_reqs + 1 long:
        the bound only shapes the view, indices are the kernel's to keep in range)."""
        return tuple(cute.make_tensor(p, num_reqs + 1) for p in (p_cu, p_starts, p_slots, p_cuc))

    @cute.jit
    def stage_ape_all(self, p_ape, sApe, by, tid):
        """The CTA's column chunk of ape, (W, cvc*V) fp32, as the forward stages it, over all
        `nt` threads; the caller's barrier publishes it."""
        for kk in cutlass.range_constexpr(-(-(self.W * self.cvc) // self.nt)):
            idx = tid + kk * self.nt
            k = idx // self.cvc
            c = idx % self.cvc
            col_v = by * self.cvc + c
            if idx < self.W * self.cvc and (not self.ragged_cols or col_v < self.tpr):
                src = cute.assume(self.ape_base(k) + col_v * self.V, divby=self.V)
                dst = cute.assume(k * (self.cvc * self.V) + c * self.V, divby=self.V)
                cute.autovec_copy(cute.make_tensor(p_ape + src, self.V),
                                  cute.make_tensor(sApe.iterator + dst, self.V))

    @cute.jit
    def store_row(self, p_out, rO, n, cv):
        off = cute.assume(Int64(n) * self.D + cv * self.V, divby=self.V)
        cute.autovec_copy(rO, cute.make_tensor(p_out + off, self.V))

    @cute.jit
    def zero_row(self, p_out, n, cv):
        rO = cute.make_rmem_tensor((self.V,), self.dtype)
        rO.fill(0.0)
        self.store_row(p_out, rO, n, cv)

    @cute.jit
    def pooled_row(self, rKV, rL, q):
        """Block q's row from gathered values and logits, as the forward pools it. (A
        first-block flag the compiler could fold would let it contract a multiply-add the
        forward keeps apart: tests/test_extend_kernel.py audits the operations.)"""
        first = q == 0

        def column(i):
            return (lambda k: Float32(rL[i, k]), lambda k: self.element(rKV[None, k], i), first)

        rO = cute.make_rmem_tensor((self.V,), self.dtype)
        softmax.pool_columns(self, rO, lambda i: softmax.column_fast(self, *column(i)),
                             lambda i: softmax.column_exact(self, *column(i)))
        return rO

    @cute.jit
    def pool_store(self, p_out, rKV, rL, n, q, cv):
        """Row n = block q (pooled_row)."""
        self.store_row(p_out, self.pooled_row(rKV, rL, q), n, cv)

    @cute.jit
    def body_row(self, p_kv, p_score, p_out, sApe, n, q, t0, cv, cvl):
        """Row n = block q (new_token_row)."""
        self.store_row(p_out, self.new_token_row(p_kv, p_score, sApe, q, t0, cv, cvl), n, cv)

    @cute.jit
    def new_token_row(self, p_kv, p_score, sApe, q, t0, cv, cvl):
        """Block q's row, whose window lies in the new tokens from t0 - (C-1)*R on: the
        forward's code."""
        first = q == 0
        rKV = cute.make_rmem_tensor((self.V, self.W), self.dtype)
        rS = cute.make_rmem_tensor((self.V, self.W), self.dtype)
        self.load_window(p_kv, p_score, rKV, rS, t0, first, cv)
        rO = cute.make_rmem_tensor((self.V,), self.dtype)
        self.pool_window(rO, rKV, rS, sApe, cvl, first)
        return rO

    @cute.jit
    def pool_row(self, p_out, rKV, rS, sApe, n, first, cv, cvl):
        """Row n pooled from a window load_window loaded, and stored."""
        rO = cute.make_rmem_tensor((self.V,), self.dtype)
        self.pool_window(rO, rKV, rS, sApe, cvl, first)
        self.store_row(p_out, rO, n, cv)

    @cute.jit
    def update_state(self, p_kv, p_score, p_kvs, p_ss, sApe, tok0, start, end, slot, cv, cvl):
        """The serving state for `end` tokens (docs/serving.md): entry e then holds position
        (end // R - C + 1) * R + e where that is < end (new tokens, a moved entry, or the
        initial state before position 0); other entries stay. Ascending e, loads of a group
        before its stores: a moved entry's source, e + (end // R - start // R) * R > e, is
        read before anything writes it."""
        shift = (end // self.R - start // self.R) * self.R
        st1 = (end // self.R - (self.C - 1)) * self.R
        slot_base = self.slot_offset(slot, cv)
        for e0 in cutlass.range_constexpr(0, self.W, self.group):
            span = min(self.group, self.W - e0)
            rK = cute.make_rmem_tensor((self.V, span, self.C), self.dtype)
            rN = cute.make_rmem_tensor((self.V, span, self.C), self.dtype)
            rF = cute.make_rmem_tensor((self.V, span, self.C), Float32)
            for j in cutlass.range_constexpr(span):
                pos = st1 + (e0 + j)
                if pos < end:
                    if pos >= start:
                        tok = self.token_offset(tok0 + (pos - start), cv)
                        for h in cutlass.range_constexpr(self.C):
                            off = cute.assume(tok + h * self.D, divby=self.V)
                            cute.autovec_copy(cute.make_tensor(p_kv + off, self.V), rK[None, j, h])
                            cute.autovec_copy(cute.make_tensor(p_score + off, self.V),
                                              rN[None, j, h])
                    elif pos >= 0 and shift != 0:
                        src = cutlass.min(shift + (e0 + j), Int32(self.W - 1))
                        for h in cutlass.range_constexpr(self.C):
                            off = cute.assume(slot_base + src * self.row_elems + h * self.D,
                                              divby=self.V)
                            cute.autovec_copy(cute.make_tensor(p_kvs + off, self.V), rK[None, j, h])
                            cute.autovec_copy(cute.make_tensor(p_ss + off, self.V), rF[None, j, h])
            for j in cutlass.range_constexpr(span):
                e = e0 + j
                pos = st1 + e
                if pos < end:
                    dst = slot_base + e * self.row_elems
                    if pos >= start:
                        for h in cutlass.range_constexpr(self.C):
                            for i in cutlass.range_constexpr(self.V):
                                new = Float32(rN[i, j, h])
                                rF[i, j, h] = cm.add_rn(
                                    new, sApe[h * self.R + e % self.R, cvl * self.V + i])
                    if pos >= start or (pos >= 0 and shift != 0):
                        for h in cutlass.range_constexpr(self.C):
                            off = cute.assume(dst + h * self.D, divby=self.V)
                            cute.autovec_copy(rK[None, j, h], cute.make_tensor(p_kvs + off, self.V))
                            cute.autovec_copy(rF[None, j, h], cute.make_tensor(p_ss + off, self.V))
                    elif pos < 0:  # before the sequence (coff 2, no complete block yet)
                        rZ = cute.make_rmem_tensor((self.V,), self.dtype)
                        rZ.fill(0.0)
                        rI = cute.make_rmem_tensor((self.V,), Float32)
                        rI.fill(float("-inf"))
                        for h in cutlass.range_constexpr(self.C):
                            off = cute.assume(dst + h * self.D, divby=self.V)
                            cute.autovec_copy(rZ, cute.make_tensor(p_kvs + off, self.V))
                            cute.autovec_copy(rI, cute.make_tensor(p_ss + off, self.V))

    def is_decode(self, ok, start, length, heads):
        """A one-token request whose new state starts at a position >= 0 (no initial-state
        entries to write), and that moves no more entries than `moved`: update_state's work,
        done by preload_decode and store_decode."""
        decode = ok & (length == 1) & (start + 1 >= (self.C - 1) * self.R)
        if cutlass.const_expr(self.C == 2 and self.moved == 0):
            decode = decode & (heads == 0)
        return decode

    def decode_registers(self):
        """preload_decode's destinations: the token's kv and score per coff-half, the moved
        entries' half-0 kv and logits."""
        moved = max(self.moved, 1)
        return (cute.make_rmem_tensor((self.V, self.C), self.dtype),
                cute.make_rmem_tensor((self.V, self.C), self.dtype),
                cute.make_rmem_tensor((self.V, moved), self.dtype),
                cute.make_rmem_tensor((self.V, moved), Float32))

    @staticmethod
    def no_request():
        """Batch.request's values before a request is read: (ok, first token, start,
        length, slot, rows)."""
        return cutlass.Boolean(False), Int32(0), Int32(0), Int32(0), Int32(0), Int32(0)

    @cute.jit
    def preload_decode(self, p_kv, p_score, p_kvs, p_ss, rNK, rNS, rMK, rML, tok0, slot, heads, cv):
        """store_decode's sources: the token's kv and score per coff-half (rNK, rNS) and the
        moved entries' half-0 kv and logits (rMK, rML)."""
        tok = self.token_offset(tok0, cv)
        for h in cutlass.range_constexpr(self.C):
            off = cute.assume(tok + h * self.D, divby=self.V)
            self.load_vector(p_kv, off, rNK[None, h])
            self.load_vector(p_score, off, rNS[None, h])
        if cutlass.const_expr(self.moved > 0):  # noqa: SIM102 (compile-time, then run-time test)
            if heads > 0:  # entry R + e holds the completed block's position e
                slot_base = self.slot_offset(slot, cv)
                for e in cutlass.range_constexpr(self.moved):
                    off = cute.assume(slot_base + (self.R + e) * self.row_elems, divby=self.V)
                    self.load_vector(p_kvs, off, rMK[None, e])
                    cute.autovec_copy(cute.make_tensor(p_ss + off, self.V), rML[None, e])

    @cute.jit
    def store_decode(self, p_kvs, p_ss, sApe, rKV, rL, rNK, rNS, rMK, rML, start, slot, heads, cv,
                     cvl):
        """update_state's stores for a decode request (is_decode): the token's entry and,
        for a completed block at coff 2, the block's entries moved to 0..R-1 (half 0
        preloaded, half 1 the window's entries R..2R-1: the same values update_state loads
        from the old state). At coff 1 a completed block leaves no entry below `end`."""
        slot_base = self.slot_offset(slot, cv)
        if heads == 0 or cutlass.const_expr(self.C == 2):
            e_new = start - ((start + 1) // self.R - (self.C - 1)) * self.R
            for h in cutlass.range_constexpr(self.C):
                rF = cute.make_rmem_tensor((self.V,), Float32)
                for i in cutlass.range_constexpr(self.V):
                    rF[i] = cm.add_rn(self.element(rNS[None, h], i),
                                      sApe[h * self.R + e_new % self.R, cvl * self.V + i])
                off = cute.assume(slot_base + e_new * self.row_elems + h * self.D, divby=self.V)
                self.store_vector(rNK[None, h], p_kvs, off)
                cute.autovec_copy(rF, cute.make_tensor(p_ss + off, self.V))
        if cutlass.const_expr(self.moved > 0):  # noqa: SIM102 (compile-time, then run-time test)
            if heads > 0:
                for e in cutlass.range_constexpr(self.moved):
                    off = cute.assume(slot_base + e * self.row_elems, divby=self.V)
                    self.store_vector(rMK[None, e], p_kvs, off)
                    cute.autovec_copy(rML[None, e], cute.make_tensor(p_ss + off, self.V))
                    off = cute.assume(off + self.D, divby=self.V)
                    self.store_vector(rKV[None, self.R + e], p_kvs, off)
                    cute.autovec_copy(rL[None, self.R + e], cute.make_tensor(p_ss + off, self.V))

    def later_rows(self, base, rows, num_rows):
        """[lo, hi): the output rows base + h, h in [coff, rows), that lie in [0, num_rows)
        (bounds in int64: garbage row counts must not wrap into range)."""
        lo = cutlass.max(Int64(base) + self.C, Int64(0))
        hi = cutlass.min(Int64(base) + Int64(rows), Int64(num_rows))
        return Int32(cutlass.min(lo, hi)), Int32(hi)

    def block_token(self, q, start, tok0):
        return requests.block_token(q, start, tok0, self.R)

    def is_head_row(self, h, rows):
        return h < requests.head_rows(rows, self.C)

    @cute.jit
    def pool_later_rows(self, p_kv, p_score, p_out, sApe, base, rows, q0, start, tok0, num_rows, cv,
                        cvl):
        """A request's rows past its first coff (request_rows), one after another: their
        windows lie in the new tokens, so the forward's row code pools them."""
        lo, hi = self.later_rows(base, rows, num_rows)
        for n in cutlass.range(lo, hi, unroll=1):
            q = q0 + (n - base)
            self.body_row(p_kv, p_score, p_out, sApe, n, q, self.block_token(q, start, tok0), cv,
                          cvl)

    @cute.jit
    def zero_rows(self, p_out, lo, hi, step, cv):
        for n in cutlass.range(lo, hi, step):
            self.zero_row(p_out, n, cv)

    @cute.jit
    def place_request(self, cuc, sReq, sBase, b, first_row, rows_b, item0, row_lo, row_hi, num_reqs,
                      bid):
        """Request b, whose rows start at first_row: its offset in cu_seqlens_comp (by one
        CTA), its own item's base and its rows' request and base for the CTA's row items it
        covers."""
        if cutlass.const_expr(self.has_rows):  # noqa: SIM102 (compile-time, then run-time)
            if bid == 0:
                cuc[b] = first_row
        if b >= item0 and b < item0 + self.rpc:
            sBase[b - item0] = first_row
        for n in cutlass.range(cutlass.max(first_row, row_lo),
                               cutlass.min(requests.add_rows(first_row, rows_b), row_hi)):
            sReq[n + num_reqs - item0] = b
            sBase[n + num_reqs - item0] = first_row

    @cute.kernel
    def kernel(self, p_kv, p_score, p_ape, p_cu, p_starts, p_slots, p_kvs, p_ss, p_out, p_cuc,
               num_tokens: Int32, num_rows: Int32, num_reqs: Int32, num_slots: Int32):
        if cutlass.const_expr(self.part == Part.ROWS):
            # This launch reads only the call's inputs and writes only row items' rows:
            # nothing part 1 reads or writes. It starts only once every part-1 CTA has
            # passed its wait, so the grids before the call are complete.
            cm.release_dependents(self.pdl)
        else:
            cm.await_upstream(self.pdl)
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        bx = bid // self.ny
        by = bid % self.ny
        ry = tid // self.cvc
        cvl = tid % self.cvc
        cv = by * self.cvc + cvl
        item0 = bx * self.rpc
        if cutlass.const_expr(self.part == Part.ROWS):
            item0 = item0 + num_reqs  # row items only
        item = item0 + ry  # < num_reqs: request `item`; else output row item - num_reqs
        cu, starts, slots, cuc = self.batch_views(p_cu, p_starts, p_slots, p_cuc, num_reqs)
        smem = SmemAllocator()
        sApe = smem.allocate_tensor(Float32, self.ape_layout(), 16)
        sReq = smem.allocate_tensor(Int32, cute.make_layout(self.rpc), 4)
        sBase = smem.allocate_tensor(Int32, cute.make_layout(self.rpc), 4)
        sWarp = smem.allocate_tensor(Int32, cute.make_layout(self.warp_sums), 4)
        active = tid < self.threads and (not self.ragged_cols or cv < self.tpr)

        # The batch's first row counts load first: the CTA's sums wait on them, and its
        # requests' loads, issued next, are in flight meanwhile.
        if cutlass.const_expr(self.request_rows):
            held = self.batch.strided_counts(cu, starts, num_reqs, tid)
        else:
            held = self.batch.run_counts(cu, starts, num_reqs, tid)
        # A request's first row issues its window loads before the scan (latency); a split
        # call's first part issues every head row's.
        windows = [self.window_registers() for _ in range(self.early_heads)]
        ok, tok0, start, length, slot, rows = self.no_request()
        heads = Int32(0)
        decode = cutlass.Boolean(False)
        rNK, rNS, rMK, rML = self.decode_registers()
        if cutlass.const_expr(not self.has_requests):
            pass
        elif active and item < num_reqs:
            ok, tok0, start, length, slot, rows = self.batch.request(cu, starts, slots, item,
                                                                     num_tokens, num_slots)
            heads = requests.head_rows(rows, self.C)
            for h in cutlass.range_constexpr(self.early_heads):
                if ok and heads > h:
                    self.gather(p_kv, p_score, p_kvs, p_ss, *windows[h], start // self.R + h, start,
                                tok0,
                                slot, cv)
            if cutlass.const_expr(self.preload):
                decode = self.is_decode(ok, start, length, heads)
            if decode:
                self.preload_decode(p_kv, p_score, p_kvs, p_ss, rNK, rNS, rMK, rML, tok0, slot,
                                    heads, cv)

        self.stage_ape_all(p_ape, sApe, by, tid)
        own_base = Int32(0)
        total = Int32(0)
        if cutlass.const_expr(self.request_rows):
            # Each request pools its own rows: the CTA needs the rows before its first
            # request and the batch's total, two sums, not a scan and a placement.
            sRows = sReq  # no row items: the items' own row counts (0 past the batch)
            counter = cvl == 0 and tid < self.threads  # one thread per item
            if counter:
                sRows[ry] = rows
            below, total = self.batch.row_sums(cu, starts, num_reqs, item0, tid, sWarp, held)
            rows_before = Int64(below)
            for j in cutlass.range_constexpr(self.rpc - 1):
                if j < ry:
                    rows_before = rows_before + Int64(sRows[j])
            own_base = requests.saturated(rows_before)
            if counter and by == 0 and item < num_reqs:
                cuc[item] = own_base
            if bid == 0 and tid == 0:
                cm.store_row_total(cuc, num_reqs, total, num_rows)
        else:
            if tid < self.rpc:
                sReq[tid] = Int32(-1)

            # Row offsets: thread t counts the rows of a contiguous run of requests, a block
            # scan gives each run its first row.
            b_lo, b_hi, running, total = self.batch.scan(cu, starts, num_reqs, tid, sWarp, held)
            # Each request records its first row for its own item and its request for the
            # CTA's row items it covers (at most rpc iterations per CTA in all).
            row_lo = cutlass.max(item0 - num_reqs, Int32(0))
            row_hi = cutlass.min(item0 + self.rpc - num_reqs, num_rows)
            self.batch.place(cu, starts, num_reqs, b_lo, b_hi, running, held,
                             lambda b, first_row, rows_b: self.place_request(
                            cuc, sReq, sBase, b, first_row, rows_b, item0, row_lo, row_hi,
                            num_reqs, bid))
            if cutlass.const_expr(self.has_rows):  # noqa: SIM102 (compile-time, then run-time)
                if bid == 0 and tid == 0:
                    cm.store_row_total(cuc, num_reqs, total, num_rows)
            cute.arch.sync_threads()

        if active:
            if cutlass.const_expr(not self.has_requests):
                pass
            elif item < num_reqs:
                base = own_base
                if cutlass.const_expr(not self.request_rows):
                    base = sBase[ry]
                if ok:
                    q0 = start // self.R
                    for h in cutlass.range_constexpr(self.C):
                        if h < heads:
                            rKV, rSc, rL = windows[min(h, self.early_heads - 1)]
                            if cutlass.const_expr(h >= self.early_heads):
                                self.gather(p_kv, p_score, p_kvs, p_ss, rKV, rSc, rL, q0 + h, start,
                                            tok0, slot, cv)
                            self.finish_logits(rSc, rL, sApe, q0 + h, start, cvl)
                            if base + h >= 0 and base + h < num_rows:
                                self.pool_store(p_out, rKV, rL, base + h, q0 + h, cv)
                    if decode:  # its one head row's window
                        self.store_decode(p_kvs, p_ss, sApe, windows[0][0], windows[0][2], rNK, rNS,
                                          rMK, rML, start, slot, heads, cv, cvl)
                    else:
                        self.update_state(p_kv, p_score, p_kvs, p_ss, sApe, tok0, start,
                                          start + length, slot, cv, cvl)
                    if cutlass.const_expr(self.request_rows):  # after the update: no state read
                        self.pool_later_rows(p_kv, p_score, p_out, sApe, base, rows, q0, start,
                                             tok0, num_rows, cv, cvl)
                else:
                    for h in cutlass.range_constexpr(self.C):
                        if h < heads and base + h >= 0 and base + h < num_rows:
                            self.zero_row(p_out, base + h, cv)
                    if cutlass.const_expr(self.request_rows):
                        lo, hi = self.later_rows(base, rows, num_rows)
                        self.zero_rows(p_out, lo, hi, Int32(1), cv)
            if cutlass.const_expr(self.request_rows):
                # Padding rows [total, num_rows), strided over the grid's item slots.
                pad0 = cutlass.min(cutlass.max(total, Int32(0)), num_rows)
                first_pad = pad0 + item
                self.zero_rows(p_out, first_pad, num_rows,
                               cute.arch.grid_dim()[0] // self.ny * self.rpc, cv)
            elif cutlass.const_expr(not self.has_rows):
                pass
            elif item >= num_reqs:
                n = item - num_reqs
                if n < num_rows:
                    b = sReq[ry]
                    if b < 0:  # padding, or a row no request covers
                        self.zero_row(p_out, n, cv)
                    else:
                        ok_b, tok_b, start_b, _, _, rows_b = self.batch.request(
                            cu, starts, slots, b, num_tokens, num_slots)
                        h = n - sBase[ry]
                        if not self.is_head_row(h, rows_b):  # else the request's item
                            if ok_b and h < rows_b:
                                q = start_b // self.R + h
                                self.body_row(p_kv, p_score, p_out, sApe, n, q,
                                              self.block_token(q, start_b, tok_b), cv, cvl)
                            else:
                                self.zero_row(p_out, n, cv)
        if cutlass.const_expr(self.part == Part.ROWS):
            cm.complete_after_upstream(self.pdl, bid)

    @cute.kernel
    def lane_rows(self, p_kv, p_score, p_ape, p_cu, p_starts, p_slots, p_out, p_cuc,
                  num_tokens: Int32, num_rows: Int32, num_reqs: Int32, num_slots: Int32):
        """Part 2 of a split call of at most 32 requests (lane_requests), in the forward
        kernel's order: find the row's request, load its window, stage ape, pool. Each warp
        holds the whole batch in its lanes (Batch.hold_in_lanes), so a row's request and
        first row come by shuffles: no batch scan, barrier or reload before the window
        loads (the CTA-wide scan and placement cost part 2 9% more instructions than the
        forward's binary search)."""
        # As in `kernel`'s part 2: no wait here (cm.complete_after_upstream at the end).
        cm.release_dependents(self.pdl)
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        by = bid % self.ny
        cvl = tid % self.cvc
        cv = by * self.cvc + cvl
        n = (bid // self.ny) * self.rpc + tid // self.cvc
        cu, starts, slots, cuc = self.batch_views(p_cu, p_starts, p_slots, p_cuc, num_reqs)
        smem = SmemAllocator()
        sApe = smem.allocate_tensor(Float32, self.ape_layout(), 16)
        lane = tid % 32
        held = self.batch.hold_in_lanes(cu, starts, slots, num_reqs, num_tokens, num_slots, lane)
        _, _, _, _, rows_before, total = held
        if bid == 0 and tid < 32:
            if lane < num_reqs:
                cuc[lane] = rows_before
            if lane == 0:
                cm.store_row_total(cuc, num_reqs, total, num_rows)
        found, base, ok_b, tok_b, start_b, rows_b, _ = self.batch.lane_of_row(n, held)
        active = tid < self.threads and (not self.ragged_cols or cv < self.tpr) and n < num_rows
        rKV = cute.make_rmem_tensor((self.V, self.W), self.dtype)
        rS = cute.make_rmem_tensor((self.V, self.W), self.dtype)
        pooled = cutlass.Boolean(False)
        zero = cutlass.Boolean(active)  # padding, a row no request holds, an invalid one's
        first = cutlass.Boolean(False)
        if active and found:
            h = n - base
            if self.is_head_row(h, rows_b):  # part 1's
                zero = cutlass.Boolean(False)
            elif ok_b:
                q = start_b // self.R + h
                first = q == 0
                pooled = cutlass.Boolean(True)
                zero = cutlass.Boolean(False)
                self.load_window(p_kv, p_score, rKV, rS, self.block_token(q, start_b, tok_b), first,
                                 cv)
        self.stage_ape_all(p_ape, sApe, by, tid)
        cute.arch.sync_threads()
        if pooled:
            self.pool_row(p_out, rKV, rS, sApe, n, first, cv, cvl)
        if zero:
            self.zero_row(p_out, n, cv)
        cm.complete_after_upstream(self.pdl, bid)

    @cute.jit
    def __call__(self, p_kv: cute.Pointer, p_score: cute.Pointer, p_ape: cute.Pointer,
                 p_cu: cute.Pointer, p_starts: cute.Pointer, p_slots: cute.Pointer,
                 p_kvs: cute.Pointer, p_ss: cute.Pointer, p_out: cute.Pointer,
                 p_cuc: cute.Pointer, num_tokens: Int32, num_rows: Int32, num_reqs: Int32,
                 num_slots: Int32, grid: Int32, stream: cuda.CUstream):
        if cutlass.const_expr(self.part == Part.ROWS and self.key.knobs.lane_requests):
            launched = self.lane_rows(p_kv, p_score, p_ape, p_cu, p_starts, p_slots, p_out, p_cuc,
                                      num_tokens, num_rows, num_reqs, num_slots)
        else:
            launched = self.kernel(p_kv, p_score, p_ape, p_cu, p_starts, p_slots, p_kvs, p_ss,
                                   p_out, p_cuc, num_tokens, num_rows, num_reqs, num_slots)
        launched.launch(
            grid=(grid * self.ny, 1, 1), block=(self.nt, 1, 1), smem=self.smem_bytes, stream=stream,
            use_pdl=self.pdl, min_blocks_per_mp=self.min_ctas,
            # a carveout spares the DSL a device query when min_ctas caps the registers
            preferred_smem_carveout=100 if self.min_ctas else None)
