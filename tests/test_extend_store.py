"""csa::compressor_extend_store on the CPU: the encodings against brute-force searches, the
stored rows against the training op and the fp64 oracle, chunking invariance, untouched
bytes, the unchecked (CUDA) path, opcheck, the fake and the errors.

Scales are recomputed here from the rows with Python floats and their grids are searched
exhaustively, apart from csa_ops.reference_epilogue's encoders.
"""

from __future__ import annotations

import contextlib
import math
import struct

import csa_ops.meta.epilogue  # noqa: F401  (registers the fakes)
import pytest
import torch
from helpers import assert_bitwise_equal, ulp
from serving_helpers import make_requests, permuted_slots, random_schedule, step_inputs
from test_epilogue import HostReadsAreErrors, rope_tables
from torch._subclasses.fake_tensor import FakeTensorMode

import csa_ops
from csa_ops import CompressorState, epilogue, reference_epilogue, serving_store

OP = torch.ops.csa.compressor_extend_store.default
HEAD_DIM = {"none": 128, "fp8_block128": 128, "mxfp4": 128, "fp8_ds_mla": 512}
PAGE_SIZE = 3


def fp32(value: float) -> float:
    """A Python float rounded to fp32 (a correctly rounded fp64 quotient stays correctly
    rounded: fp64 has more than twice fp32's precision)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def ceil_exponent(v: float) -> int:
    """The smallest e with 2**e >= v, by search."""
    e = math.ceil(math.log2(v))
    while 2.0**e < v:
        e += 1
    while 2.0 ** (e - 1) >= v:
        e -= 1
    return e


def e4m3_grid():
    """(codes, values) of every finite e4m3fn value."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    return codes, codes.view(torch.float8_e4m3fn).float()


def nearest_even(x: torch.Tensor, codes: torch.Tensor, values: torch.Tensor,
                 sign_bit: int) -> torch.Tensor:
    """Code of the grid value nearest to each x, ties to the even code, |x| past the grid's
    largest value saturating to it, a zero result with x's sign (``sign_bit`` of its code)."""
    top = values.abs().max()
    x = x.clamp(-top, top)
    distance = (x[:, None].double() - values[None, :].double()).abs()
    best = distance.min(1, keepdim=True).values
    tied = distance == best
    even = tied & (codes[None, :] % 2 == 0)
    pick = torch.where(even.any(1, keepdim=True), even, tied)
    # Of several equal candidates (+0 and -0), the one with x's sign.
    negative_zero = (values[None, :] == 0) & (codes[None, :] & sign_bit > 0)
    sign_ok = (values[None, :] < 0) | negative_zero
    sign_ok = sign_ok == torch.signbit(x)[:, None]
    pick = torch.where((pick & sign_ok).any(1, keepdim=True), pick & sign_ok, pick)
    return codes[pick.int().argmax(1)]


def test_e4m3_encoding_is_round_to_nearest_even_with_saturation():
    gen = torch.Generator().manual_seed(0)
    codes, values = e4m3_grid()
    midpoints = (values[:-1] + values[1:]) / 2
    x = torch.cat([torch.randn(2000, generator=gen) * 10.0 ** torch.randint(-3, 3, (2000,),
                                                                             generator=gen),
                   midpoints[torch.isfinite(midpoints)], torch.tensor([448.0, 449.0, -500.0,
                                                                       1e30, -1e30, -0.0])])
    assert_bitwise_equal(reference_epilogue.encode_e4m3(x), nearest_even(x, codes, values, 0x80),
                         "e4m3 codes")


def test_e2m1_encoding_is_round_to_nearest_even_with_saturation():
    gen = torch.Generator().manual_seed(1)
    codes = torch.arange(16, dtype=torch.uint8)
    grid = torch.tensor(reference_epilogue.E2M1_VALUES)
    values = torch.cat([grid, -grid])
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = torch.cat([torch.randn(3000, generator=gen) * 3, ties, -ties,
                   torch.tensor([6.0, 6.5, 7.0, -9.0, 1e30, 0.0, -0.0, -1e-3])])
    encoded = reference_epilogue.encode_e2m1(x)
    assert_bitwise_equal(encoded, nearest_even(x, codes, values, 0x08), "e2m1 codes")
    decoded = reference_epilogue.decode_e2m1(encoded)
    assert_bitwise_equal(torch.signbit(decoded), torch.signbit(x), "e2m1 signs")


