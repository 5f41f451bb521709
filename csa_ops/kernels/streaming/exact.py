"""The deferred streaming forward: the columns its certificate failed, in torch's order, by
a second launch.

A forward with `deferred` set does not recompute a failing column inside its row loop, where
the whole CTA waits at the next row's barrier while one warp runs a column's chains (a
serial chain of up to `W` adds) and the grid, one wave, ends with its slowest CTA. Its row
loop (DeferredRows) writes one word per (output row, column vector) instead: bit v set
where column v of the vector needs torch's order, zero elsewhere, padding rows included, so
the workspace is never cleared. It also copies a failing column's logits and values from
the tile to one of its warp's SAVED_COLUMNS slots while it has one, and writes the slot into
the word. This launch (ExactColumns) then takes the marked columns of every CTA at once,
spread over the whole GPU. Each CTA lists the marked words among `WORDS` consecutive ones
in shared memory, and its warps take them in turn; a warp reads a marked column's window
from its slot (coalesced; past the slots, the window's elements from DRAM, 32 bytes moved
per element) and computes it with the in-place path's own code
(StreamingKernel._torch_column), then overwrites the fast value. So the output is the
in-place forward's, bit for bit.

The row lookups only read the call's offsets, which the forward does not write: they run
before the PDL wait, while the forward's last CTAs finish.
"""

from __future__ import annotations

import math

import cutlass
from cutlass import Float32, Int32, Int64, cute
from cutlass.memory import SmemAllocator

from ..shared import common as cm
from .plan import SAVED_COLUMNS, SLOT_SHIFT
from .rows import RowTiles

WORDS = 64  # marked-column words one CTA scans: ~3.5 marked at a 5% rate, one per warp
WARPS = 8


