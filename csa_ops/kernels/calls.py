"""csa::compressor_extend's call size classes, and the extend key of a forward key.

Family-independent and DSL-free: the families' plans map a size class to launch knobs
(`extend_key`), and the extend kernel of any family compiles from its problem's forward key,
whose knobs fix the bits of a row.
"""

from __future__ import annotations

import enum

from ..config import KernelKey, with_knobs

DECODE_SIZED = 256  # new tokens: the largest decode-sized call
LANE_BATCH = 32  # requests a warp's lanes hold (lane_requests)
LANE_TOKENS = 3072  # new tokens from which a split call of few requests places rows by lanes


class SizeClass(enum.IntEnum):
    """A call's size class, which picks the extend kernel's launch knobs."""

    DECODE_SIZED = 0  # up to DECODE_SIZED new tokens
    LARGE = 1  # more
    FEW_LARGE = 2  # at least LANE_TOKENS new tokens over at most LANE_BATCH requests
    STEP = 3  # decode steps: as many new tokens as requests, decode-sized
    LARGE_STEP = 4  # ... more than decode-sized


def size_class(num_tokens: int, num_requests: int) -> SizeClass:
    if num_tokens == num_requests:
        return SizeClass.STEP if num_tokens <= DECODE_SIZED else SizeClass.LARGE_STEP
    if num_tokens <= DECODE_SIZED:
        return SizeClass.DECODE_SIZED
    if num_tokens >= LANE_TOKENS and num_requests <= LANE_BATCH:
        return SizeClass.FEW_LARGE
    return SizeClass.LARGE


def from_forward(key: KernelKey, **overrides: int) -> KernelKey:
    """The extend key of a forward key: the forward's own, `overrides` set launch knobs by
    name (vec, threads, min_ctas: CTAs per SM the registers must allow; none changes a
    row's bits). fast_exp and parity are the forward's: they do change them."""
    for knob in ("fast_exp", "parity"):
        if knob in overrides and overrides[knob] != getattr(key.knobs, knob, overrides[knob]):
            raise ValueError(f"extend keys take the forward key's {knob}: rows must equal "
                             "the forward's bit for bit")
    return with_knobs(key, **overrides) if overrides else key


def check_lanes(key: KernelKey, num_requests: int) -> None:
    """A rows launch by lanes holds the whole batch in a warp's lanes."""
    if key.knobs.lane_requests and key.knobs.part == 2 and num_requests > LANE_BATCH:
        raise ValueError(f"{key!r} holds at most {LANE_BATCH} requests in a warp's lanes, "
                         f"got {num_requests}")
