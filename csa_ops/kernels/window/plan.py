"""Register-window family, host side: keys, support, launch plans of all three directions.

Pure Python, no DSL: keys and launch plans are chosen without importing the compiler. The
device code (forward.py, backward.py, extend.py) builds on `Geometry` below.
"""

from __future__ import annotations

import dataclasses
import functools

from ...config import (
    TYPES,
    Direction,
    KernelKey,
    LaunchPlan,
    Part,
    WindowKnobs,
    widest_vec,
    with_knobs,
)
from .. import sm
from ..calls import SizeClass, check_lanes, from_forward
from ..epilogue.plan import EpilogueKey

# Largest window (coff * ratio) the family keeps in registers; larger ones go to streaming.
WINDOW_MAX = 32
# Up to this head_dim and window the family favours threads over vector width (see
# _vec_threads); measured at window 8, wider windows keep the register-lean default.
NARROW_HEAD_DIM = 128
NARROW_WINDOW_MAX = 8
CTAS_PER_SM = 4  # backward grid-stride target; more CTAs only add grad_ape partials


def configure(ratio: int, coff: int, head_dim: int, dtype: str, arch: str,
              direction: Direction, **overrides: int) -> KernelKey:
    """Heuristic key for one direction (extend: the forward's); `overrides` set knobs by
    name (autotuning).

    A thread holds window * vec elements of kv and of score in registers (at most 64 each,
    and the backward's grad_ape partials in shared memory also scale with it), so wide
    windows trade vector width for registers.
    """
    backward = direction is Direction.BACKWARD
    vec, threads = _vec_threads(ratio, coff, head_dim, dtype, backward)
    knobs = WindowKnobs(vec, threads, **_flags(coff * ratio, head_dim, dtype, backward))
    key = KernelKey("window", ratio, coff, head_dim, dtype, arch, knobs)
    return with_knobs(key, **overrides) if overrides else key


def _flags(window: int, head_dim: int, dtype: str, backward: bool) -> dict[str, bool]:
    if backward:
        # Wide rows: the 2-D grid (column chunk slowest) beat the 1-D one in three H200
        # runs at d512 (3x8192 r4 c2 63.0 against 65.6 us, 1x65536 160.5 against 163.0,
        # 1x8192 24.0 against 25.0); at d128 the 1-D grid won (1x8192 9.9 against 10.2).
        return {"linear": head_dim <= NARROW_HEAD_DIM}
    # The bf16 forward takes the certified fast softmax (shared/softmax.py, pool_fast):
    # within one output rounding step, as the numerics contract allows (H200: 3x8192 d512 r4 c2 30.7
    # against 34.9 us, 142 of 3.1M elements one step off). fp16's 8x finer step would send
    # 8x more columns to the exact fallback, and fp32 has no slack: both stay exact. Short
    # windows over narrow rows are latency-bound, and there the certificate's longer chain
    # costs more than the exact softmax (r4 c1 1x8192 d128: 3.27 against 3.0 us).
    fast = dtype == "bfloat16" and not (window <= 4 and head_dim <= NARROW_HEAD_DIM)
    return {"fast_exp": fast}