class DeferredRows:
    """The row loop's side of the deferral (a base of kernels.StreamingKernel): the word of
    a row's failing columns and the saved copies of their windows."""

    @cute.jit
    def _failing_columns(self, fails):
        """The warp's word of failing columns, bit v for column v, from the scattered
        per-column flag (the lanes that hold one column in _scatter's layout agree)."""
        ballot = cute.arch.vote_ballot_sync(fails != 0)
        word = Int32(0)
        for v in cutlass.range_constexpr(self.vec):
            word = word | (((ballot >> (v << (5 - self.log_vec))) & 1) << v)
        return word

    @cute.jit
    def _save_columns(self, word, tiles: RowTiles, saved, st, t0, fl, num_tokens, lane, cvw,
                      bid):
        """Copy the failing columns' logits and values (fp32, entry k at k) from the row's
        tiles to consecutive slots of this warp's SAVED_COLUMNS, while it has room for all
        of them, and return the word with the first one's slot + 1 above its column bits
        (exact.py reads them there instead of the window's scattered elements in DRAM)."""
        counter = tiles.scratch
        used = counter[cvw]
        need = cute.arch.popc(word)
        result = word
        if used + need <= SAVED_COLUMNS:
            first = (bid * self.col_vectors + cvw) * SAVED_COLUMNS + used
            slot = first
            for v in cutlass.range_constexpr(self.vec):
                if ((word >> v) & 1) != 0:
                    for i in cutlass.range_constexpr(self.window_padded // 32):
                        k = i * 32 + lane
                        ph = self._phys(cvw, k)
                        saved[k, 0, slot] = self._logit_reader(tiles, st, ph, k, cvw)(v)
                        saved[k, 1, slot] = self._load_f32(tiles.tile[(None, ph, k, 1, st)])[v]
                    slot = slot + 1
            cute.arch.sync_warp()  # every lane has read the count
            if lane == 0:
                counter[cvw] = used + need
            result = word | ((first + 1) << SLOT_SHIFT)
        return result

    @cute.jit
    def _mark(self, flags, n, colc, word):
        """Row n's word of column vector colc in the deferred forward's workspace (every
        word is written each call: padding rows' and certified vectors' are 0)."""
        if colc < self.half_vectors:
            flags[n * self.half_vectors + colc] = word


class ExactColumns:
    """The second launch of the deferred forward `fwd` (a kernels.StreamingKernel, whose
    compile-time constants and column code it uses)."""

    def __init__(self, fwd) -> None:
        assert fwd.deferred
        self.fwd = fwd
        self.threads = 32 * WARPS

    @cute.jit
    def _column(self, p_kv, p_score, p_ape, gSaved, slot, colc, v, t0, fl, num_tokens: Int32,
                lane, sw):
        """Column v of column vector colc of the row whose window starts at token t0 (flags
        fl), in torch's order: lane j takes entries k = j + 32 i, from saved column `slot`
        (coalesced, likely still in L2) or, at slot -1, from the window's elements."""
        width = self.fwd.coff * self.fwd.head_dim
        oks, logits, values = [], [], []
        for i in cutlass.range_constexpr(self.fwd.window_padded // 32):
            k = i * 32 + lane
            ok = self.fwd._entry_ok(k, t0, fl, num_tokens)
            logit = Float32(0.0)
            value = Float32(0.0)
            if slot >= 0:
                logit = gSaved[k, 0, slot]
                value = gSaved[k, 1, slot]
            elif ok:
                half = k // self.fwd.ratio
                column = half * self.fwd.head_dim + colc * self.fwd.vec + v
                element = Int64(t0 + k) * width + column
                ape_row = k - half * self.fwd.ratio
                # The row loop's logit: fp32(score) + ape.
                logit = (Float32(cute.make_tensor(p_score + element, 1)[0])
                         + cute.make_tensor(p_ape + (ape_row * width + column), 1)[0])
                value = Float32(cute.make_tensor(p_kv + element, 1)[0])
            oks.append(ok)
            logits.append(logit)
            values.append(value)
        # The column's max, as the row loop's (max is exact: any order gives its bits).
        m = Float32(-math.inf)
        for i in cutlass.range_constexpr(self.fwd.window_padded // 32):
            m = cute.arch.fmax(m, cm.pick(oks[i], logits[i], Float32(-math.inf)), nan=True)
        for step in cutlass.range_constexpr(5):
            m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=16 >> step), nan=True)
        return self.fwd._torch_column(oks, logits, values, m, sw, lane)

    @cute.kernel
    def kernel(self, p_kv, p_score, p_ape, p_cu, p_cuc, p_out, p_flags, gSaved: cute.Tensor,
               num_tokens: Int32, num_rows: Int32, num_segs: Int32):
        hv = self.fwd.half_vectors
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        lane, warp = tid % 32, tid // 32
        smem = SmemAllocator()
        sT0 = smem.allocate_tensor(Int32, cute.make_layout(WORDS), 16)
        sFl = smem.allocate_tensor(Int32, cute.make_layout(WORDS), 16)
        sWord = smem.allocate_tensor(Int32, cute.make_layout(WORDS), 16)
        sList = smem.allocate_tensor(Int32, cute.make_layout(WORDS + 1), 16)
        sScratch = smem.allocate_tensor(
            Float32, cute.make_layout((self.fwd.window_padded, WARPS)), 16)
        mCu = cute.make_tensor(p_cu, num_segs + 1)
        mCuc = cute.make_tensor(p_cuc, num_segs + 1)
        words = num_rows * hv
        first = bid * WORDS
        if tid < WORDS and first + tid < words:
            t0, fl = self.fwd._row_info((first + tid) // hv, mCu, mCuc, num_tokens, num_segs)
            sT0[tid] = t0
            sFl[tid] = fl
        cm.await_upstream(True)
        # Warp 0 lists the CTA's marked words in order (a ballot per 32 words).
        if warp == 0:
            flags = cute.make_tensor(p_flags, words)
            below = (Int32(1) << lane) - 1
            count = Int32(0)
            for r in cutlass.range_constexpr(WORDS // 32):
                slot = r * 32 + lane
                word = Int32(0)
                if first + slot < words:
                    word = flags[first + slot]
                sWord[slot] = word
                marked = cute.arch.vote_ballot_sync(word != 0)
                if word != 0:
                    sList[count + cute.arch.popc(marked & below)] = slot
                count = count + cute.arch.popc(marked)
            if lane == 0:
                sList[WORDS] = count
        cute.arch.sync_threads()
        for item in cutlass.range(warp, sList[WORDS], WARPS, unroll=1):
            slot = sList[item]
            word = sWord[slot]
            n = (first + slot) // hv
            colc = (first + slot) % hv
            # The row loop saved the word's columns in consecutive slots from `saved` - 1.
            saved = (word >> SLOT_SHIFT) & ((1 << (32 - SLOT_SHIFT)) - 1)
            # A run-time loop: one copy of the column's code (a vector rarely has two).
            for v in cutlass.range(self.fwd.vec, unroll=1):
                if ((word >> v) & 1) != 0:  # the same for the whole warp
                    x = self._column(p_kv, p_score, p_ape, gSaved, saved - 1, colc, v,
                                     sT0[slot], sFl[slot], num_tokens, lane,
                                     sScratch[(None, warp)])
                    if saved != 0:
                        saved = saved + 1
                    if lane == 0:
                        element = Int64(n) * self.fwd.head_dim + colc * self.fwd.vec + v
                        cute.make_tensor(p_out + element, 1)[0] = self.fwd.dtype(x)

    def launch(self, p_kv, p_score, p_ape, p_cu, p_cuc, p_out, p_flags, gSaved: cute.Tensor,
               num_tokens: Int32, num_rows: Int32, num_segs: Int32, stream) -> None:
        """After the forward's row loop, in its stream (PDL: its CTAs start as the forward's
        retire and wait for all of it before reading a word)."""
        grid = cutlass.max((num_rows * self.fwd.half_vectors + WORDS - 1) // WORDS, Int32(1))
        self.kernel(p_kv, p_score, p_ape, p_cu, p_cuc, p_out, p_flags, gSaved, num_tokens,
                    num_rows, num_segs).launch(grid=(grid, 1, 1), block=(self.threads, 1, 1),
                                     stream=stream, use_pdl=True)
