"""The row epilogue of csa::compressor_epilogue's forward: per row of the pooled output, the
steps of rows.py at the row's training position, written packed in the row dtype.

Row b of sequence s (cu_seqlens_comp[s] <= n < cu_seqlens_comp[s + 1]) sits at position
b * ratio plus position_offset[s] when the key has offsets; rows past cu_seqlens_comp[-1]
are padding and written as zeros, as the reference's. The kernel runs after the pooling
forward in the same stream (PDL: it waits for it before any access).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import Float32, Int32, Int64, cute

from ..shared import common as cm
from .plan import EpilogueKey
from .rows import RowEpilogue


class RowEpilogueRows(RowEpilogue):
    """Training: the epilogue of csa::compressor's rows, packed (strided stores)."""

    def __init__(self, key: EpilogueKey) -> None:
        super().__init__(key)
        self.offsets = key.position_offset

    @cute.jit
    def position(self, p_cuc, p_offset, n: Int32, num_segs: Int32, ratio: Int32):
        """(valid, position) of output row n: valid below cu_seqlens_comp[-1] (with no
        segment too, at position 0, as the reference's); the segment search clamps as the
        reference's lookup does, so every load is in bounds for any offsets' contents."""
        cuc = cute.make_tensor(p_cuc, num_segs + 1)
        valid = n < cuc[num_segs]
        position = Int64(0)
        if valid and num_segs > 0:
            s = cm.count_le(cuc, num_segs + 1, n) - 1
            s = cutlass.min(cutlass.max(s, Int32(0)), num_segs - 1)
            position = (Int64(n) - Int64(cuc[s])) * Int64(ratio)
            if cutlass.const_expr(self.offsets):
                position = position + Int64(cute.make_tensor(p_offset, num_segs)[s])
        return valid, position

    @cute.kernel
    def kernel(self, p_rows, p_weight, p_cos, p_sin, p_cuc, p_offset, p_out, num_rows: Int32,
               num_segs: Int32, table_rows: Int32, ratio: Int32):
        tid, n, sRow = self.row_of_cta()
        valid, position = self.position(p_cuc, p_offset, n, num_segs, ratio)
        rX = cute.make_rmem_tensor((self.V,), Float32)
        rX.fill(0.0)
        if valid:  # the same for every thread of the CTA
            self.finish_row(p_rows, n, p_weight, p_cos, p_sin, position, table_rows, sRow,
                            tid, rX)
        out = cute.make_tensor(p_out + Int64(n) * self.D, self.D)
        for k in cutlass.range_constexpr(self.V):
            out[tid + k * self.T] = self.dtype(rX[k])

    @cute.jit
    def __call__(self, p_rows: cute.Pointer, p_weight: cute.Pointer, p_cos: cute.Pointer,
                 p_sin: cute.Pointer, p_cuc: cute.Pointer, p_offset: cute.Pointer,
                 p_out: cute.Pointer, num_rows: Int32, num_segs: Int32, table_rows: Int32,
                 ratio: Int32, grid: Int32, stream: cuda.CUstream):
        self.kernel(p_rows, p_weight, p_cos, p_sin, p_cuc, p_offset, p_out, num_rows,
                    num_segs, table_rows, ratio).launch(
            grid=(grid, 1, 1), block=(self.T, 1, 1), smem=self.D * 4 + 16, stream=stream,
            use_pdl=self.pdl)


