"""The kernel families: their plans by name, the family contract, and the one lazy import of
their device code.

A family is a package (kernels/<family>/): `plan.py`, pure Python with no DSL, chooses keys
and launch plans for all three directions; its kernel modules hold one class per direction,
compiled from a key. Plans never import kernels: `launch_entry` below imports them, and only
when a kernel must be compiled.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol

from ..config import Direction, KernelKey, LaunchPlan
from .calls import SizeClass
from .streaming import plan as streaming_plan
from .window import plan as window_plan


class KernelFamily(Protocol):
    """What a family's plan module exposes (pure functions of keys and sizes).

    configure(ratio, coff, head_dim, dtype, arch, direction) -> KernelKey
        Heuristic key for one direction (EXTEND: the forward's); dtype/arch as in config.
    supports(key) -> bool
        Whether this family compiles `key` (cheap, no device access).
    fast_forward(key) -> KernelKey
        The forward key of the fast numerics mode (csa_ops.set_forward_numerics).
    plan_forward / plan_backward(key, num_tokens, num_rows, num_sms) -> LaunchPlan
        Grid size and fp32 workspace elements. Workspace content is undefined on entry; a
        family that needs it zeroed zeroes it inside its own launches (CUDA-graph safe).
        With workspace 0 the workspace argument is some other fp32 tensor: never access it.
    extend_key(key, size) -> KernelKey
        csa::compressor_extend's key for calls of one size class, from the forward key.
    extend_launches(key) -> (KernelKey, ...)
        The kernels one extend call launches, in order (a split call launches twice).
    plan_extend(key, num_tokens, num_requests, num_rows, num_sms) -> ((key, LaunchPlan), ..)
        Each launch of one extend call, planned; plan_extend_launch plans one of them (a
        streaming split call's rows launch only beside its requests').
    Kernels (the classes named in KERNELS) get their arguments as
    launch_description.ARGUMENTS[direction] then the stream; num_rows = out.shape[0] (may
    exceed cuc[-1]). Every output element is written (outputs come from torch.empty), no
    float atomics, no read or write out of bounds for any offsets' contents.
    """

    def configure(self, ratio: int, coff: int, head_dim: int, dtype: str, arch: str,
                  direction: Direction) -> KernelKey: ...
    def supports(self, key: KernelKey) -> bool: ...
    def fast_forward(self, key: KernelKey) -> KernelKey: ...
    def plan_forward(self, key: KernelKey, num_tokens: int, num_rows: int,
                     num_sms: int) -> LaunchPlan: ...
    def plan_backward(self, key: KernelKey, num_tokens: int, num_rows: int,
                      num_sms: int) -> LaunchPlan: ...
    def extend_key(self, key: KernelKey, size: SizeClass) -> KernelKey: ...
    def extend_launches(self, key: KernelKey) -> tuple[KernelKey, ...]: ...
    def plan_extend(self, key: KernelKey, num_tokens: int, num_requests: int, num_rows: int,
                    num_sms: int) -> tuple[tuple[KernelKey, LaunchPlan], ...]: ...
    def plan_extend_launch(self, key: KernelKey, num_tokens: int, num_requests: int,
                           num_rows: int, num_sms: int) -> LaunchPlan: ...


# In order of preference: the register-window kernels wherever they apply.
FAMILIES: dict[str, KernelFamily] = {"window": window_plan, "streaming": streaming_plan}

# The kernel class of each family and direction, as "module:Class" under kernels/<family>/.
KERNELS = {
    "window": {Direction.FORWARD: "forward:WindowForward",
               Direction.BACKWARD: "backward:WindowBackward",
               Direction.EXTEND: "extend:WindowExtend",
               # csa::compressor_extend_store's decode step (an ExtendStoreKey)
               Direction.EXTEND_STORE: "extend_store:WindowExtendStore",
               # ... and a split call's rows (a RowsStoreKey) beside its head rows
               Direction.ROWS_STORE: "rows_store:WindowRowsStore",
               # csa::compressor_epilogue's forward and backward (a ForwardEpilogueKey, a
               # BackwardEpilogueKey)
               Direction.FORWARD_EPILOGUE: "forward_epilogue:WindowForwardEpilogue",
               Direction.BACKWARD_EPILOGUE: "backward_epilogue:WindowBackwardEpilogue"},
    "streaming": {Direction.FORWARD: "kernels:StreamingForward",
                  Direction.BACKWARD: "kernels:StreamingBackward",
                  Direction.EXTEND: "extend:StreamingExtend"},
    # Not a pooling family: the row epilogue after csa::compressor_extend (an EpilogueKey).
    "epilogue": {Direction.STORE: "store:RowEpilogueStore",
                 Direction.EPILOGUE: "training:RowEpilogueRows",
                 Direction.EPILOGUE_BACKWARD: "training:RowEpilogueRowsBackward"},
}


def select_key(ratio: int, coff: int, head_dim: int, dtype: str, arch: str,
               direction: Direction) -> KernelKey | None:
    """The heuristic key of the first family that supports this problem, else None."""
    for plan in FAMILIES.values():
        key = plan.configure(ratio, coff, head_dim, dtype, arch, direction)
        if plan.supports(key):
            return key
    return None


def launch_entry(direction: Direction, key: KernelKey) -> Callable[..., Any]:
    """The `@cute.jit` launch entry of one direction of `key` (imports the DSL)."""
    module, name = KERNELS[key.family][Direction(direction)].split(":")
    kernel_class = getattr(importlib.import_module(f"{__package__}.{key.family}.{module}"),
                           name)
    return kernel_class(key).__call__
