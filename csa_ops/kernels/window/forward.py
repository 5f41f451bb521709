"""The register-window forward: one pass, a thread per (row, column vector), padding and
invalid rows written as zeros. bf16 takes the certified fast softmax with the exact one as
the fallback of the columns it cannot certify (shared/softmax.py). Launches are
programmatic dependent launches (PDL) by default: CTAs can be resident before the previous
grid ends and wait for it before the first access."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import Float32, Int32, Int64, cute
from cutlass.memory import SmemAllocator

from ..shared import common as cm
from ..shared import segments
from .rows import WindowKernel


class WindowForward(WindowKernel):
    @cute.kernel
    def kernel(self, p_kv, p_score, p_ape, p_cu, p_cuc, p_out, num_tokens: Int32,
               num_rows: Int32, num_segs: Int32):
        cm.await_upstream(self.pdl)
        tid, _, _ = cute.arch.thread_idx()
        bx, by, _ = self.cta_coords()
        cvl = tid % self.cvc
        cv = by * self.cvc + cvl
        n = bx * self.rpc + tid // self.cvc
        cu, cuc = self.call_offsets(p_cu, p_cuc, num_segs, num_rows)
        smem = SmemAllocator()
        sApe = smem.allocate_tensor(Float32, self.ape_layout(), 16)
        rKV = cute.make_rmem_tensor((self.V, self.W), self.dtype)
        rS = cute.make_rmem_tensor((self.V, self.W), self.dtype)
        active = n < num_rows and (not self.ragged_cols or cv < self.tpr)
        valid = cutlass.Boolean(False)
        first = cutlass.Boolean(False)
        if active:
            valid, t0, first, _, _, _ = segments.locate_row(cu, cuc, num_segs, num_tokens, n,
                                                            self.R)
            if valid:
                # Issued before the ape barrier so the window's DRAM latency overlaps it.
                self.load_window(p_kv, p_score, rKV, rS, t0, first, cv)
        self.stage_ape(p_ape, sApe, by, tid)
        if active:
            rO = self.pooled(rKV, rS, sApe, cvl, valid, first)
            o_off = cute.assume(Int64(n) * self.D + cv * self.V, divby=self.V)
            cute.autovec_copy(rO, cute.make_tensor(p_out + o_off, self.V))

    def smem_bytes(self) -> int:
        return self.W * self.cvc * self.V * 4 + 16  # ape's (W, cvc * V) fp32

    @cute.jit
    def __call__(self, p_kv: cute.Pointer, p_score: cute.Pointer, p_ape: cute.Pointer,
                 p_cu: cute.Pointer, p_cuc: cute.Pointer, p_out: cute.Pointer,
                 p_work: cute.Pointer, num_tokens: Int32, num_rows: Int32, num_segs: Int32,
                 grid: Int32, stream: cuda.CUstream):
        self.kernel(p_kv, p_score, p_ape, p_cu, p_cuc, p_out, num_tokens, num_rows,
                    num_segs).launch(grid=self.launch_grid(grid), block=(self.threads, 1, 1),
                                     smem=self.smem_bytes(), stream=stream,
                                     use_pdl=self.pdl)
