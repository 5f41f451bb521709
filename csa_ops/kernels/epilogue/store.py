"""The row epilogue of csa::compressor_extend_store: per pooled row, the steps of rows.py,
one cache format and the paged store.

The formats' scales and codes come from the reference's exact bit operations
(shared/formats.py), so a stored row is bitwise the composition's. One CTA per row of the
call's output capacity; rows past cu_seqlens_comp[-1], rows of invalid requests and rows
whose block-table entry is out of range write nothing. The kernel runs after the extend
kernel in the same stream (PDL): it finds each row's request, position and cache row from
the call's inputs while the extend kernel runs, and waits for it only before reading the
row.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
from cutlass import Boolean, Float32, Int32, Int64, Uint8, Uint32, cute

from ...cache_formats import (
    BLOCK_COLUMNS,
    DS_MLA_FP8_DIM,
    DS_MLA_ROW_BYTES,
    DS_MLA_SCALE_BYTES,
    E4M3_NAN,
    FP8_MAX,
    SCALE_FLOOR,
    SCALE_TOP,
    UE8M0_NAN,
    row_bytes,
    top_parts,
)
from ..shared import common as cm
from ..shared import formats as fm
from ..shared import requests
from .plan import EpilogueKey
from .rows import RowEpilogue, doublings

# Requests whose row counts a CTA loads in one round trip, where its threads can hold them
# (at most 8 each): a narrow row's CTA (32 threads at d128) would otherwise scan a decode
# batch of 256 in four trips, and place its rows in four more.
LOOKUP_REQUESTS = 256


class RowEpilogueStore(RowEpilogue):
    """Serving: the epilogue of the extend kernel's rows, encoded and stored into a paged
    cache (the contiguous layout of plan.py for the encoding)."""

    def __init__(self, key: EpilogueKey) -> None:
        super().__init__(key)
        self.format = key.cache_format
        self.block = BLOCK_COLUMNS.get(key.cache_format, 0)  # columns per scale
        self.block_lanes = doublings(max(self.block // self.V, 1))  # its shuffle offsets
        if self.block:
            self.row_bytes = row_bytes(key.cache_format, key.head_dim)
        if key.cache_format in SCALE_TOP:  # the power-of-two scales' exponent rule
            self.top_parts = top_parts(SCALE_TOP[key.cache_format])

    @cute.jit
    def block_amax(self, rZ: cute.Tensor):
        """(amax bits, finite) of the scale block of this thread's contiguous columns: one
        integer max of the magnitudes' bits, which orders non-negative floats as their
        values do and puts Inf and NaN above every finite value. The lanes of a block are
        neighbours, reduced by shuffles."""
        amax = Uint32(0)
        for k in cutlass.range_constexpr(self.V):
            amax = cutlass.max(amax, rZ[k].bitcast(Uint32) & Uint32(fm.MAGNITUDE))
        for s in cutlass.range_constexpr(len(self.block_lanes)):
            amax = cutlass.max(amax, cute.arch.shuffle_sync_bfly(amax,
                                                                 offset=self.block_lanes[s]))
        return amax, amax < Uint32(fm.INF_BITS)

    @cute.jit
    def pow2_scale(self, amax: Uint32, finite: Boolean):
        """(2**-e, e) with e = ceil(log2(max(amax, floor) / top)), the quotient rounded to
        fp32; e = 0 off finite blocks."""
        floor = Float32(SCALE_FLOOR[self.format]).bitcast(Uint32)
        e = Int32(0)
        if finite:
            e = fm.scale_exponent(cutlass.max(amax, floor), *self.top_parts)
        return fm.pow2(-e), e

    @cute.jit
    def store_bytes(self, rB: cute.Tensor, base: cute.Pointer, offset: Int64,
                    count: cutlass.Constexpr[int]):
        dst = cute.make_tensor(base + cute.assume(offset, divby=count), count)
        cute.autovec_copy(rB, dst)

    @cute.jit
    def encode_ds_mla(self, rZ: cute.Tensor, p_cache, row_offset: Int64, scale_offset: Int64,
                      tid: Int32):
        """Columns [0, 448): e4m3 codes of 7 blocks of 64 with UE8M0 scales (byte 7: 0);
        columns [448, 512): bf16 bytes. Data row at row_offset, scale bytes at scale_offset."""
        amax, finite = self.block_amax(rZ)
        column = tid * self.V
        if column < DS_MLA_FP8_DIM:
            factor, e = self.pow2_scale(amax, finite)
            rB = cute.make_rmem_tensor((self.V,), Uint8)
            for k in cutlass.range_constexpr(self.V):
                rB[k] = Uint8(E4M3_NAN)
                if finite:
                    rB[k] = fm.e4m3(cm.mul_rn(rZ[k], factor))
            self.store_bytes(rB, p_cache, row_offset + column, self.V)
            if column % self.block == 0:
                scale = Uint8(UE8M0_NAN)
                if finite:
                    scale = Uint8(e + 127)
                fm.store_byte(p_cache, scale_offset + column // self.block, scale)
        else:
            if column == DS_MLA_FP8_DIM:
                fm.store_byte(p_cache, scale_offset + DS_MLA_SCALE_BYTES - 1, Uint8(0))
            rB = cute.make_rmem_tensor((2 * self.V,), Uint8)
            for k in cutlass.range_constexpr(self.V):
                bits = Uint32(cutlass.BFloat16(rZ[k]).bitcast(cutlass.Uint16))
                rB[2 * k] = Uint8(bits)
                rB[2 * k + 1] = Uint8(bits >> 8)
            rope_offset = DS_MLA_FP8_DIM + 2 * (column - DS_MLA_FP8_DIM)
            self.store_bytes(rB, p_cache, row_offset + rope_offset, 2 * self.V)

    @cute.jit
    def encode_block128(self, rZ: cute.Tensor, p_cache, row_offset: Int64, tid: Int32):
        """e4m3 codes of x / scale, scale = amax / 448 in fp32 after the codes: zero codes
        and scale where it is 0, NaN codes and scale off finite blocks."""
        amax, finite = self.block_amax(rZ)
        scale = cm.div_rn(amax.bitcast(Float32), Float32(FP8_MAX))
        usable = finite and scale > Float32(0.0)
        column = tid * self.V
        rB = cute.make_rmem_tensor((self.V,), Uint8)
        for k in cutlass.range_constexpr(self.V):
            rB[k] = Uint8(0)
            if usable:
                rB[k] = fm.e4m3(cm.div_rn(rZ[k], scale))
            elif not finite:
                rB[k] = Uint8(E4M3_NAN)
        self.store_bytes(rB, p_cache, row_offset + column, self.V)
        if column % self.block == 0:
            stored = cutlass.select_(finite, scale.bitcast(Uint32), Uint32(0x7FC00000))
            rS = cute.make_rmem_tensor((4,), Uint8)
            for b in cutlass.range_constexpr(4):
                rS[b] = Uint8(stored >> (8 * b))
            self.store_bytes(rS, p_cache, row_offset + self.D + 4 * (column // self.block), 4)

    @cute.jit
    def encode_mxfp4(self, rZ: cute.Tensor, p_cache, row_offset: Int64, tid: Int32):
        """e2m1 codes of x * 2**-e two per byte (low nibble first), then one UE8M0 byte per
        32 columns; zero codes and the NaN scale off finite blocks."""
        amax, finite = self.block_amax(rZ)
        factor, e = self.pow2_scale(amax, finite)
        column = tid * self.V
        rB = cute.make_rmem_tensor((self.V // 2,), Uint8)
        for k in cutlass.range_constexpr(self.V // 2):
            packed = Int32(0)
            if finite:
                packed = (fm.e2m1(cm.mul_rn(rZ[2 * k], factor))
                          | (fm.e2m1(cm.mul_rn(rZ[2 * k + 1], factor)) << 4))
            rB[k] = Uint8(packed)
        self.store_bytes(rB, p_cache, row_offset + column // 2, self.V // 2)
        if column % self.block == 0:
            scale = Uint8(UE8M0_NAN)
            if finite:
                scale = Uint8(e + 127)
            fm.store_byte(p_cache, row_offset + self.D // 2 + column // self.block, scale)

    # ------------------------------------------------------------ the kernel
    def smem_bytes(self) -> int:
        # Batch.scan's warp sums, the found request and its first row (with slack).
        return super().smem_bytes() + 4 * (self.T // 32) + 4 + 8 + 4

    @cute.jit
    def request_of_row(self, cu, starts, n: Int32, num_requests: Int32, ratio: Int32,
                       tid: Int32, sWarps: cute.Tensor, sFound: cute.Tensor):
        """(i, first row of i) of the request whose rows hold output row n, i = -1 where
        none does (n at or past the batch's rows). From the extend kernels' own row counts
        and scan (shared/requests.Batch), so the rows are placed as the extend kernel placed
        them, without its cu_seqlens_comp, which exists only once it has run."""
        batch = requests.Batch(ratio, self.T, max(requests.COUNTS_AHEAD,
                                                  min(8, LOOKUP_REQUESTS // self.T)))
        held = batch.run_counts(cu, starts, num_requests, tid)
        if tid == 0:
            sFound[0] = Int32(-1)  # published by scan's barrier
        b_lo, b_hi, running, _ = batch.scan(cu, starts, num_requests, tid, sWarps, held)
        batch.place(cu, starts, num_requests, b_lo, b_hi, running, held,
                    lambda b, first, rows: self.mark_if_holds(sFound, b, first, rows, n))
        cute.arch.sync_threads()
        return sFound[0], sFound[1]

    @cute.jit
    def mark_if_holds(self, sFound: cute.Tensor, b, first, rows, n):
        """Batch.place's visit: request b (rows [first, first + rows)) into sFound if it
        holds row n. Exactly one request does where n is below the batch's rows (offsets
        saturate: shared/requests.py)."""
        if Int64(first) <= Int64(n) and Int64(n) < Int64(first) + Int64(rows):
            sFound[0] = b
            sFound[1] = first

    @cute.jit
    def target(self, p_cu, p_start, p_slots, p_table, p_cos, p_sin, angles, n: Int32,
               num_requests: Int32, num_tokens: Int32, num_slots: Int32, table_rows: Int32,
               table_width: Int32, num_pages: Int32, page_size: Int32, page_bytes: Int32,
               ratio: Int32, tid: Int32, sWarps: cute.Tensor, sFound: cute.Tensor):
        """(writes, data offset, scale offset) of output row n (row_target's), its RoPE
        angles loaded into ``angles``: its request i, compressed row q = start_pos[i] //
        ratio + n - (i's first row). It writes when a request's rows hold n, the request is
        valid (as the extend kernels judge it) and the block-table entry is in range. Reads
        only the call's inputs, none of which the extend kernel writes, so it runs before
        the PDL wait, while the extend kernel runs. Every load is in bounds for any
        contents."""
        cu = cute.make_tensor(p_cu, num_requests + 1)
        starts = cute.make_tensor(p_start, num_requests)
        i, first = self.request_of_row(cu, starts, n, num_requests, ratio, tid, sWarps,
                                       sFound)
        writes = Boolean(False)
        data = Int64(0)
        scale = Int64(0)
        if i >= 0:
            valid, _, start, _, _ = requests.request_of(
                cu, starts, cute.make_tensor(p_slots, num_requests), i, num_tokens, num_slots)
            if valid:
                q = Int64(start // ratio) + Int64(n) - Int64(first)
                writes, data, scale = self.row_target(
                    p_table, p_cos, p_sin, angles, i, q, ratio, table_rows, table_width,
                    num_pages, page_size, page_bytes, tid)
        return writes, data, scale

    @cute.jit
    def row_target(self, p_table, p_cos, p_sin, angles, i, q: Int64, ratio, table_rows: Int32,
                   table_width: Int32, num_pages: Int32, page_size: Int32, page_bytes: Int32,
                   tid: Int32):
        """(writes, data offset, scale offset) of compressed row q of valid request i, its
        RoPE angles (at position q * ratio) loaded into ``angles``: the row goes to slot
        q % page_size of page block_table[i, q // page_size], written when that entry is in
        range. Loads only in bounds; its offsets are ready before the row is (encode's
        arguments), so no division waits for the epilogue."""
        self.load_angles(angles, p_cos, p_sin, q * Int64(ratio), table_rows, tid)
        return self.page_target(p_table, i, q, table_width, num_pages, page_size, page_bytes)

    @cute.jit
    def page_target(self, p_table, i, q: Int64, table_width: Int32, num_pages: Int32,
                    page_size: Int32, page_bytes: Int32):
        """(writes, data offset, scale offset) of compressed row q of valid request i
        (row_target's, without the angles)."""
        writes = Boolean(False)
        data = Int64(0)
        scale = Int64(0)
        column = q // Int64(page_size)
        if column < Int64(table_width):
            page = cute.make_tensor(p_table + Int64(i) * Int64(table_width) + column, 1)[0]
            if page >= 0 and page < num_pages:
                writes = Boolean(True)
                data, scale = self.cache_offsets(Int64(page), q - column * Int64(page_size),
                                                 page_size, page_bytes)
        return writes, data, scale

    def cache_offsets(self, page: Int64, slot: Int64, page_size: Int32, page_bytes: Int32):
        """(data, scales) offsets of a cache row in the cache's elements: fp8_ds_mla's
        scales lie after its page's rows; the other formats' follow the row's data (and
        "none" has none)."""
        if self.format == "fp8_ds_mla":
            page_base = page * Int64(page_bytes)
            return (page_base + slot * DS_MLA_ROW_BYTES,
                    page_base + Int64(page_size) * DS_MLA_ROW_BYTES + slot * DS_MLA_SCALE_BYTES)
        row_elements = self.D if self.format == "none" else self.row_bytes
        return (page * Int64(page_size) + slot) * row_elements, Int64(0)

    @cute.kernel
    def kernel(self, p_rows, p_weight, p_cos, p_sin, p_cu, p_start, p_slots, p_table,
               p_cache, num_rows: Int32, num_requests: Int32, num_tokens: Int32,
               num_slots: Int32, table_rows: Int32, table_width: Int32, num_pages: Int32,
               page_size: Int32, page_bytes: Int32, ratio: Int32):
        tid, n, sRow, smem = self.cta()
        sWarps = smem.allocate_tensor(Int32, cute.make_layout(max(self.T // 32, 1)), 4)
        sFound = smem.allocate_tensor(Int32, cute.make_layout(2), 8)
        # Everything but the row comes from the call's inputs: looked up while the extend
        # kernel runs (a decode step's time is this chain of dependent loads).
        rWeight = self.load_weight(p_weight, tid)
        angles = self.angle_registers()
        writes, data, scale = self.target(
            p_cu, p_start, p_slots, p_table, p_cos, p_sin, angles, n, num_requests,
            num_tokens, num_slots, table_rows, table_width, num_pages, page_size, page_bytes,
            ratio, tid, sWarps, sFound)
        # Every CTA waits, writer or not: the grid must complete after the extend kernel,
        # so that a grid waiting on this one sees the extend kernel's state writes too.
        cm.await_upstream(self.pdl)
        if writes:  # the same for every thread of the CTA
            rX = self.load_row(p_rows, n, tid)
            self.finish_and_store(rX, rWeight, angles, sRow, p_cache, data, scale, tid)

    @cute.jit
    def finish_and_store(self, rX: cute.Tensor, rWeight: cute.Tensor, angles,
                         sRow: cute.Tensor, p_cache, data: Int64, scale: Int64, tid: Int32):
        """A pooled row (strided, in rX) through the epilogue (finish_row), encoded and
        stored at row_target's offsets; every thread of the CTA calls it."""
        self.finish_row(rX, rWeight, angles, sRow, tid)
        # Strided to contiguous through shared memory.
        for k in cutlass.range_constexpr(self.V):
            sRow[tid + k * self.T] = rX[k]
        cute.arch.sync_threads()
        rZ = cute.make_rmem_tensor((self.V,), Float32)
        for k in cutlass.range_constexpr(self.V):
            rZ[k] = sRow[tid * self.V + k]
        self.encode(rZ, p_cache, data, scale, tid)

    @cute.jit
    def encode(self, rZ: cute.Tensor, p_cache, data: Int64, scale: Int64, tid: Int32):
        if cutlass.const_expr(self.format == "none"):
            rO = cute.make_rmem_tensor((self.V,), self.dtype)
            for k in cutlass.range_constexpr(self.V):
                rO[k] = self.dtype(rZ[k])
            self.store_bytes(rO, p_cache, data + tid * self.V, self.V)
        elif cutlass.const_expr(self.format == "fp8_ds_mla"):
            self.encode_ds_mla(rZ, p_cache, data, scale, tid)
        elif cutlass.const_expr(self.format == "fp8_block128"):
            self.encode_block128(rZ, p_cache, data, tid)
        else:
            self.encode_mxfp4(rZ, p_cache, data, tid)

    @cute.jit
    def __call__(self, p_rows: cute.Pointer, p_weight: cute.Pointer, p_cos: cute.Pointer,
                 p_sin: cute.Pointer, p_cu: cute.Pointer, p_start: cute.Pointer,
                 p_slots: cute.Pointer, p_table: cute.Pointer,
                 p_cache: cute.Pointer, num_rows: Int32, num_requests: Int32,
                 num_tokens: Int32, num_slots: Int32, table_rows: Int32, table_width: Int32,
                 num_pages: Int32, page_size: Int32, page_bytes: Int32, ratio: Int32,
                 grid: Int32, stream: cuda.CUstream):
        self.kernel(p_rows, p_weight, p_cos, p_sin, p_cu, p_start, p_slots, p_table,
                    p_cache, num_rows, num_requests, num_tokens, num_slots, table_rows,
                    table_width, num_pages, page_size, page_bytes, ratio).launch(
            grid=(grid, 1, 1), block=(self.T, 1, 1), smem=self.smem_bytes(), stream=stream,
            use_pdl=self.pdl)

