"""Streaming kernels of the compressor for large windows (coff * ratio > the register
window's limit): the forward and the backward.

A CTA owns a column block (cv vectors of `vec` columns) and a strided set of output rows. Per
row, cp.async brings the window tile into shared memory in coalesced 128-byte rows, `stages-1`
rows ahead, so each input element leaves DRAM once. Warp w then owns column vector w % cv and
a 32 * kt slice of the window (one entry per lane and step): the softmax runs as exact passes
over the tile (max; then exp, sum and sum e*v) with reductions by warp shuffles in a fixed
order (bitwise run-to-run deterministic). The forward (parity knob) bounds each column's
distance from torch's own CUDA order and recomputes, in that order (torch_order.py), the
columns it cannot place within one output step. The backward writes its gradients back into
the tile and stores them coalesced. grad_ape: per-CTA partials in registers, written to the
workspace and summed over CTAs by shared/reduce.py's fixed-order sum. Keys and plans:
plan.py; csa::compressor_extend's kernel (extend.py) builds on the class here.
"""

from __future__ import annotations

import math

import cutlass
from cutlass import Float32, Int32, Int64, const_expr, cute
from cutlass.cute.nvgpu import cpasync

from ...config import TYPES, KernelKey
from ..shared import certificate, segments, softmax, torch_order
from ..shared import common as cm
from ..shared.certificate import Certificate
from ..shared.reduce import launch_sum_parts
from .exact import DeferredRows, ExactColumns
from .plan import MAX_ROWS, RED_KINDS, SAVED_COLUMNS
from .rows import RowFlag, RowTensors, RowTiles, Thread, flat

_SUM_SPLIT = 16  # grad_ape sum: warps per CTA, each summing every 16th CTA partial


