"""The row epilogue of csa::compressor_epilogue's forward: per row of the pooled output, the
steps of rows.py at the row's training position, written packed in the row dtype.

Row b of sequence s (cu_seqlens_comp[s] <= n < cu_seqlens_comp[s + 1]) sits at position
b * ratio plus position_offset[s] when the key has offsets; rows past cu_seqlens_comp[-1]
are padding and written as zeros, as the reference's. The kernel runs after the pooling
forward in the same stream (PDL): it looks up each row's position while the pooling kernel
runs (cu_seqlens_comp is an input of both), and waits for it before reading the row.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import Float32, Int32, Int64, cute

from ..shared import common as cm
from ..shared import segments
from ..shared.reduce import launch_sum_parts
from .plan import EpilogueKey
from .rows import RowEpilogue


_SUM_SPLIT = 32  # grad_weight's sum: warps per CTA, each adding every 32nd partial row


class RowEpilogueRows(RowEpilogue):
    """Training: the epilogue of csa::compressor's rows, packed (strided stores)."""

    def __init__(self, key: EpilogueKey) -> None:
        super().__init__(key)
        self.offsets = key.position_offset

    @cute.jit
    def position(self, p_cuc, p_offset, n: Int32, num_segs: Int32, ratio: Int32):
        """(valid, position) of output row n: valid below cu_seqlens_comp[-1] (with no
        segment too, at position 0, as the reference's), its segment the reference's
        (segments.lookup_row: every load in bounds for any offsets' contents)."""
        cuc = cute.make_tensor(p_cuc, num_segs + 1)
        return self.place(segments.lookup_row(None, cuc, num_segs, n), cuc, p_offset, n,
                          num_segs, ratio)

    @cute.jit
    def place(self, row: segments.RowLookup, cuc: cute.Tensor, p_offset, n: Int32,
              num_segs: Int32, ratio):
        """position()'s (valid, position) of output row n from its lookup."""
        valid = n < cuc[num_segs]
        position = Int64(0)
        if row.real:
            position = (Int64(n) - Int64(row.row_begin)) * Int64(ratio)
            if cutlass.const_expr(self.offsets):
                position = position + Int64(cute.make_tensor(p_offset, num_segs)[row.segment])
        return valid, position

    @cute.kernel
    def kernel(self, p_rows, p_weight, p_cos, p_sin, p_cuc, p_offset, p_out, num_rows: Int32,
               num_segs: Int32, table_rows: Int32, ratio: Int32):
        tid, n, sRow, _ = self.cta()
        # The weight, the row's position and its angles come from the call's inputs, which
        # the pooling kernel does not write: looked up while it runs.
        rWeight = self.load_weight(p_weight, tid)
        angles = self.angle_registers()
        valid, position = self.position(p_cuc, p_offset, n, num_segs, ratio)
        if valid:  # the same for every thread of the CTA
            self.load_angles(angles, p_cos, p_sin, position, table_rows, tid)
        cm.await_upstream(self.pdl)
        rX = self.load_row(p_rows, n, tid)
        if valid:
            self.finish_row(rX, rWeight, angles, sRow, tid)
        self.store_row(p_out, n, rX, valid, tid)

    @cute.jit
    def store_row(self, p_out, n, rX: cute.Tensor, valid, tid: Int32):
        """Row n of the packed output: rX in the row dtype, zeros where not ``valid``."""
        out = cute.make_tensor(p_out + Int64(n) * self.D, self.D)
        for k in cutlass.range_constexpr(self.V):
            out[tid + k * self.T] = self.dtype(cm.pick(valid, rX[k], Float32(0.0)))

    @cute.jit
    def __call__(self, p_rows: cute.Pointer, p_weight: cute.Pointer, p_cos: cute.Pointer,
                 p_sin: cute.Pointer, p_cuc: cute.Pointer, p_offset: cute.Pointer,
                 p_out: cute.Pointer, num_rows: Int32, num_segs: Int32, table_rows: Int32,
                 ratio: Int32, grid: Int32, stream: cuda.CUstream):
        self.kernel(p_rows, p_weight, p_cos, p_sin, p_cuc, p_offset, p_out, num_rows,
                    num_segs, table_rows, ratio).launch(
            grid=(grid, 1, 1), block=(self.T, 1, 1), smem=self.smem_bytes(), stream=stream,
            use_pdl=self.pdl)


