"""The base of the register-window kernels: the CTA shape of a key plus what device code
derives from it, the window's loads and stores, ape staging, the CTA grid, and the output
column of a window held in registers (shared/softmax.py)."""

from __future__ import annotations

import cutlass
from cutlass import Float32, Int64, cute
from cutlass.memory import SmemAllocator

from ...config import TYPES, KernelKey
from ..shared import common as cm
from ..shared import softmax, torch_order
from ..shared.certificate import Certificate
from .plan import Geometry


class WindowKernel(Geometry):
    """One compiled configuration of a register-window kernel; every attribute is a
    compile-time constant. Thread = (output row or work item, vector of V columns); a CTA
    is rpc rows x cvc column vectors of one of ny column chunks."""

    def __init__(self, key: KernelKey) -> None:
        super().__init__(key)
        self.key = key
        self.dtype = cm.dsl_type(key.dtype)
        knobs = key.knobs
        self.min_ctas, self.balance, self.pdl = knobs.min_ctas, knobs.balance, knobs.pdl
        # No fast column of a 32-bit output can be certified within one of its steps, so
        # there fast_exp runs the exact softmax: the fallback every column would take.
        self.linear = knobs.linear
        self.fast_exp = knobs.fast_exp and TYPES[key.dtype].bytes == 2
        self.shift = softmax.exponent_shift(self.W)
        if self.fast_exp:
            # softmax.pool_fast's: a thread sums its column's entries in order.
            self.certificate = Certificate.for_column(
                self.W, self.shift, self.W, torch_order.sum_depth(self.W, self.D),
                TYPES[key.dtype].precision)
        # Window entry k: (token offset from t0, column offset, ape offset, needs block b-1).
        self.entries = []
        for k in range(self.W):
            if self.C == 1:
                self.entries.append((k, 0, k * self.D, False))
            elif k < self.R:
                self.entries.append((k - self.R, 0, k * 2 * self.D, True))
            else:
                self.entries.append((k - self.R, self.D, (k - self.R) * 2 * self.D + self.D,
                                     False))

    # ---------------------------------------------------------------- the CTA grid
    @cute.jit
    def cta_coords(self):
        """(bx, by, gx): row-block index, column-chunk index, row blocks in the grid."""
        if cutlass.const_expr(self.linear):
            bid, _, _ = cute.arch.block_idx()
            nb, _, _ = cute.arch.grid_dim()
            return bid // self.ny, bid % self.ny, nb // self.ny
        bx, by, _ = cute.arch.block_idx()
        gx, _, _ = cute.arch.grid_dim()
        return bx, by, gx

    def launch_grid(self, grid):
        """A plan's `grid` CTAs per column chunk; the linear grid puts the chunk fastest, so
        CTAs resident together read whole token rows (DRAM pages)."""
        return (grid * self.ny, 1, 1) if self.linear else (grid, self.ny, 1)

    def fused_with(self, epilogue):
        """``epilogue`` (a row-epilogue kernel object), whose CTA this kernel's is: a kernel
        that fuses it (whole_rows) has its threads and their columns."""
        assert self.whole_rows and (self.ny, self.rpc, self.threads) == (1, 1, epilogue.T)
        assert self.V == epilogue.V
        return epilogue

    @cute.jit
    def fused_prologue(self, p_cu, p_cuc, num_segs, num_rows):
        """A fused kernel's start, after the upstream grid: (thread index, CTA coordinates,
        cu_seqlens, cu_seqlens_comp, its shared memory, ape's rows allocated first in it)."""
        cm.await_upstream(self.pdl)
        tid, _, _ = cute.arch.thread_idx()
        coords = self.cta_coords()
        cu, cuc = self.call_offsets(p_cu, p_cuc, num_segs, num_rows)
        smem = SmemAllocator()
        return tid, coords, cu, cuc, smem, smem.allocate_tensor(Float32, self.ape_layout(), 16)

    @cute.jit
    def call_offsets(self, p_cu, p_cuc, num_segs, num_rows):
        """(cu_seqlens, cu_seqlens_comp) of the call, once cu_seqlens_comp[-1] is known to
        fit its num_rows (common.assert_offsets_fit)."""
        cu = cute.make_tensor(p_cu, num_segs + 1)
        cuc = cute.make_tensor(p_cuc, num_segs + 1)
        cm.assert_offsets_fit(cuc, num_segs, num_rows)
        return cu, cuc

    # ---------------------------------------------------------------- window I/O
    def ape_layout(self):
        # Row-major (W, cvc*V): stage_ape writes it through raw offsets, and a thread's V
        # columns of one entry are contiguous for vector reads. (make_layout defaults to
        # column-major.)
        return cute.make_layout((self.W, self.cvc * self.V), stride=(self.cvc * self.V, 1))

    def ape_base(self, k):
        # ape row k % R, column half k // R (coff 2) of entry k, computed at run time.
        if cutlass.const_expr(self.C == 1):
            return k * self.D
        return (k % self.R) * (2 * self.D) + (k // self.R) * self.D

    def window_offsets(self, t0, cv):
        """(entry k, element offset, needs_prev) of each entry of row t0's window in the
        thread's column vector cv (trace-time: the entries are unrolled). needs_prev: the
        entry is of block b-1, which a segment's first block has not."""
        base = Int64(t0) * (self.C * self.D) + cv * self.V
        for k in range(self.W):
            tok, col, _, needs_prev = self.entries[k]
            yield k, cute.assume(base + (tok * self.C * self.D + col), divby=self.V), needs_prev

    @cute.jit
    def load_window(self, p_kv, p_score, rKV, rS, t0, first, cv):
        # Entries of block b-1 of a first block read nothing: value 0 (the reference's).
        for k, off, needs_prev in self.window_offsets(t0, cv):
            if cutlass.const_expr(needs_prev):
                if first:
                    for i in cutlass.range_constexpr(self.V):
                        rKV[i, k] = self.dtype(0.0)
                        rS[i, k] = self.dtype(0.0)
                else:
                    cute.autovec_copy(cute.make_tensor(p_kv + off, self.V), rKV[None, k])
                    cute.autovec_copy(cute.make_tensor(p_score + off, self.V), rS[None, k])
            else:
                cute.autovec_copy(cute.make_tensor(p_kv + off, self.V), rKV[None, k])
                cute.autovec_copy(cute.make_tensor(p_score + off, self.V), rS[None, k])

    @cute.jit
    def stage_ape(self, p_ape, sApe, by, tid):
        """The CTA's column chunk of ape, (W, cvc*V) fp32, into shared memory: thread
        (row r, column vector c) copies entries k = r, r + rpc, ... of vector c."""
        cvl = tid % self.cvc
        ry = tid // self.cvc
        cv = by * self.cvc + cvl
        if not self.ragged_cols or cv < self.tpr:
            for kk in cutlass.range_constexpr(-(-self.W // self.rpc)):
                k = ry + kk * self.rpc
                if k < self.W:
                    src = cute.assume(self.ape_base(k) + cv * self.V, divby=self.V)
                    dst = cute.assume(k * (self.cvc * self.V) + cvl * self.V, divby=self.V)
                    cute.autovec_copy(cute.make_tensor(p_ape + src, self.V),
                                      cute.make_tensor(sApe.iterator + dst, self.V))
        cute.arch.sync_threads()

    @cute.jit
    def store_window(self, p_dst, rD, t0, first, cv):
        for k, off, needs_prev in self.window_offsets(t0, cv):
            dst = cute.make_tensor(p_dst + off, self.V)
            if cutlass.const_expr(needs_prev):
                if not first:
                    cute.autovec_copy(rD[None, k], dst)
            else:
                cute.autovec_copy(rD[None, k], dst)

    # ---------------------------------------------------------------- output columns
    def window_column(self, rKV, rS, sApe, i, cvl):
        """(logit, value) of column i of a window loaded by load_window: score + ape, as the
        reference adds them."""
        return (lambda k: cm.add_rn(Float32(rS[i, k]), sApe[k, cvl * self.V + i]),
                lambda k: Float32(rKV[i, k]))

    def pool_window(self, rO, rKV, rS, sApe, cvl, first):
        """rO = the output row's V columns of a window loaded by load_window."""
        softmax.pool_columns(
            self, rO,
            lambda i: softmax.column_fast(self, *self.window_column(rKV, rS, sApe, i, cvl),
                                          first),
            lambda i: softmax.column_exact(self, *self.window_column(rKV, rS, sApe, i, cvl),
                                           first))

    @cute.jit
    def pooled(self, rKV, rS, sApe, cvl, valid, first):
        """The row's V columns in the row dtype (zeros where the row is not valid), once
        ape is staged."""
        rO = cute.make_rmem_tensor((self.V,), self.dtype)
        rO.fill(0.0)
        if valid:
            self.pool_window(rO, rKV, rS, sApe, cvl, first)
        return rO

    def window_probs(self, rKV, rS, sApe, i, cvl, first):
        """(probabilities, values) of column i in the reference's exact operation order."""
        logit, value = self.window_column(rKV, rS, sApe, i, cvl)
        logits, m = softmax.window_logits(self, logit, first)
        return softmax.exact_softmax(self, logits, m, value)
