"""csa::compressor_extend kernels, host side: key, support, launch plan (no DSL import).

The extend kernel compiles from its problem's forward key, whose knobs fix the bits of a
row, so emitted rows equal the forward's bit for bit: kernels/extend.py for the
register-window family (window.py's per-column softmax; its launch knobs vary by call
size), the streaming family's extend kernel (kernels/streaming.py: the forward's own row
code) for larger windows.
"""

from __future__ import annotations

from ..config import KernelKey, LaunchPlan, with_knobs
from . import streaming_plan, window_plan


def configure(ratio: int, coff: int, head_dim: int, dtype: str, arch: str,
              **overrides: int) -> KernelKey:
    """The extend key of the forward's heuristic key (window_plan.configure)."""
    return from_forward(window_plan.configure(ratio, coff, head_dim, dtype, arch, False),
                        **overrides)


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
# 3.24 / 5.42 us with vec 2 / 128 threads (4.03 / 4.43 / 6.37); batch 1024 17.7 us with
# vec 4 / 256 threads (22.5; vec 2 / 128: 31.2); prefill 4 x 2048 is best with the
# forward's own knobs (16.4 us; vec 2 / 128: 17.3). Small calls want more, narrower CTAs.
# Decode-sized calls also preload one-token requests' state updates (kernel time at batch
# 64 / 256: 2.78 / 5.16 us against 3.10 / 5.49); at the mid and prefill keys the registers
# it costs (142 / 146 against 122 / 118) made batch 1024 25.0 us and prefill 19.4.
# Decode steps (as many new tokens as requests) let each request pool its own rows
# (request_rows): no row items, and a CTA sums the rows before its requests instead of
# scanning the batch. Graph replay (kernel time), bench/time_extend.py: batch 1 / 64 / 256 /
# 1024 2.66 (2.17) / 2.99 (2.74) / 4.76 (4.28) / 15.0 (16.8) us, against 2.81 / 3.26 / 5.09
# / 21.8 for the same grid with the batch scan in the same run; the size-class keys took
# 2.79 / 2.90 / 5.42 / 17.9 (the mid-sized key) in a run of their own. vec 4 / 256 threads
# lost at every batch but 1024 (15.9).
SIZE_LIMITS = (256, 2048)  # new tokens: the largest call of each size class but the last
STEP = len(SIZE_LIMITS) + 1  # the class of decode steps


def size_class(num_tokens: int, num_requests: int) -> int:
    """0: decode-sized calls, 1: mid-sized, 2: prefill-sized (by new tokens); STEP: decode
    steps, as many new tokens as requests, whatever the size."""
    if num_tokens == num_requests:
        return STEP
    return sum(num_tokens > limit for limit in SIZE_LIMITS)


def for_size(key: KernelKey, size: int) -> KernelKey:
    """The extend key of forward key `key` for calls of size class `size` (a streaming key:
    itself, whatever the size)."""
    if key.family == "streaming":
        return key
    if size == STEP:
        # A call with as many tokens as requests may still give one request several (its
        # rows past coff then pool one after another): correct, if slower than row items.
        return with_knobs(for_size(key, 0), request_rows=True)
    if size == 0:
        return from_forward(key, vec=min(key.knobs.vec, 2), threads=128, preload_decode=True)
    if size == 1:
        return from_forward(key, threads=max(key.knobs.threads, 256))
    return from_forward(key)


def keys(key: KernelKey) -> tuple[KernelKey, ...]:
    """Every extend key calls of forward key `key` may launch (precompile builds them all)."""
    return tuple(dict.fromkeys(for_size(key, size) for size in range(STEP + 1)))


def supports(key: KernelKey) -> bool:
    return window_plan.supports(key) or streaming_plan.supports(key)


def plan(key: KernelKey, num_requests: int, num_rows: int, num_sms: int) -> LaunchPlan:
    """Register windows: one CTA per `rpc` work items (each request's state, then each
    output row unless the key's requests pool their own rows) and column chunk; at least one
    CTA, which writes cu_seqlens_comp. Streaming:
    streaming_plan.plan_extend."""
    if key.family == "streaming":
        return streaming_plan.plan_extend(key, num_requests, num_rows, num_sms)
    g = window_plan.geometry(key)
    items = num_requests if key.knobs.request_rows else num_requests + num_rows
    return LaunchPlan(grid=max(1, -(-items // g.rpc)))


def launch_entry(key: KernelKey):
    """The `@cute.jit` launch entry (imports the DSL); its arguments are
    host.ARGUMENTS["ext"] then the stream."""
    if key.family == "streaming":
        from . import streaming

        return streaming.extend_entry(key)
    from . import extend

    return extend.launch_entry(key)
