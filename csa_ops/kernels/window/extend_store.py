"""csa::compressor_extend_store's decode step in one launch (register-window family): a CTA
per request updates its state, pools the rows its new tokens complete as the extend kernel
does, and takes each row straight through the row epilogue into the paged cache. A split
call (a prefill) launches it for its requests' head rows (the rows that read the state) and
states only, beside rows_store.py's launch for the rest.

Apart, the step is two launches: the extend kernel writes packed rows, and the store kernel
(kernels/epilogue/store.py) waits for that whole grid before it reads them back. Here the
CTA is both: its threads are the epilogue's (`threads` threads of `vec` columns over the
whole row, plan.extend_store_key), so a pooled row goes from registers to the epilogue
through one shared-memory transpose (the pooling's contiguous columns to the epilogue's
strided ones), with no packed rows, no second grid and no wait between them. The pooling
is the extend kernel's code (the forward key's softmax: the same bits), the epilogue and
the encoding the store kernel's, so the cache holds the two-launch step's bytes. Every
branch around a barrier depends on the CTA's request only, the same for all its threads.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import Boolean, Float32, Int32, Int64, cute
from cutlass.memory import SmemAllocator

from ..epilogue.store import LOOKUP_REQUESTS, RowEpilogueStore
from ..shared import common as cm
from ..shared import requests
from .extend import WindowExtend
from .plan import ExtendStoreKey


class WindowExtendStore(WindowExtend):
    whole_rows = True  # Geometry: one request's whole row per CTA

    def __init__(self, key: ExtendStoreKey) -> None:
        super().__init__(key.extend)
        self.head_rows_only = key.head_rows_only
        self.epi = self.fused_with(RowEpilogueStore(key.epilogue))
        # Batch.row_sums keeps two sums a warp, whichever items the extend key has.
        self.warp_sums = 2 * self.warps
        # A CTA sums the batch's rows alone: as many requests per round trip as the store
        # kernel's narrow CTAs load.
        self.batch = requests.Batch(self.R, self.nt, max(requests.COUNTS_AHEAD,
                                                         min(8, LOOKUP_REQUESTS // self.nt)))
        # The row's fp32 buffer, ape's (W, head_dim), the row sums' two words per warp.
        self.smem_bytes = (self.D + self.W * self.D + self.warp_sums) * 4 + 64

    @cute.jit
    def emit(self, rO: cute.Tensor, place, rWeight, angles, sRow: cute.Tensor, p_cache,
             tid: Int32, after_row: cutlass.Constexpr[bool] = True):
        """A pooled row (contiguous, the row dtype) through the epilogue into the cache, where
        the row writes; ``place``: target's (writes, data offset, scale offset);
        ``after_row``: an earlier row may have used sRow."""
        writes, data, scale = place
        if writes:
            if cutlass.const_expr(after_row):
                cute.arch.sync_threads()  # the earlier row's readers of sRow are done
            rX = self.epi.strided(rO, sRow, tid)
            self.epi.finish_and_store(rX, rWeight, angles, sRow, p_cache, data, scale, tid)

    @cute.kernel
    def kernel(self, p_kv, p_score, p_ape, p_cu, p_starts, p_slots, p_kvs, p_ss, p_cuc,
               p_weight, p_cos, p_sin, p_table, p_cache, num_tokens: Int32, num_rows: Int32,
               num_reqs: Int32, num_slots: Int32, table_rows: Int32, table_width: Int32,
               num_pages: Int32, page_size: Int32, page_bytes: Int32):
        # The block table, the tables and the weight may come from the kernels before ours.
        cm.await_upstream(self.pdl)
        tid, _, _ = cute.arch.thread_idx()
        item, _, _ = cute.arch.block_idx()
        cu, starts, slots, cuc = self.batch_views(p_cu, p_starts, p_slots, p_cuc, num_reqs)
        smem = SmemAllocator()
        sRow = smem.allocate_tensor(Float32, cute.make_layout(self.D), 16)
        sApe = smem.allocate_tensor(Float32, self.ape_layout(), 16)
        sWarp = smem.allocate_tensor(Int32, cute.make_layout(self.warp_sums), 4)

        held = self.batch.strided_counts(cu, starts, num_reqs, tid)
        rKV, rSc, rL = self.window_registers()
        rNK, rNS, rMK, rML = self.decode_registers()
        rWeight = self.epi.load_weight(p_weight, tid)
        angles = self.epi.angle_registers()
        ok, tok0, start, length, slot, rows = self.no_request()
        heads = Int32(0)
        decode = Boolean(False)
        writes = Boolean(False)
        data = Int64(0)
        scale = Int64(0)
        if item < num_reqs:
            ok, tok0, start, length, slot, rows = self.batch.request(cu, starts, slots, item,
                                                                     num_tokens, num_slots)
            heads = requests.head_rows(rows, self.C)
            if ok and heads > 0:  # the first row's window, angles and cache row, early
                self.gather(p_kv, p_score, p_kvs, p_ss, rKV, rSc, rL, start // self.R, start,
                            tok0, slot, tid)
                writes, data, scale = self.target(p_table, p_cos, p_sin, angles, item,
                                                  start // self.R, table_rows, table_width,
                                                  num_pages, page_size, page_bytes, tid)
            if cutlass.const_expr(self.preload):
                decode = self.is_decode(ok, start, length, heads)
            if decode:
                self.preload_decode(p_kv, p_score, p_kvs, p_ss, rNK, rNS, rMK, rML, tok0, slot,
                                    heads, tid)

        self.stage_ape_all(p_ape, sApe, 0, tid)
        # The rows before this request and in all; its barrier publishes sApe.
        below, total = self.batch.row_sums(cu, starts, num_reqs, item, tid, sWarp, held)
        if tid == 0:
            if item < num_reqs:
                cuc[item] = below
            if item == 0:
                cm.store_row_total(cuc, num_reqs, total, num_rows)

        if item < num_reqs and ok:
            q0 = start // self.R
            for h in cutlass.range_constexpr(self.C):
                if h < heads:
                    if cutlass.const_expr(h > 0):  # a later head row: its own lookups
                        self.gather(p_kv, p_score, p_kvs, p_ss, rKV, rSc, rL, q0 + h, start,
                                    tok0, slot, tid)
                        writes, data, scale = self.target(
                            p_table, p_cos, p_sin, angles, item, q0 + h, table_rows,
                            table_width, num_pages, page_size, page_bytes, tid)
                    self.finish_logits(rSc, rL, sApe, q0 + h, start, tid)
                    self.emit(self.pooled_row(rKV, rL, q0 + h), (writes, data, scale), rWeight,
                              angles, sRow, p_cache, tid, h > 0)
            if decode:  # a decode request has one head row at most: the window's still held
                self.store_decode(p_kvs, p_ss, sApe, rKV, rL, rNK, rNS, rMK, rML, start, slot,
                                  heads, tid, tid)
            else:
                self.update_state(p_kv, p_score, p_kvs, p_ss, sApe, tok0, start,
                                  start + length, slot, tid, tid)
            # Rows past the head rows read new tokens only (after the update: no state
            # read); a split call's rows launch (rows_store.py) takes them.
            if cutlass.const_expr(not self.head_rows_only):
                self.store_later_rows(p_kv, p_score, sApe, p_table, p_cos, p_sin, angles,
                                      rWeight, sRow, p_cache, item, rows, start, tok0,
                                      table_rows, table_width, num_pages, page_size,
                                      page_bytes, tid)

    @cute.jit
    def store_later_rows(self, p_kv, p_score, sApe, p_table, p_cos, p_sin, angles, rWeight,
                         sRow, p_cache, item, rows, start, tok0, table_rows: Int32,
                         table_width: Int32, num_pages: Int32, page_size: Int32,
                         page_bytes: Int32, tid: Int32):
        """A request's rows past its head rows into the cache, one after another."""
        q0 = start // self.R
        for h in cutlass.range(self.C, rows, unroll=1):
            q = q0 + h
            place = self.target(p_table, p_cos, p_sin, angles, item, q, table_rows,
                                table_width, num_pages, page_size, page_bytes, tid)
            rO = self.new_token_row(p_kv, p_score, sApe, q, self.block_token(q, start, tok0),
                                    tid, tid)
            self.emit(rO, place, rWeight, angles, sRow, p_cache, tid)

    @cute.jit
    def target(self, p_table, p_cos, p_sin, angles, item, q, table_rows: Int32,
               table_width: Int32, num_pages: Int32, page_size: Int32, page_bytes: Int32,
               tid: Int32):
        """(writes, data offset, scale offset) of the request's compressed row q, its angles
        loaded (RowEpilogueStore.row_target)."""
        return self.epi.row_target(p_table, p_cos, p_sin, angles, item, Int64(q), self.R,
                                   table_rows, table_width, num_pages, page_size, page_bytes,
                                   tid)

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
            grid=(grid, 1, 1), block=(self.nt, 1, 1), smem=self.smem_bytes, stream=stream,
            use_pdl=self.pdl, min_blocks_per_mp=self.min_ctas,
            preferred_smem_carveout=100 if self.min_ctas else None)
