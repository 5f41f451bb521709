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