class RowEpilogueRowsBackward(RowEpilogueRows):
    """Training backward: per row, the gradient of the pooled row through the rotation, RoPE
    and the norm (reference_epilogue.epilogue_rows_backward operation for operation, so
    grad_rows is the torch route's bits), and each CTA's column sums of grad * normed over
    its rows in row order: one fp32 partial row of grad_weight per CTA, summed on the host
    (a fixed order, no atomics)."""

    @cute.jit
    def row_gradient(self, p_grad, p_rows, n: Int32, p_weight, p_cos, p_sin, position: Int64,
                     table_rows: Int32, sRow: cute.Tensor, tid: Int32, rG: cute.Tensor,
                     rW: cute.Tensor):
        """rG <- the gradient of pooled row n (strided) in the row dtype's values; rW +=
        this row's grad * normed."""
        grad = cute.make_tensor(p_grad + Int64(n) * self.D, self.D)
        for k in cutlass.range_constexpr(self.V):
            rG[k] = Float32(grad[tid + k * self.T])
        # The forward's steps in reverse, each transposed: the rotation is its own.
        if cutlass.const_expr(self.rotate):
            self.hadamard(rG, sRow, tid)
        if cutlass.const_expr(self.rope_dim > 0):
            table_row = cutlass.min(cutlass.max(position, Int64(0)), Int64(table_rows) - 1)
            self.rope(rG, p_cos, p_sin, table_row, tid, transpose=True)
        row = cute.make_tensor(p_rows + Int64(n) * self.D, self.D)
        rX = cute.make_rmem_tensor((self.V,), Float32)
        for k in cutlass.range_constexpr(self.V):
            rX[k] = Float32(row[tid + k * self.T])
        inverse = self.inverse_rms(rX, sRow, tid)
        weight = cute.make_tensor(p_weight, self.D)
        rScaled = cute.make_rmem_tensor((self.V,), Float32)
        for k in cutlass.range_constexpr(self.V):
            rX[k] = cm.mul_rn(rX[k], inverse)  # normed
            rW[k] = cm.add_rn(rW[k], cm.mul_rn(rG[k], rX[k]))
            rScaled[k] = cm.mul_rn(rG[k], Float32(weight[tid + k * self.T]))
            rG[k] = cm.mul_rn(rX[k], rScaled[k])  # the mean's terms (rG is free now)
        mean = cm.div_rn(self.row_sum(rG, sRow, tid), Float32(float(self.D)))
        # d/dx of x * r(x), r = 1 / sqrt(mean(x^2) + eps): r * (h - x r * mean(x r * h)).
        for k in cutlass.range_constexpr(self.V):
            rG[k] = self.to_dtype(
                cm.mul_rn(cm.sub_rn(rScaled[k], cm.mul_rn(rX[k], mean)), inverse))

    @cute.kernel
    def kernel(self, p_grad, p_rows, p_weight, p_cos, p_sin, p_cuc, p_offset, p_grad_rows,
               p_partials, num_rows: Int32, num_segs: Int32, table_rows: Int32, ratio: Int32,
               rows_per_cta: Int32):
        tid, cta, sRow = self.row_of_cta()
        rW = cute.make_rmem_tensor((self.V,), Float32)
        rW.fill(0.0)
        rG = cute.make_rmem_tensor((self.V,), Float32)
        first = cta * rows_per_cta
        for n in cutlass.range(first, cutlass.min(first + rows_per_cta, num_rows), unroll=1):
            valid, position = self.position(p_cuc, p_offset, n, num_segs, ratio)
            rG.fill(0.0)
            if valid:  # the same for every thread of the CTA; padding rows add nothing
                self.row_gradient(p_grad, p_rows, n, p_weight, p_cos, p_sin, position,
                                  table_rows, sRow, tid, rG, rW)
            grad_rows = cute.make_tensor(p_grad_rows + Int64(n) * self.D, self.D)
            for k in cutlass.range_constexpr(self.V):
                grad_rows[tid + k * self.T] = self.dtype(rG[k])
        partial = cute.make_tensor(p_partials + Int64(cta) * self.D, self.D)
        for k in cutlass.range_constexpr(self.V):
            partial[tid + k * self.T] = rW[k]

    @cute.jit
    def __call__(self, p_grad: cute.Pointer, p_rows: cute.Pointer, p_weight: cute.Pointer,
                 p_cos: cute.Pointer, p_sin: cute.Pointer, p_cuc: cute.Pointer,
                 p_offset: cute.Pointer, p_grad_rows: cute.Pointer, p_partials: cute.Pointer,
                 num_rows: Int32, num_segs: Int32, table_rows: Int32, ratio: Int32,
                 rows_per_cta: Int32, grid: Int32, stream: cuda.CUstream):
        self.kernel(p_grad, p_rows, p_weight, p_cos, p_sin, p_cuc, p_offset, p_grad_rows,
                    p_partials, num_rows, num_segs, table_rows, ratio, rows_per_cta).launch(
            grid=(grid, 1, 1), block=(self.T, 1, 1), smem=self.D * 4 + 16, stream=stream,
            use_pdl=self.pdl)
