"""Streaming family, host side: keys, support, launch plans of all three directions.

Pure Python, no DSL: keys and launch plans are chosen without importing the compiler. The
device code is kernels.py (forward, backward) and extend.py.
"""

from __future__ import annotations

import math

from ...config import (
    TYPES,
    Direction,
    KernelKey,
    LaunchPlan,
    Parity,
    Part,
    StreamingKnobs,
    widest_vec,
    with_knobs,
)
from .. import sm
from ..calls import SizeClass, check_lanes
from ..shared import torch_order

MAX_ROWS = 256  # rows one CTA owns: its row table lives in shared memory
MAX_KT = 4  # window entries per lane: kt * vec fp32 exponentials + grad_ape sums in registers
EXTEND_WAVES = 4  # extend CTAs per column block: this many waves of the forward's CTA slots
FWD_FAST_EXP = True  # forward exp via ex2.approx: within one output rounding step
# Failing columns per column vector of a CTA whose window the deferred row loop saves for
# exact.py (fp32 logits and values, 8 * window_padded bytes each); past them, exact.py
# loads the window's elements from DRAM again. The word of a row and vector holds the
# first saved column's slot + 1 from bit SLOT_SHIFT (above the vec <= 8 column bits).
SAVED_COLUMNS = 8
SLOT_SHIFT = 8
# Cross-warp partials of a row (kernels.py): max, sum e, sum e*v and the forward's
# certificate sums (sum e|v|, sum |v|).
RED_KINDS = 5


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def _shape(window: int, head_dim: int, vec: int) -> tuple[int, int, int]:
    """(cv, wpc, kt): column vectors per CTA, warps per column vector, entries per lane."""
    wpc = _pow2_ceil(-(-window // (32 * MAX_KT)))
    cv = max(1, min(8, _pow2_ceil(-(-head_dim // vec)), 16 // wpc))
    kt = -(-window // (32 * wpc))
    return cv, wpc, kt


def _smem_bytes(elem_bytes: int, vec: int, cv: int, wpc: int, kt: int, backward: bool,
                stages: int, parity: bool = False, row_tables: int = 2) -> int:
    cols, wpad = cv * vec, 32 * kt * wpc
    stage = (2 * wpad + (1 if backward else 0)) * cols * elem_bytes
    fixed = wpad * cols * 4 + RED_KINDS * cols * wpc * 4 + row_tables * MAX_ROWS * 4
    if parity and not backward:
        fixed += wpad * cv * 4  # the exact columns' scratch
    return fixed + stages * stage + 1024


def key_smem_bytes(key: KernelKey, backward: bool) -> int:
    """Shared memory of one CTA of `key` in one direction."""
    k = key.knobs
    # A rows launch by lanes keeps a third row table: each entry's output row.
    tables = 3 if k.part == Part.ROWS and k.lane_requests else 2
    return _smem_bytes(key.elem_bytes, k.vec, k.cv, k.wpc, k.kt, backward, k.stages,
                       bool(k.parity) and not k.deferred, tables)


def defers_exact_columns(wpc: int, head_dim: int) -> bool:
    """Whether the certified forward computes its failing columns in a second launch
    (exact.py) rather than in their rows: where two warps share a column vector (coff 2 at
    ratio 128) at d512, whose in-place columns stall the whole CTA's row loop (H100, graph
    replay: 1x65536 / 1x131072 d512 r128 c2 114.5 / 218.2 us against 121.0 / 246.3 in
    place); elsewhere the second launch costs more than the stalls it saves (1x65536
    d128 r128 c1: 29.1 against 17.7 us; docs/tuning.md)."""
    return wpc == 2 and head_dim >= 512


def configure(ratio: int, coff: int, head_dim: int, dtype: str, arch: str,
              direction: Direction, *, cv: int | None = None, ctas: int | None = None,
              stages: int | None = None, **overrides: int) -> KernelKey:
    """Heuristic key for one direction (extend: the forward's). `cv`, `ctas` and `stages`
    override the heuristic and the knobs that depend on them follow; `overrides` set any
    other knob by name."""
    backward = direction is Direction.BACKWARD
    eb = TYPES[dtype].bytes
    vec = widest_vec(head_dim, eb, 16 // eb)
    cv0, wpc, kt = _shape(coff * ratio, head_dim, vec)
    if cv is None:
        # Forward with two warps per column vector: 64-byte rows and two CTAs per SM beat
        # one 512-thread CTA (H200: -6% at ratio 128, coff 2).
        cv = min(cv0, 4) if wpc == 2 and not backward else cv0
    nt = 32 * cv * wpc
    ctas = max(1, min(4, 512 // nt)) if ctas is None else ctas
    # The forward certifies each column against torch's order and recomputes in that order
    # the few it cannot: within one rounding step of the eager region, every column.
    certify = not backward and torch_order.supported(coff * ratio, head_dim)
    parity = Parity.UNCERTIFIED if certify else Parity.NEVER
    while stages is None:
        fits = [s for s in (4, 3, 2)
                if _smem_bytes(eb, vec, cv, wpc, kt, backward, s, parity) * ctas <= sm.SMEM_FOR_CTAS]
        if fits or ctas == 1:
            stages = fits[0] if fits else 2
        else:
            ctas -= 1
    # Programmatic dependent launch: H200 bench, PDL against none (same code otherwise):
    # the backward and the one-warp-per-column forward gain 1-7% (r128 c1 1x65536 d128 fwd
    # 13.1 against 14.0 us), but the forward with two warps per column (coff 2) loses 7-13%
    # (1x131072 d512 168.1 against 149.0 us), so it launches plainly.
    # The stages above count the in-place exact columns' scratch, so a deferred key and its
    # in-place twin differ in that alone.
    knobs = StreamingKnobs(vec, cv, wpc, kt, stages, ctas, fast_exp=FWD_FAST_EXP and not backward,
                           pdl=backward or wpc != 2, parity=parity,
                           deferred=(certify and direction is Direction.FORWARD
                                     and defers_exact_columns(wpc, head_dim)))
    key = KernelKey("streaming", ratio, coff, head_dim, dtype, arch, knobs)
    if overrides.get("parity") == Parity.NEVER and "deferred" not in overrides:
        overrides["deferred"] = False  # nothing to defer
    return with_knobs(key, **overrides) if overrides else key


def fast_forward(key: KernelKey) -> KernelKey:
    """The forward key of the fast numerics mode: no columns in torch's order (the fast
    softmax alone: within one rounding step of the eager region except on rare cancelling
    columns)."""
    return with_knobs(key, parity=Parity.NEVER, deferred=False)


def supports(key: KernelKey) -> bool:
    if key.family != "streaming" or key.dtype not in ("bfloat16", "float16"):
        return False
    k = key.knobs
    if min(k.cv, k.wpc, k.kt) < 1 or k.kt > MAX_KT:
        return False
    if k.stages < 2:  # the loop waits for row j while row j+1 is in flight
        return False
    if k.threads > 1024 or 32 * k.wpc * k.kt < key.window or 32 % k.vec:
        return False
    if k.parity and not torch_order.supported(key.window, key.head_dim):
        return False
    if k.deferred and not k.parity:  # nothing to defer
        return False
    smem = max(key_smem_bytes(key, backward) for backward in (False, True))
    return smem <= sm.SMEM_FOR_CTAS


def enumerate_keys(ratio: int, coff: int, head_dim: int, dtype: str, arch: str,
                   direction: Direction):
    """All supported keys worth timing for one problem (autotuning): CTA widths, CTAs per
    SM and the lean row path, around the heuristic's other knobs."""
    seen = set()
    for cv in (1, 2, 4, 8):
        for ctas in (None, 1, 2, 3, 4):
            for lean in (False, True):
                key = configure(ratio, coff, head_dim, dtype, arch, direction, cv=cv,
                                ctas=ctas, lean=lean)
                if key not in seen and supports(key):
                    seen.add(key)
                    yield key


def column_blocks(key: KernelKey) -> int:
    return -(-key.head_dim // (key.knobs.cv * key.knobs.vec))


def _plan(key: KernelKey, num_rows: int, num_sms: int, backward: bool) -> LaunchPlan:
    cb = column_blocks(key)
    slots = max(1, num_sms * key.knobs.ctas)
    groups = min(max(1, slots // cb), max(1, num_rows))
    # Even out rows per CTA and keep each CTA's rows within its row table.
    per_cta = min(max(1, -(-num_rows // groups)), MAX_ROWS)
    groups = max(1, -(-num_rows // per_cta))
    if backward:  # grad_ape's partials
        work = groups * key.ratio * key.coff * key.head_dim
    else:
        work = forward_workspace(key, num_rows, groups * cb)
    return LaunchPlan(grid=groups * cb, workspace=work)


def forward_workspace(key: KernelKey, num_rows: int, grid: int) -> int:
    """fp32 elements of a forward launch of `grid` CTAs: the deferred forward's words of
    failing columns (int32, padded to 16 bytes), then its CTAs' saved columns."""
    k = key.knobs
    if not k.deferred:
        return 0
    words = -(-num_rows * (key.head_dim // k.vec) // 4) * 4
    slots = grid * k.cv * SAVED_COLUMNS
    assert slots < 1 << (31 - SLOT_SHIFT), "a saved column's slot must fit its word"
    return words + slots * 2 * 32 * k.kt * k.wpc


def plan_forward(key: KernelKey, num_tokens: int, num_rows: int, num_sms: int) -> LaunchPlan:
    return _plan(key, num_rows, num_sms, False)


def plan_backward(key: KernelKey, num_tokens: int, num_rows: int, num_sms: int) -> LaunchPlan:
    return _plan(key, num_rows, num_sms, True)


def quiet_lanes(key: KernelKey) -> int:
    """Lanes that update one quiet request's state (one that completes no block: a decode
    step's usual request): one per (column vector, coff-half) of a token's entry, so a warp
    writes 32 // quiet_lanes one-token requests at once."""
    return min(32, key.knobs.cv * key.coff)


def plan_extend_launch(key: KernelKey, num_tokens: int, num_requests: int, num_rows: int,
                       num_sms: int) -> LaunchPlan:
    """csa::compressor_extend: work items (each request, then each output row) strided over
    `groups` CTAs per column block, at most MAX_ROWS per CTA; at least one CTA, which writes
    cu_seqlens_comp. A CTA runs its items that pool a window one after another: up to
    EXTEND_WAVES waves of CTA slots, so that each has few. A decode step (as many tokens as
    requests) has few such items: a request completes at most one block, whose row is the
    request's own, and the others only write their token (all of a CTA's at once) or skip
    their row (a head row, or padding: zeros). One wave then: the CTAs' fixed costs (the
    batch scan, the loads before a store) are paid once. Where CTAs share items, its group
    count is odd: requests whose blocks complete together are often a power of two apart
    (positions that advanced together, power-of-two ratios), and would otherwise share a
    CTA. A split call (part knob, extend_key) launches the requests' items (part
    REQUESTS, this plan), then the other rows (part ROWS, `plan_rows`)."""
    if key.knobs.part == Part.ROWS:
        raise ValueError(f"a split call's rows launch is planned beside its requests' "
                         f"(plan_rows), got {key!r}")
    cb = column_blocks(key)
    items = max(1, num_requests + (0 if key.knobs.part == Part.REQUESTS else num_rows))
    step = num_tokens == num_requests
    groups = min(items, max(1, (1 if step else EXTEND_WAVES) * num_sms * key.knobs.ctas // cb))
    if step and groups % 2 == 0 and groups < items:
        groups -= 1
    return LaunchPlan(grid=max(groups, -(-items // MAX_ROWS)) * cb)


def plan_rows(key: KernelKey, num_rows: int, num_sms: int, requests: KernelKey,
              requests_grid: int) -> LaunchPlan:
    """Part 2 of a split call, beside part 1 (`requests`, launched with `requests_grid`
    CTAs): the rows (strided, or by lanes in order) over as many groups as one wave holds,
    less one. A wave is `ctas` CTAs per SM, less the slots part 1's CTAs hold (each the
    registers of ceil(ctas / its ctas) of ours). Every CTA slot then pools its share of
    rows at once; a group more, and the last CTAs wait for a second wave. H200, d512 r128
    c1, 4 requests from state by 2048 new tokens (64 rows, 16 column blocks, 132 x 4 -
    32 x 2 = 464 slots), rows by the scan, graph replay: 28 groups 14.06 us, 29 (the whole
    wave) 14.78, 30 17.26; 26 13.93-14.09, 22 (the forward's plan at 3 CTAs per SM)
    14.72-15.05 (training forward 12.29-12.54). Where part 1 leaves less than half a wave,
    half a wave."""
    cb = column_blocks(key)
    ctas = key.knobs.ctas
    slots = num_sms * ctas - requests_grid * -(-ctas // requests.knobs.ctas)
    groups = max(slots // cb - 1, num_sms * ctas // (2 * cb))
    groups = min(groups, num_rows)
    return LaunchPlan(grid=max(1, groups, -(-num_rows // MAX_ROWS)) * cb)


def rows_by_lanes(key: KernelKey, num_rows: int, num_requests: int, groups: int) -> bool:
    """Whether a split call's rows launch (`key`, at most 32 requests) places its rows by
    lanes (lane_requests) over `groups` groups: where the fullest holds two rows or more
    (of `num_rows` less the requests' heads; the host sees no row counts). The lanes start a
    group's first tile a round trip or two before a batch scan would (no scan, no barrier,
    no reloads) and spread the rows evenly, which pays where the rows launch sets the
    call's time; where each group has a row, the requests' launch does, and tiles loaded
    earlier beside it only slow it down. H200, d512 r128 c1, 4 requests from state, graph
    replay, one process: by 2048 / 8192 new tokens 13.46 / 31.54 us by lanes against
    14.00 / 32.70 with the scan (training forward 12.13 / 29.37); by 1024, one row per
    group, 12.04 against 11.52."""
    later = num_rows - num_requests * key.coff
    return -(-later // max(groups, 1)) >= 2


def narrow(key: KernelKey) -> KernelKey:
    """Launch knobs of csa::compressor_extend's latency-bound launches (decode-sized calls
    and steps, a split call's rows launch) from key `key`: CTAs half as wide (a
    column's bits do not depend on the CTA's width), as many per SM as shared memory holds
    (up to 4); `key` itself where that key is not supported. Narrower CTAs gather less each
    and spread a call's few items over more SMs, and a split call's rows launch shares SMs
    with its requests' CTAs in one wave (`plan_rows`). H200, d512 r128 c1, graph replay
    (kernel time), one process per variant: decode steps at batch 1 / 64 / 256 4.39 (4.37) /
    6.34 (5.84) / 6.76 (6.27) us against 5.20 (5.04) / 7.16 (6.28) / 7.30 (6.71) at the
    forward's 8 column vectors and 2 CTAs per SM (2 column vectors: 4.33 / 6.47 / 7.70; 1:
    4.29 / 6.91 / 9.89); 8 requests by 32 tokens from state 5.28 against 5.80. d512 r128 c2
    decode steps: 10.66 / 12.13 / 15.27 against 11.36 / 12.22 / 15.82."""
    key = with_knobs(key, deferred=False)  # an extend key's (extend_key)
    k = key.knobs
    narrower = with_knobs(key, cv=max(1, k.cv // 2))
    fit = min(4, sm.SMEM_FOR_CTAS // key_smem_bytes(narrower, False))
    narrower = with_knobs(narrower, ctas=max(k.ctas, fit))
    return narrower if supports(narrower) else key


def extend_key(key: KernelKey, size: SizeClass) -> KernelKey:
    """The extend key of forward key `key` for calls of size class `size`. Decode-sized
    calls and steps: CTAs of few latency-bound items (`narrow`). Larger calls split: the
    rows past the requests' heads run in the forward's own pipelined loop beside the
    requests' launch (PDL, whatever the forward's). Steps of more requests keep the
    forward's CTAs: every CTA scans the batch, and a narrower one takes twice as long over
    it (d512 r128 c1 B1024 graph replay 10.72 us against 9.18). Split calls of few requests
    place part 2's rows by lanes, evenly (lane_requests). Every extend key computes its
    failing columns in their rows: a serving call's rows are few, and a second launch
    would cost more than it spreads (the same bits either way)."""
    key = with_knobs(key, deferred=False)
    if size in (SizeClass.DECODE_SIZED, SizeClass.STEP):
        return narrow(key)
    if size == SizeClass.FEW_LARGE:
        return with_knobs(key, part=Part.REQUESTS, pdl=True, lane_requests=True)
    if size == SizeClass.LARGE:
        return with_knobs(key, part=Part.REQUESTS, pdl=True)
    return key


def extend_launches(key: KernelKey) -> tuple[KernelKey, ...]:
    """The kernels one call of extend key `key` launches, in order: itself, or a split
    call's requests' launch and rows launch. Part 1 is the same kernel whichever way part 2
    places its rows (one key for it). The rows launch in narrower CTAs, which share SMs with
    the requests' and run in one wave (`plan_rows`). The requests' launch keeps the
    forward's: narrowed, it gained in one machine session and lost in another (d512 r128 c1
    4 x 2048, graph replay: 14.71 us against 15.61; 13.92 and 14.66 against 13.75)."""
    if not key.knobs.part:
        return (key,)
    if key.knobs.part != Part.REQUESTS:  # its rows launch has launch knobs of its own
        raise ValueError(f"extend_launches takes a split call's first part, got {key!r}")
    return (with_knobs(key, lane_requests=False), with_knobs(narrow(key), part=Part.ROWS))


def plan_extend(key: KernelKey, num_tokens: int, num_requests: int, num_rows: int,
                num_sms: int) -> tuple[tuple[KernelKey, LaunchPlan], ...]:
    """(key, plan) of each launch of one call of extend key `key` (extend_key's). A split
    call's rows launch is planned beside its requests' launch, and places its rows by lanes
    only where it sets the call's time (rows_by_lanes); else by the scan (class LARGE's
    kernel)."""
    first, *rest = extend_launches(key)
    first_plan = plan_extend_launch(first, num_tokens, num_requests, num_rows, num_sms)
    planned = ((first, first_plan),)
    for part in rest:
        check_lanes(part, num_requests)
        laid = plan_rows(part, num_rows, num_sms, first, first_plan.grid)
        groups = laid.grid // column_blocks(part)
        if part.knobs.lane_requests and not rows_by_lanes(part, num_rows, num_requests,
                                                          groups):
            part = with_knobs(part, lane_requests=False)
        planned += ((part, laid),)
    return planned
