"""csa::compressor_extend kernels, host side: key, support, launch plan (no DSL import).

The extend kernel compiles from its problem's forward key, whose knobs fix the bits of a
row, so emitted rows equal the forward's bit for bit: kernels/extend.py for the
register-window family (window.py's per-column softmax; its launch knobs vary by call
size), the streaming family's extend kernel (kernels/streaming.py: the forward's own row
code; narrower CTAs where they pay, streaming_plan.narrow) for larger windows.
"""

from __future__ import annotations

from ..config import KernelKey, LaunchPlan, with_knobs
from . import streaming_plan, window_plan


def configure(ratio: int, coff: int, head_dim: int, dtype: str, arch: str) -> KernelKey:
    """The extend key of the forward's heuristic key (window_plan.configure)."""
    return from_forward(window_plan.configure(ratio, coff, head_dim, dtype, arch, False))


def from_forward(key: KernelKey, **overrides: int) -> KernelKey:
    """The extend key of a forward key: the forward's own, `overrides` set launch knobs by
    name (vec, threads, min_ctas: CTAs per SM the registers must allow; none changes a
    row's bits). fast_exp and parity are the forward's: they do change them."""
    for knob in ("fast_exp", "parity"):
        if knob in overrides and overrides[knob] != getattr(key.knobs, knob, overrides[knob]):
            raise ValueError(f"extend keys take the forward key's {knob}: rows must equal "
                             "the forward's bit for bit")
    return with_knobs(key, **overrides) if overrides else key


# Launch knobs by call size (new tokens). H200, d512 r4 c2 bf16, CUDA-graph replay per call,
# against the forward key's vec 4 / 128 threads: decode at batch 1 / 64 / 256 takes 2.90 /
# 3.24 / 5.42 us with vec 2 / 128 threads (4.03 / 4.43 / 6.37); small calls want more,
# narrower CTAs. Decode-sized calls also preload one-token requests' state updates (kernel
# time at batch 64 / 256: 2.78 / 5.16 us against 3.10 / 5.49).
# Decode steps (as many new tokens as requests) let each request pool its own rows
# (request_rows): no row items, and a CTA sums the rows before its requests instead of
# scanning the batch. Graph replay (kernel time), bench/time_extend.py: batch 1 / 64 / 256 /
# 1024 2.66 (2.17) / 2.99 (2.74) / 4.76 (4.28) / 15.0 (16.8) us, against 2.81 / 3.26 / 5.09
# / 21.8 for the same grid with the batch scan in the same run; the size-class keys took
# 2.79 / 2.90 / 5.42 / 17.9 (batch 1024: vec 4 / 256 threads) in a run of their own. The
# step kernel at vec 4 / 256 threads lost at every batch but 1024 (15.9).
# Larger calls split (part): the requests' items, whose windows held across the scan cost
# registers (118 against the forward's 77: 4 CTAs per SM instead of 6), launch apart from
# the row items, which then run at 77. The first part gathers all its head rows' windows
# and state loads at once (178 registers, a few CTAs): its chain of dependent loads, not
# the row items, otherwise sets the call's time. Its CTAs take few items' knobs (vec 2,
# 128 threads, as decode-sized calls): 4 x 2048, graph replay, one process each, 13.98
# against 15.30 us at the forward's vec 4 (training forward 13.34). Graph replay, 4
# requests from state, one run, the first part at the forward's knobs: 4 x 256 / 1024 /
# 2048 / 8192 new tokens 7.35 / 10.69 / 15.46 / 46.9 us, against
# 7.99 / 12.80 / 16.43 / 54.5 in one launch with the forward's knobs and 9.11 / 12.65 / 17.56
# / 59.1 with its 256-thread CTAs (the training forward: 4.48 / 8.39 / 12.96 / 40.65).
# Split calls of few requests (at most LANE_BATCH, the lanes of a warp) and at least
# LANE_TOKENS new tokens place their row items by lanes (lane_requests): part 2 then runs as
# fast as the training forward (ncu, 4 x 8192: 51.9 against 52.6 us, 27.7 M warp
# instructions against 26.0 M; with the batch scan 58.1 us, 28.3 M). Graph replay, one run,
# 4 requests from state by 768 / 1024 / 2048 new tokens each: 9.60 / 9.82 / 14.85 us against
# 9.89 / 10.38 / 15.53 with the batch scan (training forward 7.44 / 8.66 / 12.99); another
# run, 4 x 8192: 42.62 against 47.69 (forward 40.98). Below LANE_TOKENS the first part's
# chain of loads sets the call's time and part 2's earlier loads slow it down: 4 x 256 / 512
# 7.42 / 9.27 against 6.89 / 8.47; 7 and 31 decode requests beside one request of 2048 new
# tokens 8.25 / 9.69 against 7.69 / 8.96.
DECODE_SIZED = 256  # new tokens: the largest decode-sized call
LANE_BATCH = 32
LANE_TOKENS = 3072
FEW_LARGE = 2  # the class of split calls whose rows go by lanes
STEP = 3  # the class of decode steps
LARGE_STEP = 4  # ... of more than DECODE_SIZED requests
SIZE_CLASSES = range(LARGE_STEP + 1)


