"""Streaming CuTe-DSL kernels of the compressor for large windows (coff * ratio > WINDOW_MAX).

A CTA owns a column block (cv vectors of `vec` columns) and a strided set of output rows. Per
row, cp.async brings the window tile into shared memory in coalesced 128-byte rows, `stages-1`
rows ahead, so each input element leaves DRAM once. Warp w then owns column vector w % cv and
a 32 * kt slice of the window (one entry per lane and step): the softmax runs as exact passes
over the tile (max; then exp, sum and sum e*v) with reductions by warp shuffles in a fixed
order (bitwise run-to-run deterministic). The forward (parity knob) bounds each column's
distance from torch's own CUDA order and recomputes, in that order (torch_order.py), the
columns it cannot place within one output step. The backward writes its gradients back into
the tile and stores them coalesced. grad_ape: per-CTA partials in registers, written to the
workspace and summed over CTAs by reduce.py's fixed-order sum. Keys and plans:
streaming_plan.py.
"""

from __future__ import annotations

import math

import cutlass
from cutlass import Float32, Int32, Int64, const_expr, cute
from cutlass.cute.nvgpu import cpasync

from ..config import TYPES, KernelKey
from . import common as cm
from . import requests, torch_order
from .reduce import launch_sum_parts
from .streaming_plan import MAX_ROWS, RED_KINDS, quiet_lanes

_SUM_SPLIT = 16  # grad_ape sum: warps per CTA, each summing every 16th CTA partial
QUIET_UNROLL = 4  # pieces of a quiet request's update loaded before their stores
# An extend CTA's item table holds a row's request, or NO_REQUEST: a row no request holds
# (padding: zeros), or ITEM_DONE: an item finished before the CTA's loop over its items (a
# request whose quiet update ran, a head row, which its request's item pools).
NO_REQUEST = -1
ITEM_DONE = -2
# A split extend call's row launch flags the head rows (its requests' launch writes them).
SKIP_ROW = 8


def _flat(t: cute.Tensor, n: int, h: int = 0) -> cute.Tensor:
    """Elements [h * n, (h + 1) * n) of a sliced vector as a flat view (the shape cute.copy
    expects; h > 0: one 16-byte fp32 access of a wider vector)."""
    return cute.make_tensor(t.iterator + h * n if h else t.iterator, cute.make_layout(n))