def _special_row(d: int, blocks: list, block: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    row = torch.randn(d, generator=gen)
    for b, kind in enumerate(blocks):
        part = row[b * block:(b + 1) * block]
        if kind == "zero":
            part.zero_()
        elif kind == "large":
            part.mul_(1000.0)
        elif kind == "tiny":
            part.mul_(1e-7)
        elif kind == "subnormal":
            part.mul_(1e-44)
        elif kind in ("nan", "inf", "-inf"):
            part[3] = float(kind)
    return row[None]


def test_fp8_ds_mla_special_blocks():
    kinds = ["zero", "large", "tiny", "nan", "inf", "-inf", "normal"]
    row = _special_row(512, kinds, 64)
    row[0, 450] = float("nan")  # a RoPE column: bf16 passes it through
    data, scales = reference_epilogue.encode_fp8_ds_mla(row.bfloat16())
    floor = ceil_exponent(fp32(fp32(1e-4) / 448)) + 127
    assert scales[0, 0] == floor and scales[0, 2] == floor, "amax below 1e-4: the floor"
    assert scales[0, 1] == ceil_exponent(fp32(float(row[0, 64:128].bfloat16().abs().max())
                                              / 448)) + 127
    assert scales[0, 3:6].tolist() == [0xFF] * 3 and scales[0, 7] == 0
    assert bool((data[0, 192:384] == 0x7F).all()), "NaN codes in non-finite blocks"
    decoded = reference_epilogue.decode_fp8_ds_mla(data, scales)[0]
    assert_bitwise_equal(decoded[:64], torch.zeros(64), "zero block")
    assert bool(decoded[192:384].isnan().all()), "non-finite blocks decode to NaN"
    assert bool(torch.isfinite(decoded[64:192]).all() and decoded[450].isnan())
    assert float(decoded[64:128].abs().max()) <= 448 * 2.0 ** (int(scales[0, 1]) - 127)


def test_fp8_block128_special_blocks():
    row = _special_row(640, ["zero", "subnormal", "large", "nan", "inf"], 128)
    encoded = reference_epilogue.encode_fp8_block128(row)
    scales = encoded[0, 640:].view(torch.float32)
    assert scales[0] == 0 and scales[1] == 0, "zero amax and an amax / 448 that underflows"
    amax = float(row[0, 256:384].abs().max())
    assert scales[2] == fp32(amax / 448), "scale = amax / 448 in fp32"
    assert bool(scales[3:].isnan().all()) and bool((encoded[0, 384:640] == 0x7F).all())
    decoded = reference_epilogue.decode_fp8_block128(encoded)[0]
    assert_bitwise_equal(decoded[:256], torch.zeros(256), "zero-scale blocks: exact zeros")
    assert bool(decoded[384:].isnan().all())
    assert float(decoded[256:384].abs().max()) == pytest.approx(amax, rel=2**-4)


def test_mxfp4_special_blocks():
    row = _special_row(160, ["zero", "subnormal", "large", "nan", "-inf"], 32)
    encoded = reference_epilogue.encode_mxfp4(row)
    scales = encoded[0, 80:]
    assert scales[:2].tolist() == [1, 1], "amax floored at 6 * 2**-126: scale 2**-126"
    amax = float(row[0, 64:96].abs().max())
    assert scales[2] == ceil_exponent(fp32(amax / 6)) + 127
    assert scales[3:].tolist() == [0xFF, 0xFF] and bool((encoded[0, 48:80] == 0).all())
    decoded = reference_epilogue.decode_mxfp4(encoded)[0]
    assert bool((decoded[:64] == 0).all()) and bool(decoded[96:].isnan().all())
    assert float(decoded[64:96].abs().max()) <= 6 * 2.0 ** (int(scales[2]) - 127)


# ---------------------------------------------------------------------------------------
# The op: requests fed in steps, rows stored into a paged cache.


class Serving:
    """Requests, their state, block table and cache in one format."""

    def __init__(self, cache_format: str, lengths, ratio: int, coff: int, rope_dim: int,
                 rotate: bool, seed: int = 0, dtype=torch.bfloat16):
        self.cache_format, self.ratio, self.coff = cache_format, ratio, coff
        self.rope_dim, self.rotate = rope_dim, rotate
        d = HEAD_DIM[cache_format]
        self.head_dim = d
        self.req = make_requests(lengths, ratio, coff, d, dtype, seed=seed)
        gen = torch.Generator().manual_seed(seed + 1)
        self.norm_weight = 1 + 0.25 * torch.randn(d, generator=gen)
        angles = torch.rand(64, max(rope_dim // 2, 1), generator=gen) * 6.3
        self.cos, self.sin = torch.cos(angles), torch.sin(angles)
        self.slot_of = permuted_slots(len(lengths), len(lengths) + 1, seed)
        self.state = CompressorState(len(lengths) + 1, ratio, coff, d, dtype)
        pages = -(-max(n // ratio for n in lengths) // PAGE_SIZE)
        num_pages = len(lengths) * pages + 2  # two spare pages nobody owns
        order = torch.randperm(num_pages, generator=gen)[:len(lengths) * pages]
        self.block_table = order.view(len(lengths), pages).to(torch.int32)
        self.cache = serving_store.new_cache(num_pages, PAGE_SIZE, d, cache_format, dtype)
        fill = torch.randint(0, 256, self.cache.shape, generator=gen, dtype=torch.uint8)
        self.cache.copy_(fill if cache_format != "none" else fill.to(dtype) - 300)
        self.initial = self.cache.clone()

    def args(self, step, consumed) -> tuple:
        kv, score, cu, start_pos, slots = step_inputs(self.req, step, consumed, self.slot_of)
        block_table = self.block_table[[i for i, _ in step]]
        return (kv, score, self.req.ape, cu, start_pos, slots, self.state.kv, self.state.score,
                self.norm_weight, 1e-6, self.cos, self.sin, self.rope_dim, self.rotate,
                self.cache_format, self.cache, block_table, PAGE_SIZE, self.ratio, self.coff)

    def run(self, schedule) -> None:
        consumed = [0] * len(self.req.kv)
        for step in schedule:
            cuc = OP(*self.args(step, consumed))
            rows = [(consumed[i] + n) // self.ratio - consumed[i] // self.ratio
                    for i, n in step]
            assert cuc.tolist() == [sum(rows[:j]) for j in range(len(rows) + 1)]
            for i, n in step:
                consumed[i] += n

    def whole(self, fn):
        """fn (the training op or the oracle) over the whole sequences, rows per request."""
        req = self.req
        lengths = req.lengths
        cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))],
                          dtype=torch.int32)
        counts = [n // self.ratio for n in lengths]
        cuc = torch.tensor([0] + [sum(counts[:i + 1]) for i in range(len(counts))],
                           dtype=torch.int32)
        rope = {"cos": self.cos, "sin": self.sin} if self.rope_dim else {}
        params = reference_epilogue.EpilogueParams(self.norm_weight, 1e-6, rope.get("cos"),
                                                   rope.get("sin"), self.rope_dim, self.rotate)
        rows = fn(torch.cat(req.kv), torch.cat(req.score), req.ape, cu, cuc, params)
        return list(rows.split(counts))

    def cache_rows(self, i: int, rows: int) -> list:
        """Cache row indices of request i's compressed rows 0..rows-1."""
        return [int(self.block_table[i, q // PAGE_SIZE]) * PAGE_SIZE + q % PAGE_SIZE
                for q in range(rows)]


def _training_rows(kv, score, ape, cu, cuc, params):
    return epilogue.compressor_epilogue(
        kv, score, ape, cu, cuc, ratio=RATIO, coff=COFF, norm_weight=params.norm_weight,
        cos=params.cos, sin=params.sin, rope_dim=params.rope_dim, rotate=params.rotate)


def _oracle_rows(kv, score, ape, cu, cuc, params):
    return reference_epilogue.compressor_epilogue_oracle(kv, score, ape, cu, cuc, RATIO, COFF,
                                                         params)


RATIO, COFF = 4, 2
LENGTHS = (11, 6, 17)
FORMAT_CASES = [
    pytest.param("none", 64, True, id="none_rope64_rot"),
    pytest.param("fp8_ds_mla", 64, False, id="fp8_ds_mla"),
    pytest.param("fp8_block128", 0, True, id="fp8_block128_rot"),
    pytest.param("mxfp4", 64, True, id="mxfp4_rope64_rot"),
]


def _one_prefill(s: Serving) -> None:
    s.run([[(i, n) for i, n in enumerate(s.req.lengths)]])


def _written_mask(s: Serving) -> torch.Tensor:
    """(num_pages, page bytes or page_size) bool: where the target rows' bytes live."""
    rows = [r for i, n in enumerate(s.req.lengths) for r in s.cache_rows(i, n // RATIO)]
    flat = torch.zeros(s.cache.shape[0] * PAGE_SIZE, dtype=torch.bool)
    flat[rows] = True
    by_slot = flat.view(s.cache.shape[0], PAGE_SIZE)
    if s.cache_format != "fp8_ds_mla":
        return by_slot[..., None].expand(s.cache.shape)
    mask = torch.zeros(s.cache.shape, dtype=torch.bool)
    data, scales = reference_epilogue.ds_mla_views(mask, PAGE_SIZE)
    data |= by_slot[..., None]
    scales |= by_slot[..., None]
    return mask


def _stored(s: Serving):
    """(stored rows per request, comparator rows per request) in the cache's decoding."""
    decoded = serving_store.dequantize_cache(s.cache, s.cache_format, PAGE_SIZE)
    rows = s.whole(_training_rows)
    return [decoded[s.cache_rows(i, r.shape[0])] for i, r in enumerate(rows)], rows


def _row_bytes(s: Serving, rows: list) -> tuple:
    """The bytes (or values, for none) stored at cache rows ``rows``."""
    if s.cache_format == "fp8_ds_mla":
        views = reference_epilogue.ds_mla_views(s.cache, PAGE_SIZE)
    else:
        views = (s.cache,)
    return tuple(v.reshape(-1, v.shape[-1])[rows] for v in views)


@pytest.mark.parametrize("cache_format, rope_dim, rotate", FORMAT_CASES)
def test_stored_rows_are_the_training_rows_encoded(cache_format, rope_dim, rotate):
    """Cache row block_table[i, q // P] * P + q % P holds the encoding of the training op's
    row q of request i; no other byte changes (the cache starts as random bytes)."""
    s = Serving(cache_format, LENGTHS, RATIO, COFF, rope_dim, rotate)
    _one_prefill(s)
    mask = _written_mask(s)
    assert_bitwise_equal(s.cache[~mask], s.initial[~mask], "bytes no row owns")
    for i, want in enumerate(s.whole(_training_rows)):
        got = _row_bytes(s, s.cache_rows(i, want.shape[0]))
        encoded = reference_epilogue.encode_rows(want, cache_format)
        for j, (a, b) in enumerate(zip(got, encoded)):
            assert_bitwise_equal(a, b, f"request {i}, part {j}")


def _blocks(cache_format: str):
    """(first quantized column, end, block size, fp8 grid top, amax floor) per format."""
    return {"fp8_ds_mla": (0, 448, 64, 448.0, fp32(1e-4)), "fp8_block128": (0, 128, 128, 448.0,
                                                                             None),
            "mxfp4": (0, 128, 32, 6.0, 6 * 2.0**-126)}[cache_format]


def _grid_step(u: torch.Tensor, cache_format: str) -> torch.Tensor:
    """Spacing of the element grid at |u| (in scaled units)."""
    mag = u.abs()
    if cache_format == "mxfp4":
        return torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0)).double()
    exponent = torch.floor(torch.log2(mag.clamp(min=2.0**-6)))
    return torch.exp2(exponent - 3).double()


@pytest.mark.parametrize("cache_format", ["fp8_ds_mla", "fp8_block128", "mxfp4"])
def test_quantized_rows_against_the_rows_and_the_fp64_oracle(cache_format):
    """Scales bit for bit from the comparator rows (Python floats); values within one grid
    step of the comparator, and of the oracle up to the comparator's own rounding (four
    half steps of the row's largest value, as the training op's oracle test)."""
    rope_dim = 64 if cache_format == "fp8_ds_mla" else 0
    s = Serving(cache_format, LENGTHS, RATIO, COFF, rope_dim, cache_format != "fp8_ds_mla",
                seed=4)
    _one_prefill(s)
    stored, rows = _stored(s)
    truth = s.whole(_oracle_rows)
    start, end, block, top, floor = _blocks(cache_format)
    for got, want, exact in zip(stored, rows, truth):
        values = want[:, start:end].float().reshape(-1, block)
        scale = []
        for amax in values.abs().amax(1).tolist():
            if cache_format == "fp8_block128":
                scale.append(fp32(amax / top))
            else:
                scale.append(2.0 ** ceil_exponent(fp32(max(amax, floor) / top)))
        scale = torch.tensor(scale, dtype=torch.float64)[:, None]
        deq = got[:, start:end].double().reshape(-1, block)
        # fp8_block128 decodes code * scale in fp32: one rounding off the grid point.
        assert bool(((deq / scale).abs() <= top * (1 + 2**-23)).all()), "values past the grid"
        step = _grid_step(values.double() / scale, cache_format) * scale
        assert bool(((deq - values.double()).abs() <= step).all()), "one step of the rows"
        row_max = exact.abs().amax(1, keepdim=True)
        slack = (4 * ulp(row_max, torch.bfloat16)).expand(-1, end - start).reshape(-1, block)
        off = (deq - exact[:, start:end].reshape(-1, block)).abs()
        assert bool((off <= step + slack).all()), "one step of the oracle"
        if cache_format == "fp8_ds_mla":
            assert_bitwise_equal(got[:, 448:], want[:, 448:].float(), "RoPE columns")


@pytest.mark.parametrize("cache_format, rope_dim, rotate", FORMAT_CASES)
def test_chunked_prefill_and_decode_store_what_one_prefill_stores(cache_format, rope_dim,
                                                                  rotate):
    whole = Serving(cache_format, LENGTHS, RATIO, COFF, rope_dim, rotate, seed=5)
    _one_prefill(whole)
    chunked = Serving(cache_format, LENGTHS, RATIO, COFF, rope_dim, rotate, seed=5)
    chunked.run(random_schedule(LENGTHS, RATIO, seed=5, decode_tail=6))
    assert_bitwise_equal(chunked.cache, whole.cache, "cache")
    again = Serving(cache_format, LENGTHS, RATIO, COFF, rope_dim, rotate, seed=5)
    _one_prefill(again)
    assert_bitwise_equal(again.cache, whole.cache, "run to run")


@pytest.mark.parametrize("coff", [1, 2])
def test_coff_and_ratio_variants_match_the_training_rows(coff):
    s = Serving("none", (9, 3, 12), 3, coff, 64, False, seed=6, dtype=torch.float32)
    s.run(random_schedule((9, 3, 12), 3, seed=6, decode_tail=4))
    decoded = serving_store.dequantize_cache(s.cache, "none", PAGE_SIZE)
    req = s.req
    cu = torch.tensor([0, 9, 12, 24], dtype=torch.int32)
    cuc = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    want = epilogue.compressor_epilogue(torch.cat(req.kv), torch.cat(req.score), req.ape, cu,
                                        cuc, ratio=3, coff=coff, norm_weight=s.norm_weight,
                                        cos=s.cos, sin=s.sin, rope_dim=64)
    for i, rows in enumerate(want.split([3, 1, 4])):
        assert_bitwise_equal(decoded[s.cache_rows(i, rows.shape[0])], rows, f"request {i}")


def test_nan_rows_store_nan_scales_not_clean_values():
    for cache_format in ("fp8_block128", "mxfp4"):
        s = Serving(cache_format, (8,), RATIO, COFF, 0, True, seed=7)
        # An Inf in row 1's window (own block: second-half columns): the norm makes NaN
        # of it, the rotation spreads NaN over the row.
        s.req.kv[0][5, HEAD_DIM[cache_format] + 3] = float("inf")
        _one_prefill(s)
        stored, _ = _stored(s)
        assert bool(stored[0][1].isnan().all()) and bool(torch.isfinite(stored[0][0]).all())


@pytest.mark.parametrize("table", ["bad_pages", "narrow"])
def test_unchecked_path_skips_rows_it_cannot_place(table):
    """The path CUDA takes (no content checks): rows whose block-table entry is negative or
    past the cache (bad_pages), or past the table's width (narrow), write nothing; the
    others are stored as a clean call stores them."""
    s = Serving("fp8_block128", LENGTHS, RATIO, COFF, 0, True, seed=8)
    args = list(s.args([(0, 11), (1, 6), (2, 17)], [0, 0, 0]))
    if table == "bad_pages":
        args[ARG["block_table"]][0, 0] = -1  # request 0's rows 0 and 1
        args[ARG["block_table"]][2, 1] = s.cache.shape[0]  # request 2's row 3
        placed = [(1, 0), (2, 0), (2, 1), (2, 2)]
    else:
        args[ARG["block_table"]] = args[ARG["block_table"]][:, :1].contiguous()
        placed = [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1), (2, 2)]
    serving_store.extend_store(*args, check_contents=False)
    clean = Serving("fp8_block128", LENGTHS, RATIO, COFF, 0, True, seed=8)
    _one_prefill(clean)
    flat, want = (c.cache.view(-1, c.cache.shape[-1]) for c in (s, clean))
    rows = [s.cache_rows(i, q + 1)[q] for i, q in placed]
    assert_bitwise_equal(flat[rows], want[rows], "rows with a page")
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[rows] = False
    assert_bitwise_equal(flat[untouched], s.initial.view(flat.shape)[untouched], "the rest")


def test_unchecked_path_with_no_row_to_write_leaves_the_cache():
    s = Serving("none", (8, 5), RATIO, COFF, 64, True, seed=9)
    args = list(s.args([(0, 8), (1, 5)], [0, 0]))
    args[16] = torch.full_like(s.block_table, -3)
    serving_store.extend_store(*args, check_contents=False)
    assert_bitwise_equal(s.cache, s.initial, "cache")


@pytest.mark.parametrize("cache_format, rope_dim, rotate", FORMAT_CASES)
@pytest.mark.parametrize("pages", ["some_out_of_range", "none_in_range"])
def test_unchecked_path_reads_nothing_on_the_host(cache_format, rope_dim, rotate, pages):
    """The path CUDA takes never syncs (what lets a decode step sit in a CUDA graph): no
    op of the composition reads tensor contents on the host, whether some rows or none
    have a page; the cache is then what the same call stores outside the check."""
    caches = []
    for mode in (HostReadsAreErrors, contextlib.nullcontext):
        s = Serving(cache_format, LENGTHS, RATIO, COFF, rope_dim, rotate, seed=14)
        args = list(s.args([(0, 11), (1, 6), (2, 17)], [0, 0, 0]))
        table = args[ARG["block_table"]]
        table[0, 0] = -1
        if pages == "none_in_range":
            table.fill_(s.cache.shape[0])
        with mode():
            serving_store.extend_store(*args, check_contents=False)
        caches.append(s.cache)
    assert_bitwise_equal(caches[0], caches[1], "cache")
    assert torch.equal(caches[0], s.initial) == (pages == "none_in_range")


OPCHECK_CASES = [
    pytest.param("none", 1, 0, False, id="none_coff1_rope0"),
    pytest.param("fp8_ds_mla", 2, 64, False, id="fp8_ds_mla_coff2"),
    pytest.param("fp8_block128", 1, 64, True, id="fp8_block128_coff1_rot"),
    pytest.param("mxfp4", 2, 0, True, id="mxfp4_coff2_rot"),
]


@pytest.mark.parametrize("cache_format, coff, rope_dim, rotate", OPCHECK_CASES)
def test_opcheck(cache_format, coff, rope_dim, rotate):
    s = Serving(cache_format, (6, 1, 9), RATIO, coff, rope_dim, rotate, seed=10)
    torch.library.opcheck(OP, s.args([(0, 6), (2, 9), (1, 1)], [0, 0, 0]))


def test_fake_returns_the_offsets_metadata():
    s = Serving("mxfp4", (6, 9), RATIO, COFF, 0, True, seed=11)
    args = s.args([(0, 6), (1, 9)], [0, 0])
    with FakeTensorMode() as mode:
        fake = OP(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    real = OP(*args)
    assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())


def test_gradient_request_is_refused():
    s = Serving("none", (6,), RATIO, COFF, 0, False, seed=12)
    s.norm_weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="compressor_extend_store: inference only"):
        OP(*s.args([(0, 6)], [0]))
    with torch.no_grad():
        OP(*s.args([(0, 6)], [0]))


def test_wrapper_and_dequantize_helpers():
    s = Serving("fp8_ds_mla", (8,), RATIO, COFF, 64, False, seed=13)
    kv, score, ape, cu, start_pos, slots, *_ = s.args([(0, 8)], [0])
    cuc = serving_store.compressor_extend_store(
        kv, score, ape, cu, start_pos, slots, s.state.kv, s.state.score,
        norm_weight=s.norm_weight, cache_format="fp8_ds_mla", cache=s.cache,
        block_table=s.block_table, page_size=PAGE_SIZE, ratio=RATIO, coff=COFF, cos=s.cos,
        sin=s.sin, rope_dim=64)
    assert cuc.tolist() == [0, 2]
    assert_bitwise_equal(serving_store.dequantize_fp8_ds_mla(s.cache, PAGE_SIZE),
                         serving_store.dequantize_cache(s.cache, "fp8_ds_mla", PAGE_SIZE), "")
    for cache_format, helper in (("fp8_block128", serving_store.dequantize_fp8_block128),
                                 ("mxfp4", serving_store.dequantize_mxfp4)):
        cache = serving_store.new_cache(2, 4, 256, cache_format)
        assert_bitwise_equal(helper(cache), torch.zeros(8, 256), cache_format)


# ---------------------------------------------------------------------------------------
# Bad inputs: every one names the argument, and none writes anything.

ARG = {name: i for i, name in enumerate(
    ("kv", "score", "ape", "cu_seqlens", "start_pos", "slots", "kv_state", "score_state",
     "norm_weight", "eps", "cos", "sin", "rope_dim", "rotate", "cache_format", "cache",
     "block_table", "page_size", "ratio", "coff"))}


def _bad(name, cache_format, mutate, match, error=ValueError):
    return pytest.param(cache_format, mutate, match, error, id=name)


def _set(**changes):
    def mutate(args):
        for key, value in changes.items():
            args[ARG[key]] = value(args) if callable(value) else value
    return mutate


BAD_INPUTS = [
    _bad("format_unknown", "none", _set(cache_format="fp16"), "`cache_format` must be one of"),
    _bad("none_dtype", "none", _set(cache=lambda a: a[ARG["cache"]].float()),
         "`cache` must be torch.bfloat16 for cache_format 'none'"),
    _bad("none_shape", "none", _set(page_size=4), r"`cache` must have shape \('num_pages', 4"),
    _bad("block128_width", "fp8_block128",
         _set(cache=lambda a: a[ARG["cache"]][..., :-1].contiguous()),
         r"`cache` must have shape \('num_pages', 3, 132\)"),
    _bad("mxfp4_dtype", "mxfp4", _set(cache=lambda a: a[ARG["cache"]].to(torch.int8)),
         "`cache` must be torch.uint8"),
    _bad("cache_noncontiguous", "mxfp4",
         _set(cache=lambda a: a[ARG["cache"]].transpose(0, 1).contiguous().transpose(0, 1)),
         "`cache` must be contiguous"),
    _bad("cache_device", "none", _set(cache=lambda a: a[ARG["cache"]].to("meta")),
         "`cache` must be on the device of `kv`"),
    _bad("ds_mla_head_dim", "none", _set(cache_format="fp8_ds_mla"),
         "cache_format 'fp8_ds_mla' needs head_dim 512"),
    _bad("ds_mla_rope", "fp8_ds_mla", _set(rope_dim=32, cos=lambda a: a[ARG["cos"]][:, :16],
                                           sin=lambda a: a[ARG["sin"]][:, :16]),
         "`rope_dim` must be 64 for cache_format 'fp8_ds_mla'"),
    _bad("ds_mla_page_bytes", "fp8_ds_mla",
         _set(cache=lambda a: a[ARG["cache"]][:, :2303].contiguous()),
         r"page_bytes >= 2304 \(3 rows of 576 bytes and 8 scale bytes"),
    _bad("ds_mla_rank", "fp8_ds_mla",
         _set(cache=lambda a: a[ARG["cache"]][:, :1728].reshape(-1, 3, 576)),
         r"`cache` must be \(num_pages, page_bytes\)"),
    _bad("block128_head_dim", "fp8_block128", _set(
        kv=lambda a: a[0][:, :128], score=lambda a: a[1][:, :128], ape=lambda a: a[2][:, :128],
        kv_state=lambda a: a[6][..., :128].contiguous(),
        score_state=lambda a: a[7][..., :128].contiguous(),
        norm_weight=lambda a: a[8][:64]),
         "cache_format 'fp8_block128' needs head_dim a multiple of 128, got head_dim=64"),
    _bad("rotate_not_pow2", "fp8_block128", _set(
        kv=lambda a: a[0][:, :192], score=lambda a: a[1][:, :192], ape=lambda a: a[2][:, :192],
        kv_state=lambda a: a[6][..., :192].contiguous(),
        score_state=lambda a: a[7][..., :192].contiguous(),
        norm_weight=lambda a: a[8][:96]),
         "`rotate` needs a power-of-two head_dim .*, got head_dim=96"),
    _bad("quantized_fp64", "mxfp4", _set(
        kv=lambda a: a[0].double(), score=lambda a: a[1].double(),
        kv_state=lambda a: a[6].double(), score_state=lambda a: a[7].double()),
         "`kv` must be bfloat16, float16 or float32 for cache_format 'mxfp4'"),
    _bad("page_size_zero", "none", _set(page_size=0), "`page_size` must be >= 1"),
    _bad("page_size_float", "none", _set(page_size=3.0), "page_size", (ValueError, RuntimeError)),
    _bad("block_table_int64", "none", _set(block_table=lambda a: a[ARG["block_table"]].long()),
         r"`block_table` must be an int32 tensor of shape \(B, pages per request\)"),
    _bad("block_table_rows", "none", _set(block_table=lambda a: a[ARG["block_table"]][:1]),
         "`block_table` must be an int32 tensor"),
    _bad("block_table_page", "none", lambda a: a[ARG["block_table"]].__setitem__((1, 0), 99),
         r"`block_table\[1, 0\]` = 99 is out of range \[0, 8\)"),
    _bad("block_table_narrow", "none",
         _set(block_table=lambda a: a[ARG["block_table"]][:, :1].contiguous()),
         "`block_table` has 1 pages per request, but request 0's compressed row 3 needs page 1"),
    _bad("position_past_table", "none", _set(cos=lambda a: a[ARG["cos"]][:8],
                                             sin=lambda a: a[ARG["sin"]][:8]),
         "`cos`/`sin` hold 8 positions, but request 0's compressed row 3 sits at position 12"),
    _bad("cos_shape", "none", _set(cos=lambda a: a[ARG["cos"]][:, :3]), "`cos` must have shape"),
    _bad("rope_odd", "none", _set(rope_dim=5), "`rope_dim` must be even"),
    _bad("weight_shape", "none", _set(norm_weight=lambda a: a[8][:7]), "`norm_weight` must"),
    _bad("eps_negative", "none", _set(eps=-1.0), "`eps` must be a finite float >= 0"),
    _bad("slot_out_of_range", "none", lambda a: a[ARG["slots"]].__setitem__(0, 7),
         r"`slots\[0\]` = 7 is out of range"),
    _bad("ratio_zero", "none", _set(ratio=0), "`ratio` must be an int >= 1"),
    _bad("state_dtype", "none", _set(kv_state=lambda a: a[6].float()), "`kv_state` must be"),
]


@pytest.mark.parametrize("cache_format, mutate, match, error", BAD_INPUTS)
def test_bad_input_raises_before_writing(cache_format, mutate, match, error):
    s = Serving(cache_format, (17, 5, 6), RATIO, COFF,
                64 if cache_format in ("none", "fp8_ds_mla") else 0,
                cache_format in ("fp8_block128", "mxfp4"), seed=14)
    args = list(s.args([(0, 17), (1, 5), (2, 6)], [0, 0, 0]))
    mutate(args)
    state = (s.state.kv.clone(), s.state.score.clone())
    with pytest.raises(error, match=match):
        OP(*args)
    assert_bitwise_equal(s.cache, s.initial, "cache")
    assert_bitwise_equal(s.state.kv, state[0], "kv_state")
    assert_bitwise_equal(s.state.score, state[1], "score_state")


def test_errors_name_the_store_op():
    s = Serving("none", (6,), RATIO, COFF, 0, False, seed=15)
    args = list(s.args([(0, 6)], [0]))
    args[ARG["slots"]] = torch.tensor([9], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^csa\.compressor_extend_store: `slots\[0\]` = 9"):
        OP(*args)
    args[ARG["slots"]] = torch.tensor([0], dtype=torch.int32)
    args[ARG["cache_format"]] = "fp4"
    with pytest.raises(ValueError, match=r"^csa\.compressor_extend_store: `cache_format`"):
        OP(*args)


def test_compressor_block_extend_stores_its_forward_rows_encoded():
    """csa_ops.Compressor.extend with a cache: a prefill of most of each sequence, then
    decode steps, leave in every cache row the encoding of the block's own forward rows over
    the whole sequences (RMSNorm, RoPE, rotation); the other bytes stay zero."""
    torch.manual_seed(0)
    ratio, coff, d, dim, page_size, fmt = 4, 2, 64, 24, 3, "mxfp4"
    block = csa_ops.Compressor(dim, d, ratio, coff, rope_dim=16, rotate=True).eval()
    with torch.no_grad():
        block.norm.weight.uniform_(0.5, 1.5)
    lengths = [13, 8, 21]
    xs = [torch.randn(n, dim) for n in lengths]
    cos, sin = rope_tables(16, 32)
    pages = 2  # 5 rows at most, pages of 3
    table = torch.arange(len(lengths) * pages, dtype=torch.int32).flip(0).view(-1, pages)
    cache = serving_store.new_cache(len(lengths) * pages, page_size, d, fmt)
    state = CompressorState(len(lengths), ratio, coff, d, torch.float32)
    slots = torch.arange(len(lengths), dtype=torch.int32)
    done = [n - 3 for n in lengths]
    pieces = [[x[:n] for x, n in zip(xs, done)]] + [
        [x[n + k:n + k + 1] for x, n in zip(xs, done)] for k in range(3)]
    starts = [[0] * len(lengths)] + [[n + k for n in done] for k in range(3)]
    for piece, start in zip(pieces, starts):
        cu, _ = csa_ops.offsets_for([p.shape[0] for p in piece], ratio)
        block.extend(torch.cat(piece), cu, torch.tensor(start, dtype=torch.int32), slots,
                     state, cache=cache, cache_format=fmt, block_table=table,
                     page_size=page_size, cos=cos, sin=sin)
    cu, cuc = csa_ops.offsets_for(lengths, ratio)
    with torch.no_grad():
        rows = block(torch.cat(xs), cu, cuc, cos=cos, sin=sin)
    want = torch.zeros_like(cache)
    for i, part in enumerate(rows.split([n // ratio for n in lengths])):
        encoded = reference_epilogue.encode_rows(part, fmt)[0]
        for q in range(part.shape[0]):
            want[int(table[i, q // page_size]), q % page_size] = encoded[q]
    assert_bitwise_equal(cache, want, "cache")
    with pytest.raises(ValueError, match="block_table"):
        block.extend(torch.cat(pieces[1]), cu, torch.tensor(starts[1], dtype=torch.int32),
                     slots, state, cache=cache, cache_format=fmt)
    with pytest.raises(ValueError, match="describe a `cache`"):
        block.extend(torch.cat(pieces[1]), cu, torch.tensor(starts[1], dtype=torch.int32),
                     slots, state, block_table=table)


@pytest.mark.parametrize("cache_format, rope_dim, rotate", FORMAT_CASES[1:])
def test_compiled_steps_store_what_eager_steps_store(cache_format, rope_dim, rotate):
    """torch.compile(fullgraph=True) of a serving step (the op mutating the state and the
    cache in place, then a use of the offsets): a prefill piece and decode steps leave the
    state, the cache and the offsets bitwise as eager steps do."""
    torch._dynamo.reset()
    eager = Serving(cache_format, LENGTHS, RATIO, COFF, rope_dim, rotate)
    compiled = Serving(cache_format, LENGTHS, RATIO, COFF, rope_dim, rotate)

    @torch.compile(fullgraph=True)
    def step(*args):
        return OP(*args) * 2

    schedule = random_schedule(list(LENGTHS), RATIO, seed=5, decode_tail=3)
    consumed = [0] * len(LENGTHS)
    for piece in schedule:
        want = OP(*eager.args(piece, consumed)) * 2
        got = step(*compiled.args(piece, consumed))
        assert_bitwise_equal(got, want, "offsets")
        for i, n in piece:
            consumed[i] += n
    assert_bitwise_equal(compiled.cache, eager.cache, "cache")
    assert_bitwise_equal(compiled.state.kv, eager.state.kv, "kv_state")
    assert_bitwise_equal(compiled.state.score, eager.state.score, "score_state")


def test_metadata_checks_run_once_per_signature(monkeypatch):
    """A repeated call's metadata checks are skipped (its signature passed them), but not
    the cache's layout, which the signature leaves out, nor a scalar of another type."""
    s = Serving("mxfp4", (17, 5, 6), RATIO, COFF, 0, True, seed=16)
    args = list(s.args([(0, 17), (1, 5), (2, 6)], [0, 0, 0]))
    calls = []
    check = serving_store.check_arguments
    monkeypatch.setattr(serving_store, "check_arguments",
                        lambda *a: calls.append(1) or check(*a))
    serving_store._CHECKED.clear()
    OP(*args)
    OP(*args)
    assert len(calls) == 1
    cache = args[ARG["cache"]]
    args[ARG["cache"]] = cache.transpose(0, 1).contiguous().transpose(0, 1)
    with pytest.raises(ValueError, match="`cache` must be contiguous"):
        OP(*args)
    assert len(calls) == 2
    args[ARG["cache"]] = cache
    ratio = float(args[ARG["ratio"]])  # equal and of the same hash, but not an int
    with pytest.raises(ValueError, match="`ratio` must be an int"):
        serving_store._check_once(cache, (*args[:ARG["ratio"]], ratio, args[ARG["coff"]]))
    assert len(calls) == 3
