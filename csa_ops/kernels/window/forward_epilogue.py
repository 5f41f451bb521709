"""csa::compressor_epilogue's forward in one launch (register-window family): a CTA pools
its rows as the forward kernel does and takes each straight through the training epilogue
into the output.

Apart, the forward is two launches: the forward kernel writes the pooled rows, and the
row-epilogue kernel (kernels/epilogue/training.py) waits for that whole grid before it
reads them back. Here the CTA is both: its threads are the epilogue's (`threads` threads of
`vec` columns over the whole row, plan.forward_epilogue_key), so a pooled row goes from
registers to the epilogue through one shared-memory transpose, with no pooled rows in
DRAM, no second grid and no wait between them. The pooling is the forward kernel's code
(its key's softmax: the same bits) and the epilogue the training kernel's, so the output
is the two launches' bytes.

A CTA takes `rows_per_cta` consecutive rows (plan.plan_row_share: one wave of the
CTAs an SM its launch bound, min_ctas, keeps resident), so ape is staged and the weight
loaded once for all of them: its threads look the rows up at once, a thread a row, and each
row's window and angles are loaded while the row before it is pooled and finished. Every
branch around a barrier depends on the row only, the same for all threads.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import Float32, Int32, Int64, cute

from ..epilogue.training import RowEpilogueRows
from ..shared import segments
from .forward import WindowForward
from .plan import ForwardEpilogueKey


class RowFlag:
    """Bits of a looked-up row's flags word."""

    POOLED = 1  # its window exists (segments.row_window's valid)
    FIRST = 2  # the segment's first block: coff 2's previous half reads nothing
    KEPT = 4  # below cu_seqlens_comp[-1]: through the epilogue (else a padding row, zeros)


