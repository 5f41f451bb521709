"""csa::compressor_extend, host side: the extend keys and launch plans of a call, through
its forward key's family (no DSL import).

The extend kernel compiles from its problem's forward key, whose knobs fix the bits of a
row, so emitted rows equal the forward's bit for bit; each family maps a call's size class
to launch knobs (its plan's `extend_key`) and plans the call's launches (`plan_extend`).
"""

from __future__ import annotations

from ..config import Direction, KernelKey, LaunchPlan
from .calls import DECODE_SIZED, LANE_BATCH, LANE_TOKENS, SizeClass, size_class
from .families import FAMILIES


def configure(ratio: int, coff: int, head_dim: int, dtype: str, arch: str) -> KernelKey:
    """The register-window family's heuristic forward key, which its extend keys start from
    (a streaming problem's is its forward key: select_key)."""
    return FAMILIES["window"].configure(ratio, coff, head_dim, dtype, arch, Direction.FORWARD)


def supports(key: KernelKey) -> bool:
    return FAMILIES[key.family].supports(key)


def for_size(key: KernelKey, size: SizeClass) -> KernelKey:
    """The extend key of forward key `key` for calls of size class `size`."""
    return FAMILIES[key.family].extend_key(key, SizeClass(size))


def launches(key: KernelKey) -> tuple[KernelKey, ...]:
    """The kernels one call of extend key `key` (for_size's) launches, in order."""
    return FAMILIES[key.family].extend_launches(key)


def keys(key: KernelKey) -> tuple[KernelKey, ...]:
    """Every extend kernel calls of forward key `key` may launch (precompile builds them
    all; a split streaming call's rows launch by the scan, where lanes do not pay, is the
    LARGE class's kernel)."""
    return tuple(dict.fromkeys(launched for size in SizeClass
                               for launched in launches(for_size(key, size))))


def plans(key: KernelKey, num_tokens: int, num_requests: int, num_rows: int,
          num_sms: int) -> tuple[tuple[KernelKey, LaunchPlan], ...]:
    """(key, plan) of each launch of one call of extend key `key` (for_size's), in order."""
    return FAMILIES[key.family].plan_extend(key, num_tokens, num_requests, num_rows, num_sms)


def plan(key: KernelKey, num_tokens: int, num_requests: int, num_rows: int,
         num_sms: int) -> LaunchPlan:
    """One launch of `key` (an entry of `launches`; a split streaming call's rows launch is
    planned beside its requests' launch, through `plans`)."""
    return FAMILIES[key.family].plan_extend_launch(key, num_tokens, num_requests, num_rows,
                                                   num_sms)


__all__ = ["DECODE_SIZED", "LANE_BATCH", "LANE_TOKENS", "SizeClass", "configure", "for_size",
           "keys", "launches", "plan", "plans", "size_class", "supports"]