def size_class(num_tokens: int, num_requests: int) -> int:
    """0: decode-sized calls (by new tokens), 1: larger ones, FEW_LARGE: larger still and of
    few requests; STEP: decode steps, as many new tokens as requests, LARGE_STEP where they
    are more than decode-sized."""
    if num_tokens == num_requests:
        return STEP if num_tokens <= DECODE_SIZED else LARGE_STEP
    if num_tokens <= DECODE_SIZED:
        return 0
    return FEW_LARGE if num_tokens >= LANE_TOKENS and num_requests <= LANE_BATCH else 1


def for_size(key: KernelKey, size: int) -> KernelKey:
    """The extend key of forward key `key` for calls of size class `size` (a streaming key:
    narrower CTAs for decode-sized calls and steps, split with PDL past them)."""
    if key.family == "streaming":
        # Decode-sized calls and steps: CTAs of few latency-bound items (streaming_plan.narrow).
        # Larger calls split: the rows past the requests' heads run in the forward's own
        # pipelined loop beside the requests' launch (PDL, whatever the forward's). Steps of
        # more requests keep the forward's CTAs: every CTA scans the batch, and a narrower one
        # takes twice as long over it (d512 r128 c1 B1024 graph replay 10.72 us against 9.18).
        # Split calls of few requests place part 2's rows by lanes, evenly (lane_requests).
        if size in (0, STEP):
            return streaming_plan.narrow(key)
        if size == FEW_LARGE:
            return with_knobs(key, part=1, pdl=True, lane_requests=True)
        return with_knobs(key, part=1, pdl=True) if size == 1 else key
    if size in (STEP, LARGE_STEP):
        # A call with as many tokens as requests may still give one request several (its
        # rows past coff then pool one after another): correct, if slower than row items.
        return with_knobs(for_size(key, 0), request_rows=True)
    if size == 0:
        return _few_items(key, preload_decode=True)
    return from_forward(key, part=1, lane_requests=size == FEW_LARGE)


def _few_items(key: KernelKey, **knobs: int) -> KernelKey:
    """Register-window launch knobs for CTAs of few items (decode-sized calls, a split
    call's requests): more, narrower CTAs."""
    return from_forward(key, vec=min(key.knobs.vec, 2), threads=128, **knobs)


