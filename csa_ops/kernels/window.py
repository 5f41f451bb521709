"""Register-window compressor kernels: the whole coff*ratio window of a row lives in registers.

Thread = (output row, vector of `vec` columns); a CTA is rows x column-vectors with ~128
contiguous bytes per row (window_plan.Geometry). Launches are programmatic dependent
launches (PDL) by default: CTAs can be resident before the previous grid ends and wait for
it before the first access.
Forward: one pass, padding and invalid rows written as zeros; bf16 takes a certified fast
softmax (_output_fast) with the exact one as the fallback of the columns it cannot certify.
Backward: a grid-stride loop over "slots"; slot i is row i (its window's grads, disjoint
stores) plus token chunk [i*ratio, (i+1)*ratio), whose never-consumed elements it zeroes.
grad_ape: per-thread fp32 partials in shared memory, a fixed-order CTA reduction to one partial
per CTA in the workspace, then reduce.py's fixed-order sum over the CTAs.
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
from cutlass import Float32, Int32, Int64, cute
from cutlass.memory import SmemAllocator

from ..config import TYPES, KernelKey
from . import common as cm
from .reduce import launch_sum_parts
from .window_plan import CTAS_PER_SM, Geometry

# The backward's grid-stride plan gives every CTA the same slots and assumes CTAS_PER_SM
# of them on each SM. A kernel light enough for more would let the block scheduler stack
# CTAs on the SMs that free up first (under PDL, while the previous grid drains) and leave
# others short, and the busiest SM sets the time (H200, r2 c2 d512: 93 us against 80 us
# without PDL). Shared memory just over 1/(CTAS_PER_SM + 1) of an SM (228 KiB on SM90 and
# SM100, 1 KiB of it reserved per CTA) caps residency at CTAS_PER_SM.
_BALANCED_SMEM = 228 * 1024 // (CTAS_PER_SM + 1) + 1024
_SUM_SPLIT = 32  # grad_ape sum: warps per CTA, each summing every 32nd CTA partial


class _Geometry(Geometry):
    """The CTA shape plus what the device code derives from the key at trace time."""

    def __init__(self, key: KernelKey) -> None:
        super().__init__(key)
        self.dtype = cm.dsl_type(key.dtype)
        knobs = key.knobs
        self.min_ctas, self.balance, self.pdl = knobs.min_ctas, knobs.balance, knobs.pdl
        self.linear, self.fast_exp = knobs.linear, knobs.fast_exp
        # exp(l - m) is kept scaled by 2**-shift so sum(e * v) cannot overflow before
        # max|v| does (W entries, each e <= 2**-shift).
        self.shift = max(0, math.ceil(math.log2(self.W)))
        # _output_fast's certificate: the error bound's coefficients over one output step
        # (at least 2**-p |out| for p significand bits), with a factor 2 margin.
        step = 2.0 ** (TYPES[key.dtype].precision + 1)
        self.cert_mag = step * 2.0**-24 * (4 * self.W + 40)
        self.cert_mag_d = step * 2.0**-24 * 6
        self.cert_flush = step * 2.0**-126
        # Window entry k: (token offset from t0, column offset, ape offset, needs block b-1).
        self.entries = []
        for k in range(self.W):
            if self.C == 1:
                self.entries.append((k, 0, k * self.D, False))
            elif k < self.R:
                self.entries.append((k - self.R, 0, k * 2 * self.D, True))
            else:
                self.entries.append((k - self.R, self.D, (k - self.R) * 2 * self.D + self.D, False))


# ---------------------------------------------------------------------------------------
# Device code


def _window_logits(g, logit, first):
    """(logits, their max) of one column from logit(k), the fp32 logit of window entry k.
    Entries of block b-1 of a first block are the reference's constants: logit -inf."""
    logits = []
    for k in range(g.W):
        lk = logit(k)
        if g.entries[k][3]:
            lk = cm.pick(first, Float32(float("-inf")), lk)
        logits.append(lk)
    m = logits[0]
    for k in range(1, g.W):
        m = cm.max_nan(m, logits[k])
    return logits, m


def _logits(g, rS, sApe, i, cvl, first):
    """_window_logits of column i: score + ape, as the reference adds them."""
    return _window_logits(g, lambda k: cm.add_rn(Float32(rS[i, k]), sApe[k, cvl * g.V + i]),
                          first)


