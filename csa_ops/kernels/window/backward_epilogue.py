"""csa::compressor_epilogue_backward in one launch (register-window family): the pooling
backward whose CTA first takes each row's output gradient back through the epilogue.

Apart, the backward is three kernels and their sums: the pooling forward recomputes the
rows, the row-epilogue backward (kernels/epilogue/training.py) turns grad_out into the
rows' gradient and grad_weight's partials, and the pooling backward takes that gradient
through the softmax. Here one CTA is all three for its rows: its threads are the
epilogue's (`threads` threads of `vec` columns over the whole row,
plan.backward_epilogue_key), so per row it loads the window once, pools it with the
forward key's softmax (the forward's bits), goes back through rotation, RoPE and the norm
in the strided layout, turns the rows' gradient back into the pooling's contiguous
columns through shared memory, and runs the pooling backward's own code on the window it
holds. The rows' gradient is the staged route's bits, so grad_kv and grad_score are too;
grad_ape and grad_weight are fixed-order sums of per-CTA partials (the pooling backward's
grid-stride plan), within fp32 summation error of the staged route's. Every branch around
a barrier depends on the row only, the same for all threads of the CTA.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import Float32, Int32, Int64, cute

from ..epilogue.training import RowEpilogueRowsBackward
from ..shared import segments
from ..shared.reduce import launch_sum_parts
from .backward import _SUM_SPLIT, WindowBackward
from .plan import BackwardEpilogueKey, backward_epilogue_part_elems


class WindowBackwardEpilogue(WindowBackward):
    whole_rows = True  # Geometry: the CTA's threads span a whole row

    def __init__(self, key: BackwardEpilogueKey) -> None:
        super().__init__(key.backward)
        self.epi = self.fused_with(RowEpilogueRowsBackward(key.epilogue))
        self.part_elems = backward_epilogue_part_elems(key)  # grad_ape's, then grad_weight's

    @cute.jit
    def fused_row_grads(self, p_gout, p_kv, p_score, p_cos, p_sin, p_gkv, p_gs, sApe, sAcc,
                        sRow, rWeight, rW, t0, first, kept, position: Int64, n: Int32,
                        table_rows: Int32, tid: Int32):
        """Row n's window gradients (its window valid); a kept row's grad * normed added to
        rW. A row past cu_seqlens_comp[-1] has zero gradient, as in the staged route."""
        rKV = cute.make_rmem_tensor((self.V, self.W), self.dtype)
        rS = cute.make_rmem_tensor((self.V, self.W), self.dtype)
        self.load_window(p_kv, p_score, rKV, rS, t0, first, tid)
        rG = self.epi.row_registers()
        angles = self.epi.angle_registers()
        if kept:
            self.epi.fill_row(rG, p_gout, n, tid)
            self.epi.load_angles(angles, p_cos, p_sin, position, table_rows, tid)
        rX = self.epi.strided(self.pooled(rKV, rS, sApe, tid, True, first), sRow, tid)
        rGrad = cute.make_rmem_tensor((self.V,), self.dtype)
        rGrad.fill(0.0)
        if kept:  # the same for every thread of the CTA
            self.epi.row_gradient(rG, rX, rWeight, angles, sRow, tid, rW)
            self.epi.contiguous(rG, rGrad, sRow, tid)
        self.window_grads(rKV, rS, rGrad, p_gkv, p_gs, sApe, sAcc, t0, first, tid, tid, tid)

    @cute.kernel
    def kernel(self, p_gout, p_kv, p_score, p_ape, p_cu, p_cuc, p_weight, p_cos, p_sin,
               p_offset, p_gkv, p_gs, p_work, num_tokens: Int32, num_rows: Int32,
               num_segs: Int32, table_rows: Int32):
        tid, (bx, by, gx), cu, cuc, smem, sApe = self.fused_prologue(p_cu, p_cuc, num_segs,
                                                                      num_rows)
        sAcc = self.ape_accumulators(smem, tid)
        sRow = smem.allocate_tensor(Float32, cute.make_layout(self.D), 16)
        rWeight = self.epi.load_weight(p_weight, tid)
        rW = self.epi.row_registers()
        rW.fill(0.0)
        self.stage_ape(p_ape, sApe, by, tid)
        num_slots = cutlass.max((num_tokens + (self.R - 1)) // self.R, num_rows)
        for slot in cutlass.range(bx, num_slots, gx):
            seg = Int32(-1)
            u0 = Int32(0)
            u1 = Int32(0)
            if slot < num_rows:
                # One search: the row's window (segments.locate_row's) and its place in the
                # epilogue (RowEpilogueRows.position's).
                row = segments.lookup_row(cu, cuc, num_segs, slot)
                seg, u0, u1 = segments.segment_of(row, num_segs), row.token_begin, row.token_end
                valid, t0, first = segments.row_window(row, num_tokens, slot, self.R)
                kept, position = self.epi.place(row, cuc, p_offset, slot, num_segs, self.R)
                if valid:
                    self.fused_row_grads(p_gout, p_kv, p_score, p_cos, p_sin, p_gkv, p_gs,
                                         sApe, sAcc, sRow, rWeight, rW, t0, first, kept,
                                         position, slot, table_rows, tid)
            self.zero_chunk(p_gkv, p_gs, cu, cuc, num_segs, num_tokens, num_rows, slot, tid,
                            seg, u0, u1)
        cute.arch.sync_threads()
        self.write_ape_partial(sAcc, p_work, bx, by, gx, tid)
        # grad_weight: this CTA's partial row (its rows in slot order), after its grad_ape
        # partial.
        partial = cute.make_tensor(p_work + Int64(bx) * self.part_elems + self.E, self.D)
        for k in cutlass.range_constexpr(self.V):
            partial[tid + k * self.epi.T] = rW[k]

    @cute.jit
    def __call__(self, p_gout: cute.Pointer, p_kv: cute.Pointer, p_score: cute.Pointer,
                 p_ape: cute.Pointer, p_cu: cute.Pointer, p_cuc: cute.Pointer,
                 p_weight: cute.Pointer, p_cos: cute.Pointer, p_sin: cute.Pointer,
                 p_offset: cute.Pointer, p_gkv: cute.Pointer, p_gs: cute.Pointer,
                 p_gape: cute.Pointer, p_gweight: cute.Pointer, p_work: cute.Pointer,
                 num_tokens: Int32, num_rows: Int32, num_segs: Int32, table_rows: Int32,
                 grid: Int32, stream: cuda.CUstream):
        self.kernel(p_gout, p_kv, p_score, p_ape, p_cu, p_cuc, p_weight, p_cos, p_sin,
                    p_offset, p_gkv, p_gs, p_work, num_tokens, num_rows, num_segs,
                    table_rows).launch(grid=self.launch_grid(grid), block=(self.threads, 1, 1),
                                       smem=self.smem_bytes(self.epi.smem_bytes()),
                                       stream=stream, use_pdl=self.pdl,
                                       min_blocks_per_mp=self.min_ctas,
                                       preferred_smem_carveout=100)
        # grad_ape's and grad_weight's partials, each summed in a fixed order, in one launch.
        launch_sum_parts(p_work, p_gape, grid, self.part_elems, _SUM_SPLIT, self.pdl, stream,
                         tail=(p_gweight, self.D))
