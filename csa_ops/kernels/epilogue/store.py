"""The row epilogue of csa::compressor_extend_store: per pooled row, the steps of rows.py,
one cache format and the paged store.

The formats' scales and codes come from the reference's exact bit operations
(shared/formats.py), so a stored row is bitwise the composition's. One CTA per row of the
call's output capacity; rows past cu_seqlens_comp[-1], rows of invalid requests and rows
whose block-table entry is out of range write nothing. The kernel runs after the extend
kernel in the same stream (PDL: it waits for it before any access).
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
)
from ..shared import common as cm
from ..shared import formats as fm
from ..shared import requests
from .plan import EpilogueKey
from .rows import RowEpilogue, doublings


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

    @cute.jit
    def block_amax(self, rZ: cute.Tensor):
        """(amax, finite) of the scale block of this thread's contiguous columns: the lanes
        of a block are neighbours, reduced by shuffles."""
        amax = Float32(0.0)
        bad = Float32(0.0)
        for k in cutlass.range_constexpr(self.V):
            amax = cute.arch.fmax(amax, fm.abs_bits(rZ[k]))
            bad = cute.arch.fmax(bad, cm.pick(fm.finite(rZ[k]), Float32(0.0), Float32(1.0)))
        for s in cutlass.range_constexpr(len(self.block_lanes)):
            offset = self.block_lanes[s]
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=offset))
            bad = cute.arch.fmax(bad, cute.arch.shuffle_sync_bfly(bad, offset=offset))
        return amax, bad == Float32(0.0)

    @cute.jit
    def pow2_scale(self, amax: Float32, finite: Boolean):
        """(2**-e, e) with e = ceil(log2(max(amax, floor) / top)); e = 0 off finite blocks."""
        floor = Float32(SCALE_FLOOR[self.format])
        e = Int32(0)
        if finite:
            e = fm.ceil_log2(cm.div_rn(cute.arch.fmax(amax, floor),
                                     Float32(SCALE_TOP[self.format])))
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
        scale = cm.div_rn(amax, Float32(FP8_MAX))
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
        return super().smem_bytes() + 4 * (self.T // 32) + 4  # count_le_cta's warp sums

    @cute.jit
    def target(self, p_cu, p_start, p_slots, p_cuc, p_table, p_cos, p_sin, angles,
               n: Int32, num_requests: Int32, num_tokens: Int32, num_slots: Int32,
               table_rows: Int32, table_width: Int32, num_pages: Int32, page_size: Int32,
               ratio: Int32, tid: Int32, sWarps: cute.Tensor):
        """(writes, cache row) of output row n, its RoPE angles loaded into ``angles``:
        its request i (cuc[i] <= n < cuc[i+1]), compressed row q = start_pos[i] // ratio +
        n - cuc[i] at position q * ratio, cache row block_table[i, q // page_size] *
        page_size + q % page_size. It writes when n < cuc[-1], the request is valid (as the
        extend kernels judge it) and the block-table entry is in range. Every load is in
        bounds for any contents; the angles' and the page's loads are in flight together."""
        cuc = cute.make_tensor(p_cuc, num_requests + 1)
        # cu_seqlens_comp comes from the extend kernel: sorted, from 0. So i < num_requests
        # exactly when n < cuc[-1], and i >= 0 always (checked all the same).
        i = cm.count_le_cta(cuc, num_requests + 1, n, tid, self.T, sWarps) - 1
        writes = Boolean(False)
        cache_row = Int64(0)
        if i >= 0 and i < num_requests:  # noqa: PLR1716
            valid, _, start, _, _ = requests.request_of(
                cute.make_tensor(p_cu, num_requests + 1),
                cute.make_tensor(p_start, num_requests),
                cute.make_tensor(p_slots, num_requests), i, num_tokens, num_slots)
            if valid:
                q = Int64(start // ratio) + Int64(n) - Int64(cuc[i])
                self.load_angles(angles, p_cos, p_sin, q * Int64(ratio), table_rows, tid)
                column = q // Int64(page_size)
                if column < Int64(table_width):
                    page = cute.make_tensor(
                        p_table + Int64(i) * Int64(table_width) + column, 1)[0]
                    if page >= 0 and page < num_pages:
                        writes = Boolean(True)
                        cache_row = Int64(page) * Int64(page_size) + q % Int64(page_size)
        return writes, cache_row

    @cute.kernel
    def kernel(self, p_rows, p_weight, p_cos, p_sin, p_cu, p_start, p_slots, p_cuc, p_table,
               p_cache, num_rows: Int32, num_requests: Int32, num_tokens: Int32,
               num_slots: Int32, table_rows: Int32, table_width: Int32, num_pages: Int32,
               page_size: Int32, page_bytes: Int32, ratio: Int32):
        tid, n, sRow, smem = self.row_of_cta()
        sWarps = smem.allocate_tensor(Int32, cute.make_layout(max(self.T // 32, 1)), 4)
        # The row and the weight need no lookup: their loads fly during the row's.
        rX = self.load_row(p_rows, n, tid)
        rWeight = self.load_weight(p_weight, tid)
        angles = self.angle_registers()
        writes, cache_row = self.target(
            p_cu, p_start, p_slots, p_cuc, p_table, p_cos, p_sin, angles, n, num_requests,
            num_tokens, num_slots, table_rows, table_width, num_pages, page_size, ratio, tid,
            sWarps)
        if writes:  # the same for every thread of the CTA
            self.finish_row(rX, rWeight, angles, sRow, tid)
            # Strided to contiguous through shared memory.
            for k in cutlass.range_constexpr(self.V):
                sRow[tid + k * self.T] = rX[k]
            cute.arch.sync_threads()
            rZ = cute.make_rmem_tensor((self.V,), Float32)
            for k in cutlass.range_constexpr(self.V):
                rZ[k] = sRow[tid * self.V + k]
            self.encode(rZ, p_cache, cache_row, page_size, page_bytes, tid)

    @cute.jit
    def encode(self, rZ: cute.Tensor, p_cache, cache_row: Int64, page_size: Int32,
               page_bytes: Int32, tid: Int32):
        if cutlass.const_expr(self.format == "none"):
            rO = cute.make_rmem_tensor((self.V,), self.dtype)
            for k in cutlass.range_constexpr(self.V):
                rO[k] = self.dtype(rZ[k])
            self.store_bytes(rO, p_cache, cache_row * self.D + tid * self.V, self.V)
        elif cutlass.const_expr(self.format == "fp8_ds_mla"):
            page = cache_row // Int64(page_size)
            slot = cache_row % Int64(page_size)
            page_base = page * Int64(page_bytes)
            self.encode_ds_mla(rZ, p_cache, page_base + slot * DS_MLA_ROW_BYTES,
                               page_base + Int64(page_size) * DS_MLA_ROW_BYTES
                               + slot * DS_MLA_SCALE_BYTES, tid)
        elif cutlass.const_expr(self.format == "fp8_block128"):
            self.encode_block128(rZ, p_cache, cache_row * self.row_bytes, tid)
        else:
            self.encode_mxfp4(rZ, p_cache, cache_row * self.row_bytes, tid)

    @cute.jit
    def __call__(self, p_rows: cute.Pointer, p_weight: cute.Pointer, p_cos: cute.Pointer,
                 p_sin: cute.Pointer, p_cu: cute.Pointer, p_start: cute.Pointer,
                 p_slots: cute.Pointer, p_cuc: cute.Pointer, p_table: cute.Pointer,
                 p_cache: cute.Pointer, num_rows: Int32, num_requests: Int32,
                 num_tokens: Int32, num_slots: Int32, table_rows: Int32, table_width: Int32,
                 num_pages: Int32, page_size: Int32, page_bytes: Int32, ratio: Int32,
                 grid: Int32, stream: cuda.CUstream):
        self.kernel(p_rows, p_weight, p_cos, p_sin, p_cu, p_start, p_slots, p_cuc, p_table,
                    p_cache, num_rows, num_requests, num_tokens, num_slots, table_rows,
                    table_width, num_pages, page_size, page_bytes, ratio).launch(
            grid=(grid, 1, 1), block=(self.T, 1, 1), smem=self.smem_bytes(), stream=stream,
            use_pdl=self.pdl)