def _softmax(g, logits, m, value):
    """(probabilities, values) of one column in the reference's exact operation order;
    value(k) is entry k's fp32 value."""
    rE = cute.make_rmem_tensor((g.W,), Float32)
    rP = cute.make_rmem_tensor((g.W,), Float32)
    for k in range(g.W):
        rE[k] = cm.exp_accurate(cm.sub_rn(logits[k], m))
    s = rE[0]
    for k in range(1, g.W):
        s = cm.add_rn(s, rE[k])
    cm.divide_into(rE, rP, s, g.W)
    p = [rP[k] for k in range(g.W)]
    v = [value(k) for k in range(g.W)]
    return p, v


def _probs(g, rKV, rS, sApe, i, cvl, first):
    """Softmax over the window for column i, in the reference's exact operation order."""
    logits, m = _logits(g, rS, sApe, i, cvl, first)
    return _softmax(g, logits, m, lambda k: Float32(rKV[i, k]))


def _pool_exact(g, p, v):
    """Bit for bit torch's eager (kvg * w).sum(dim=1) on CUDA: RN(p_k * v_k) summed in the
    order of torch's reduction kernel."""
    return cm.torch_sum([cm.mul_rn(p[k], v[k]) for k in range(g.W)])


def _output_exact(g, rKV, rS, sApe, i, cvl, first):
    """Output column i, bit for bit torch's eager region on CUDA."""
    return _pool_exact(g, *_probs(g, rKV, rS, sApe, i, cvl, first))


def _output_fast(g, rKV, rS, sApe, i, cvl, first):
    """_pool_fast of column i."""
    logits, m = _logits(g, rS, sApe, i, cvl, first)
    return _pool_fast(g, logits, m, lambda k: Float32(rKV[i, k]), first)


@cute.jit
def pool_columns(g, rO, fast, exact):
    """rO[i] = output column i in the key's dtype, i < V: fast(i) -> (value, certified)
    where the key takes the fast softmax and its certificate holds, else exact(i) -> value
    (rare under fast_exp: a cancelling column, NaN or infinity). The forward and the extend
    kernel's rows pool through here, so their bits agree by construction."""
    for i in cutlass.range_constexpr(g.V):
        if cutlass.const_expr(g.fast_exp):
            res, certified = fast(i)
            if not certified:
                res = exact(i)
            rO[i] = g.dtype(res)
        else:
            rO[i] = g.dtype(exact(i))


def _pool_fast(g, logits, m, value, first):
    """(output column, certified): sum(e_k * v_k) / sum(e_k) with e_k = 2**x_k by
    ex2.approx, x_k = (l_k - m) * log2(e) - shift: about half the exact path's instructions
    (the forward is issue-bound at every shape).

    Certified means the result provably rounds to the exact path's output dtype value or
    a neighbour of it: the two fp32 results differ by at most
        u * ((4W + 40) * sum(e|v|) + 6 * sum(e|v||l - m|)) / s + 2**-126 * sum(|v|) / s
    (u = 2**-24: the exact path's expf, sums, division and products, ex2.approx's 2**-21
    and its argument's rounding, which grows with |l - m|, and the flush of tiny e); below
    one output step (at least 2**-p |out| for p significand bits) they cannot straddle two
    rounding boundaries. Columns that cancel (|out| far below sum(p|v|)), and any NaN or
    infinity, fail the test and take the exact path.
    """
    s = Float32(0.0)
    acc = Float32(0.0)
    mag = Float32(0.0)
    mag_d = Float32(0.0)
    vsum = Float32(0.0)
    for k in range(g.W):
        d = cm.sub_rn(logits[k], m)
        e = cute.math.exp2(d * cm.LOG2E - g.shift, fastmath=True)
        v = value(k)
        t = e * cute.math.absf(v)
        s = s + e
        acc = acc + e * v
        mag = mag + t
        if g.entries[k][3]:  # invalid entries: d = -inf, e = 0, v = 0
            mag_d = mag_d + cm.pick(first, Float32(0.0), t * cute.math.absf(d))
        else:
            mag_d = mag_d + t * cute.math.absf(d)
        vsum = vsum + cute.math.absf(v)
    bound = g.cert_mag * mag + g.cert_mag_d * mag_d + g.cert_flush * vsum
    certified = (cute.math.absf(acc) >= bound) & (bound < Float32(float("inf")))
    return acc / s, certified


