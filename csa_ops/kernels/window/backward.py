"""The register-window backward: a grid-stride loop over "slots"; slot i is row i (its
window's gradients, disjoint stores) plus token chunk [i*ratio, (i+1)*ratio), whose
never-consumed elements it zeroes. grad_ape: per-thread fp32 partials in shared memory, a
fixed-order CTA reduction to one partial per CTA in the workspace, then shared/reduce.py's
fixed-order sum over the CTAs."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import Float32, Int32, Int64, cute
from cutlass.memory import SmemAllocator

from .. import sm
from ..shared import common as cm
from ..shared import segments
from ..shared.reduce import launch_sum_parts
from .plan import CTAS_PER_SM
from .rows import WindowKernel

# The grid-stride plan gives every CTA the same slots and assumes CTAS_PER_SM of them on each
# SM. A kernel light enough for more would let the block scheduler stack CTAs on the SMs
# that free up first (under PDL, while the previous grid drains) and leave others short, and
# the busiest SM sets the time (H200, r2 c2 d512: 93 us against 80 us without PDL). Shared
# memory just over 1/(CTAS_PER_SM + 1) of an SM (with each CTA's reserve) caps residency at
# CTAS_PER_SM.
_BALANCED_SMEM = sm.SMEM_PER_SM // (CTAS_PER_SM + 1) + sm.RESERVED_SMEM_PER_CTA
_SUM_SPLIT = 32  # grad_ape sum: warps per CTA, each summing every 32nd CTA partial


class WindowBackward(WindowKernel):
    def __init__(self, key) -> None:
        super().__init__(key)
        self.row_elems = self.C * self.D
        self.ape_partials = self.W * self.cvc * self.V  # grad_ape partials of a row of threads
        self.part_elems = self.E  # a CTA's partials in the workspace: grad_ape's (E) and more

    @cute.jit
    def scatter_into_zeros(self, rD: cute.Tensor):
        """rD (V, W), gradients rounded to their dtype, as torch's autograd delivers them:
        the gathered windows' backward adds each gradient into zeros, so a zero comes out
        +0, never -0. Adding +0 in the dtype does exactly that and nothing else; bf16 and
        fp16 add two at a time (one packed add per pair)."""
        if cutlass.const_expr(self.dtype is Float32):
            for k in cutlass.range_constexpr(self.W):
                for i in cutlass.range_constexpr(self.V):
                    rD[i, k] = cm.add_rn(rD[i, k], Float32(0.0))
        else:
            add_pair = (cute.arch.add_packed_bf16x2
                        if cutlass.const_expr(self.dtype is cutlass.BFloat16)
                        else cute.arch.add_packed_f16x2)
            zeros = (self.dtype(0.0), self.dtype(0.0))
            for k in cutlass.range_constexpr(self.W):
                for i in cutlass.range_constexpr(0, self.V, 2):
                    if cutlass.const_expr(i + 1 < self.V):
                        rD[i, k], rD[i + 1, k] = add_pair((rD[i, k], rD[i + 1, k]), zeros,
                                                          rnd="rn")
                    else:  # an odd vector's last element rides with a zero
                        rD[i, k], _ = add_pair((rD[i, k], self.dtype(0.0)), zeros, rnd="rn")

    @cute.jit
    def zero_vec(self, p_dst, off):
        rZ = cute.make_rmem_tensor((self.V,), self.dtype)
        rZ.fill(0.0)
        cute.autovec_copy(rZ, cute.make_tensor(p_dst + cute.assume(off, divby=self.V), self.V))

    @cute.jit
    def zero_chunk(self, p_gkv, p_gs, cu, cuc, num_segs, num_tokens, num_rows, slot, cv, s, u0,
                   u1):
        """Zeroes the never-consumed elements of tokens [slot*R, slot*R + R), column cv.

        (s, u0, u1): the segment row `slot` fell in (s < 0: none), which usually also
        holds the chunk and then spares a binary search.
        """
        if Int64(slot) * self.R < Int64(num_tokens):
            t_first = slot * self.R
            seg_end = t_first
            own_from = t_first
            prev_from = t_first
            if s >= 0 and u0 <= t_first and t_first < u1:  # noqa: PLR1716
                seg_end, own_from, prev_from = segments.segment_bounds(
                    cuc, s, u0, u1, num_tokens, num_rows, self.R)
            else:
                seg_end, own_from, prev_from = segments.token_bounds(
                    cu, cuc, num_segs, num_tokens, num_rows, t_first, self.R)
            for k in cutlass.range_constexpr(self.R):
                t = t_first + k
                if t < num_tokens:
                    if t >= seg_end:
                        seg_end, own_from, prev_from = segments.token_bounds(
                            cu, cuc, num_segs, num_tokens, num_rows, t, self.R)
                    base = Int64(t) * self.row_elems + cv * self.V
                    if t >= own_from:
                        self.zero_vec(p_gkv, base + (self.C - 1) * self.D)
                        self.zero_vec(p_gs, base + (self.C - 1) * self.D)
                    if cutlass.const_expr(self.C == 2):  # noqa: SIM102  (trace-time branch)
                        if t >= prev_from:
                            self.zero_vec(p_gkv, base)
                            self.zero_vec(p_gs, base)

    @cute.jit
    def row_grads(self, p_gout, p_kv, p_score, p_gkv, p_gs, sApe, sAcc, t0, first, n, cv, cvl,
                  tid):
        V, W = self.V, self.W
        rKV = cute.make_rmem_tensor((V, W), self.dtype)
        rS = cute.make_rmem_tensor((V, W), self.dtype)
        rG = cute.make_rmem_tensor((V,), self.dtype)
        g_off = cute.assume(Int64(n) * self.D + cv * V, divby=V)
        cute.autovec_copy(cute.make_tensor(p_gout + g_off, V), rG)
        self.load_window(p_kv, p_score, rKV, rS, t0, first, cv)
        self.window_grads(rKV, rS, rG, p_gkv, p_gs, sApe, sAcc, t0, first, cv, cvl, tid)

    @cute.jit
    def window_grads(self, rKV, rS, rG, p_gkv, p_gs, sApe, sAcc, t0, first, cv, cvl, tid):
        """A row's window gradients from its loaded window and its output gradient rG (the
        row dtype), stored; the window's grad_ape terms added to the thread's partials."""
        V, W = self.V, self.W
        rGKV = cute.make_rmem_tensor((V, W), self.dtype)
        rGS = cute.make_rmem_tensor((V, W), self.dtype)
        rGL = cute.make_rmem_tensor((V, W), Float32)
        for i in cutlass.range_constexpr(V):
            p, v = self.window_probs(rKV, rS, sApe, i, cvl, first)
            go = Float32(rG[i])
            # torch's softmax backward, operation for operation: t_k = RN(RN(go*v_k) * p_k),
            # sum = ((0 + t_0) + t_1) + ... (one thread per column for windows < 64), then
            # its epilogue t_k - p_k * sum, which nvcc contracts into one FMA.
            t = [cm.mul_rn(cm.mul_rn(go, v[k]), p[k]) for k in range(W)]
            dot = Float32(0.0)
            for k in cutlass.range_constexpr(W):
                dot = cm.add_rn(dot, t[k])
            for k in cutlass.range_constexpr(W):
                gl = cm.fma_rn(-p[k], dot, t[k])
                rGKV[i, k] = self.dtype(cm.mul_rn(p[k], go))
                rGS[i, k] = self.dtype(gl)
                if cutlass.const_expr(self.entries[k][3]):
                    gl = cm.pick(first, Float32(0.0), gl)  # invalid entries feed no ape grad
                rGL[i, k] = gl
        # Once all V columns are done, each entry's V partials update in one vector access
        # (every partial adds the same values in the same order as one at a time).
        for k in cutlass.range_constexpr(W):
            rA = cute.make_rmem_tensor((V,), Float32)
            cute.autovec_copy(sAcc[(None, k), tid], rA)
            for i in cutlass.range_constexpr(V):
                rA[i] = cm.add_rn(rA[i], rGL[i, k])
            cute.autovec_copy(rA, sAcc[(None, k), tid])
        self.scatter_into_zeros(rGKV)
        self.scatter_into_zeros(rGS)
        self.store_window(p_gkv, rGKV, t0, first, cv)
        self.store_window(p_gs, rGS, t0, first, cv)

    @cute.kernel
    def kernel(self, p_gout, p_kv, p_score, p_ape, p_cu, p_cuc, p_gkv, p_gs, p_work,
               num_tokens: Int32, num_rows: Int32, num_segs: Int32):
        cm.await_upstream(self.pdl)
        tid, _, _ = cute.arch.thread_idx()
        bx, by, gx = self.cta_coords()
        cvl = tid % self.cvc
        cv = by * self.cvc + cvl
        cu, cuc = self.call_offsets(p_cu, p_cuc, num_segs, num_rows)
        smem = SmemAllocator()
        sApe = smem.allocate_tensor(Float32, self.ape_layout(), 16)
        sAcc = self.ape_accumulators(smem, tid)
        self.stage_ape(p_ape, sApe, by, tid)
        num_slots = cutlass.max((num_tokens + (self.R - 1)) // self.R, num_rows)
        if not self.ragged_cols or cv < self.tpr:
            for slot in cutlass.range(bx * self.rpc + tid // self.cvc, num_slots,
                                      gx * self.rpc):
                seg = Int32(-1)
                u0 = Int32(0)
                u1 = Int32(0)
                if slot < num_rows:
                    valid, t0, first, seg, u0, u1 = segments.locate_row(
                        cu, cuc, num_segs, num_tokens, slot, self.R)
                    if valid:
                        self.row_grads(p_gout, p_kv, p_score, p_gkv, p_gs, sApe, sAcc, t0,
                                       first, slot, cv, cvl, tid)
                self.zero_chunk(p_gkv, p_gs, cu, cuc, num_segs, num_tokens, num_rows, slot, cv,
                                seg, u0, u1)
        cute.arch.sync_threads()
        self.write_ape_partial(sAcc, p_work, bx, by, gx, tid)

    @cute.jit
    def ape_accumulators(self, smem, tid):
        """The thread's grad_ape partials, zeroed: W vectors of V (one per window entry),
        contiguous, so a row adds into them with one 8- or 16-byte access per entry,
        conflict-free."""
        sAcc = smem.allocate_tensor(Float32, cute.make_layout(
            ((self.V, self.W), self.threads), stride=((1, self.threads * self.V), self.V)), 16)
        for j in cutlass.range(self.W * self.V):
            sAcc[(j % self.V, j // self.V), tid] = Float32(0.0)
        return sAcc

    @cute.jit
    def write_ape_partial(self, sAcc, p_work, bx, by, gx, tid):
        """Fixed-order sum over the CTA's rows of threads: one grad_ape partial per CTA, the
        first E of its part_elems in the workspace. After a barrier past the last row."""
        mWork = cute.make_tensor(p_work, gx * self.part_elems)
        beyond = self.part_elems - self.E  # the CTA's other partials (0: grad_ape's only)
        for e in cutlass.range(tid, self.ape_partials, self.threads):
            k = e // (self.cvc * self.V)
            c = e % (self.cvc * self.V)
            total = sAcc[(c % self.V, k), c // self.V]
            for r in cutlass.range(1, self.rpc, unroll=8):
                total = cm.add_rn(total, sAcc[(c % self.V, k), r * self.cvc + c // self.V])
            col = by * (self.cvc * self.V) + c
            if col < self.D:
                ape_row = k % self.R
                half = k // self.R
                mWork[(bx * self.R + ape_row) * self.row_elems + half * self.D + col
                      + bx * beyond] = total

    def smem_bytes(self, extra: int = 0) -> int:
        """ape's rows, the grad_ape partials, then ``extra`` bytes; padded to the balanced
        size (the balance knob)."""
        smem_bytes = (self.W * self.cvc * self.V + self.W * self.V * self.threads) * 4 + 64
        smem_bytes += extra
        return max(smem_bytes, _BALANCED_SMEM) if self.balance else smem_bytes

    @cute.jit
    def __call__(self, p_gout: cute.Pointer, p_kv: cute.Pointer, p_score: cute.Pointer,
                 p_ape: cute.Pointer, p_cu: cute.Pointer, p_cuc: cute.Pointer,
                 p_gkv: cute.Pointer, p_gs: cute.Pointer, p_gape: cute.Pointer,
                 p_work: cute.Pointer, num_tokens: Int32, num_rows: Int32, num_segs: Int32,
                 grid: Int32, stream: cuda.CUstream):
        self.kernel(p_gout, p_kv, p_score, p_ape, p_cu, p_cuc, p_gkv, p_gs, p_work, num_tokens,
                    num_rows, num_segs).launch(grid=self.launch_grid(grid),
                                               block=(self.threads, 1, 1),
                                               smem=self.smem_bytes(),
                                               stream=stream, use_pdl=self.pdl,
                                               min_blocks_per_mp=self.min_ctas,
                                               preferred_smem_carveout=100)
        launch_sum_parts(p_work, p_gape, grid, self.E, _SUM_SPLIT, self.pdl, stream)