def _vec_threads(ratio: int, coff: int, head_dim: int, dtype: str,
                 backward: bool) -> tuple[int, int]:
    window = coff * ratio
    vec = widest_vec(head_dim, TYPES[dtype].bytes, max(1, 64 // window))
    if backward and head_dim > NARROW_HEAD_DIM and window <= 4:
        # Windows of 4 leave room for 16-byte accesses (H200, r2 c2 3x8192 d512 bwd sweep:
        # vec 8 / 128 threads 68.4 us, vec 4 / 128 77.0, vec 2 / 256 79.0).
        return vec, 128
    if window <= NARROW_WINDOW_MAX and (backward or head_dim <= NARROW_HEAD_DIM):
        # The kernels are latency-bound: trade vector width for threads (and registers for
        # occupancy). H200 sweeps, r4 c2 bf16, every key checked against the reference:
        # 1x8192 d128: vec 8 / 128 threads 12.5 us fwd, 18.5 us bwd; vec 2 / 256: 6.7, 12.5.
        # 3x8192 d512 bwd: vec 8 / 128 87.3 us, vec 4 / 128 65.0, vec 2 / 256 63.8.
        return min(vec, 2), 256
    if window <= NARROW_WINDOW_MAX:
        # 3x8192 d512 fwd: vec 8 / 128 threads 39.0 us, vec 4 / 128 36.3, vec 2 / 256 39.0.
        return min(vec, 4), 128
    return vec, 128


def fast_forward(key: KernelKey) -> KernelKey:
    """The forward key of the fast numerics mode: the same (the certified fast softmax
    already runs at full speed)."""
    return key


def supports(key: KernelKey) -> bool:
    return key.family == "window" and key.window <= WINDOW_MAX


def enumerate_keys(ratio: int, coff: int, head_dim: int, dtype: str, arch: str,
                   direction: Direction):
    """All keys worth timing for one problem (autotuning): vector widths and CTA sizes
    around the heuristic's other knobs."""
    backward = direction is Direction.BACKWARD
    base = configure(ratio, coff, head_dim, dtype, arch, direction)
    vmax = widest_vec(head_dim, TYPES[dtype].bytes, max(1, 64 // (coff * ratio)))
    for vec in (v for v in (1, 2, 4, 8, 16) if v <= vmax):
        for threads in (64, 128, 256):
            key = with_knobs(base, vec=vec, threads=threads)
            yield key
            if backward and threads == 128:
                yield with_knobs(key, min_ctas=3)


class Geometry:
    """Static CTA shape of a key: `rpc` rows of `cvc` column vectors (`vec` columns each),
    `ny` column chunks per row; E grad_ape elements. A chunk is 128 bytes of a row, or the
    whole row where `whole_rows` (a kernel whose CTA finishes its rows: extend_store.py)."""

    whole_rows = False

    def __init__(self, key: KernelKey) -> None:
        self.R, self.C, self.D, self.V = key.ratio, key.coff, key.head_dim, key.knobs.vec
        self.W = self.R * self.C
        self.tpr = self.D // self.V
        cvc = (self.tpr if self.whole_rows
               else min(self.tpr, max(1, 128 // (self.V * key.elem_bytes))))
        self.ny = -(-self.tpr // cvc)
        self.cvc = -(-self.tpr // self.ny)
        self.rpc = max(1, key.knobs.threads // self.cvc)
        self.threads = self.cvc * self.rpc
        self.ragged_cols = self.cvc * self.ny != self.tpr
        self.E = self.R * self.C * self.D  # grad_ape elements


@functools.lru_cache(maxsize=256)
def geometry(key: KernelKey) -> Geometry:
    # Plans run on every launch: build each key's geometry once.
    return Geometry(key)


def plan_forward(key: KernelKey, num_tokens: int, num_rows: int, num_sms: int) -> LaunchPlan:
    g = geometry(key)
    return LaunchPlan(grid=max(1, -(-num_rows // g.rpc)))


def plan_backward(key: KernelKey, num_tokens: int, num_rows: int, num_sms: int) -> LaunchPlan:
    g = geometry(key)
    grid = _grid_stride(key.ratio, num_tokens, num_rows, g.rpc, g.ny, num_sms)
    return LaunchPlan(grid=grid, workspace=grid * g.E)


def _grid_stride(ratio: int, num_tokens: int, num_rows: int, rows_per_cta: int,
                 chunks: int, num_sms: int) -> int:
    """The backward's grid (its row blocks): CTAS_PER_SM CTAs an SM over the column chunks,
    fewer where the slots (a row and a ratio of tokens each) run out."""
    slots = max(-(-num_tokens // ratio), num_rows)
    return max(1, min(-(-slots // rows_per_cta), max(1, num_sms * CTAS_PER_SM // chunks)))


# csa::compressor_extend. Launch knobs by call size (new tokens). H200, d512 r4 c2 bf16,
# CUDA-graph replay per call, against the forward key's vec 4 / 128 threads: decode at batch
# 1 / 64 / 256 takes 2.90 / 3.24 / 5.42 us with vec 2 / 128 threads (4.03 / 4.43 / 6.37):
# small calls want more, narrower CTAs. Decode-sized calls also preload one-token requests'
# state updates (kernel time at batch 64 / 256: 2.78 / 5.16 us against 3.10 / 5.49).
# Decode steps let each request pool its own rows (request_rows): no row items, and a CTA
# sums the rows before its requests instead of scanning the batch (batch 1 / 64 / 256 /
# 1024 2.66 / 2.99 / 4.76 / 15.0 us against 2.81 / 3.26 / 5.09 / 21.8 with the batch scan).
# Larger calls split (part): the requests' items, whose windows held across the scan cost
# registers (118 against the forward's 77: 4 CTAs per SM instead of 6), launch apart from
# the row items, which then run at 77; the first part's CTAs take few items' knobs (4 x
# 2048: 13.98 against 15.30 us at the forward's vec 4; training forward 13.34). Split calls
# of few requests and many tokens place their row items by lanes (lane_requests): part 2
# then runs as fast as the training forward (ncu, 4 x 8192: 51.9 against 52.6 us; with the
# batch scan 58.1 us). Below LANE_TOKENS the first part's chain of loads sets the call's
# time and part 2's earlier loads slow it down (4 x 256: 7.42 against 6.89 us).


def extend_key(key: KernelKey, size: SizeClass) -> KernelKey:
    """The extend key of forward key `key` for calls of size class `size`."""
    if size in (SizeClass.STEP, SizeClass.LARGE_STEP):
        # A call with as many tokens as requests may still give one request several (its
        # rows past coff then pool one after another): correct, if slower than row items.
        return with_knobs(extend_key(key, SizeClass.DECODE_SIZED), request_rows=True)
    if size == SizeClass.DECODE_SIZED:
        return _few_items(key, preload_decode=True)
    return from_forward(key, part=Part.REQUESTS, lane_requests=size == SizeClass.FEW_LARGE)


def _few_items(key: KernelKey, **knobs: int) -> KernelKey:
    """Launch knobs for CTAs of few items (decode-sized calls, a split call's requests):
    more, narrower CTAs."""
    return from_forward(key, vec=min(key.knobs.vec, 2), threads=128, **knobs)


def extend_launches(key: KernelKey) -> tuple[KernelKey, ...]:
    """The kernels one call of extend key `key` launches, in order: itself, or a split
    call's two parts (requests' items, at few items' knobs, then row items). Part 1 is the
    same kernel whichever way part 2 places its rows (one key for it)."""
    if not key.knobs.part:
        return (key,)
    return (_few_items(with_knobs(key, lane_requests=False), part=Part.REQUESTS),
            with_knobs(key, part=Part.ROWS))


def plan_extend_launch(key: KernelKey, num_tokens: int, num_requests: int, num_rows: int,
                       num_sms: int) -> LaunchPlan:
    """One launch of extend key `key` (an entry of extend_launches): one CTA per `rpc` work
    items and column chunk; the items are each request's (its state), then each output row
    unless the key's requests pool their own rows; a split call's parts have the requests'
    items and the row items. At least one CTA: a launch with row items, or whose requests
    pool their own rows, writes cu_seqlens_comp."""
    check_lanes(key, num_requests)
    if key.knobs.request_rows or key.knobs.part == Part.REQUESTS:
        items = num_requests
    elif key.knobs.part == Part.ROWS:
        items = num_rows
    else:
        items = num_requests + num_rows
    return LaunchPlan(grid=max(1, -(-items // geometry(key).rpc)))


def plan_extend(key: KernelKey, num_tokens: int, num_requests: int, num_rows: int,
                num_sms: int) -> tuple[tuple[KernelKey, LaunchPlan], ...]:
    """(key, plan) of each launch of one call of extend key `key` (extend_key's)."""
    return tuple((part, plan_extend_launch(part, num_tokens, num_requests, num_rows, num_sms))
                 for part in extend_launches(key))


# Kernels that fuse the row epilogue into the pooling (a CTA's threads are the epilogue's, so
# a pooled row goes through it where it is pooled): csa::compressor_extend_store's decode
# steps (extend_store.py, a request per CTA) and csa::compressor_epilogue's forward
# (forward_epilogue.py, consecutive rows per CTA) and backward (backward_epilogue.py, the
# backward's grid-stride rows).
FUSED_SMEM = 40 * 1024  # bytes: below the 48 KiB a launch gets without opting in


class _FusedKey:
    """What a key of a pooling kernel fused with the row epilogue derives from its pooling
    key (the field ``pooling_field`` names) and its ``epilogue`` key, whose dtype, arch and
    head_dim agree and whose CTA shapes are one."""

    family = "window"  # the kernel package (kernels.families.KERNELS)
    pooling_field = ""

    @property
    def pooling(self) -> KernelKey:
        return getattr(self, self.pooling_field)

    def check_keys(self) -> None:
        p, x, name = self.pooling, self.epilogue, type(self).__name__
        if (p.dtype, p.arch) != (x.dtype, x.arch) or p.head_dim != x.head_dim:
            raise ValueError(f"{name}: the {self.pooling_field} and epilogue keys must agree "
                             f"on dtype, arch and head_dim, got {p!r} and {x!r}")
        if (p.knobs.vec, p.knobs.threads) != (x.vec, x.threads):
            raise ValueError(f"{name}: the {self.pooling_field} key must pool in the "
                             f"epilogue's CTA ({x.threads} threads of {x.vec} columns), got "
                             f"{p.knobs!r}")

    dtype = property(lambda self: self.pooling.dtype)
    arch = property(lambda self: self.pooling.arch)
    align_bytes = property(lambda self: self.pooling.align_bytes)
    weight_dtype = property(lambda self: self.epilogue.weight_dtype)
    cache_dtype = property(lambda self: self.epilogue.cache_dtype)


def _epilogue_cta(key: KernelKey, epilogue: EpilogueKey, smem_rows: int) -> KernelKey | None:
    """``key`` launched in the epilogue's CTA (a whole row of ``threads`` threads of ``vec``
    columns), None where one CTA cannot be both: the epilogue's CTA is not whole warps (a
    row of fewer than 128 columns), its columns per thread exceed one 16-byte access of
    the row dtype or the window's registers (64 elements of kv and of score a thread), or
    the kernel's ``smem_rows`` fp32 rows of shared memory (ape's whole rows, the row's
    buffer, ...) exceed FUSED_SMEM."""
    threads, vec = epilogue.threads, epilogue.vec
    if key.family != "window" or threads % 32 or vec * key.elem_bytes > 16:
        return None
    if vec * key.window > 64 or smem_rows * key.head_dim * 4 > FUSED_SMEM:
        return None
    return with_knobs(key, vec=vec, threads=threads)


@dataclasses.dataclass(frozen=True)
class ExtendStoreKey(_FusedKey):
    """A fused kernel of csa::compressor_extend_store with a request per CTA: the extend
    key it pools and updates the state with (whole rows per CTA) and the epilogue key of
    what follows. A decode step's extend key pools all of a request's rows in its item
    (request_rows); a split call's first part (part REQUESTS) only the rows that read the
    state, its second launch (RowsStoreKey) the rest."""

    extend: KernelKey
    epilogue: EpilogueKey

    pooling_field = "extend"

    def __post_init__(self) -> None:
        self.check_keys()
        if self.extend.knobs.request_rows == (self.extend.knobs.part == Part.REQUESTS):
            raise ValueError(f"ExtendStoreKey: the extend key must pool its requests' rows "
                             f"in the epilogue's CTA (request_rows), or their head rows "
                             f"(part REQUESTS), got {self.extend.knobs!r}")

    @property
    def head_rows_only(self) -> bool:
        return self.extend.knobs.part == Part.REQUESTS


def extend_store_key(key: KernelKey, epilogue: EpilogueKey) -> ExtendStoreKey | None:
    """The fused key of a decode step whose extend key is `key` (extend_key's, size class
    STEP) and whose epilogue is `epilogue`; None where one CTA cannot be both
    (_epilogue_cta)."""
    if key.family != "window" or not key.knobs.request_rows:
        return None
    fused = _epilogue_cta(key, epilogue, key.window + 1)
    return None if fused is None else ExtendStoreKey(fused, epilogue)


def plan_extend_store(key: ExtendStoreKey, num_requests: int) -> LaunchPlan:
    """A CTA per request (at least one: it writes cu_seqlens_comp)."""
    return LaunchPlan(grid=max(1, num_requests))


@dataclasses.dataclass(frozen=True)
class RowsStoreKey(_FusedKey):
    """A split csa::compressor_extend_store call's second launch (rows_store.py): the row
    items of the extend key (part ROWS; lane_requests: the batch in a warp's lanes, else
    scanned) pooled in the epilogue's CTA, consecutive rows per CTA, each through the
    epilogue into the cache."""

    rows: KernelKey
    epilogue: EpilogueKey

    pooling_field = "rows"

    def __post_init__(self) -> None:
        self.check_keys()
        if self.rows.knobs.part != Part.ROWS:
            raise ValueError(f"RowsStoreKey: the extend key must be a split call's row "
                             f"items (part ROWS), got {self.rows.knobs!r}")


def split_store_keys(key: KernelKey,
                     epilogue: EpilogueKey) -> tuple[ExtendStoreKey, RowsStoreKey] | None:
    """The two fused launches of a split call (extend_key's, size classes LARGE and
    FEW_LARGE) whose epilogue is `epilogue`: the requests' head rows and states, then the
    other rows, each in the epilogue's CTA; None where one CTA cannot be both
    (_epilogue_cta) or the call is not split."""
    if key.family != "window" or key.knobs.part != Part.REQUESTS:
        return None
    heads = _epilogue_cta(with_knobs(key, lane_requests=False), epilogue, key.window + 1)
    rows = _epilogue_cta(with_knobs(key, part=Part.ROWS), epilogue, key.window + 1)
    if heads is None or rows is None:
        return None
    rows = with_knobs(rows, min_ctas=forward_epilogue_residency(rows))
    return ExtendStoreKey(heads, epilogue), RowsStoreKey(rows, epilogue)


# The directions of split_store_keys' two launches, in order.
SPLIT_STORE = (Direction.EXTEND_STORE, Direction.ROWS_STORE)


class _TrainingKey(_FusedKey):
    """A fused key of csa::compressor_epilogue, whose epilogue writes rows."""

    def __post_init__(self) -> None:
        self.check_keys()
        if self.epilogue.cache_format != "none":
            raise ValueError(f"{type(self).__name__}: the training epilogue writes rows "
                             f"(cache format 'none'), got {self.epilogue.cache_format!r}")


@dataclasses.dataclass(frozen=True)
class ForwardEpilogueKey(_TrainingKey):
    """csa::compressor_epilogue's forward in one kernel: the forward key it pools with (its
    knobs fix the rows' bits; whole rows per CTA) and the training epilogue's key."""

    forward: KernelKey
    epilogue: EpilogueKey

    pooling_field = "forward"


def forward_epilogue_key(key: KernelKey, epilogue: EpilogueKey) -> ForwardEpilogueKey | None:
    """The fused key of a training forward whose pooling key is `key` (the forward's) and
    whose epilogue is `epilogue`; None where one CTA cannot be both (_epilogue_cta). Its
    min_ctas is the CTAs an SM its launch bound keeps resident (forward_epilogue_residency),
    which its plan fills in one wave."""
    fused = _epilogue_cta(key, epilogue, key.window + 1)
    if fused is None:
        return None
    return ForwardEpilogueKey(with_knobs(fused, min_ctas=forward_epilogue_residency(fused)),
                              epilogue)


# The fused forward holds a row's window and the next row's (kv and score) in registers, so
# its registers a thread grow with the window's elements a thread (window x vec). ptxas
# (sm_90a), unbounded: bf16 64 at 2 x 4, 96 at 4 x 4, 148 at 8 x 4, 239 at 16 x 4, 252 at
# 8 x 8; fp32 192 at 8 x 4; fp16 131 at 8 x 4 (the exact softmax). The estimate below is at
# or above each, and the kernel's launch bound (min_ctas) holds it to the CTAs an SM it
# allows, so the plan knows how many CTAs one wave holds. One wave of CTAs with a share of
# the rows each beat more, shorter CTAs in 2.6 waves (H100, bf16 r4 c2 RoPE 64, CUDA-graph
# replay: 3x8192 d512 42.7 against 47.9 us, 1x65536 d512 103.9 against 115.1). A bound of
# four CTAs instead of three at d512 spills (128 registers, 24 bytes; 47.6 us), and the next
# row's window through a cp.async ring in shared memory instead of registers (128
# registers, four CTAs) ran 48.1 us.

def forward_epilogue_registers(key: KernelKey) -> int:
    """The fused forward's registers a thread, estimated from its window elements (42 plus
    10/3 a 2-byte element, twice that a 4-byte one)."""
    elements = key.window * key.knobs.vec * key.elem_bytes // 2
    return 42 + -(-10 * elements // 3)


def forward_epilogue_residency(key: KernelKey) -> int:
    """The fused forward's CTAs an SM at forward_epilogue_registers a thread."""
    threads, granule = key.knobs.threads, sm.REGISTER_GRANULE
    registers = min(forward_epilogue_registers(key), sm.MAX_REGISTERS)
    registers = -(-registers // granule) * granule
    warps = sm.SUB_PARTITIONS * (sm.REGISTER_FILE // sm.SUB_PARTITIONS // (32 * registers))
    return max(1, min(sm.MAX_CTAS, sm.MAX_THREADS // threads, warps * 32 // threads))


def plan_row_share(key: ForwardEpilogueKey | RowsStoreKey, num_rows: int,
                   num_sms: int) -> tuple[LaunchPlan, int]:
    """(plan, rows per CTA) of a fused kernel of consecutive rows per CTA: an equal share of
    them for each CTA that one wave holds (its pooling key's min_ctas an SM), at most one
    per thread (a thread looks one up); at least one CTA."""
    resident = num_sms * max(1, key.pooling.knobs.min_ctas)
    rows_per_cta = min(key.epilogue.threads, max(1, -(-num_rows // resident)))
    return LaunchPlan(grid=max(1, -(-num_rows // rows_per_cta))), rows_per_cta


@dataclasses.dataclass(frozen=True)
class BackwardEpilogueKey(_TrainingKey):
    """csa::compressor_epilogue_backward in one kernel: the backward key it takes the rows'
    gradient through the softmax with, carrying the forward key's fast_exp (it pools each
    row again, as the forward did), and the training epilogue's key."""

    backward: KernelKey
    epilogue: EpilogueKey

    pooling_field = "backward"


def backward_epilogue_key(key: KernelKey, forward: KernelKey,
                          epilogue: EpilogueKey) -> BackwardEpilogueKey | None:
    """The fused key of a training backward whose pooling keys are `key` (the backward's)
    and `forward` and whose epilogue is `epilogue`; None where one CTA cannot be both
    (_epilogue_cta: ape's rows, the grad_ape partials' as many, the row's buffer)."""
    fused = _epilogue_cta(key, epilogue, 2 * key.window + 1)
    if fused is None:
        return None
    return BackwardEpilogueKey(with_knobs(fused, fast_exp=forward.knobs.fast_exp), epilogue)


def plan_backward_epilogue(key: BackwardEpilogueKey, num_tokens: int, num_rows: int,
                           num_sms: int) -> LaunchPlan:
    """The backward's grid-stride plan with a row per CTA; the workspace holds each CTA's
    grad_ape partial, then its grad_weight partial (one sum launch takes both).

    CTAS_PER_SM CTAs an SM even where the registers allow more: each CTA adds a partial to
    write and sum and stages ape again; fewer leave latency uncovered. H100, bf16 r4 c2 RoPE
    64, forward+backward, CUDA-graph replay, at 2 / 3 / 4 / 8 / 10 / 20 CTAs an SM: 1x8192
    d128 (ten 64-thread CTAs fit an SM) 34.4 / 29.8 / 24.7 / 28.8 / 31.7 / 37.0 us; 3x8192
    d512 (four fit) 221.7 / 174.1 / 156.6 us at 2 / 3 / 4."""
    grid = _grid_stride(key.backward.ratio, num_tokens, num_rows, 1, 1, num_sms)
    return LaunchPlan(grid=grid, workspace=grid * backward_epilogue_part_elems(key))


def backward_epilogue_part_elems(key: BackwardEpilogueKey) -> int:
    """A fused backward CTA's fp32 partials in the workspace: its grad_ape partial (window
    x head_dim), then its grad_weight partial (a row)."""
    return (key.backward.window + 1) * key.backward.head_dim