class _Streaming:
    """One compiled configuration; every attribute is a compile-time constant."""

    def __init__(self, key: KernelKey, backward: bool):
        k = key.knobs
        self.dtype = cm.dsl_type(key.dtype)
        self.d, self.r, self.co = key.head_dim, key.ratio, key.coff
        self.w = self.r * self.co
        self.vec, self.nt = k.vec, k.threads
        self.cv, self.wpc, self.kt = k.cv, k.wpc, k.kt
        self.wpad = 32 * self.kt * self.wpc
        self.stages, self.ctas = k.stages, k.ctas
        self.fast_exp, self.pdl = k.fast_exp, k.pdl
        # lean: rows whose whole window exists skip the per-entry masks (same results).
        self.lean = k.lean and self.wpad == self.w
        self.bwd = backward
        self.ncv = self.d // self.vec  # column vectors per coff-half
        self.cb = -(-self.ncv // self.cv)
        self.av = min(4, self.vec)  # fp32 ape access (16 bytes at most)
        self.ah = self.vec // self.av
        self.lv = int(math.log2(self.vec))
        self.lpc = 32 // self.vec  # lanes that end up holding one column's reduction
        self.loads = -(-self.w * self.cv // self.nt)  # tile vectors per thread per tensor
        # Tile rows are cv 16-byte chunks; xor-swizzle the chunk by the row so the 32 rows a
        # warp reads at one column vector fall in distinct banks.
        self.rpl = max(1, 128 // (self.cv * self.vec * 2))
        # e is kept as exp(l - m) * 2**-shift: sum(e * v) then cannot overflow before max|v|.
        self.shift = max(0, math.ceil(math.log2(self.w)))
        self.async_copy = self.vec * 2 >= 4  # cp.async moves 4, 8 or 16 bytes
        self.parity = 0 if backward else k.parity
        if self.parity:  # the exact columns' order, and the certificate that calls them
            self.soft_chains = torch_order.softmax_chains(self.w, self.d)
            self.sum_split = torch_order.sum_split(self.w, self.d)
            self._certificate(key)

    def _certificate(self, key: KernelKey) -> None:
        """Constants of _row's certificate: a column is certified when
            cert_m * sum(e|v|) + cert_v * sum(|v|) < cert_keep * |sum(e v)|.
        To first order (u = 2**-24) the fast column and torch's lie within
            u (3 sum(p|v||l - m|) + c_S sum(p|v|) + c_O |out|)
        of each other. c_S: per entry, ex2.approx (2**-21) and the rounding of its argument
        (|x| u, x = (l - m) log2(e) - shift) against expf (2 ulp), the division and the
        product (the 14 counts 8 + 4 + 1 and one product; the other product's rounding is
        the first add of a depth below); both sums' trees (depths kt + 4 + wpc and
        torch_order.sum_depth, each counting its exact first add as a rounding). c_O: both
        denominators' sums (torch's: up to W - 1 roundings), the final division and the
        per-entry errors' weighted mean (sum p|l - m| <= ln W). The |l - m| term (the
        arguments' roundings, both sides) costs no sum of its own: entries with |l - m| <=
        D0 add at most 3 D0 sum(p|v|), the others at most 3 D0 e**-D0 sum|v| / s
        (p|l - m| <= e**(l - m) |l - m| / s). ex2.approx.ftz flushes e below 2**-126: at most
        2**-126 sum|v| on sum(e v). One output step is at least 2**-p |out| for p significand
        bits; below it the two cannot round more than one step apart. The test asks for half
        that (2**(p+1)) and 1.25 more for the second order: that margin also covers the
        gradual underflow of products e v below 2**-126 (at most W**2 2**-150 / s, under
        the smallest bf16 step). NaN and infinities fail the test."""
        w, u, d0 = self.w, 2.0**-24, 4.0
        depth_fast = self.kt + 4 + self.wpc
        c_s = (14 + math.log(2) * self.shift + depth_fast + torch_order.sum_depth(w, self.d)
               + 3 * d0)
        c_o = w + depth_fast + 16 + 3 * math.log(w) + 0.7 * self.shift
        scale = 1.25 * 2.0 ** (TYPES[key.dtype].precision + 1)
        # e is scaled by 2**-shift: the tail's e**(l - m) is 2**shift e.
        self.cert_m = scale * u * c_s
        self.cert_v = scale * (2.0**-126 + 3 * u * 2.0**-self.shift * d0 * math.exp(-d0))
        self.cert_keep = 1 - scale * u * c_o
        assert self.cert_keep > 0.5, "the certificate is meant for 16-bit outputs"

    # ---------------------------------------------------------------- small helpers
    def _phys(self, cv, k):
        return cv ^ ((k // self.rpl) % self.cv)

    @cute.jit
    def _load_f32(self, src):
        frag = cute.make_rmem_tensor((self.vec,), Float32)
        frag.store(src.load().to(Float32))
        return frag

    @cute.jit
    def _store(self, dst, vals):
        frag = cute.make_rmem_tensor((self.vec,), Float32)
        for v in cutlass.range_constexpr(self.vec):
            frag[v] = vals[v]
        dst.store(frag.load().to(self.dtype))

    @cute.jit
    def _op(self, a, b, is_max):
        res = a + b
        if const_expr(is_max):
            res = cute.arch.fmax(a, b, nan=True)
        return res

    @cute.jit
    def _scatter(self, vals, lane, is_max):
        """Warp reduction of vec per-column values; lane keeps column (lane >> (5-lv)) % vec.

        Reduce-scatter: each butterfly step halves the values a lane carries, so the whole
        reduction costs about 2 * vec shuffles instead of 5 * vec. IEEE add and max commute,
        so the lanes sharing a column agree bit for bit."""
        cur = [vals[v] for v in range(self.vec)]
        for step in cutlass.range_constexpr(5):
            off = 16 >> step
            n = len(cur)
            if const_expr(n > 1):
                upper = ((lane >> (4 - step)) & 1) == 1
                half = n // 2
                nxt = []
                for j in cutlass.range_constexpr(half):
                    keep = cutlass.select_(upper, cur[j + half], cur[j])
                    send = cutlass.select_(upper, cur[j], cur[j + half])
                    nxt.append(self._op(keep, cute.arch.shuffle_sync_bfly(send, offset=off),
                                        is_max))
                cur = nxt
            else:
                cur = [self._op(cur[0], cute.arch.shuffle_sync_bfly(cur[0], offset=off),
                                is_max)]
        return cur[0]

    @cute.jit
    def _gather(self, x):
        """Inverse of _scatter's layout: every lane gets all vec columns."""
        return [cute.arch.shuffle_sync(x, offset=v << (5 - self.lv)) for v in range(self.vec)]

    @cute.jit
    def _cross(self, x, sRed, kind, lane, cvw, wp, col, is_max):
        """Combine the per-warp results of warps sharing a column vector, in warp order."""
        return self._cross_all([x], sRed, kind, lane, cvw, wp, col, is_max)[0]

    @cute.jit
    def _cross_all(self, xs, sRed, kind, lane, cvw, wp, col, is_max):
        """_cross of several values (kinds kind, kind + 1, ...) behind one barrier."""
        res = list(xs)
        if const_expr(self.wpc > 1):
            if lane % self.lpc == 0:
                for i in cutlass.range_constexpr(len(xs)):
                    sRed[col, wp, cvw, kind + i] = xs[i]
            cute.arch.barrier()
            for i in cutlass.range_constexpr(len(xs)):
                r = sRed[col, 0, cvw, kind + i]
                for w in cutlass.range_constexpr(1, self.wpc):
                    r = self._op(r, sRed[col, w, cvw, kind + i], is_max)
                res[i] = r
        return res

    def _pick(self, ok, a, b):
        return a if ok is True else cutlass.select_(ok, a, b)

    def _scratch(self, smem, placeholder):
        """The exact columns' scratch (forward with parity): one window of fp32 per column
        vector, where a warp lays out a column's terms for its chains' lanes."""
        if not self.parity:
            return placeholder
        return smem.allocate_tensor(Float32, cute.make_layout((self.wpad, self.cv)), 16)

    @cute.jit
    def _row_info(self, n, mCu, mCuc, num_tokens, num_segs):
        """(first window token, flags) of row n; flag bit 0: a real row (n < cuc[-1]), bit 1:
        its block has a previous block, bit 2: every window entry exists. Segment: how many
        of cuc[1:] are <= n, as the reference searches; every index read lies inside the
        offsets, so any content is safe."""
        lo = Int32(0)
        hi = num_segs
        c_lo = mCuc[0]
        u_lo = mCu[0]
        while lo < hi:
            mid = (lo + hi) // 2
            c = mCuc[mid + 1]
            u = mCu[mid + 1]  # loaded beside cuc: the search is the only dependent chain
            if c <= n:
                lo = mid + 1
                c_lo = c
                u_lo = u
            else:
                hi = mid
        # lo == num_segs only when n >= cuc[-1] (not a real row) for sorted offsets.
        block = n - c_lo
        t0 = Int64(u_lo) + Int64(block) * self.r - (self.co - 1) * self.r
        t0 = cutlass.max(cutlass.min(t0, Int64(num_tokens) + 1), Int64(-self.w - 1))
        real = n < mCuc[num_segs] and num_segs > 0
        full = real and t0 >= 0 and t0 + self.w <= num_tokens and (self.co == 1 or block > 0)
        fl = Int32(real) + 2 * Int32(block > 0) + 4 * Int32(full)
        return Int32(t0), fl

    @cute.jit
    def _entry_ok(self, k, t0, fl, num_tokens):
        """Entry k of a row exists: inside the window and the token range, and for coff 2 a
        first-half entry needs a previous block in the segment (flag bit 1)."""
        tk = t0 + k
        ok = k < self.w and tk >= 0 and tk < num_tokens
        if const_expr(self.co == 2):
            ok = ok and ((fl & 2) != 0 or k >= self.r)
        return ok

    @cute.jit
    def _zero_range(self, gA, gB, ta, tb, half, cb, tid):
        """Zero this block's columns of tokens [ta, tb), coff-half `half`, in gA and gB."""
        zero = cute.make_rmem_tensor((self.vec,), self.dtype)
        zero.fill(0.0)
        for idx in cutlass.range(tid, (tb - ta) * self.cv, self.nt, unroll=1):
            c = cb * self.cv + idx % self.cv
            if c < self.ncv:
                t = ta + idx // self.cv
                gA[(None, (t, half * self.ncv + c))].store(zero.load())
                gB[(None, (t, half * self.ncv + c))].store(zero.load())

    def _coordinates(self):
        """(tid, bid, column block, row group, lane, the warp's column vector, its warp
        index among the warps of that vector) of this thread."""
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        cb = bid % self.cb
        rg = bid // self.cb
        lane = tid % 32
        warp = tid // 32
        return tid, bid, cb, rg, lane, warp % self.cv, warp // self.cv

    # ---------------------------------------------------------------- the kernel
    @cute.kernel
    def kernel(self, gKV: cute.Tensor, gSc: cute.Tensor, gApe: cute.Tensor, mCu: cute.Tensor,
               mCuc: cute.Tensor, gOut: cute.Tensor, gGo: cute.Tensor, gGkv: cute.Tensor,
               gGsc: cute.Tensor, gWork: cute.Tensor, num_tokens: Int32, num_rows: Int32,
               num_segs: Int32, groups: Int32):
        cm.await_upstream(self.pdl)
        tid, _, cb, rg, lane, cvw, wp = self._coordinates()
        smem = cutlass.memory.SmemAllocator()
        tables = self._row_tables(smem)
        _, _, _, sT0, sFl, _ = tables

        # Row table: first window token and flags (bit 0: real row, bit 1: has a previous
        # block) of each row this CTA owns; one binary search per row, all rows in parallel.
        nr = self._rows_owned(rg, num_rows, groups)
        for j in cutlass.range(tid, nr, self.nt, unroll=1):
            t0, fl = self._row_info(rg + j * groups, mCu, mCuc, num_tokens, num_segs)
            sT0[j] = t0
            sFl[j] = fl
        gacc = cute.make_rmem_tensor((self.kt * self.vec,), Float32)
        gacc.fill(0.0)
        self._pipeline(nr, tables, gKV, gSc, gApe, gGo, gOut, gGkv, gGsc, gacc, tid, lane, cvw,
                       wp, cb, rg, groups, num_tokens, False)
        if const_expr(self.bwd):
            self._epilogue(gacc, gWork, gGkv, gGsc, mCu, mCuc, lane, cvw, wp, cb, rg, tid,
                           num_tokens, num_rows, num_segs, groups)

    def _row_tables(self, smem):
        """(sTile, sApe, sRed, sT0, sFl, sG) of the pipelined row loop: `stages` window tiles
        (score in slot 0, kv in slot 1), the CTA's ape tile, the cross-warp partials, the
        row table (first window token, flags) and sG: grad_out rows (backward) or the exact
        columns' scratch (forward)."""
        VEC, CV, S = self.vec, self.cv, self.stages
        sTile = smem.allocate_tensor(self.dtype, cute.make_layout((VEC, CV, self.wpad, 2, S)),
                                     128)
        sApe = smem.allocate_tensor(
            Float32, cute.make_layout((self.av, self.wpad, self.ah, CV)), 16)
        sRed = smem.allocate_tensor(Float32, cute.make_layout((VEC, self.wpc, CV, RED_KINDS)),
                                    16)
        sT0 = smem.allocate_tensor(Int32, cute.make_layout(MAX_ROWS), 16)
        sFl = smem.allocate_tensor(Int32, cute.make_layout(MAX_ROWS), 16)
        sG = self._scratch(smem, sRed)
        if const_expr(self.bwd):
            sG = smem.allocate_tensor(self.dtype, cute.make_layout((VEC, CV, S)), 16)
        return sTile, sApe, sRed, sT0, sFl, sG

    @cute.jit
    def _rows_owned(self, rg, num_rows, groups):
        """Rows rg, rg + groups, ... of a CTA in row group rg: how many (at most MAX_ROWS)."""
        nr = Int32(0)
        if rg < num_rows:
            nr = cutlass.min((num_rows - rg + groups - 1) // groups, MAX_ROWS)
        return nr

    @cute.jit
    def _pipeline(self, nr, tables, gKV, gSc, gApe, gGo, gOut, gGkv, gGsc, gacc, tid, lane, cvw,
                  wp, cb, rg, groups, num_tokens, skips, sRow=None):
        """The CTA's rows j < nr (row rg + j * groups, or sRow[j] where given; window from
        token sT0[j], flags sFl[j]): tiles `stages - 1` rows ahead by cp.async, ape staged
        while the first are in flight, then each row pooled (or its gradient) once its tile
        lands. Rows that are not real get zeros (forward), except, where `skips`, those
        flagged SKIP_ROW (another launch writes them, or no row). Starts with the barrier
        that publishes the row table."""
        VEC, CV, S = self.vec, self.cv, self.stages
        sTile, sApe, sRed, sT0, sFl, sG = tables
        atom = self._g2s_atom(self.dtype, VEC)
        cute.arch.barrier()

        for p in cutlass.range_constexpr(S - 1):
            if p < nr:
                self._issue(Int32(p), p, sT0, sFl, sTile, sG, gSc, gKV, gGo, tid, cb, rg,
                            groups, num_tokens, atom)
            cute.arch.cp_async_commit_group()
        # The CTA's ape tile, once, while the first tiles are in flight.
        self._stage_ape(gApe, sApe, tid, cb)

        for j in cutlass.range(nr, unroll=1):
            cute.arch.cp_async_wait_group(S - 2)
            # Row j's tile is complete for every thread, and row j-1's stage is free.
            cute.arch.barrier()
            jn = j + S - 1
            if jn < nr:
                self._issue(jn, jn % S, sT0, sFl, sTile, sG, gSc, gKV, gGo, tid, cb, rg,
                            groups, num_tokens, atom)
            cute.arch.cp_async_commit_group()
            fl = sFl[j]
            if (fl & 1) != 0:
                args = (sTile, sApe, sRed, sG, gOut, gGkv, gGsc, gacc, j % S,
                        self._table_row(sRow, rg, j, groups), sT0[j], fl, num_tokens, tid,
                        lane, cvw, wp, cb)
                if const_expr(self.lean):
                    if (fl & 4) != 0:
                        self._row(*args, False)
                    else:
                        self._row(*args, True)
                else:
                    self._row(*args, True)
            elif const_expr(not self.bwd):
                zeros = lane == 0 and wp == 0
                if const_expr(skips):
                    zeros = zeros and fl != SKIP_ROW
                if zeros:
                    self._zero_vector(gOut, self._table_row(sRow, rg, j, groups), cb * CV + cvw)

    def _table_row(self, sRow, rg, j, groups):
        """The output row of entry j of a CTA's row table: rg + j * groups, or sRow[j]."""
        return rg + j * groups if sRow is None else sRow[j]

    @cute.jit
    def _zero_vector(self, gOut, n, colc):
        """Zeros in column vector colc of output row n (none past the row)."""
        if colc < self.ncv:
            self._store(gOut[(None, (n, colc))], [Float32(0.0)] * self.vec)

    @cute.jit
    def _zero_row(self, gOut, n, lane, cvw, wp, cb):
        """Row n's zeros in this CTA's columns, by the whole CTA (a lane per column vector)."""
        if lane == 0 and wp == 0:
            self._zero_vector(gOut, n, cb * self.cv + cvw)

    def _ape_chunk(self, half, colc, h):
        """gApe's column of chunk h (av fp32 values) of column vector colc in coff-half
        `half`."""
        return ((half * self.ncv + colc) * self.vec) // self.av + h

    @cute.jit
    def _stage_ape(self, gApe, sApe, tid, cb):
        """The CTA's ape tile: entry k (ape row k % ratio, coff-half k // ratio) of each of
        its column vectors, fp32, in av-wide chunks."""
        CV, R = self.cv, self.r
        for r in cutlass.range_constexpr(self.kt * self.ah):
            q = tid + self.nt * r
            k = q // (CV * self.ah)
            c = (q // self.ah) % CV
            h = q % self.ah
            colc = cb * CV + c
            if k < self.w and colc < self.ncv:
                half = k // R
                sApe[(None, k, h, c)].store(
                    gApe[(None, (k - half * R, self._ape_chunk(half, colc, h)))].load())

    @cute.jit
    def _issue(self, j, st, sT0, sFl, sTile, sG, gSc, gKV, gGo, tid, cb, rg, groups,
               num_tokens, atom):
        """Start row j's tile copy (coalesced: consecutive threads, consecutive vectors)."""
        t0 = sT0[j]
        fl = sFl[j]
        if (fl & 1) != 0:
            def load(tk, gc, k, ph):
                self._copy(atom, gSc[(None, (tk, gc))], sTile[(None, ph, k, 0, st)])
                self._copy(atom, gKV[(None, (tk, gc))], sTile[(None, ph, k, 1, st)])

            self._tile_entries(tid, cb, t0, fl, num_tokens, load)
            if const_expr(self.bwd):  # noqa: SIM102 (compile-time, then run-time test)
                if tid < self.cv and cb * self.cv + tid < self.ncv:
                    self._copy(atom, gGo[(None, (rg + j * groups, cb * self.cv + tid))],
                               sG[(None, tid, st)])

    @cute.jit
    def _tile_entries(self, tid, cb, t0, fl, num_tokens, body):
        """body(token, global column vector, entry k, tile slot) for each window entry of
        row (t0, fl) that this thread moves between global memory and the tile: consecutive
        threads, consecutive column vectors (coalesced)."""
        for r in cutlass.range_constexpr(self.loads):
            q = tid + self.nt * r
            k = q // self.cv
            c = q % self.cv
            colc = cb * self.cv + c
            if colc < self.ncv and self._entry_ok(k, t0, fl, num_tokens):
                body(t0 + k, (k // self.r) * self.ncv + colc, k, self._phys(c, k))

    def _g2s_atom(self, dtype, elems: int):
        """cp.async of `elems` elements of `dtype` (16-byte copies bypass L1)."""
        mode = cute.nvgpu.LoadCacheMode.ALWAYS
        if const_expr(elems * dtype.width == 128):
            mode = cute.nvgpu.LoadCacheMode.GLOBAL
        return cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=mode), dtype,
                                   num_bits_per_copy=max(32, elems * dtype.width))

    @cute.jit
    def _copy(self, atom, src, dst):
        if const_expr(self.async_copy):
            cute.copy(atom, _flat(src, self.vec), _flat(dst, self.vec))
        else:
            dst.store(src.load())

    def _ape(self, sApe, k, c):
        """Entry k's ape over column vector c, fp32 (row k % ratio, coff-half k // ratio)."""
        ap = cute.make_rmem_tensor((self.vec,), Float32)
        for h in range(self.ah):  # trace-time loop (not a cute.jit function)
            _flat(ap, self.av, h).store(sApe[(None, k, h, c)].load())
        return ap

    def _logit_reader(self, sTile, sApe, sLg, st, ph, k, cvw):
        """v -> entry k's logit: fp32(score) + ape of column v, the tile's score and ape
        loaded here and each add where the caller asks for it; or, where the caller has an
        fp32 logit tile sLg (the extend kernel's gathered windows), its entry."""
        if sLg is not None:
            lg = cute.make_rmem_tensor((self.vec,), Float32)
            lg.store(sLg[(None, ph, k)].load())
            return lambda v: lg[v]
        sc = self._load_f32(sTile[(None, ph, k, 0, st)])
        ap = self._ape(sApe, k, cvw)
        return lambda v: sc[v] + ap[v]

    @cute.jit
    def _row(self, sTile, sApe, sRed, sG, gOut, gGkv, gGsc, gacc, st, n, t0, fl, num_tokens,
             tid, lane, cvw, wp, cb, masked, sLg=None):
        """Softmax pooling (forward) or its gradient (backward) of one row's column block.

        Pass 1: logits l and their max m. Pass 2: e = exp(l - m), s = sum e and a = sum e * v
        (forward: out = a / s) or a = sum e * (g * v) (backward: dot = a / s); backward pass 3:
        p = e / s, grad_v = p * g, grad_l = p * (g * v - dot), as the reference."""
        VEC, KT = self.vec, self.kt
        kk = [(wp * KT + i) * 32 + lane for i in range(KT)]
        ok = [True] * KT
        if const_expr(masked):
            ok = [self._entry_ok(kk[i], t0, fl, num_tokens) for i in range(KT)]
        ph = [self._phys(cvw, kk[i]) for i in range(KT)]
        col = (lane >> (5 - self.lv)) % VEC
        ninf = Float32(-math.inf)
        zero = Float32(0.0)
        lg = cute.make_rmem_tensor((KT * VEC,), Float32)
        mloc = cute.make_rmem_tensor((VEC,), Float32)
        mloc.fill(-math.inf)
        for i in cutlass.range_constexpr(KT):
            logit = self._logit_reader(sTile, sApe, sLg, st, ph[i], kk[i], cvw)
            for v in cutlass.range_constexpr(VEC):
                x = self._pick(ok[i], logit(v), ninf)
                lg[i * VEC + v] = x
                mloc[v] = cute.arch.fmax(mloc[v], x, nan=True)
        m_c = self._cross(self._scatter(mloc, lane, True), sRed, 0, lane, cvw, wp, col, True)
        m_max = m_c
        if const_expr(self.fast_exp):
            m_c = m_c * cm.LOG2E + self.shift
        m = self._gather(m_c)
        sloc = cute.make_rmem_tensor((VEC,), Float32)
        aloc = cute.make_rmem_tensor((VEC,), Float32)
        sloc.fill(0.0)
        aloc.fill(0.0)
        cert = self.parity == 1
        # The certificate's sums (see _certificate): e|v| and |v| per column.
        mag = cute.make_rmem_tensor((VEC,), Float32)
        vsum = cute.make_rmem_tensor((VEC,), Float32)
        mag.fill(0.0)
        vsum.fill(0.0)
        g = sloc
        if const_expr(self.bwd):
            g = self._load_f32(sG[(None, cvw, st)])
        scale = Float32(2.0 ** -self.shift)
        for i in cutlass.range_constexpr(KT):
            kv = self._load_f32(sTile[(None, ph[i], kk[i], 1, st)])
            for v in cutlass.range_constexpr(VEC):
                e = zero
                if const_expr(self.fast_exp):
                    # One pinned rounding, the certificate's (an unfused mul would round
                    # l * log2(e), an error that grows with |l| rather than |l - m|).
                    e = cute.math.exp2(cm.fma_rn(lg[i * VEC + v], Float32(cm.LOG2E), -m[v]),
                                       fastmath=True)
                else:
                    e = cute.math.exp(lg[i * VEC + v] - m[v]) * scale
                lg[i * VEC + v] = e
                sloc[v] = sloc[v] + e
                x = self._pick(ok[i], kv[v], zero)
                if const_expr(self.bwd):
                    x = g[v] * x  # the reference's g * v (its overflow pattern included)
                if const_expr(self.wpad > self.w):
                    x = cutlass.select_(kk[i] < self.w, x, zero)
                aloc[v] = aloc[v] + e * x
                if const_expr(cert):
                    mag[v] = mag[v] + e * cute.math.absf(x)
                    vsum[v] = vsum[v] + cute.math.absf(x)
        sums = [sloc, aloc]
        if const_expr(cert):
            sums = [sloc, aloc, mag, vsum]
        sums = self._cross_all([self._scatter(t, lane, False) for t in sums], sRed, 1, lane,
                               cvw, wp, col, False)
        s_c, a_c = sums[0], sums[1]
        colw = cb * self.cv + cvw
        if const_expr(not self.bwd):
            out = cute.make_rmem_tensor((VEC,), Float32)
            quotient = self._gather(a_c / s_c)
            for v in cutlass.range_constexpr(VEC):
                out[v] = quotient[v]
            if const_expr(self.parity > 0):  # noqa: SIM102 (compile-time, then run-time test)
                if wp == 0 and colw < self.ncv:
                    fails = Int32(1)
                    if const_expr(cert):
                        bound = self.cert_m * sums[2] + self.cert_v * sums[3]
                        fails = cutlass.select_(
                            bound < cute.math.absf(a_c) * self.cert_keep, Int32(0), Int32(1))
                    self._parity_columns(out, fails, self._gather(m_max), sTile, sApe, sLg, sG,
                                         st, t0, fl, num_tokens, lane, cvw, masked)
            if lane == 0 and wp == 0 and colw < self.ncv:
                self._store(gOut[(None, (n, colw))], out)
        else:
            rs = self._gather(Float32(1.0) / s_c)
            dot = self._gather(a_c / s_c)  # sum_k (g * v_k) * p_k
            for i in cutlass.range_constexpr(KT):
                kv = self._load_f32(sTile[(None, ph[i], kk[i], 1, st)])
                gv = [None] * VEC
                gl = [None] * VEC
                for v in cutlass.range_constexpr(VEC):
                    p = lg[i * VEC + v] * rs[v]
                    gv[v] = p * g[v]
                    gl[v] = p * (g[v] * kv[v] - dot[v])
                    gacc[i * VEC + v] = gacc[i * VEC + v] + self._pick(ok[i], gl[v], zero)
                # Gradients go back into the tile slots this lane read, then out coalesced.
                self._store(sTile[(None, ph[i], kk[i], 1, st)], gv)
                self._store(sTile[(None, ph[i], kk[i], 0, st)], gl)
            cute.arch.barrier()

            def store(tk, gc, k, ph):
                gGkv[(None, (tk, gc))].store(sTile[(None, ph, k, 1, st)].load())
                gGsc[(None, (tk, gc))].store(sTile[(None, ph, k, 0, st)].load())

            self._tile_entries(tid, cb, t0, fl, num_tokens, store)

    # ---------------------------------------------------------------- torch's order
    @cute.jit
    def _parity_columns(self, out, fails, m, sTile, sApe, sLg, sScr, st, t0, fl, num_tokens,
                        lane, cvw, masked):
        """Replace out[v] by torch's value where column v failed the certificate (fails: the
        scattered per-column flag; every column at parity 2). One warp, all its lanes."""
        if cute.arch.vote_any_sync(fails != 0):
            flags = self._gather(fails)
            for v in cutlass.range_constexpr(self.vec):
                if flags[v] != 0:
                    out[v] = self._exact_column(sTile, sApe, sLg, sScr, st, v, m[v], t0, fl,
                                                num_tokens, lane, cvw, masked)

    @cute.jit
    def _exact_column(self, sTile, sApe, sLg, sScr, st, v, m, t0, fl, num_tokens, lane, cvw,
                      masked):
        """Column v of the warp's column vector as torch's eager region computes it on CUDA
        (torch_order.py). Lane j computes the terms k = j + 32 i of the window; each chain
        of torch's sums is then one lane's loop over the terms in the warp's scratch."""
        sw = sScr[(None, cvw)]
        e = []
        kv = []
        for i in cutlass.range_constexpr(self.wpad // 32):
            k = i * 32 + lane
            ok = k < self.w
            if const_expr(masked):
                ok = self._entry_ok(k, t0, fl, num_tokens)
            ph = self._phys(cvw, k)
            logit = self._logit_reader(sTile, sApe, sLg, st, ph, k, cvw)(v)
            value = self._load_f32(sTile[(None, ph, k, 1, st)])[v]
            # Missing entries hold -inf / 0 in torch's gathered tensors: e = 0, product +0.
            e.append(cutlass.select_(ok, cm.exp_accurate(cm.sub_rn(logit, m)), Float32(0.0)))
            kv.append(cutlass.select_(ok, value, Float32(0.0)))
            sw[k] = e[i]
        cute.arch.sync_warp()
        s = self._tree(self._chains(sw, self.soft_chains, lane), self.soft_chains)
        cute.arch.sync_warp()  # every chain has read e
        for i in cutlass.range_constexpr(self.wpad // 32):
            sw[i * 32 + lane] = cm.mul_rn(kv[i], cm.div_rn(e[i], s))
        cute.arch.sync_warp()
        split = self.sum_split
        acc = self._chains(sw, torch_order.ACCUMULATORS * split, lane)
        cute.arch.sync_warp()  # the scratch is free for the next column
        # Thread y's accumulators (chains y + split * a) in order, then the threads' tree.
        y = lane % split
        total = Float32(0.0)
        for a in cutlass.range_constexpr(torch_order.ACCUMULATORS):
            part = cute.arch.shuffle_sync(acc[(split * a) // 32], offset=(y + split * a) % 32)
            if const_expr(a == 0):
                total = part
            else:
                total = cm.add_rn(total, part)
        return self._tree([total], split)

    @cute.jit
    def _chains(self, sw, stride, lane):
        """Sums from +0 of the chains c < stride of the window's terms sw[k] (terms k = c +
        stride i, i in order; k >= W adds +0, which leaves a sum of these terms unchanged).
        stride >= 32: lane j returns chains j + 32 q, q < stride / 32; below 32, lane j
        chain j % stride (every lane: the loads are broadcasts)."""
        count = -(-self.w // stride)  # terms of chain 0, the longest
        acc = []
        for q in cutlass.range_constexpr(max(1, stride // 32)):
            c = lane + 32 * q
            if const_expr(stride < 32):
                c = lane % stride
            total = Float32(0.0)
            for i in cutlass.range(count, unroll=32):
                k = c + stride * i
                term = sw[cutlass.min(k, self.wpad - 1)]
                total = cm.add_rn(total, cutlass.select_(k < self.w, term, Float32(0.0)))
            acc.append(total)
        return acc

    @cute.jit
    def _tree(self, parts, count):
        """Halving tree over `count` chains as _chains leaves them (chain c += chain c + h for
        h = count / 2, ..., 1), broadcast to every lane."""
        parts = list(parts)
        levels = count.bit_length() - 1
        for j in cutlass.range_constexpr(max(0, levels - 5)):  # h >= 32: within a lane
            h = (count >> (j + 1)) // 32
            for q in cutlass.range_constexpr(h):
                parts[q] = cm.add_rn(parts[q], parts[q + h])
        total = parts[0]
        for j in cutlass.range_constexpr(min(levels, 5)):  # h = 16, ..., 1: across lanes
            total = cm.add_rn(total, cute.arch.shuffle_sync_down(
                total, offset=min(count // 2, 16) >> j))
        return cute.arch.shuffle_sync(total, offset=0)

    @cute.jit
    def _epilogue(self, gacc, gWork, gGkv, gGsc, mCu, mCuc, lane, cvw, wp, cb, rg, tid,
                  num_tokens, num_rows, num_segs, groups):
        """grad_ape partials of this CTA, then zeros for the elements no window consumes."""
        VEC, R = self.vec, self.r
        colw = cb * self.cv + cvw
        zero = cute.make_rmem_tensor((VEC,), self.dtype)
        zero.fill(0.0)
        for i in cutlass.range_constexpr(self.kt):
            k = (wp * self.kt + i) * 32 + lane
            if k < self.w and colw < self.ncv:
                half = k // R
                for h in cutlass.range_constexpr(self.ah):
                    frag = cute.make_rmem_tensor((self.av,), Float32)
                    for v in cutlass.range_constexpr(self.av):
                        frag[v] = gacc[i * VEC + h * self.av + v]
                    c = self._ape_chunk(half, colw, h)
                    gWork[(None, (rg * R + k - half * R, c))].store(frag.load())
        T = num_tokens
        for s in cutlass.range(rg, num_segs, groups, unroll=1):
            a = cutlass.max(cutlass.min(mCu[s], T), 0)
            e = cutlass.max(cutlass.min(mCu[s + 1], T), a)
            tail = a + ((e - a) // R) * R
            for hh in cutlass.range_constexpr(self.co):
                self._zero_range(gGkv, gGsc, tail, e, hh, cb, tid)
            if const_expr(self.co == 2):  # noqa: SIM102 (compile-time, then run-time test)
                if tail > a:  # first halves of the last block feed no window
                    self._zero_range(gGkv, gGsc, tail - R, tail, 0, cb, tid)
        # Rows past a static capacity smaller than the true count: their windows get zeros.
        hi_row = cutlass.min(mCuc[num_segs], T // R + 1)
        for n in cutlass.range(num_rows + rg, hi_row, groups, unroll=1):
            t0, fl = self._row_info(n, mCu, mCuc, num_tokens, num_segs)
            for idx in cutlass.range(tid, self.w * self.cv, self.nt, unroll=1):
                k = idx // self.cv
                c = cb * self.cv + idx % self.cv
                if c < self.ncv and (fl & 1) != 0 and self._entry_ok(k, t0, fl, num_tokens):
                    gc = (k // R) * self.ncv + c
                    gGkv[(None, (t0 + k, gc))].store(zero.load())
                    gGsc[(None, (t0 + k, gc))].store(zero.load())
        first = cutlass.max(cutlass.min(mCu[0], T), 0)
        last = cutlass.max(cutlass.min(mCu[num_segs], T), 0)
        chunk = (T - last + groups - 1) // groups
        lo = last + rg * chunk
        hi = cutlass.min(lo + chunk, T)
        for hh in cutlass.range_constexpr(self.co):
            if rg == 0:
                self._zero_range(gGkv, gGsc, 0, first, hh, cb, tid)
            if lo < hi:
                self._zero_range(gGkv, gGsc, lo, hi, hh, cb, tid)

    # ---------------------------------------------------------------- launch entries
    def _launch_main(self, gKV, gSc, p_ape, p_cu, p_cuc, gOut, gGo, gGkv, gGsc, gWork,
                     num_tokens, num_rows, num_segs, groups, stream):
        width = self.co * self.d
        gApe = cute.zipped_divide(
            cute.make_tensor(p_ape, cute.make_layout((self.r, width), stride=(width, 1))),
            (1, self.av))
        mCu = cute.make_tensor(p_cu, cute.make_layout(num_segs + 1))
        mCuc = cute.make_tensor(p_cuc, cute.make_layout(num_segs + 1))
        self.kernel(gKV, gSc, gApe, mCu, mCuc, gOut, gGo, gGkv, gGsc, gWork, num_tokens,
                    num_rows, num_segs, groups).launch(
            grid=(groups * self.cb, 1, 1), block=(self.nt, 1, 1), stream=stream,
            min_blocks_per_mp=self.ctas, preferred_smem_carveout=100, use_pdl=self.pdl)

    def _rows(self, ptr, rows, cols):
        return cute.zipped_divide(
            cute.make_tensor(ptr, cute.make_layout((rows, cols), stride=(cols, 1))),
            (1, self.vec))

    @cute.jit
    def forward(self, p_kv: cute.Pointer, p_score: cute.Pointer, p_ape: cute.Pointer,
                p_cu: cute.Pointer, p_cuc: cute.Pointer, p_out: cute.Pointer,
                p_work: cute.Pointer, num_tokens: Int32, num_rows: Int32, num_segs: Int32,
                grid: Int32, stream):
        width = self.co * self.d
        gKV = self._rows(p_kv, num_tokens, width)
        gSc = self._rows(p_score, num_tokens, width)
        gOut = self._rows(p_out, num_rows, self.d)
        self._launch_main(gKV, gSc, p_ape, p_cu, p_cuc, gOut, gOut, gOut, gOut, gOut,
                          num_tokens, num_rows, num_segs, grid // self.cb, stream)

    @cute.jit
    def backward(self, p_go: cute.Pointer, p_kv: cute.Pointer, p_score: cute.Pointer,
                 p_ape: cute.Pointer, p_cu: cute.Pointer, p_cuc: cute.Pointer,
                 p_gkv: cute.Pointer, p_gsc: cute.Pointer, p_gape: cute.Pointer,
                 p_work: cute.Pointer, num_tokens: Int32, num_rows: Int32, num_segs: Int32,
                 grid: Int32, stream):
        width = self.co * self.d
        groups = grid // self.cb
        gWork = cute.zipped_divide(cute.make_tensor(
            p_work, cute.make_layout((groups * self.r, width), stride=(width, 1))),
            (1, self.av))
        self._launch_main(self._rows(p_kv, num_tokens, width),
                          self._rows(p_score, num_tokens, width), p_ape, p_cu, p_cuc,
                          self._rows(p_go, num_rows, self.d), self._rows(p_go, num_rows, self.d),
                          self._rows(p_gkv, num_tokens, width),
                          self._rows(p_gsc, num_tokens, width), gWork, num_tokens, num_rows,
                          num_segs, groups, stream)
        launch_sum_parts(p_work, p_gape, groups, self.r * width, _SUM_SPLIT, self.pdl, stream)


class _StreamingExtend(_Streaming):
    """csa::compressor_extend for large windows (SPEC 8), compiled from the forward's key.

    Work items as in extend.py: per request, its state-reading rows (its first min(rows,
    coff)) and then its state update; then one per output row (windows of new tokens only;
    padding: zeros). A CTA owns a column block and a strided set of items; every CTA scans
    the batch's row counts to place its items (requests.Batch). Then its subwarps take the
    items that need no more (requests that complete no block, padding rows) all at once,
    and the whole CTA runs the rest one after another (`_run_item`); a CTA of a single item
    runs it without the subwarps' pass. A row gathers its window
    into the forward's tile, kv from the new tokens or the state, and logits into an fp32
    tile: fp32(score) + ape as the forward adds them (ape read from L2, not staged: a decode
    CTA needs a single entry of it), or the state's stored logit. It then pools through the
    forward's own `_row`, so rows are bit-identical to the CUDA csa::compressor's. A
    request's rows and its update run in one CTA per column block, so CTA barriers order
    every state read before the writes.

    A split call (the part knob, for calls past decode-sized ones) is two launches: part 1
    has the requests' items only; part 2 (`rows_kernel`) every other row, whose window
    lies in the new tokens, through the forward's own pipelined loop (`_pipeline`), beside
    part 1 (PDL: it reads nothing part 1 writes).
    """

    def __init__(self, key: KernelKey):
        super().__init__(key, backward=False)
        self.batch = requests.Batch(self.r, self.nt)
        self.quiet_lanes = quiet_lanes(key)
        self.part = key.knobs.part
        self.has_rows = self.part != 1  # this launch has row items (part 1: requests only)
        self.lanes = key.knobs.lane_requests  # part 2 places its rows by lanes

    @cute.jit
    def _new_logits(self, gSc, gApe, t, gc, k, colc):
        """fp32(score) + ape of new token t (window entry k, column vector colc of its
        coff-half), ape read where it lies (L2): a decode CTA needs one entry of it."""
        sc = self._load_f32(gSc[(None, (t, gc))])
        ap = cute.make_rmem_tensor((self.vec,), Float32)
        half = k // self.r
        for h in cutlass.range_constexpr(self.ah):
            chunk = self._ape_chunk(half, colc, h)
            _flat(ap, self.av, h).store(gApe[(None, (k - half * self.r, chunk))].load())
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
        R, W = self.r, self.w
        win0 = (q - (self.co - 1)) * R
        st0 = (start // R - (self.co - 1)) * R
        kv_atom = self._g2s_atom(self.dtype, self.vec)
        logit_atom = self._g2s_atom(Float32, self.av)
        for r in cutlass.range_constexpr(self.loads):
            idx = tid + self.nt * r
            k, c = idx // self.cv, idx % self.cv
            colc, pos = cb * self.cv + c, win0 + k
            if k < W and colc < self.ncv and pos >= 0:
                ph = self._phys(c, k)
                gc = (k // R) * self.ncv + colc
                if pos >= start:
                    t = tok0 + (pos - start)
                    sTile[(None, ph, k, 1, 0)].store(gKV[(None, (t, gc))].load())
                    sLg[(None, ph, k)].store(self._new_logits(gSc, gApe, t, gc, k, colc).load())
                else:
                    entry = slot * W + cutlass.max(cutlass.min(pos - st0, Int32(W - 1)),
                                                   Int32(0))
                    self._copy(kv_atom, gKVs[(None, (entry, gc))], sTile[(None, ph, k, 1, 0)])
                    src, dst = gSs[(None, (entry, gc))], sLg[(None, ph, k)]
                    for h in cutlass.range_constexpr(self.ah):
                        cute.copy(logit_atom, _flat(src, self.av, h), _flat(dst, self.av, h))
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def _pool(self, sTile, sLg, gApe, sRed, sScr, gKV, gSc, gKVs, gSs, gOut, n, q, tok0, start,
              slot, tid, lane, cvw, wp, cb):
        """Row n = block q of a request (uniform over the CTA)."""
        self._gather_window(sTile, sLg, gApe, gKV, gSc, gKVs, gSs, q, tok0, start, slot, tid,
                            cb)
        cute.arch.barrier()
        # Entries exist from position 0 on: flags "real row, has a previous block", and no
        # token bound, so the mask is the forward's block-0 mask. (No ape tile: the logits
        # are in sLg.)
        self._row(sTile, None, sRed, sScr, gOut, gOut, gOut, None, 0, n,
                  (q - (self.co - 1)) * self.r, Int32(3), Int32(requests.INT32_MAX), tid,
                  lane, cvw, wp, cb, True, sLg)
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
        idx = tid + self.nt * r
        e = idx // self.cv
        return e, cb * self.cv + idx % self.cv, st1 + e

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
        """SPEC 8's state for `end` tokens, this CTA's columns: entry e then holds position
        (end // ratio - coff + 1) * ratio + e where that is < end (a new token, a moved
        entry, or the initial state before position 0); other entries stay. Per coff-half,
        every thread loads its entries' sources, a barrier, then every thread stores (a
        moved entry's source is another entry of the slot)."""
        R, W, VEC = self.r, self.w, self.vec
        shift = (end // R - start // R) * R
        st1 = (end // R - (self.co - 1)) * R
        for h in cutlass.range_constexpr(self.co):
            rK = cute.make_rmem_tensor((VEC, self.loads), self.dtype)
            rF = cute.make_rmem_tensor((VEC, self.loads), Float32)
            for r in cutlass.range_constexpr(self.loads):
                e, colc, pos = self._slot_entry(r, tid, cb, st1)
                if e < W and colc < self.ncv and pos < end:
                    gc = h * self.ncv + colc
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
                if e < W and colc < self.ncv and pos < end:
                    dst = slot * W + e
                    gc = h * self.ncv + colc
                    if pos >= start or (pos >= 0 and shift != 0):
                        gKVs[(None, (dst, gc))].store(rK[None, r].load())
                        gSs[(None, (dst, gc))].store(rF[None, r].load())
                    elif pos < 0:  # before the sequence (coff 2, no complete block yet)
                        self._store_initial(gKVs, gSs, dst, gc)
            cute.arch.barrier()

    def _quiet_piece(self, u, tok0, start, st1, cb):
        """(slot entry, token, state column, column vector, ape entry) of piece u of a quiet
        update: the pieces run over the new tokens' (column vector, coff-half) pairs."""
        per_entry = self.cv * self.co
        e = start - st1 + u // per_entry
        h = (u // self.cv) % self.co
        colc = cb * self.cv + u % self.cv
        return e, tok0 + (st1 + e - start), h * self.ncv + colc, colc, h * self.r + e % self.r

    @cute.jit
    def _quiet_update(self, gApe, gKV, gSc, gKVs, gSs, tok0, start, end, slot, lane, cb):
        """`_update` for a request that completes no block (end // ratio == start // ratio,
        a decode step's usual case), by the quiet_lanes lanes of one subwarp (`lane` among
        them): no entry moves, so no store can clobber another entry's source and no
        barrier is needed. Entry e holds position st1 + e: the new tokens at [start, end)
        and, for coff 2 before the first block completes, the initial state at negative
        positions; other entries stay. QUIET_UNROLL pieces load before any stores, so a
        longer request's loads overlap."""
        R, W, CV, L, U = self.r, self.w, self.cv, self.quiet_lanes, QUIET_UNROLL
        st1 = (end // R - (self.co - 1)) * R
        per_entry = CV * self.co  # (column vector, coff-half) pairs of one entry
        pieces = (end - start) * per_entry
        for u0 in cutlass.range(lane, pieces, L * U, unroll=1):
            rK = cute.make_rmem_tensor((self.vec, U), self.dtype)
            rF = cute.make_rmem_tensor((self.vec, U), Float32)
            for i in cutlass.range_constexpr(U):
                e, t, gc, colc, k = self._quiet_piece(u0 + i * L, tok0, start, st1, cb)
                if u0 + i * L < pieces and colc < self.ncv:
                    rK[None, i].store(gKV[(None, (t, gc))].load())
                    rF[None, i].store(self._new_logits(gSc, gApe, t, gc, k, colc).load())
            for i in cutlass.range_constexpr(U):
                e, t, gc, colc, k = self._quiet_piece(u0 + i * L, tok0, start, st1, cb)
                if u0 + i * L < pieces and colc < self.ncv:
                    gKVs[(None, (slot * W + e, gc))].store(rK[None, i].load())
                    gSs[(None, (slot * W + e, gc))].store(rF[None, i].load())
        if const_expr(self.co == 2):
            for u in cutlass.range(lane, cutlass.min(cutlass.max(-st1, Int32(0)), Int32(W))
                                   * per_entry, L, unroll=1):
                e = u // per_entry
                gc = ((u // CV) % self.co) * self.ncv + cb * CV + u % CV
                if cb * CV + u % CV < self.ncv:
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
            heads = requests.head_rows(rows_b, self.co)
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
        CV = self.cv
        cm.await_upstream(self.pdl)
        tid, bid, cb, rg, lane, cvw, wp = self._coordinates()

        smem = cutlass.memory.SmemAllocator()
        # The forward's tile layout, kv in slot 1; the score slot aliases it (stride 0): the
        # logits live in sLg, and the smem saved lets more CTAs share an SM.
        tile = (self.vec, CV, self.wpad, 2, 1)
        sTile = smem.allocate_tensor(self.dtype, cute.make_layout(
            tile, stride=(1, self.vec, self.vec * CV, 0, 0)), 128)
        sLg = smem.allocate_tensor(Float32, cute.make_layout((self.vec, CV, self.wpad)), 16)
        sRed = smem.allocate_tensor(
            Float32, cute.make_layout((self.vec, self.wpc, CV, RED_KINDS)), 16)
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
        for j in cutlass.range(tid, ni, self.nt, unroll=1):
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
            mCuc[num_reqs] = total
        cute.arch.barrier()

        tiles = (sTile, sLg, gApe, sRed, self._scratch(smem, sRed), gKV, gSc, gKVs, gSs, gOut)
        work = (tiles, sItem, sBase, mCu, mStart, mSlots, rg, groups, num_tokens, num_rows,
                num_reqs, num_slots, tid, lane, cvw, wp, cb)
        pending = ni  # a CTA of one item (a prefill's usual CTA) runs it: no subwarps, no list
        if ni > 1:
            # Items a subwarp does, all of the CTA's at once: requests that complete no
            # block (they only write their new tokens' entries; each marks its item done)
            # and rows that no request holds (zeros). The items left need the whole CTA,
            # one at a time: a decode step's CTA lists at most a few among many.
            L = self.quiet_lanes
            for j in cutlass.range(tid // L, ni, self.nt // L, unroll=1):
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
        tid, bid, cb, rg, lane, cvw, wp = self._coordinates()
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
        self._pipeline(nr, tables, gKV, gSc, gApe, gOut, gOut, gOut, gOut, None, tid, lane,
                       cvw, wp, cb, rg, groups, num_tokens, True, sRow)
        cm.complete_after_upstream(self.pdl, bid)

    @cute.jit
    def _place_by_scan(self, sT0, sFl, rg, groups, mCu, mStart, mSlots, num_tokens, num_rows,
                       num_reqs, num_slots, tid, sWarp):
        """rows_kernel's row table, rows rg, rg + groups, ...: a batch scan, then each
        request's rows that are this CTA's. Returns the CTA's row count."""
        held = self.batch.run_counts(mCu, mStart, num_reqs, tid)
        nr = self._rows_owned(rg, num_rows, groups)
        for j in cutlass.range(tid, nr, self.nt, unroll=1):
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
        heads = requests.head_rows(rows, self.co)
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
        for j0 in cutlass.range(0, nr, self.nt, unroll=1):  # warp-uniform: shuffles inside
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
                fl = Int32(SKIP_ROW)
            if j < nr:
                sRow[j] = n
                sT0[j] = t0
                sFl[j] = fl
        return nr

    @cute.jit
    def _later_row(self, h, rows_b, ok, tok0, start, num_tokens):
        """(first window token, flags) of a request's row h for the forward's row loop: a
        head row (h < coff) is SKIP_ROW, a row of a request that is not ok not real (zeros);
        else block q = start // ratio + h, whose window lies in the new tokens (positions
        past start): real, with a previous block. An ok request's window is always whole;
        the "whole" flag, which lets a lean key drop the masks, is still tested here so
        that it can never be set on a window that is not."""
        t0 = Int32(0)
        fl = Int32(SKIP_ROW)
        if h >= requests.head_rows(rows_b, self.co):
            fl = Int32(0)
            if ok:
                q = start // self.r + h
                t0 = tok0 + ((q - (self.co - 1)) * self.r - start)
                fl = 3 + 4 * Int32(t0 >= 0 and t0 + self.w <= num_tokens)
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
                  num_rows, num_reqs, num_slots, tid, lane, cvw, wp, cb):
        """The CTA's item j by the whole CTA, whatever its kind: a request pools its first
        min(rows, coff) rows (zeros if it is not ok) and updates its slot; a row past its
        request's heads pools (or zeros); padding is zeroed; a head row (ITEM_DONE) is its
        request's."""
        R, C = self.r, self.co
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
                        self._pool(*tiles, n, start // R + h, tok0, start, slot, tid, lane,
                                   cvw, wp, cb)
                    else:
                        self._zero_row(gOut, n, lane, cvw, wp, cb)
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
                    self._pool(*tiles, n, start // R + h, tok0, start, slot, tid, lane, cvw,
                               wp, cb)
                else:
                    self._zero_row(gOut, n, lane, cvw, wp, cb)
            elif b == NO_REQUEST:  # padding, or a row no request covers
                self._zero_row(gOut, n, lane, cvw, wp, cb)

    @cute.jit
    def extend(self, p_kv: cute.Pointer, p_score: cute.Pointer, p_ape: cute.Pointer,
               p_cu: cute.Pointer, p_starts: cute.Pointer, p_slots: cute.Pointer,
               p_kvs: cute.Pointer, p_ss: cute.Pointer, p_out: cute.Pointer,
               p_cuc: cute.Pointer, num_tokens: Int32, num_rows: Int32, num_reqs: Int32,
               num_slots: Int32, grid: Int32, stream):
        width = self.co * self.d
        gApe = cute.zipped_divide(
            cute.make_tensor(p_ape, cute.make_layout((self.r, width), stride=(width, 1))),
            (1, self.av))
        gKV, gSc = self._rows(p_kv, num_tokens, width), self._rows(p_score, num_tokens, width)
        mCu, mStart, mSlots, mCuc = [cute.make_tensor(p, cute.make_layout(num_reqs + 1))
                                     for p in (p_cu, p_starts, p_slots, p_cuc)]
        gOut = self._rows(p_out, num_rows, self.d)
        if const_expr(self.part == 2):
            launched = self.rows_kernel(gKV, gSc, gApe, mCu, mStart, mSlots, gOut, num_tokens,
                                        num_rows, num_reqs, num_slots, grid // self.cb)
        else:
            entries = num_slots * self.w
            gSs = cute.zipped_divide(
                cute.make_tensor(p_ss, cute.make_layout((entries, width), stride=(width, 1))),
                (1, self.vec))
            launched = self.extend_kernel(
                gKV, gSc, gApe, mCu, mStart, mSlots, self._rows(p_kvs, entries, width), gSs,
                gOut, mCuc, num_tokens, num_rows, num_reqs, num_slots, grid // self.cb)
        launched.launch(grid=(grid, 1, 1), block=(self.nt, 1, 1), stream=stream,
                        min_blocks_per_mp=self.ctas, preferred_smem_carveout=100,
                        use_pdl=self.pdl)


def extend_entry(key: KernelKey):
    """csa::compressor_extend's `@cute.jit` launch entry (host.ARGUMENTS["ext"], stream)."""
    return _StreamingExtend(key).extend


def launch_entry(key: KernelKey, backward: bool):
    """The `@cute.jit` launch entry of one direction; its arguments are host.ARGUMENTS."""
    impl = _Streaming(key, backward)
    return impl.backward if backward else impl.forward