class WindowForwardEpilogue(WindowForward):
    whole_rows = True  # Geometry: the CTA's threads span a whole row
    epilogue_kernel = RowEpilogueRows  # what a pooled row goes through

    def __init__(self, key: ForwardEpilogueKey) -> None:
        super().__init__(key.pooling)
        self.epi = self.fused_with(self.epilogue_kernel(key.epilogue))

    def smem_bytes(self) -> int:
        # ape's rows, the row's buffer, then the looked-up rows' first tokens, flags and
        # positions (a thread's row each).
        return super().smem_bytes() + self.epi.smem_bytes() + 16 * self.threads + 16

    def row_operands(self):
        """A row's (kv window, score window, cos, sin) registers, as fetch fills them."""
        rKV = cute.make_rmem_tensor((self.V, self.W), self.dtype)
        rS = cute.make_rmem_tensor((self.V, self.W), self.dtype)
        return (rKV, rS, *self.epi.angle_registers())

    @cute.jit
    def fetch(self, operands, p_kv, p_score, p_cos, p_sin, flags: Int32, t0: Int32,
              position: Int64, table_rows: Int32, tid: Int32):
        """Issues the loads of a looked-up row's window (where it has one) and angles (where
        it is kept)."""
        rKV, rS, rCos, rSin = operands
        if (flags & RowFlag.POOLED) != 0:
            self.load_window(p_kv, p_score, rKV, rS, t0, (flags & RowFlag.FIRST) != 0, tid)
        if (flags & RowFlag.KEPT) != 0:
            self.epi.load_angles((rCos, rSin), p_cos, p_sin, position, table_rows, tid)

    @cute.jit
    def move(self, source, target):
        for src, dst in zip(source, target):
            for i in cutlass.range_constexpr(cute.size(src)):
                dst[i] = src[i]

    @cute.kernel
    def kernel(self, p_kv, p_score, p_ape, p_cu, p_cuc, p_weight, p_cos, p_sin, p_offset,
               p_out, num_tokens: Int32, num_rows: Int32, num_segs: Int32, table_rows: Int32,
               rows_per_cta: Int32):
        tid, (cta, _, _), cu, cuc, smem, sApe = self.fused_prologue(p_cu, p_cuc, num_segs,
                                                                     num_rows)
        sRow = smem.allocate_tensor(Float32, cute.make_layout(self.D), 16)
        sPosition = smem.allocate_tensor(Int64, cute.make_layout(self.threads), 8)
        sToken = smem.allocate_tensor(Int32, cute.make_layout(self.threads), 4)
        sFlags = smem.allocate_tensor(Int32, cute.make_layout(self.threads), 4)
        begin = cta * rows_per_cta
        end = cutlass.min(begin + rows_per_cta, num_rows)
        # The CTA's rows looked up at once, a thread each: its window (segments.row_window)
        # and its place in the epilogue (position, kept) from one search.
        n = begin + tid
        if n < end:
            row = segments.lookup_row(cu, cuc, num_segs, n)
            pooled, t0, first = segments.row_window(row, num_tokens, n, self.R)
            kept, position = self.epi.place(row, cuc, p_offset, n, num_segs, self.R)
            sToken[tid] = t0
            sPosition[tid] = position
            sFlags[tid] = (Int32(pooled) * RowFlag.POOLED + Int32(first) * RowFlag.FIRST
                           + Int32(kept) * RowFlag.KEPT)
        self.each_row(p_kv, p_score, p_ape, p_weight, p_cos, p_sin, sApe, sToken, sPosition,
                      sFlags, begin, end, table_rows, tid,
                      lambda n, flags, operands, rWeight: self.finish(
                          p_out, sApe, sRow, n, flags, operands, rWeight, tid))

    @cute.jit
    def finish(self, p_out, sApe, sRow, n, flags, operands, rWeight, tid):
        """Row n pooled, through the epilogue where it is kept, into the output (zeros
        where it is not pooled)."""
        rKV, rS, rCos, rSin = operands
        rO = self.pooled(rKV, rS, sApe, tid, (flags & RowFlag.POOLED) != 0,
                         (flags & RowFlag.FIRST) != 0)
        rX = self.epi.strided(rO, sRow, tid)
        kept = (flags & RowFlag.KEPT) != 0
        if kept:
            self.epi.finish_row(rX, rWeight, (rCos, rSin), sRow, tid)
        self.epi.store_row(p_out, n, rX, kept, tid)

    @cute.jit
    def each_row(self, p_kv, p_score, p_ape, p_weight, p_cos, p_sin, sApe, sToken, sPosition,
                 sFlags, begin, end, table_rows: Int32, tid: Int32, finish):
        """finish(n, flags, operands, weight) for each of the CTA's rows [begin, end), looked
        up into sToken, sPosition and sFlags (published by the ape barrier here), with each
        row's operands fetched while the row before it is finished. ``flags`` is the same
        for every thread of the CTA."""
        rWeight = self.epi.load_weight(p_weight, tid)
        self.stage_ape(p_ape, sApe, 0, tid)  # its barrier publishes the lookups too
        current, upcoming = self.row_operands(), self.row_operands()
        if begin < end:
            self.fetch(current, p_kv, p_score, p_cos, p_sin, sFlags[0], sToken[0],
                       sPosition[0], table_rows, tid)
        for n in cutlass.range(begin, end, unroll=1):
            j = n - begin
            if n + 1 < end:
                self.fetch(upcoming, p_kv, p_score, p_cos, p_sin, sFlags[j + 1],
                           sToken[j + 1], sPosition[j + 1], table_rows, tid)
            finish(n, sFlags[j], current, rWeight)
            self.move(upcoming, current)

    @cute.jit
    def __call__(self, p_kv: cute.Pointer, p_score: cute.Pointer, p_ape: cute.Pointer,
                 p_cu: cute.Pointer, p_cuc: cute.Pointer, p_weight: cute.Pointer,
                 p_cos: cute.Pointer, p_sin: cute.Pointer, p_offset: cute.Pointer,
                 p_out: cute.Pointer, num_tokens: Int32, num_rows: Int32, num_segs: Int32,
                 table_rows: Int32, rows_per_cta: Int32, grid: Int32, stream: cuda.CUstream):
        self.kernel(p_kv, p_score, p_ape, p_cu, p_cuc, p_weight, p_cos, p_sin, p_offset,
                    p_out, num_tokens, num_rows, num_segs, table_rows, rows_per_cta).launch(
            grid=self.launch_grid(grid), block=(self.threads, 1, 1), smem=self.smem_bytes(),
            stream=stream, use_pdl=self.pdl, min_blocks_per_mp=self.min_ctas,
            preferred_smem_carveout=100)