def launches(key: KernelKey) -> tuple[KernelKey, ...]:
    """The kernels one call of extend key `key` (for_size's) launches, in order: itself, or a
    split call's two parts (requests' items, then row items)."""
    if key.family == "streaming" and key.knobs.part:
        if key.knobs.part != 1:  # its rows launch has launch knobs of its own
            raise ValueError(f"launches takes a split streaming call's first part, got {key!r}")
        # Part 1 is the same kernel whichever way part 2 places its rows (one key for it).
        # The rows launch in narrower CTAs, which share SMs with the requests' and run in
        # one wave (streaming_plan.plan_rows). The requests' launch keeps the forward's:
        # narrowed, it gained in one machine session and lost in another (d512 r128 c1
        # 4 x 2048, graph replay, one process each: 14.71 us against 15.61; 13.92 and
        # 14.66 against 13.75).
        return (with_knobs(key, lane_requests=False),
                with_knobs(streaming_plan.narrow(key), part=2))
    if key.family == "window" and key.knobs.part:
        # Part 1 is the same kernel either way (one key for it), at few items' knobs.
        return (_few_items(with_knobs(key, lane_requests=False), part=1),
                with_knobs(key, part=2))
    return (key,)


def keys(key: KernelKey) -> tuple[KernelKey, ...]:
    """Every extend kernel calls of forward key `key` may launch (precompile builds them
    all; `plans` launches a split streaming call's rows by a batch scan where lanes do not
    pay, class 1's kernel)."""
    return tuple(dict.fromkeys(launched for size in SIZE_CLASSES
                               for launched in launches(for_size(key, size))))


def supports(key: KernelKey) -> bool:
    return window_plan.supports(key) or streaming_plan.supports(key)


def plans(key: KernelKey, num_tokens: int, num_requests: int, num_rows: int,
          num_sms: int) -> tuple[tuple[KernelKey, LaunchPlan], ...]:
    """(key, plan) of each launch of one call of extend key `key` (for_size's), in order.
    A split streaming call's rows launch is planned beside its requests' launch."""
    first, *rest = launches(key)
    first_plan = plan(first, num_tokens, num_requests, num_rows, num_sms)
    planned = ((first, first_plan),)
    for part in rest:
        if part.family == "streaming":
            _check_lanes(part, num_requests)
            laid = streaming_plan.plan_rows(part, num_rows, num_sms, first, first_plan.grid)
            groups = laid.grid // streaming_plan.column_blocks(part)
            # Rows by lanes only where part 2 sets the call's time (rows_by_lanes); else
            # the scan's rows launch, class 1's kernel.
            if part.knobs.lane_requests and not streaming_plan.rows_by_lanes(
                    part, num_rows, num_requests, groups):
                part = with_knobs(part, lane_requests=False)
        else:
            laid = plan(part, num_tokens, num_requests, num_rows, num_sms)
        planned += ((part, laid),)
    return planned


def plan(key: KernelKey, num_tokens: int, num_requests: int, num_rows: int,
         num_sms: int) -> LaunchPlan:
    """One launch of `key` (an entry of `launches`; a split streaming call's rows launch
    goes through `plans`). Register windows: one CTA per `rpc` work items and column chunk;
    the items are each request's (its state), then each output row unless the key's
    requests pool their own rows; a split call's parts have the requests' items and the row
    items. At least one CTA: a launch with row items, or whose requests pool their own rows,
    writes cu_seqlens_comp. Streaming: streaming_plan.plan_extend."""
    if key.family == "streaming":
        return streaming_plan.plan_extend(key, num_tokens, num_requests, num_rows, num_sms)
    _check_lanes(key, num_requests)
    g = window_plan.geometry(key)
    if key.knobs.request_rows or key.knobs.part == 1:
        items = num_requests
    elif key.knobs.part == 2:
        items = num_rows
    else:
        items = num_requests + num_rows
    return LaunchPlan(grid=max(1, -(-items // g.rpc)))


def _check_lanes(key: KernelKey, num_requests: int) -> None:
    if key.knobs.lane_requests and key.knobs.part == 2 and num_requests > LANE_BATCH:
        raise ValueError(f"{key!r} holds at most {LANE_BATCH} requests in a warp's lanes, "
                         f"got {num_requests}")


def launch_entry(key: KernelKey):
    """The `@cute.jit` launch entry (imports the DSL); its arguments are
    host.ARGUMENTS["ext"] then the stream."""
    if key.family == "streaming":
        from . import streaming

        return streaming.extend_entry(key)
    from . import extend

    return extend.launch_entry(key)