@cute.jit
def _scatter_into_zeros(g, rD: cute.Tensor):
    """rD (V, W), gradients rounded to their dtype, as torch's autograd delivers them: the
    gathered windows' backward adds each gradient into zeros, so a zero comes out +0, never
    -0. Adding +0 in the dtype does exactly that and nothing else; bf16 and fp16 add two
    at a time (one packed add per pair)."""
    if cutlass.const_expr(g.dtype is Float32):
        for k in cutlass.range_constexpr(g.W):
            for i in cutlass.range_constexpr(g.V):
                rD[i, k] = cm.add_rn(rD[i, k], Float32(0.0))
    else:
        add_pair = (cute.arch.add_packed_bf16x2 if cutlass.const_expr(g.dtype is cutlass.BFloat16)
                    else cute.arch.add_packed_f16x2)
        zeros = (g.dtype(0.0), g.dtype(0.0))
        for k in cutlass.range_constexpr(g.W):
            for i in cutlass.range_constexpr(0, g.V, 2):
                if cutlass.const_expr(i + 1 < g.V):
                    rD[i, k], rD[i + 1, k] = add_pair((rD[i, k], rD[i + 1, k]), zeros, rnd="rn")
                else:  # an odd vector's last element rides with a zero
                    rD[i, k], _ = add_pair((rD[i, k], g.dtype(0.0)), zeros, rnd="rn")


def _ape_layout(g: _Geometry):
    # Row-major (W, cvc*V): stage_ape writes it through raw offsets, and a thread's V
    # columns of one entry are contiguous for vector reads. (make_layout defaults to
    # column-major.)
    return cute.make_layout((g.W, g.cvc * g.V), stride=(g.cvc * g.V, 1))


def _cta_grid(g: _Geometry):
    """(launch grid, coordinates helper) of a plan's `grid` CTAs per column chunk."""

    @cute.jit
    def coords():
        """(bx, by, gx): row-block index, column-chunk index, row blocks in the grid."""
        if cutlass.const_expr(g.linear):
            bid, _, _ = cute.arch.block_idx()
            nb, _, _ = cute.arch.grid_dim()
            return bid // g.ny, bid % g.ny, nb // g.ny
        bx, by, _ = cute.arch.block_idx()
        gx, _, _ = cute.arch.grid_dim()
        return bx, by, gx

    def launch_grid(grid):
        return (grid * g.ny, 1, 1) if g.linear else (grid, g.ny, 1)

    return coords, launch_grid


