"""csa::compressor_epilogue's forward in one launch (register-window family): a CTA per
output row pools the row as the forward kernel does and takes it straight through the
training epilogue into the output.

Apart, the forward is two launches: the forward kernel writes the pooled rows, and the
row-epilogue kernel (kernels/epilogue/training.py) waits for that whole grid before it
reads them back. Here the CTA is both: its threads are the epilogue's (`threads` threads of
`vec` columns over the whole row, plan.forward_epilogue_key), so a pooled row goes from
registers to the epilogue through one shared-memory transpose, with no pooled rows in
DRAM, no second grid and no wait between them. The pooling is the forward kernel's code
(its key's softmax: the same bits) and the epilogue the training kernel's, so the output
is the two launches' bytes. Every branch around a barrier depends on the CTA's row only.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
from cutlass import Float32, Int32, cute
from cutlass.memory import SmemAllocator

from ..epilogue.training import RowEpilogueRows
from ..shared import common as cm
from .forward import WindowForward
from .plan import ForwardEpilogueKey


class WindowForwardEpilogue(WindowForward):
    whole_rows = True  # Geometry: one output row per CTA

    def __init__(self, key: ForwardEpilogueKey) -> None:
        super().__init__(key.forward)
        self.epi = RowEpilogueRows(key.epilogue)
        assert (self.ny, self.rpc, self.threads) == (1, 1, self.epi.T) and self.V == self.epi.V

    def smem_bytes(self) -> int:
        return super().smem_bytes() + self.epi.smem_bytes()  # ape's rows, then the row's

    @cute.kernel
    def kernel(self, p_kv, p_score, p_ape, p_cu, p_cuc, p_weight, p_cos, p_sin, p_offset,
               p_out, num_tokens: Int32, num_rows: Int32, num_segs: Int32, table_rows: Int32):
        cm.await_upstream(self.pdl)
        tid, _, _ = cute.arch.thread_idx()
        n, _, _ = self.cta_coords()
        cu = cute.make_tensor(p_cu, num_segs + 1)
        cuc = cute.make_tensor(p_cuc, num_segs + 1)
        cm.assert_offsets_fit(cuc, num_segs, num_rows)
        smem = SmemAllocator()
        sApe = smem.allocate_tensor(Float32, self.ape_layout(), 16)
        sRow = smem.allocate_tensor(Float32, cute.make_layout(self.D), 16)
        rKV, rS, pooled, first = self.issue_window(p_kv, p_score, cu, cuc, n, tid,
                                                   n < num_rows, num_tokens, num_segs)
        # The epilogue's operands, loaded while the window's loads are in flight: the row
        # is kept below cu_seqlens_comp[-1] (padding rows are zeros) at its position.
        rWeight = self.epi.load_weight(p_weight, tid)
        angles = self.epi.angle_registers()
        kept, position = self.epi.position(p_cuc, p_offset, n, num_segs, self.R)
        if kept:
            self.epi.load_angles(angles, p_cos, p_sin, position, table_rows, tid)
        self.stage_ape(p_ape, sApe, 0, tid)
        rX = self.epi.strided(self.pooled(rKV, rS, sApe, tid, pooled, first), sRow, tid)
        if kept:
            self.epi.finish_row(rX, rWeight, angles, sRow, tid)
        self.epi.store_row(p_out, n, rX, kept, tid)

    @cute.jit
    def __call__(self, p_kv: cute.Pointer, p_score: cute.Pointer, p_ape: cute.Pointer,
                 p_cu: cute.Pointer, p_cuc: cute.Pointer, p_weight: cute.Pointer,
                 p_cos: cute.Pointer, p_sin: cute.Pointer, p_offset: cute.Pointer,
                 p_out: cute.Pointer, num_tokens: Int32, num_rows: Int32, num_segs: Int32,
                 table_rows: Int32, grid: Int32, stream: cuda.CUstream):
        self.kernel(p_kv, p_score, p_ape, p_cu, p_cuc, p_weight, p_cos, p_sin, p_offset,
                    p_out, num_tokens, num_rows, num_segs, table_rows).launch(
            grid=self.launch_grid(grid), block=(self.threads, 1, 1), smem=self.smem_bytes(),
            stream=stream, use_pdl=self.pdl)
