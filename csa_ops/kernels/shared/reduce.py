"""Fixed-order sum of per-CTA fp32 partials: the grad_ape kernel of both families' backward.

Summation order, the same for every element e and every run (bitwise deterministic, no
atomics): out[e] = S_0 + S_1 + ... + S_{split-1}, added left to right, where warp w's
S_w = ((+0.0 + x_w) + x_{w+split}) + x_{w+2 split} + ... over the parts x_p = work[p * size
+ e], p < num_parts. Every add is IEEE round-to-nearest-even (common.add_rn). The order
depends on num_parts (the launch plan's grid) and `split`, both fixed for a key and shape.
"""

from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, cute
from cutlass.memory import SmemAllocator

from . import common as cm

_UNROLL = 16  # a lane's parts whose loads issue together (see _sum_parts)


@cute.kernel
def _sum_parts(p_work: cute.Pointer, p_out: cute.Pointer, p_tail: cute.Pointer,
               num_parts: Int32, size: cutlass.Constexpr[int], head: cutlass.Constexpr[int],
               split: cutlass.Constexpr[int], pdl: cutlass.Constexpr[bool]):
    # CTA = split warps over 32 consecutive elements (one per lane), each warp reading 128
    # contiguous bytes per part. The loop unrolls by _UNROLL so that many of a lane's loads
    # are in flight before its first add waits (the adds' order is the loop's either way):
    # a few hundred parts then take two or three memory latencies, not one per 4 parts.
    cm.await_upstream(pdl)
    tid, _, _ = cute.arch.thread_idx()
    bx, _, _ = cute.arch.block_idx()
    lane = tid % 32
    w = tid // 32
    e = bx * 32 + lane
    mWork = cute.make_tensor(p_work, num_parts * size)
    mOut = cute.make_tensor(p_out, head)
    smem = SmemAllocator()
    sPart = smem.allocate_tensor(Float32, cute.make_layout((split, 32), stride=(32, 1)), 16)
    total = Float32(0.0)
    if e < size:
        for x in cutlass.range(w, num_parts, split, unroll=_UNROLL):
            total = cm.add_rn(total, mWork[x * size + e])
    sPart[w, lane] = total
    cute.arch.sync_threads()
    if w == 0 and e < size:
        total = sPart[0, lane]
        for j in cutlass.range_constexpr(1, split):
            total = cm.add_rn(total, sPart[j, lane])
        if e < head:  # always, without a tail
            mOut[e] = total
        else:
            cute.make_tensor(p_tail, size - head)[e - head] = total


def launch_sum_parts(p_work: cute.Pointer, p_out: cute.Pointer, num_parts: Int32, size: int,
                     split: int, pdl: bool, stream, tail: tuple | None = None) -> None:
    """out[0:size] = the fixed-order sum of num_parts partials work[p * size : (p+1) * size].
    With ``tail = (p_tail, n)``, two outputs in one launch: out takes the first size - n
    sums and p_tail the last n (each part holds both outputs' partials, one after the other).

    Called while tracing a family's `@cute.jit` entry, after the kernel writing `work`.
    """
    p_tail, head = (p_out, size) if tail is None else (tail[0], size - tail[1])
    _sum_parts(p_work, p_out, p_tail, num_parts, size, head, split, pdl).launch(
        grid=((size + 31) // 32, 1, 1), block=(32 * split, 1, 1), smem=split * 32 * 4 + 64,
        stream=stream, use_pdl=pdl)
