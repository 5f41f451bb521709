"""The second launch of a split csa::compressor_extend_store call (a prefill, or a batch
that mixes one with decode requests; register-window family): the rows past each request's
head rows, pooled where the epilogue's CTA runs and taken straight through the row epilogue
into the paged cache.

Apart, a prefill is the extend kernel's two launches (the requests' items, the row items),
which write packed rows, and the store kernel (kernels/epilogue/store.py), which waits for
both before it reads them back and spends most of its time finding each row's request and
page again. Here the first launch is the decode step's kernel for the head rows and states
only (extend_store.py, head_rows_only), and this one pools every other row as the extend
kernel's row items do (the forward's softmax: the same bits) and finishes and encodes it as
the store kernel does, so the cache holds the three launches' bytes. Its rows read only new
tokens and it writes only their cache rows, none of which the first launch reads or writes,
so it starts without waiting for that launch (PDL), as the extend kernel's row items do.

A CTA takes ceil(rows / CTAs) consecutive rows (plan.plan_row_share: one wave of the CTAs
an SM its launch bound keeps resident), and its threads look them up at once, a thread a
row: the request, the block, the window's first token and the cache row. With at most 32
requests (lane_requests) each warp holds the batch in its lanes and finds a row's request
by shuffles; with more, the CTA scans the batch's row counts once for all its rows, as the
extend kernel's row items do. Each row's window and angles are loaded while the row before
it is pooled and finished. Every branch around a barrier depends on the row only, the same
for all threads.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import Float32, Int32, Int64, cute
from cutlass.memory import SmemAllocator

from ..epilogue.store import LOOKUP_REQUESTS, RowEpilogueStore
from ..shared import common as cm
from ..shared import requests
from .forward_epilogue import RowFlag, WindowForwardEpilogue
from .plan import RowsStoreKey


class WindowRowsStore(WindowForwardEpilogue):
    epilogue_kernel = RowEpilogueStore

    def __init__(self, key: RowsStoreKey) -> None:
        super().__init__(key)
        self.lanes = key.rows.knobs.lane_requests
        self.batch = requests.Batch(self.R, self.threads, max(
            requests.COUNTS_AHEAD, min(8, LOOKUP_REQUESTS // self.threads)))

    def smem_bytes(self) -> int:
        # ape's rows, the row's buffer, then the looked-up rows' cache offsets (two int64),
        # positions (int64), first tokens, flags, requests and first rows (int32), a
        # thread's row each, and the scan's warp sums.
        return (self.W * self.D + self.D) * 4 + 40 * self.threads + 4 * (self.threads // 32) + 64

    @cute.jit
    def locate(self, cu, starts, slots, n: Int32, begin: Int32, end: Int32,
               num_reqs: Int32, num_tokens: Int32, num_slots: Int32, sReq, sBase, sWarp,
               tid: Int32):
        """(found, first row, ok, first token, start, rows, request) of the request whose
        rows hold row n, this thread's (found: one does). With at most 32 requests each
        warp holds the batch in its lanes (shuffles); else the CTA scans the batch's row
        counts, as the extend kernels place their rows, and marks its rows' requests in
        sReq and sBase (barriers). Every thread takes part."""
        if cutlass.const_expr(self.lanes):
            held = self.batch.hold_in_lanes(cu, starts, slots, num_reqs, num_tokens,
                                            num_slots, tid % 32)
            return self.batch.lane_of_row(n, held)
        sReq[tid] = Int32(-1)  # published by scan's barrier
        held = self.batch.run_counts(cu, starts, num_reqs, tid)
        b_lo, b_hi, running, _ = self.batch.scan(cu, starts, num_reqs, tid, sWarp, held)
        self.batch.place(cu, starts, num_reqs, b_lo, b_hi, running, held,
                         lambda b, first, rows: self.mark(sReq, sBase, b, first, rows, begin,
                                                          end))
        cute.arch.sync_threads()
        request = sReq[tid]
        first_row = sBase[tid]
        found = request >= 0
        ok, tok0, start, _, _, rows = self.batch.request(
            cu, starts, slots, cutlass.max(request, Int32(0)), num_tokens, num_slots)
        return found, first_row, ok, tok0, start, rows, request

    @cute.jit
    def mark(self, sReq, sBase, b, first, rows, begin: Int32, end: Int32):
        """Batch.place's visit: request b (rows [first, first + rows)) for the CTA's rows
        [begin, end) it holds."""
        lo = cutlass.max(first, begin)
        for n in cutlass.range(lo, cutlass.min(requests.add_rows(first, rows), end)):
            sReq[n - begin] = b
            sBase[n - begin] = first

    @cute.jit
    def look_up(self, located, p_table, n: Int32, end: Int32, table_width: Int32,
                num_pages: Int32, page_size: Int32, page_bytes: Int32, sToken, sPosition,
                sData, sScale, sFlags, tid: Int32):
        """Row n (this thread's, ``located``) into the CTA's lookups where n < end: flags
        POOLED and KEPT where a valid request's rows hold it past their head rows and its
        cache row is in range (store.py's judgement), else none."""
        found, first_row, ok, tok0, start, rows, request = located
        if n < end:
            flags = Int32(0)
            h = n - first_row
            if found and ok and h >= requests.head_rows(rows, self.C):
                q = Int64(start // self.R + h)
                writes, data, scale = self.epi.page_target(p_table, request, q, table_width,
                                                           num_pages, page_size, page_bytes)
                if writes:
                    # Past its head rows a row is never its sequence's first block: no FIRST.
                    flags = Int32(RowFlag.POOLED | RowFlag.KEPT)
                    sToken[tid] = requests.block_token(Int32(q), start, tok0, self.R)
                    sPosition[tid] = q * Int64(self.R)
                    sData[tid] = data
                    sScale[tid] = scale
            sFlags[tid] = flags

    @cute.jit
    def store(self, p_cache, sApe, sRow, data: Int64, scale: Int64, flags, operands, rWeight,
              tid: Int32):
        """A looked-up row pooled, through the epilogue and encoded into its cache row,
        where it is stored at all."""
        if (flags & RowFlag.POOLED) != 0:  # the same for every thread of the CTA
            rKV, rS, rCos, rSin = operands
            rO = self.pooled(rKV, rS, sApe, tid, True, cutlass.Boolean(False))
            rX = self.epi.strided(rO, sRow, tid)
            self.epi.finish_and_store(rX, rWeight, (rCos, rSin), sRow, p_cache, data, scale,
                                      tid)
            cute.arch.sync_threads()  # the encoding has read sRow before the next row

    @cute.kernel
    def kernel(self, p_kv, p_score, p_ape, p_cu, p_starts, p_slots, p_kvs, p_ss, p_cuc,
               p_weight, p_cos, p_sin, p_table, p_cache, num_tokens: Int32, num_rows: Int32,
               num_reqs: Int32, num_slots: Int32, table_rows: Int32, table_width: Int32,
               num_pages: Int32, page_size: Int32, page_bytes: Int32):
        # Reads only the call's inputs and writes only its own cache rows: it starts once
        # every CTA of the first launch has passed its wait (the grids before the call are
        # complete), and ends after that launch (complete_after_upstream).
        cm.release_dependents(self.pdl)
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        smem = SmemAllocator()
        sApe = smem.allocate_tensor(Float32, self.ape_layout(), 16)
        sRow = smem.allocate_tensor(Float32, cute.make_layout(self.D), 16)
        sData = smem.allocate_tensor(Int64, cute.make_layout(self.threads), 8)
        sScale = smem.allocate_tensor(Int64, cute.make_layout(self.threads), 8)
        sPosition = smem.allocate_tensor(Int64, cute.make_layout(self.threads), 8)
        sToken = smem.allocate_tensor(Int32, cute.make_layout(self.threads), 4)
        sFlags = smem.allocate_tensor(Int32, cute.make_layout(self.threads), 4)
        sReq = smem.allocate_tensor(Int32, cute.make_layout(self.threads), 4)
        sBase = smem.allocate_tensor(Int32, cute.make_layout(self.threads), 4)
        sWarp = smem.allocate_tensor(Int32, cute.make_layout(self.threads // 32), 4)
        rows_per_cta = (num_rows + grid - 1) // grid
        begin = cta * rows_per_cta
        end = cutlass.min(begin + rows_per_cta, num_rows)
        cu = cute.make_tensor(p_cu, num_reqs + 1)
        starts = cute.make_tensor(p_starts, num_reqs)
        slots = cute.make_tensor(p_slots, num_reqs)
        located = self.locate(cu, starts, slots, begin + tid, begin, end, num_reqs, num_tokens,
                              num_slots, sReq, sBase, sWarp, tid)
        self.look_up(located, p_table, begin + tid, end, table_width, num_pages, page_size,
                     page_bytes, sToken, sPosition, sData, sScale, sFlags, tid)
        self.each_row(p_kv, p_score, p_ape, p_weight, p_cos, p_sin, sApe, sToken, sPosition,
                      sFlags, begin, end, table_rows, tid,
                      lambda n, flags, operands, rWeight: self.store(
                          p_cache, sApe, sRow, sData[n - begin], sScale[n - begin], flags,
                          operands, rWeight, tid))
        cm.complete_after_upstream(self.pdl, cta)

    @cute.jit
    def __call__(self, p_kv: cute.Pointer, p_score: cute.Pointer, p_ape: cute.Pointer,
                 p_cu: cute.Pointer, p_starts: cute.Pointer, p_slots: cute.Pointer,
                 p_kvs: cute.Pointer, p_ss: cute.Pointer, p_cuc: cute.Pointer,
                 p_weight: cute.Pointer, p_cos: cute.Pointer, p_sin: cute.Pointer,
                 p_table: cute.Pointer, p_cache: cute.Pointer, num_tokens: Int32,
                 num_rows: Int32, num_reqs: Int32, num_slots: Int32, table_rows: Int32,
                 table_width: Int32, num_pages: Int32, page_size: Int32, page_bytes: Int32,
                 grid: Int32, stream: cuda.CUstream):
        self.kernel(p_kv, p_score, p_ape, p_cu, p_starts, p_slots, p_kvs, p_ss, p_cuc, p_weight,
                    p_cos, p_sin, p_table, p_cache, num_tokens, num_rows, num_reqs, num_slots,
                    table_rows, table_width, num_pages, page_size, page_bytes).launch(
            grid=(grid, 1, 1), block=(self.threads, 1, 1), smem=self.smem_bytes(),
            stream=stream, use_pdl=self.pdl, min_blocks_per_mp=self.min_ctas,
            preferred_smem_carveout=100)