def _window_io(g: _Geometry):
    """Window load/store helpers for one geometry (closures: the DSL traces them inline)."""

    @cute.jit
    def load(p_kv, p_score, rKV, rS, t0, first, cv):
        # Entries of block b-1 of a first block read nothing: value 0 (the reference's).
        base = Int64(t0) * (g.C * g.D) + cv * g.V
        for k in cutlass.range_constexpr(g.W):
            tok, col, _, needs_prev = g.entries[k]
            off = cute.assume(base + (tok * g.C * g.D + col), divby=g.V)
            if cutlass.const_expr(needs_prev):
                if first:
                    for i in cutlass.range_constexpr(g.V):
                        rKV[i, k] = g.dtype(0.0)
                        rS[i, k] = g.dtype(0.0)
                else:
                    cute.autovec_copy(cute.make_tensor(p_kv + off, g.V), rKV[None, k])
                    cute.autovec_copy(cute.make_tensor(p_score + off, g.V), rS[None, k])
            else:
                cute.autovec_copy(cute.make_tensor(p_kv + off, g.V), rKV[None, k])
                cute.autovec_copy(cute.make_tensor(p_score + off, g.V), rS[None, k])

    @cute.jit
    def stage_ape(p_ape, sApe, by, tid):
        """The CTA's column chunk of ape, (W, cvc*V) fp32, into shared memory: thread
        (row r, column vector c) copies entries k = r, r + rpc, ... of vector c."""
        cvl = tid % g.cvc
        ry = tid // g.cvc
        cv = by * g.cvc + cvl
        if not g.ragged_cols or cv < g.tpr:
            for kk in cutlass.range_constexpr(-(-g.W // g.rpc)):
                k = ry + kk * g.rpc
                if k < g.W:
                    src = cute.assume(ape_base(k) + cv * g.V, divby=g.V)
                    dst = cute.assume(k * (g.cvc * g.V) + cvl * g.V, divby=g.V)
                    cute.autovec_copy(cute.make_tensor(p_ape + src, g.V),
                                      cute.make_tensor(sApe.iterator + dst, g.V))
        cute.arch.sync_threads()

    @cute.jit
    def store(p_dst, rD, t0, first, cv):
        base = Int64(t0) * (g.C * g.D) + cv * g.V
        for k in cutlass.range_constexpr(g.W):
            tok, col, _, needs_prev = g.entries[k]
            off = cute.assume(base + (tok * g.C * g.D + col), divby=g.V)
            dst = cute.make_tensor(p_dst + off, g.V)
            if cutlass.const_expr(needs_prev):
                if not first:
                    cute.autovec_copy(rD[None, k], dst)
            else:
                cute.autovec_copy(rD[None, k], dst)

    def ape_base(k):
        # ape row k % R, column half k // R (coff 2) of entry k, computed at run time.
        if cutlass.const_expr(g.C == 1):
            return k * g.D
        return (k % g.R) * (2 * g.D) + (k // g.R) * g.D

    return load, store, stage_ape


def _build_forward(key: KernelKey):
    g = _Geometry(key)
    load_window, _, stage_ape = _window_io(g)
    cta_coords, launch_grid = _cta_grid(g)

    @cute.kernel
    def kernel(p_kv, p_score, p_ape, p_cu, p_cuc, p_out, num_tokens: Int32, num_rows: Int32,
               num_segs: Int32):
        cm.await_upstream(g.pdl)
        tid, _, _ = cute.arch.thread_idx()
        bx, by, _ = cta_coords()
        cvl = tid % g.cvc
        cv = by * g.cvc + cvl
        n = bx * g.rpc + tid // g.cvc
        cu = cute.make_tensor(p_cu, num_segs + 1)
        cuc = cute.make_tensor(p_cuc, num_segs + 1)
        smem = SmemAllocator()
        sApe = smem.allocate_tensor(Float32, _ape_layout(g), 16)
        rKV = cute.make_rmem_tensor((g.V, g.W), g.dtype)
        rS = cute.make_rmem_tensor((g.V, g.W), g.dtype)
        active = n < num_rows and (not g.ragged_cols or cv < g.tpr)
        valid = cutlass.Boolean(False)
        first = cutlass.Boolean(False)
        if active:
            valid, t0, first, _, _, _ = cm.locate_row(cu, cuc, num_segs, num_tokens, n, g.R)
            if valid:
                # Issued before the ape barrier so the window's DRAM latency overlaps it.
                load_window(p_kv, p_score, rKV, rS, t0, first, cv)
        stage_ape(p_ape, sApe, by, tid)
        if active:
            rO = cute.make_rmem_tensor((g.V,), g.dtype)
            rO.fill(0.0)
            if valid:
                pool_columns(g, rO, lambda i: _output_fast(g, rKV, rS, sApe, i, cvl, first),
                             lambda i: _output_exact(g, rKV, rS, sApe, i, cvl, first))
            o_off = cute.assume(Int64(n) * g.D + cv * g.V, divby=g.V)
            cute.autovec_copy(rO, cute.make_tensor(p_out + o_off, g.V))

    @cute.jit
    def launch(p_kv: cute.Pointer, p_score: cute.Pointer, p_ape: cute.Pointer,
               p_cu: cute.Pointer, p_cuc: cute.Pointer, p_out: cute.Pointer,
               p_work: cute.Pointer, num_tokens: Int32, num_rows: Int32, num_segs: Int32,
               grid: Int32, stream: cuda.CUstream):
        kernel(p_kv, p_score, p_ape, p_cu, p_cuc, p_out, num_tokens, num_rows,
               num_segs).launch(grid=launch_grid(grid), block=(g.threads, 1, 1),
                                smem=g.W * g.cvc * g.V * 4 + 16, stream=stream,
                                use_pdl=g.pdl)

    return launch


def _build_backward(key: KernelKey):
    g = _Geometry(key)
    load_window, store_window, stage_ape = _window_io(g)
    cta_coords, launch_grid = _cta_grid(g)
    row_elems = g.C * g.D
    part = g.W * g.cvc * g.V  # grad_ape partials of one row of threads

    @cute.jit
    def zero_vec(p_dst, off):
        rZ = cute.make_rmem_tensor((g.V,), g.dtype)
        rZ.fill(0.0)
        cute.autovec_copy(rZ, cute.make_tensor(p_dst + cute.assume(off, divby=g.V), g.V))

    @cute.jit
    def zero_chunk(p_gkv, p_gs, cu, cuc, num_segs, num_tokens, num_rows, slot, cv, s, u0, u1):
        """Zeroes the never-consumed elements of tokens [slot*R, slot*R + R), column cv.

        (s, u0, u1): the segment row `slot` fell in (s < 0: none), which usually also
        holds the chunk and then spares a binary search.
        """
        if Int64(slot) * g.R < Int64(num_tokens):
            t_first = slot * g.R
            seg_end = t_first
            own_from = t_first
            prev_from = t_first
            if s >= 0 and u0 <= t_first and t_first < u1:  # noqa: PLR1716
                seg_end, own_from, prev_from = cm.segment_bounds(
                    cuc, s, u0, u1, num_tokens, num_rows, g.R)
            else:
                seg_end, own_from, prev_from = cm.token_bounds(
                    cu, cuc, num_segs, num_tokens, num_rows, t_first, g.R)
            for k in cutlass.range_constexpr(g.R):
                t = t_first + k
                if t < num_tokens:
                    if t >= seg_end:
                        seg_end, own_from, prev_from = cm.token_bounds(
                            cu, cuc, num_segs, num_tokens, num_rows, t, g.R)
                    base = Int64(t) * row_elems + cv * g.V
                    if t >= own_from:
                        zero_vec(p_gkv, base + (g.C - 1) * g.D)
                        zero_vec(p_gs, base + (g.C - 1) * g.D)
                    if cutlass.const_expr(g.C == 2):  # noqa: SIM102  (trace-time branch)
                        if t >= prev_from:
                            zero_vec(p_gkv, base)
                            zero_vec(p_gs, base)

    @cute.jit
    def row_grads(p_gout, p_kv, p_score, p_gkv, p_gs, sApe, sAcc, t0, first, n, cv, cvl, tid):
        rKV = cute.make_rmem_tensor((g.V, g.W), g.dtype)
        rS = cute.make_rmem_tensor((g.V, g.W), g.dtype)
        rG = cute.make_rmem_tensor((g.V,), g.dtype)
        g_off = cute.assume(Int64(n) * g.D + cv * g.V, divby=g.V)
        cute.autovec_copy(cute.make_tensor(p_gout + g_off, g.V), rG)
        load_window(p_kv, p_score, rKV, rS, t0, first, cv)
        rGKV = cute.make_rmem_tensor((g.V, g.W), g.dtype)
        rGS = cute.make_rmem_tensor((g.V, g.W), g.dtype)
        rGL = cute.make_rmem_tensor((g.V, g.W), Float32)
        for i in cutlass.range_constexpr(g.V):
            p, v = _probs(g, rKV, rS, sApe, i, cvl, first)
            go = Float32(rG[i])
            # torch's softmax backward, operation for operation: t_k = RN(RN(go*v_k) * p_k),
            # sum = ((0 + t_0) + t_1) + ... (one thread per column for windows < 64), then
            # its epilogue t_k - p_k * sum, which nvcc contracts into one FMA.
            t = [cm.mul_rn(cm.mul_rn(go, v[k]), p[k]) for k in range(g.W)]
            dot = Float32(0.0)
            for k in cutlass.range_constexpr(g.W):
                dot = cm.add_rn(dot, t[k])
            for k in cutlass.range_constexpr(g.W):
                gl = cm.fma_rn(-p[k], dot, t[k])
                rGKV[i, k] = g.dtype(cm.mul_rn(p[k], go))
                rGS[i, k] = g.dtype(gl)
                if cutlass.const_expr(g.entries[k][3]):
                    gl = cm.pick(first, Float32(0.0), gl)  # invalid entries feed no ape grad
                rGL[i, k] = gl
        # Once all V columns are done, each entry's V partials update in one vector access
        # (every partial adds the same values in the same order as one at a time).
        for k in cutlass.range_constexpr(g.W):
            rA = cute.make_rmem_tensor((g.V,), Float32)
            cute.autovec_copy(sAcc[(None, k), tid], rA)
            for i in cutlass.range_constexpr(g.V):
                rA[i] = cm.add_rn(rA[i], rGL[i, k])
            cute.autovec_copy(rA, sAcc[(None, k), tid])
        _scatter_into_zeros(g, rGKV)
        _scatter_into_zeros(g, rGS)
        store_window(p_gkv, rGKV, t0, first, cv)
        store_window(p_gs, rGS, t0, first, cv)

    @cute.kernel
    def kernel(p_gout, p_kv, p_score, p_ape, p_cu, p_cuc, p_gkv, p_gs, p_work,
               num_tokens: Int32, num_rows: Int32, num_segs: Int32):
        cm.await_upstream(g.pdl)
        tid, _, _ = cute.arch.thread_idx()
        bx, by, gx = cta_coords()
        cvl = tid % g.cvc
        cv = by * g.cvc + cvl
        cu = cute.make_tensor(p_cu, num_segs + 1)
        cuc = cute.make_tensor(p_cuc, num_segs + 1)
        smem = SmemAllocator()
        sApe = smem.allocate_tensor(Float32, _ape_layout(g), 16)
        # Each thread owns W vectors of V partials (one per window entry), contiguous, so
        # a row adds into them with one 8- or 16-byte access per entry, conflict-free.
        sAcc = smem.allocate_tensor(Float32, cute.make_layout(
            ((g.V, g.W), g.threads), stride=((1, g.threads * g.V), g.V)), 16)
        for j in cutlass.range(g.W * g.V):
            sAcc[(j % g.V, j // g.V), tid] = Float32(0.0)
        stage_ape(p_ape, sApe, by, tid)
        num_slots = cutlass.max((num_tokens + (g.R - 1)) // g.R, num_rows)
        if not g.ragged_cols or cv < g.tpr:
            for slot in cutlass.range(bx * g.rpc + tid // g.cvc, num_slots, gx * g.rpc):
                seg = Int32(-1)
                u0 = Int32(0)
                u1 = Int32(0)
                if slot < num_rows:
                    valid, t0, first, seg, u0, u1 = cm.locate_row(cu, cuc, num_segs,
                                                                  num_tokens, slot, g.R)
                    if valid:
                        row_grads(p_gout, p_kv, p_score, p_gkv, p_gs, sApe, sAcc, t0, first,
                                  slot, cv, cvl, tid)
                zero_chunk(p_gkv, p_gs, cu, cuc, num_segs, num_tokens, num_rows, slot, cv,
                           seg, u0, u1)
        cute.arch.sync_threads()
        # Fixed-order sum over the CTA's rows of threads: one partial per CTA.
        mWork = cute.make_tensor(p_work, gx * g.E)
        for e in cutlass.range(tid, part, g.threads):
            k = e // (g.cvc * g.V)
            c = e % (g.cvc * g.V)
            total = sAcc[(c % g.V, k), c // g.V]
            for r in cutlass.range(1, g.rpc, unroll=8):
                total = cm.add_rn(total, sAcc[(c % g.V, k), r * g.cvc + c // g.V])
            col = by * (g.cvc * g.V) + c
            if col < g.D:
                ape_row = k % g.R
                half = k // g.R
                mWork[(bx * g.R + ape_row) * row_elems + half * g.D + col] = total

    @cute.jit
    def launch(p_gout: cute.Pointer, p_kv: cute.Pointer, p_score: cute.Pointer,
               p_ape: cute.Pointer, p_cu: cute.Pointer, p_cuc: cute.Pointer,
               p_gkv: cute.Pointer, p_gs: cute.Pointer, p_gape: cute.Pointer,
               p_work: cute.Pointer, num_tokens: Int32, num_rows: Int32, num_segs: Int32,
               grid: Int32, stream: cuda.CUstream):
        smem_bytes = (g.W * g.cvc * g.V + g.W * g.V * g.threads) * 4 + 64
        if cutlass.const_expr(g.balance):
            smem_bytes = max(smem_bytes, _BALANCED_SMEM)
        kernel(p_gout, p_kv, p_score, p_ape, p_cu, p_cuc, p_gkv, p_gs, p_work, num_tokens,
               num_rows, num_segs).launch(grid=launch_grid(grid), block=(g.threads, 1, 1),
                                          smem=smem_bytes, stream=stream, use_pdl=g.pdl,
                                          min_blocks_per_mp=g.min_ctas,
                                          preferred_smem_carveout=100)
        launch_sum_parts(p_work, p_gape, grid, g.E, _SUM_SPLIT, g.pdl, stream)

    return launch


def launch_entry(key: KernelKey, backward: bool):
    """The `@cute.jit` launch entry of one direction; its arguments are host.ARGUMENTS."""
    return _build_backward(key) if backward else _build_forward(key)