class StreamingKernel(DeferredRows):
    """One compiled configuration; every attribute is a compile-time constant."""

    def __init__(self, key: KernelKey, backward: bool):
        k = key.knobs
        self.dtype = cm.dsl_type(key.dtype)
        self.head_dim, self.ratio, self.coff = key.head_dim, key.ratio, key.coff
        self.window = self.ratio * self.coff
        self.vec, self.threads = k.vec, k.threads
        self.col_vectors, self.warps_per_col, self.entries_per_lane = k.cv, k.wpc, k.kt
        self.window_padded = 32 * self.entries_per_lane * self.warps_per_col
        self.stages, self.ctas = k.stages, k.ctas
        self.fast_exp, self.pdl = k.fast_exp, k.pdl
        # lean: rows whose whole window exists skip the per-entry masks (same results).
        self.lean = k.lean and self.window_padded == self.window
        self.bwd = backward
        self.half_vectors = self.head_dim // self.vec  # column vectors per coff-half
        self.col_blocks = -(-self.half_vectors // self.col_vectors)
        self.ape_vec = min(4, self.vec)  # fp32 ape access (16 bytes at most)
        self.ape_chunks = self.vec // self.ape_vec
        self.log_vec = int(math.log2(self.vec))
        self.lanes_per_col = 32 // self.vec  # lanes that end up holding one column's reduction
        # Tile vectors per thread per tensor.
        self.loads = -(-self.window * self.col_vectors // self.threads)
        # Tile rows are cv 16-byte chunks; xor-swizzle the chunk by the row so the 32 rows a
        # warp reads at one column vector fall in distinct banks.
        self.rows_per_swizzle = max(1, 128 // (self.col_vectors * self.vec * 2))
        # e is kept as exp(l - m) * 2**-shift: sum(e * v) then cannot overflow before max|v|.
        self.shift = softmax.exponent_shift(self.window)
        self.async_copy = self.vec * 2 >= 4  # cp.async moves 4, 8 or 16 bytes
        self.parity = 0 if backward else k.parity
        # The uncertified columns: recomputed in their rows, or marked for ExactColumns.
        self.deferred = bool(self.parity) and k.deferred
        if self.parity:  # the exact columns' order, and the certificate that calls them
            self.soft_chains = torch_order.softmax_chains(self.window, self.head_dim)
            self.sum_split = torch_order.sum_split(self.window, self.head_dim)
            # The fast sums' deepest path: a lane's entries, then the lanes' and the
            # warps' trees.
            self.certificate = Certificate.for_column(
                self.window, self.shift, self.entries_per_lane + 4 + self.warps_per_col,
                torch_order.sum_depth(self.window, self.head_dim), TYPES[key.dtype].precision)

    # ---------------------------------------------------------------- small helpers
    def _phys(self, cv, k):
        return cv ^ ((k // self.rows_per_swizzle) % self.col_vectors)

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
        return [cute.arch.shuffle_sync(x, offset=v << (5 - self.log_vec)) for v in range(self.vec)]

    @cute.jit
    def _cross(self, x, sRed, kind, lane, cvw, wp, col, is_max):
        """Combine the per-warp results of warps sharing a column vector, in warp order."""
        return self._cross_all([x], sRed, kind, lane, cvw, wp, col, is_max)[0]

    @cute.jit
    def _cross_all(self, xs, sRed, kind, lane, cvw, wp, col, is_max):
        """_cross of several values (kinds kind, kind + 1, ...) behind one barrier."""
        res = list(xs)
        if const_expr(self.warps_per_col > 1):
            if lane % self.lanes_per_col == 0:
                for i in cutlass.range_constexpr(len(xs)):
                    sRed[col, wp, cvw, kind + i] = xs[i]
            cute.arch.barrier()
            for i in cutlass.range_constexpr(len(xs)):
                r = sRed[col, 0, cvw, kind + i]
                for w in cutlass.range_constexpr(1, self.warps_per_col):
                    r = self._op(r, sRed[col, w, cvw, kind + i], is_max)
                res[i] = r
        return res

    def _pick(self, ok, a, b):
        return a if ok is True else cutlass.select_(ok, a, b)

    def _scratch(self, smem, placeholder):
        """The exact columns' scratch (forward with parity): one window of fp32 per column
        vector, where a warp lays out a column's terms for its chains' lanes; deferred, the
        count of each column vector's saved columns (_save_columns)."""
        if not self.parity:
            return placeholder
        if self.deferred:
            return smem.allocate_tensor(Int32, cute.make_layout(self.col_vectors), 16)
        return smem.allocate_tensor(
            Float32, cute.make_layout((self.window_padded, self.col_vectors)), 16)

    @cute.jit
    def _row_info(self, n, mCu, mCuc, num_tokens, num_segs):
        """(first window token, flags) of row n (RowFlag: REAL, PREVIOUS, FULL), from its
        segment as the reference finds it (segments.lookup_row)."""
        row = segments.lookup_row(mCu, mCuc, num_segs, n)
        block = n - row.row_begin
        t0 = (Int64(row.token_begin) + Int64(block) * self.ratio
              - (self.coff - 1) * self.ratio)
        t0 = cutlass.max(cutlass.min(t0, Int64(num_tokens) + 1), Int64(-self.window - 1))
        real = row.real
        full = real and t0 >= 0 and t0 + self.window <= num_tokens and (self.coff == 1 or block > 0)
        fl = (Int32(real) * RowFlag.REAL + Int32(block > 0) * RowFlag.PREVIOUS
              + Int32(full) * RowFlag.FULL)
        return Int32(t0), fl

    @cute.jit
    def _entry_ok(self, k, t0, fl, num_tokens):
        """Entry k of a row exists: inside the window and the token range, and for coff 2 a
        first-half entry needs a previous block in the segment (flag bit 1)."""
        tk = t0 + k
        ok = k < self.window and tk >= 0 and tk < num_tokens
        if const_expr(self.coff == 2):
            ok = ok and ((fl & RowFlag.PREVIOUS) != 0 or k >= self.ratio)
        return ok

    @cute.jit
    def _zero_range(self, gA, gB, ta, tb, half, cb, tid):
        """Zero this block's columns of tokens [ta, tb), coff-half `half`, in gA and gB."""
        zero = cute.make_rmem_tensor((self.vec,), self.dtype)
        zero.fill(0.0)
        for idx in cutlass.range(tid, (tb - ta) * self.col_vectors, self.threads, unroll=1):
            c = cb * self.col_vectors + idx % self.col_vectors
            if c < self.half_vectors:
                t = ta + idx // self.col_vectors
                gA[(None, (t, half * self.half_vectors + c))].store(zero.load())
                gB[(None, (t, half * self.half_vectors + c))].store(zero.load())

    def _coordinates(self) -> Thread:
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        cb = bid % self.col_blocks
        rg = bid // self.col_blocks
        lane = tid % 32
        warp = tid // 32
        return Thread(tid, bid, cb, rg, lane, warp % self.col_vectors, warp // self.col_vectors)

    # ---------------------------------------------------------------- the kernel
    @cute.kernel
    def kernel(self, gKV: cute.Tensor, gSc: cute.Tensor, gApe: cute.Tensor, mCu: cute.Tensor,
               mCuc: cute.Tensor, gOut: cute.Tensor, gGo: cute.Tensor, gGkv: cute.Tensor,
               gGsc: cute.Tensor, gWork: cute.Tensor, gSaved: cute.Tensor, num_tokens: Int32,
               num_rows: Int32, num_segs: Int32, groups: Int32):
        cm.await_upstream(self.pdl)
        cm.assert_offsets_fit(mCuc, num_segs, num_rows)
        thr = self._coordinates()
        tid, rg = thr.tid, thr.rg
        smem = cutlass.memory.SmemAllocator()
        tables = self._row_tables(smem)
        _, _, _, sT0, sFl, _ = tables

        # Row table: first window token and flags (bit 0: real row, bit 1: has a previous
        # block) of each row this CTA owns; one binary search per row, all rows in parallel.
        nr = self._rows_owned(rg, num_rows, groups)
        for j in cutlass.range(tid, nr, self.threads, unroll=1):
            t0, fl = self._row_info(rg + j * groups, mCu, mCuc, num_tokens, num_segs)
            sT0[j] = t0
            sFl[j] = fl
        gacc = cute.make_rmem_tensor((self.entries_per_lane * self.vec,), Float32)
        gacc.fill(0.0)
        flags = saved = None
        if const_expr(self.deferred):
            flags, saved = gWork, gSaved
            if tid < self.col_vectors:
                tables[5][tid] = 0  # no column saved yet (published by _pipeline's barrier)
        self._pipeline(nr, tables,
                       RowTensors(gKV, gSc, gApe, gGo, gOut, gGkv, gGsc, flags, saved),
                       gacc, thr, groups, num_tokens, False)
        if const_expr(self.bwd):
            self._epilogue(gacc, gWork, gGkv, gGsc, mCu, mCuc, thr,
                           num_tokens, num_rows, num_segs, groups)

    def _row_tables(self, smem):
        """(sTile, sApe, sRed, sT0, sFl, sG) of the pipelined row loop: `stages` window tiles
        (score in slot 0, kv in slot 1), the CTA's ape tile, the cross-warp partials, the
        row table (first window token, flags) and sG: grad_out rows (backward) or the exact
        columns' scratch (forward)."""
        VEC, CV, S = self.vec, self.col_vectors, self.stages
        sTile = smem.allocate_tensor(
            self.dtype, cute.make_layout((VEC, CV, self.window_padded, 2, S)), 128)
        sApe = smem.allocate_tensor(
            Float32, cute.make_layout((self.ape_vec, self.window_padded, self.ape_chunks, CV)), 16)
        sRed = smem.allocate_tensor(
            Float32, cute.make_layout((VEC, self.warps_per_col, CV, RED_KINDS)), 16)
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
    def _pipeline(self, nr, tables, rows: RowTensors, gacc, thr, groups, num_tokens, skips,
                  sRow=None):
        """The CTA's rows j < nr (row rg + j * groups, or sRow[j] where given; window from
        token sT0[j], flags sFl[j]): tiles `stages - 1` rows ahead by cp.async, ape staged
        while the first are in flight, then each row pooled (or its gradient) once its tile
        lands. Rows that are not real get zeros (forward), except, where `skips`, those
        flagged RowFlag.SKIP (another launch writes them, or no row). Starts with the barrier
        that publishes the row table."""
        gKV, gSc, gApe, gGo, gOut = rows.kv, rows.score, rows.ape, rows.grad_out, rows.out
        tid, lane, cvw, wp, cb, rg = thr.tid, thr.lane, thr.cvw, thr.wp, thr.cb, thr.rg
        VEC, CV, S = self.vec, self.col_vectors, self.stages
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
            if (fl & RowFlag.REAL) != 0:
                args = (RowTiles(sTile, sApe, sRed, sG), rows, gacc, j % S,
                        self._table_row(sRow, rg, j, groups), sT0[j], fl, num_tokens, thr)
                if const_expr(self.lean):
                    if (fl & RowFlag.FULL) != 0:
                        self._row(*args, False)
                    else:
                        self._row(*args, True)
                else:
                    self._row(*args, True)
            elif const_expr(not self.bwd):
                zeros = lane == 0 and wp == 0
                if const_expr(skips):
                    zeros = zeros and fl != RowFlag.SKIP
                if zeros:
                    n = self._table_row(sRow, rg, j, groups)
                    self._zero_vector(gOut, n, cb * CV + cvw)
                    if const_expr(self.deferred):
                        self._mark(rows.flags, n, cb * CV + cvw, Int32(0))

    def _table_row(self, sRow, rg, j, groups):
        """The output row of entry j of a CTA's row table: rg + j * groups, or sRow[j]."""
        return rg + j * groups if sRow is None else sRow[j]

    @cute.jit
    def _zero_vector(self, gOut, n, colc):
        """Zeros in column vector colc of output row n (none past the row)."""
        if colc < self.half_vectors:
            self._store(gOut[(None, (n, colc))], [Float32(0.0)] * self.vec)

    @cute.jit
    def _zero_row(self, gOut, n, thr):
        """Row n's zeros in this CTA's columns, by the whole CTA (a lane per column vector)."""
        lane, cvw, wp, cb = thr.lane, thr.cvw, thr.wp, thr.cb
        if lane == 0 and wp == 0:
            self._zero_vector(gOut, n, cb * self.col_vectors + cvw)

    def _ape_chunk(self, half, colc, h):
        """gApe's column of chunk h (av fp32 values) of column vector colc in coff-half
        `half`."""
        return ((half * self.half_vectors + colc) * self.vec) // self.ape_vec + h

    @cute.jit
    def _stage_ape(self, gApe, sApe, tid, cb):
        """The CTA's ape tile: entry k (ape row k % ratio, coff-half k // ratio) of each of
        its column vectors, fp32, in av-wide chunks."""
        CV, R = self.col_vectors, self.ratio
        for r in cutlass.range_constexpr(self.entries_per_lane * self.ape_chunks):
            q = tid + self.threads * r
            k = q // (CV * self.ape_chunks)
            c = (q // self.ape_chunks) % CV
            h = q % self.ape_chunks
            colc = cb * CV + c
            if k < self.window and colc < self.half_vectors:
                half = k // R
                sApe[(None, k, h, c)].store(
                    gApe[(None, (k - half * R, self._ape_chunk(half, colc, h)))].load())

    @cute.jit
    def _issue(self, j, st, sT0, sFl, sTile, sG, gSc, gKV, gGo, tid, cb, rg, groups,
               num_tokens, atom):
        """Start row j's tile copy (coalesced: consecutive threads, consecutive vectors)."""
        t0 = sT0[j]
        fl = sFl[j]
        if (fl & RowFlag.REAL) != 0:
            def load(tk, gc, k, ph):
                self._copy(atom, gSc[(None, (tk, gc))], sTile[(None, ph, k, 0, st)])
                self._copy(atom, gKV[(None, (tk, gc))], sTile[(None, ph, k, 1, st)])

            self._tile_entries(tid, cb, t0, fl, num_tokens, load)
            if const_expr(self.bwd):  # noqa: SIM102 (compile-time, then run-time test)
                if tid < self.col_vectors and cb * self.col_vectors + tid < self.half_vectors:
                    self._copy(atom, gGo[(None, (rg + j * groups, cb * self.col_vectors + tid))],
                               sG[(None, tid, st)])

    @cute.jit
    def _tile_entries(self, tid, cb, t0, fl, num_tokens, body):
        """body(token, global column vector, entry k, tile slot) for each window entry of
        row (t0, fl) that this thread moves between global memory and the tile: consecutive
        threads, consecutive column vectors (coalesced)."""
        for r in cutlass.range_constexpr(self.loads):
            q = tid + self.threads * r
            k = q // self.col_vectors
            c = q % self.col_vectors
            colc = cb * self.col_vectors + c
            if colc < self.half_vectors and self._entry_ok(k, t0, fl, num_tokens):
                body(t0 + k, (k // self.ratio) * self.half_vectors + colc, k, self._phys(c, k))

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
            cute.copy(atom, flat(src, self.vec), flat(dst, self.vec))
        else:
            dst.store(src.load())

    def _ape(self, sApe, k, c):
        """Entry k's ape over column vector c, fp32 (row k % ratio, coff-half k // ratio)."""
        ap = cute.make_rmem_tensor((self.vec,), Float32)
        for h in range(self.ape_chunks):  # trace-time loop (not a cute.jit function)
            flat(ap, self.ape_vec, h).store(sApe[(None, k, h, c)].load())
        return ap

    def _logit_reader(self, tiles: RowTiles, st, ph, k, cvw):
        """v -> entry k's logit: fp32(score) + ape of column v, the tile's score and ape
        loaded here and each add where the caller asks for it; or, where the tiles have an
        fp32 logit tile (the extend kernel's gathered windows), its entry."""
        if tiles.logits is not None:
            lg = cute.make_rmem_tensor((self.vec,), Float32)
            lg.store(tiles.logits[(None, ph, k)].load())
            return lambda v: lg[v]
        sc = self._load_f32(tiles.tile[(None, ph, k, 0, st)])
        ap = self._ape(tiles.ape, k, cvw)
        return lambda v: sc[v] + ap[v]

    @cute.jit
    def _row(self, tiles: RowTiles, rows: RowTensors, gacc, st, n, t0, fl, num_tokens,
             thr: Thread, masked):
        """Softmax pooling (forward) or its gradient (backward) of row n's column block, its
        window in stage st of the tiles, from token t0 with flags fl.

        Pass 1: logits l and their max m. Pass 2: e = exp(l - m), s = sum e and a = sum e * v
        (forward: out = a / s) or a = sum e * (g * v) (backward: dot = a / s); backward pass 3:
        p = e / s, grad_v = p * g, grad_l = p * (g * v - dot), as the reference."""
        tid, lane, cvw, wp, cb = thr.tid, thr.lane, thr.cvw, thr.wp, thr.cb
        sTile, sRed, sG = tiles.tile, tiles.red, tiles.scratch
        gOut, gGkv, gGsc = rows.out, rows.grad_kv, rows.grad_score
        VEC, KT = self.vec, self.entries_per_lane
        kk = [(wp * KT + i) * 32 + lane for i in range(KT)]
        ok = [True] * KT
        if const_expr(masked):
            ok = [self._entry_ok(kk[i], t0, fl, num_tokens) for i in range(KT)]
        ph = [self._phys(cvw, kk[i]) for i in range(KT)]
        col = (lane >> (5 - self.log_vec)) % VEC
        ninf = Float32(-math.inf)
        zero = Float32(0.0)
        lg = cute.make_rmem_tensor((KT * VEC,), Float32)
        mloc = cute.make_rmem_tensor((VEC,), Float32)
        mloc.fill(-math.inf)
        for i in cutlass.range_constexpr(KT):
            logit = self._logit_reader(tiles, st, ph[i], kk[i], cvw)
            for v in cutlass.range_constexpr(VEC):
                x = self._pick(ok[i], logit(v), ninf)
                lg[i * VEC + v] = x
                mloc[v] = cute.arch.fmax(mloc[v], x, nan=True)
        m_c = self._cross(self._scatter(mloc, lane, True), sRed, 0, lane, cvw, wp, col, True)
        m_max = m_c
        if const_expr(self.fast_exp):
            m_c = certificate.scaled_max(m_c, self.shift)
        m = self._gather(m_c)
        sloc = cute.make_rmem_tensor((VEC,), Float32)
        aloc = cute.make_rmem_tensor((VEC,), Float32)
        sloc.fill(0.0)
        aloc.fill(0.0)
        cert = self.parity == 1
        # The certificate's sums (shared/certificate.py): e|v| and |v| per column.
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
                    e = certificate.fast_exp(lg[i * VEC + v], m[v])
                else:
                    e = cute.math.exp(lg[i * VEC + v] - m[v]) * scale
                lg[i * VEC + v] = e
                sloc[v] = sloc[v] + e
                x = self._pick(ok[i], kv[v], zero)
                if const_expr(self.bwd):
                    x = g[v] * x  # the reference's g * v (its overflow pattern included)
                if const_expr(self.window_padded > self.window):
                    x = cutlass.select_(kk[i] < self.window, x, zero)
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
        colw = cb * self.col_vectors + cvw
        if const_expr(not self.bwd):
            out = cute.make_rmem_tensor((VEC,), Float32)
            quotient = self._gather(a_c / s_c)
            for v in cutlass.range_constexpr(VEC):
                out[v] = quotient[v]
            if const_expr(self.parity > 0):  # noqa: SIM102 (compile-time, then run-time test)
                if wp == 0 and colw < self.half_vectors:
                    fails = Int32(1)
                    if const_expr(cert):
                        fails = cutlass.select_(self.certificate.holds(a_c, sums[2], sums[3]),
                                                Int32(0), Int32(1))
                    if const_expr(self.deferred):
                        word = self._failing_columns(fails)
                        if word != 0:
                            word = self._save_columns(word, tiles, rows.saved, st, t0, fl,
                                                      num_tokens, lane, cvw, thr.bid)
                        if lane == 0:
                            self._mark(rows.flags, n, colw, word)
                    else:
                        self._parity_columns(out, fails, self._gather(m_max), tiles, st, t0,
                                             fl, num_tokens, lane, cvw, masked)
            if lane == 0 and wp == 0 and colw < self.half_vectors:
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
    def _parity_columns(self, out, fails, m, tiles: RowTiles, st, t0, fl, num_tokens, lane,
                        cvw, masked):
        """Replace out[v] by torch's value where column v failed the certificate (fails: the
        scattered per-column flag; every column at parity 2). One warp, all its lanes."""
        if cute.arch.vote_any_sync(fails != 0):
            flags = self._gather(fails)
            for v in cutlass.range_constexpr(self.vec):
                if flags[v] != 0:
                    out[v] = self._exact_column(tiles, st, v, m[v], t0, fl, num_tokens, lane,
                                                cvw, masked)

    @cute.jit
    def _exact_column(self, tiles: RowTiles, st, v, m, t0, fl, num_tokens, lane, cvw, masked):
        """Column v of the warp's column vector as torch's eager region computes it on CUDA,
        from the row's tiles (_torch_column)."""
        # Every entry's loads first, then the arithmetic: the loads are in flight together
        # instead of each exponential waiting for its own.
        oks, logits, values = [], [], []
        for i in cutlass.range_constexpr(self.window_padded // 32):
            k = i * 32 + lane
            ok = k < self.window
            if const_expr(masked):
                ok = self._entry_ok(k, t0, fl, num_tokens)
            ph = self._phys(cvw, k)
            oks.append(ok)
            logits.append(self._logit_reader(tiles, st, ph, k, cvw)(v))
            values.append(self._load_f32(tiles.tile[(None, ph, k, 1, st)])[v])
        return self._torch_column(oks, logits, values, m, tiles.scratch[(None, cvw)], lane)

    @cute.jit
    def _torch_column(self, oks, logits, values, m, sw, lane):
        """One column in torch's order (torch_order.py), from lane j's entries k = j + 32 i
        (oks[i]: entry k exists; its logit and value in fp32) and the column's max m: each
        chain of torch's sums is one lane's loop over the terms laid out in the warp's
        scratch sw (window_padded fp32)."""
        terms = self.window_padded // 32
        e = []
        kv = []
        for i in cutlass.range_constexpr(terms):
            # Missing entries hold -inf / 0 in torch's gathered tensors: e = 0, product +0.
            e.append(cutlass.select_(oks[i], cm.exp_accurate(cm.sub_rn(logits[i], m)),
                                     Float32(0.0)))
            kv.append(cutlass.select_(oks[i], values[i], Float32(0.0)))
            sw[i * 32 + lane] = e[i]
        cute.arch.sync_warp()
        s = self._tree(self._chains(sw, self.soft_chains, lane), self.soft_chains)
        cute.arch.sync_warp()  # every chain has read e
        for i in cutlass.range_constexpr(terms):
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
        count = -(-self.window // stride)  # terms of chain 0, the longest
        acc = []
        for q in cutlass.range_constexpr(max(1, stride // 32)):
            c = lane + 32 * q
            if const_expr(stride < 32):
                c = lane % stride
            total = Float32(0.0)
            for i in cutlass.range(count, unroll=32):
                k = c + stride * i
                term = sw[cutlass.min(k, self.window_padded - 1)]
                total = cm.add_rn(total, cutlass.select_(k < self.window, term, Float32(0.0)))
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
    def _epilogue(self, gacc, gWork, gGkv, gGsc, mCu, mCuc, thr,
                  num_tokens, num_rows, num_segs, groups):
        """grad_ape partials of this CTA, then zeros for the elements no window consumes."""
        lane, cvw, wp, cb, rg, tid = thr.lane, thr.cvw, thr.wp, thr.cb, thr.rg, thr.tid
        VEC, R = self.vec, self.ratio
        colw = cb * self.col_vectors + cvw
        zero = cute.make_rmem_tensor((VEC,), self.dtype)
        zero.fill(0.0)
        for i in cutlass.range_constexpr(self.entries_per_lane):
            k = (wp * self.entries_per_lane + i) * 32 + lane
            if k < self.window and colw < self.half_vectors:
                half = k // R
                for h in cutlass.range_constexpr(self.ape_chunks):
                    frag = cute.make_rmem_tensor((self.ape_vec,), Float32)
                    for v in cutlass.range_constexpr(self.ape_vec):
                        frag[v] = gacc[i * VEC + h * self.ape_vec + v]
                    c = self._ape_chunk(half, colw, h)
                    gWork[(None, (rg * R + k - half * R, c))].store(frag.load())
        T = num_tokens
        for s in cutlass.range(rg, num_segs, groups, unroll=1):
            a = cutlass.max(cutlass.min(mCu[s], T), 0)
            e = cutlass.max(cutlass.min(mCu[s + 1], T), a)
            tail = a + ((e - a) // R) * R
            for hh in cutlass.range_constexpr(self.coff):
                self._zero_range(gGkv, gGsc, tail, e, hh, cb, tid)
            if const_expr(self.coff == 2):  # noqa: SIM102 (compile-time, then run-time test)
                if tail > a:  # first halves of the last block feed no window
                    self._zero_range(gGkv, gGsc, tail - R, tail, 0, cb, tid)
        # Rows past a static capacity smaller than the true count: their windows get zeros.
        hi_row = cutlass.min(mCuc[num_segs], T // R + 1)
        for n in cutlass.range(num_rows + rg, hi_row, groups, unroll=1):
            t0, fl = self._row_info(n, mCu, mCuc, num_tokens, num_segs)
            for idx in cutlass.range(tid, self.window * self.col_vectors, self.threads, unroll=1):
                k = idx // self.col_vectors
                c = cb * self.col_vectors + idx % self.col_vectors
                real = (fl & RowFlag.REAL) != 0
                if c < self.half_vectors and real and self._entry_ok(k, t0, fl, num_tokens):
                    gc = (k // R) * self.half_vectors + c
                    gGkv[(None, (t0 + k, gc))].store(zero.load())
                    gGsc[(None, (t0 + k, gc))].store(zero.load())
        first = cutlass.max(cutlass.min(mCu[0], T), 0)
        last = cutlass.max(cutlass.min(mCu[num_segs], T), 0)
        chunk = (T - last + groups - 1) // groups
        lo = last + rg * chunk
        hi = cutlass.min(lo + chunk, T)
        for hh in cutlass.range_constexpr(self.coff):
            if rg == 0:
                self._zero_range(gGkv, gGsc, 0, first, hh, cb, tid)
            if lo < hi:
                self._zero_range(gGkv, gGsc, lo, hi, hh, cb, tid)

    # ---------------------------------------------------------------- launch entries
    def _launch_main(self, gKV, gSc, p_ape, p_cu, p_cuc, gOut, gGo, gGkv, gGsc, gWork,
                     num_tokens, num_rows, num_segs, groups, stream, gSaved=None):
        width = self.coff * self.head_dim
        gApe = cute.zipped_divide(
            cute.make_tensor(p_ape, cute.make_layout((self.ratio, width), stride=(width, 1))),
            (1, self.ape_vec))
        mCu = cute.make_tensor(p_cu, cute.make_layout(num_segs + 1))
        mCuc = cute.make_tensor(p_cuc, cute.make_layout(num_segs + 1))
        self.kernel(gKV, gSc, gApe, mCu, mCuc, gOut, gGo, gGkv, gGsc, gWork,
                    gWork if gSaved is None else gSaved, num_tokens,
                    num_rows, num_segs, groups).launch(
            grid=(groups * self.col_blocks, 1, 1), block=(self.threads, 1, 1), stream=stream,
            min_blocks_per_mp=self.ctas, preferred_smem_carveout=100, use_pdl=self.pdl)

    def _rows(self, ptr, rows, cols):
        return cute.zipped_divide(
            cute.make_tensor(ptr, cute.make_layout((rows, cols), stride=(cols, 1))),
            (1, self.vec))


class StreamingForward(StreamingKernel):
    def __init__(self, key: KernelKey) -> None:
        super().__init__(key, backward=False)

    @cute.jit
    def __call__(self, p_kv: cute.Pointer, p_score: cute.Pointer, p_ape: cute.Pointer,
                 p_cu: cute.Pointer, p_cuc: cute.Pointer, p_out: cute.Pointer,
                 p_work: cute.Pointer, num_tokens: Int32, num_rows: Int32, num_segs: Int32,
                 grid: Int32, stream):
        width = self.coff * self.head_dim
        gKV = self._rows(p_kv, num_tokens, width)
        gSc = self._rows(p_score, num_tokens, width)
        gOut = self._rows(p_out, num_rows, self.head_dim)
        gWork = gSaved = gOut
        if const_expr(self.deferred):  # the words of failing columns, then their launch
            p_flags = cute.recast_ptr(p_work, dtype=Int32)
            words = num_rows * self.half_vectors
            p_saved = p_work + cute.assume((words + 3) // 4 * 4, divby=4)
            gWork = cute.make_tensor(p_flags, cute.make_layout(words))
            gSaved = cute.make_tensor(p_saved, cute.make_layout(
                (self.window_padded, 2, grid * self.col_vectors * SAVED_COLUMNS)))
        self._launch_main(gKV, gSc, p_ape, p_cu, p_cuc, gOut, gOut, gOut, gOut, gWork,
                          num_tokens, num_rows, num_segs, grid // self.col_blocks, stream,
                          gSaved)
        if const_expr(self.deferred):
            ExactColumns(self).launch(p_kv, p_score, p_ape, p_cu, p_cuc, p_out, p_flags,
                                      gSaved, num_tokens, num_rows, num_segs, stream)


class StreamingBackward(StreamingKernel):
    def __init__(self, key: KernelKey) -> None:
        super().__init__(key, backward=True)

    @cute.jit
    def __call__(self, p_go: cute.Pointer, p_kv: cute.Pointer, p_score: cute.Pointer,
                 p_ape: cute.Pointer, p_cu: cute.Pointer, p_cuc: cute.Pointer,
                 p_gkv: cute.Pointer, p_gsc: cute.Pointer, p_gape: cute.Pointer,
                 p_work: cute.Pointer, num_tokens: Int32, num_rows: Int32, num_segs: Int32,
                 grid: Int32, stream):
        width = self.coff * self.head_dim
        groups = grid // self.col_blocks
        gWork = cute.zipped_divide(cute.make_tensor(
            p_work, cute.make_layout((groups * self.ratio, width), stride=(width, 1))),
                                   (1, self.ape_vec))
        self._launch_main(self._rows(p_kv, num_tokens, width),
                          self._rows(p_score, num_tokens, width), p_ape, p_cu, p_cuc,
                          self._rows(p_go, num_rows, self.head_dim),
                          self._rows(p_go, num_rows, self.head_dim),
                          self._rows(p_gkv, num_tokens, width),
                          self._rows(p_gsc, num_tokens, width), gWork, num_tokens, num_rows,
                          num_segs, groups, stream)
        launch_sum_parts(p_work, p_gape, groups, self.ratio * width, _SUM_SPLIT, self.pdl, stream)
