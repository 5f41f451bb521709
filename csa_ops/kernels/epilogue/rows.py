"""The row epilogue's steps, shared by its kernels: RMSNorm, RoPE at a row's position and
the Hadamard rotation of one pooled row per CTA, in the strided layout (plan.py).

Every step is the reference's operation for operation (csa_ops/reference_epilogue.py): fp32
arithmetic with each product and sum rounded on its own (common.*_rn: no contracted FMA),
the mean's pairwise tree in its column order, the correctly rounded square root and
division, and a rounding to the row dtype after each step. So a row is bitwise the
composition's.
"""

from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, Int64, cute
from cutlass._mlir_helpers.math import RoundingMode
from cutlass.memory import SmemAllocator

from ..shared import common as cm
from .plan import EpilogueKey


def halvings(n: int) -> tuple[int, ...]:
    """n/2, n/4, ..., 1 (n a power of two)."""
    return tuple(n >> s for s in range(1, n.bit_length()))


def doublings(n: int) -> tuple[int, ...]:
    """1, 2, ..., n/2 (n a power of two)."""
    return tuple(reversed(halvings(n)))


class RowEpilogue:
    """The base of the row-epilogue kernels: one compiled configuration (an EpilogueKey),
    every attribute a compile-time constant. A CTA of `threads` threads owns one row."""

    def __init__(self, key: EpilogueKey) -> None:
        self.key = key
        self.dtype = cm.dsl_type(key.dtype)
        self.weight_dtype = cm.dsl_type(key.weight_dtype)
        self.D, self.T, self.V = key.head_dim, key.threads, key.vec
        self.rope_dim, self.rotate = key.rope_dim, key.rotate
        self.pdl = key.pdl
        self.eps = key.eps
        self.rotate_scale = key.head_dim**-0.5
        # Compile-time step lists: in-thread halvings of the mean's tree and its lane
        # halvings; the rotation's lane strides and in-thread strides.
        self.tree_widths = halvings(self.V)
        self.tree_lanes = halvings(self.T)
        self.lane_strides = doublings(self.T)
        self.thread_strides = doublings(self.V)

    # ------------------------------------------------------------ cross-thread exchanges
    @cute.jit
    def partners(self, rX: cute.Tensor, stride: cutlass.Constexpr[int], sX: cute.Tensor,
                 tid: Int32) -> cute.Tensor:
        """Thread tid ^ stride's V values: shuffles inside a warp, else all V through shared
        memory at once (two barriers per stride, not per value)."""
        rO = self.row_registers()
        if cutlass.const_expr(stride < 32):
            for k in cutlass.range_constexpr(self.V):
                rO[k] = cute.arch.shuffle_sync_bfly(rX[k], offset=stride)
        else:
            for k in cutlass.range_constexpr(self.V):
                sX[tid + k * self.T] = rX[k]
            cute.arch.sync_threads()
            for k in cutlass.range_constexpr(self.V):
                rO[k] = sX[(tid ^ stride) + k * self.T]
            cute.arch.sync_threads()
        return rO

    @cute.jit
    def row_sum(self, values: cute.Tensor, sX: cute.Tensor, tid: Int32) -> Float32:
        """The pairwise tree of reference_epilogue.row_mean over the strided row (column j
        plus column j + w/2, w halving from head_dim), on every thread. The tree's levels
        between warps (lane strides of 32 and up) go through shared memory once: each
        thread reads the partial sums of its lane in every warp and adds them in the
        tree's order itself, so one barrier publishes them and none broadcasts the root.
        The levels inside a warp are butterflies: x + y on one lane, y + x on its partner,
        the same value, so every lane ends with the root."""
        for step in cutlass.range_constexpr(len(self.tree_widths)):
            width = self.tree_widths[step]
            for k in cutlass.range_constexpr(width):
                values[k] = cm.add_rn(values[k], values[k + width])
        total = values[0]
        warps = self.T // 32
        if cutlass.const_expr(warps > 1):
            sX[tid] = total
            cute.arch.sync_threads()
            rP = cute.make_rmem_tensor((warps,), Float32)
            for m in cutlass.range_constexpr(warps):
                rP[m] = sX[tid % 32 + 32 * m]
            for width in cutlass.range_constexpr(len(halvings(warps))):
                half = halvings(warps)[width]
                for m in cutlass.range_constexpr(half):
                    rP[m] = cm.add_rn(rP[m], rP[m + half])
            total = rP[0]
            cute.arch.sync_threads()  # every read is done before sX is written again
        for step in cutlass.range_constexpr(len(self.tree_lanes)):
            stride = self.tree_lanes[step]
            if cutlass.const_expr(stride < 32):
                total = cm.add_rn(total, cute.arch.shuffle_sync_bfly(total, offset=stride))
        return total

    def mean(self, total: Float32) -> Float32:
        """total / head_dim, correctly rounded: head_dim is a power of two, so the product
        with its exact reciprocal is the same number as the division."""
        return cm.mul_rn(total, Float32(1.0 / self.D))

    # ------------------------------------------------------------ the epilogue steps
    @cute.jit
    def to_dtype(self, x: Float32) -> Float32:
        return Float32(self.dtype(x))

    @cute.jit
    def inverse_rms(self, rX: cute.Tensor, sX: cute.Tensor, tid: Int32) -> Float32:
        """1 / sqrt(mean(x^2) + eps) of the strided row, on every thread: the correctly
        rounded root, then an IEEE division (reference_epilogue.inverse_rms)."""
        rSq = cute.make_rmem_tensor((self.V,), Float32)
        for k in cutlass.range_constexpr(self.V):
            rSq[k] = cm.mul_rn(rX[k], rX[k])
        mean = self.mean(self.row_sum(rSq, sX, tid))
        root = cute.math.sqrt(cm.add_rn(mean, Float32(self.eps)),
                              rounding=RoundingMode.NEAREST_EVEN)
        return cm.div_rn(Float32(1.0), root)

    @cute.jit
    def rms_norm(self, rX: cute.Tensor, rWeight: cute.Tensor, sX: cute.Tensor, tid: Int32):
        inverse = self.inverse_rms(rX, sX, tid)
        for k in cutlass.range_constexpr(self.V):
            rX[k] = self.to_dtype(cm.mul_rn(cm.mul_rn(rX[k], inverse), rWeight[k]))

    @cute.jit
    def rope(self, rX: cute.Tensor, angles, tid: Int32,
             transpose: cutlass.Constexpr[bool] = False):
        """GPT-J pairs (2i, 2i+1) of the last rope_dim columns: neighbouring lanes, turned by
        ``angles`` (load_angles). ``transpose`` turns them back (the backward)."""
        rCos, rSin = angles
        odd = (tid & 1) == 1
        for k in cutlass.range_constexpr(self.V):
            partner = cute.arch.shuffle_sync_bfly(rX[k], offset=1)
            if self.rope_column(tid, k):
                c, s = rCos[k], rSin[k]
                x = rX[k]
                if cutlass.const_expr(transpose):
                    if odd:  # odd * cos - even * sin
                        rX[k] = self.to_dtype(cm.sub_rn(cm.mul_rn(x, c), cm.mul_rn(partner, s)))
                    else:  # even * cos + odd * sin
                        rX[k] = self.to_dtype(cm.add_rn(cm.mul_rn(x, c), cm.mul_rn(partner, s)))
                else:
                    if odd:  # even * sin + odd * cos
                        rX[k] = self.to_dtype(cm.add_rn(cm.mul_rn(partner, s), cm.mul_rn(x, c)))
                    else:  # even * cos - odd * sin
                        rX[k] = self.to_dtype(cm.sub_rn(cm.mul_rn(x, c), cm.mul_rn(partner, s)))

    @cute.jit
    def hadamard(self, rX: cute.Tensor, sX: cute.Tensor, tid: Int32):
        """Butterflies of stride 1, 2, ..., head_dim / 2 (low + high, low - high), then the
        scale d**-0.5 in fp32: across lanes while the stride is below `threads`."""
        for s in cutlass.range_constexpr(len(self.lane_strides)):
            stride = self.lane_strides[s]
            high = (tid & stride) != 0
            rO = self.partners(rX, stride, sX, tid)
            for k in cutlass.range_constexpr(self.V):
                rX[k] = cm.pick(high, cm.sub_rn(rO[k], rX[k]), cm.add_rn(rX[k], rO[k]))
        for s in cutlass.range_constexpr(len(self.thread_strides)):
            step = self.thread_strides[s]
            for k in cutlass.range_constexpr(self.V):
                if cutlass.const_expr(k & step == 0):
                    low, high_value = rX[k], rX[k + step]
                    rX[k] = cm.add_rn(low, high_value)
                    rX[k + step] = cm.sub_rn(low, high_value)
        for k in cutlass.range_constexpr(self.V):
            rX[k] = self.to_dtype(cm.mul_rn(rX[k], Float32(self.rotate_scale)))

    # ------------------------------------------------------------ operand loads
    # Each only issues its loads: a kernel issues every load of a row that it can address
    # before the first instruction that waits (its row lookup, a barrier), so that their
    # latencies overlap instead of adding up.
    def rope_column(self, tid: Int32, k: int):
        """Whether this thread's k-th strided column is a RoPE column."""
        return tid + k * self.T >= self.D - self.rope_dim

    @cute.jit
    def strided(self, rO: cute.Tensor, sRow: cute.Tensor, tid: Int32) -> cute.Tensor:
        """The strided fp32 registers of a row the threads hold contiguously (thread t:
        columns [t * vec, (t + 1) * vec) in the row dtype, as a pooling kernel leaves them),
        through sRow, which is free again on return."""
        for k in cutlass.range_constexpr(self.V):
            sRow[tid * self.V + k] = Float32(rO[k])
        cute.arch.sync_threads()
        rX = self.row_registers()
        for k in cutlass.range_constexpr(self.V):
            rX[k] = sRow[tid + k * self.T]
        cute.arch.sync_threads()  # the epilogue's exchanges reuse sRow
        return rX

    @cute.jit
    def contiguous(self, rX: cute.Tensor, rO: cute.Tensor, sRow: cute.Tensor, tid: Int32):
        """strided's inverse: rO (vec elements of the row dtype) <- the thread's contiguous
        columns of strided rX (values of the row dtype), through sRow, which is free on
        entry and again on return."""
        for k in cutlass.range_constexpr(self.V):
            sRow[tid + k * self.T] = rX[k]
        cute.arch.sync_threads()
        for k in cutlass.range_constexpr(self.V):
            rO[k] = self.dtype(sRow[tid * self.V + k])
        cute.arch.sync_threads()  # sRow is read before the next row writes it

    def row_registers(self) -> cute.Tensor:
        return cute.make_rmem_tensor((self.V,), Float32)

    @cute.jit
    def fill_row(self, rX: cute.Tensor, p_rows, n, tid: Int32):
        """rX <- row n of a packed (rows, head_dim) tensor of the row dtype, strided, in
        fp32."""
        row = cute.make_tensor(p_rows + Int64(n) * self.D, self.D)
        for k in cutlass.range_constexpr(self.V):
            rX[k] = Float32(row[tid + k * self.T])

    @cute.jit
    def load_row(self, p_rows, n, tid: Int32) -> cute.Tensor:
        rX = self.row_registers()
        self.fill_row(rX, p_rows, n, tid)
        return rX

    @cute.jit
    def load_weight(self, p_weight, tid: Int32) -> cute.Tensor:
        """The norm weight's strided columns, in fp32."""
        weight = cute.make_tensor(p_weight, self.D)
        rWeight = self.row_registers()
        for k in cutlass.range_constexpr(self.V):
            rWeight[k] = Float32(weight[tid + k * self.T])
        return rWeight

    def angle_registers(self):
        """(cos, sin) registers for load_angles (zeros: columns without RoPE never read)."""
        rCos, rSin = self.row_registers(), self.row_registers()
        rCos.fill(0.0)
        rSin.fill(0.0)
        return rCos, rSin

    @cute.jit
    def load_angles(self, angles, p_cos, p_sin, position: Int64, table_rows: Int32,
                    tid: Int32):
        """angles <- (cos, sin) of this thread's RoPE columns at ``position``, clamped into
        the tables as the reference's lookup is."""
        if cutlass.const_expr(self.rope_dim > 0):
            rCos, rSin = angles
            half = self.rope_dim // 2
            table_row = cutlass.min(cutlass.max(position, Int64(0)), Int64(table_rows) - 1)
            cos = cute.make_tensor(p_cos + table_row * half, half)
            sin = cute.make_tensor(p_sin + table_row * half, half)
            for k in cutlass.range_constexpr(self.V):
                if self.rope_column(tid, k):
                    pair = (tid + k * self.T - (self.D - self.rope_dim)) // 2
                    rCos[k] = cos[pair]
                    rSin[k] = sin[pair]

    def smem_bytes(self) -> int:
        """Dynamic shared memory of a CTA: the row's fp32 buffer (cta), then what
        the kernel allocates after it (each buffer with its alignment's slack)."""
        return self.D * 4 + 16

    @cute.jit
    def cta(self):
        """(thread, CTA, the row's fp32 shared-memory buffer, the allocator of the rest of
        smem_bytes). Before the PDL wait for the pooling kernel (common.await_upstream),
        which each kernel places before its first read of what that kernel writes."""
        tid, _, _ = cute.arch.thread_idx()
        n, _, _ = cute.arch.block_idx()
        smem = SmemAllocator()
        sRow = smem.allocate_tensor(Float32, cute.make_layout(self.D), 16)
        return tid, n, sRow, smem

    @cute.jit
    def finish_row(self, rX: cute.Tensor, rWeight: cute.Tensor, angles, sRow: cute.Tensor,
                   tid: Int32):
        """rX (a pooled row, strided) <- after RMSNorm, RoPE by ``angles`` and the rotation,
        in the row dtype's values."""
        self.rms_norm(rX, rWeight, sRow, tid)
        if cutlass.const_expr(self.rope_dim > 0):
            self.rope(rX, angles, tid)
        if cutlass.const_expr(self.rotate):
            self.hadamard(rX, sRow, tid)