class RowEpilogueRowsBackward(RowEpilogueRows):
    """Training backward: per row, the gradient of the pooled row through the rotation, RoPE
    and the norm (reference_epilogue.epilogue_rows_backward operation for operation, so
    grad_rows is the torch route's bits), and each CTA's column sums of grad * normed over
    its rows in row order: one fp32 partial row of grad_weight per CTA, then summed by
    shared/reduce.py's kernel (a fixed order, no atomics)."""

    def smem_bytes(self) -> int:
        return super().smem_bytes() + 12 * self.T + 8  # a chunk's positions and flags

    @cute.jit
    def row_gradient(self, rG: cute.Tensor, rX: cute.Tensor, rWeight: cute.Tensor, angles,
                     sRow: cute.Tensor, tid: Int32, rW: cute.Tensor):
        """rG (the epilogue's output gradient of pooled row rX, strided) <- the gradient of
        the pooled row, in the row dtype's values; rW += this row's grad * normed. rX is
        spent."""
        # The forward's steps in reverse, each transposed: the rotation is its own.
        if cutlass.const_expr(self.rotate):
            self.hadamard(rG, sRow, tid)
        if cutlass.const_expr(self.rope_dim > 0):
            self.rope(rG, angles, tid, transpose=True)
        inverse = self.inverse_rms(rX, sRow, tid)
        rScaled = self.row_registers()
        for k in cutlass.range_constexpr(self.V):
            rX[k] = cm.mul_rn(rX[k], inverse)  # normed
            rW[k] = cm.add_rn(rW[k], cm.mul_rn(rG[k], rX[k]))
            rScaled[k] = cm.mul_rn(rG[k], rWeight[k])
            rG[k] = cm.mul_rn(rX[k], rScaled[k])  # the mean's terms (rG is free now)
        mean = self.mean(self.row_sum(rG, sRow, tid))
        # d/dx of x * r(x), r = 1 / sqrt(mean(x^2) + eps): r * (h - x r * mean(x r * h)).
        for k in cutlass.range_constexpr(self.V):
            rG[k] = self.to_dtype(
                cm.mul_rn(cm.sub_rn(rScaled[k], cm.mul_rn(rX[k], mean)), inverse))

    def operand_registers(self):
        """A row's (grad, pooled row, angles) registers for fetch."""
        return self.row_registers(), self.row_registers(), self.angle_registers()

    @cute.jit
    def fetch(self, operands, p_grad, p_rows, p_cos, p_sin, n: Int32, valid: Int32,
              position: Int64, table_rows: Int32, tid: Int32):
        """Issues the loads of row n's operands (none for a padding row)."""
        rG, rX, angles = operands
        if valid != 0:
            self.fill_row(rG, p_grad, n, tid)
            self.fill_row(rX, p_rows, n, tid)
            self.load_angles(angles, p_cos, p_sin, position, table_rows, tid)

    @cute.jit
    def move(self, source, target):
        for src, dst in zip((source[0], source[1], *source[2]), (target[0], target[1], *target[2])):
            for k in cutlass.range_constexpr(self.V):
                dst[k] = src[k]

    @cute.kernel
    def kernel(self, p_grad, p_rows, p_weight, p_cos, p_sin, p_cuc, p_offset, p_grad_rows,
               p_partials, num_rows: Int32, num_segs: Int32, table_rows: Int32, ratio: Int32,
               rows_per_cta: Int32):
        cm.await_upstream(self.pdl)
        tid, cta, sRow, smem = self.cta()
        sPosition = smem.allocate_tensor(Int64, cute.make_layout(self.T), 8)
        sValid = smem.allocate_tensor(Int32, cute.make_layout(self.T), 4)
        rWeight = self.load_weight(p_weight, tid)
        rW = self.row_registers()
        rW.fill(0.0)
        current, upcoming = self.operand_registers(), self.operand_registers()
        first = cta * rows_per_cta
        last = cutlass.min(first + rows_per_cta, num_rows)
        # The CTA's rows in chunks of `threads`: a chunk's positions are looked up at once,
        # a thread each, and each row's loads are issued while the row before it is worked.
        for chunk in cutlass.range(first, last, self.T, unroll=1):
            if chunk + tid < last:
                valid, position = self.position(p_cuc, p_offset, chunk + tid, num_segs, ratio)
                sValid[tid] = Int32(valid)
                sPosition[tid] = position
            cute.arch.sync_threads()
            end = cutlass.min(chunk + self.T, last)
            self.fetch(current, p_grad, p_rows, p_cos, p_sin, chunk, sValid[0], sPosition[0],
                       table_rows, tid)
            for n in cutlass.range(chunk, end, unroll=1):
                j = n - chunk
                if n + 1 < end:
                    self.fetch(upcoming, p_grad, p_rows, p_cos, p_sin, n + 1, sValid[j + 1],
                               sPosition[j + 1], table_rows, tid)
                valid = sValid[j] != 0  # the same for every thread of the CTA
                rG, rX, angles = current
                if valid:  # padding rows add nothing
                    self.row_gradient(rG, rX, rWeight, angles, sRow, tid, rW)
                grad_rows = cute.make_tensor(p_grad_rows + Int64(n) * self.D, self.D)
                for k in cutlass.range_constexpr(self.V):
                    grad_rows[tid + k * self.T] = self.dtype(cm.pick(valid, rG[k],
                                                                     Float32(0.0)))
                self.move(upcoming, current)
            cute.arch.sync_threads()  # the chunk's positions are read before the next's
        partial = cute.make_tensor(p_partials + Int64(cta) * self.D, self.D)
        for k in cutlass.range_constexpr(self.V):
            partial[tid + k * self.T] = rW[k]

    @cute.jit
    def __call__(self, p_grad: cute.Pointer, p_rows: cute.Pointer, p_weight: cute.Pointer,
                 p_cos: cute.Pointer, p_sin: cute.Pointer, p_cuc: cute.Pointer,
                 p_offset: cute.Pointer, p_grad_rows: cute.Pointer, p_partials: cute.Pointer,
                 p_grad_weight: cute.Pointer, num_rows: Int32, num_segs: Int32,
                 table_rows: Int32, ratio: Int32, rows_per_cta: Int32, grid: Int32,
                 stream: cuda.CUstream):
        self.kernel(p_grad, p_rows, p_weight, p_cos, p_sin, p_cuc, p_offset, p_grad_rows,
                    p_partials, num_rows, num_segs, table_rows, ratio, rows_per_cta).launch(
            grid=(grid, 1, 1), block=(self.T, 1, 1), smem=self.smem_bytes(), stream=stream,
            use_pdl=self.pdl)
        # grad_weight: the CTAs' partial rows summed in a fixed order (shared/reduce.py).
        launch_sum_parts(p_partials, p_grad_weight, grid, self.D, _SUM_SPLIT, self.pdl, stream)
