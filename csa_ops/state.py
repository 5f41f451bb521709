"""The package's process state, in one owner: what the launch path, the native library and
the kernel cache decide or build once per process, and the forward's numerics mode.

Everything here is a memo of something derivable (device facts, heuristic keys, resolved
problems, compiled kernels, prepared calls, versions and digests) or a switch a caller
sets. `STATE.forget_calls()` drops what depends on keys and kernels (prepared calls);
`STATE.reset()` returns a fresh process's state (tests).
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Callable, Iterator
from typing import Any


class ForwardNumerics(str, enum.Enum):
    """The forward's numerics (see docs/numerics.md). CERTIFIED, the default: every output
    element within one rounding step of torch's eager region on the same device, columns
    that cancel recomputed in torch's order. FAST: the ratio-128 (streaming) forward skips
    that recomputation, within one step except on rare cancelling columns; the
    register-window kernels, already certified at full speed, do not change."""

    CERTIFIED = "certified"
    FAST = "fast"


UNDECIDED = object()  # a per-process decision not yet taken


class ProcessState:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._memos: list[Any] = []  # the ops' prepared-call memos: cleared with the calls
        self._reset_hooks: list[Callable[[], None]] = []
        self.reset()

    def on_reset(self, hook: Callable[[], None]) -> None:
        """`hook()` runs with every reset: state an owner keeps in an object of its own
        (the compiled kernels of csa_ops.host)."""
        self._reset_hooks.append(hook)

    def reset(self) -> None:
        """A fresh process's state (the registered memos stay registered, emptied)."""
        # csa_ops.host
        self.devices: dict[int, tuple[str | None, int]] = {}  # index -> (arch, SMs)
        self.keys: dict[tuple, Any] = {}  # problem and direction -> kernel key or None
        self.problems: dict[tuple, Any] = {}  # call metadata -> resolved problem
        self.multi_gpu: bool | None = None
        self.python_launch_path = False  # calls prepared now take the Python path
        # csa_ops.row_epilogue: the epilogue ops' row epilogue by its kernels (off: the torch
        # route, the composition they are tested against)
        self.store_kernel = True
        self.fused_store_step = True  # ... a decode step's in one kernel with its pooling
        # ... a split call's in two (off by default: row_epilogue.fused_prefill())
        self.fused_store_prefill = False
        self.training_epilogue_kernel = True
        # ... its forward in one kernel with its pooling, and its backward
        # (row_epilogue.two_launch_forward() and staged_backward() turn them off for a scope)
        self.fused_training_forward = True
        self.fused_training_backward = True
        self.training_epilogue_backward_kernel = True
        self.forward_numerics = ForwardNumerics.CERTIFIED
        # csa_ops.native
        self.native_tag: str | None = None
        self.native_module: Any = UNDECIDED  # the loaded library, or None
        self.native_build_started = False
        # csa_ops.kernel_cache
        self.versions: dict[str, str] = {}
        self.source_digest: str | None = None
        self.runtime_loaded = False
        self.forget_calls()
        for hook in self._reset_hooks:
            hook()

    def register_memo(self, memo: Any) -> None:
        """A memo of prepared calls (csa_ops.dispatch.PreparedCalls), cleared with them."""
        with self._lock:
            if not any(m is memo for m in self._memos):
                self._memos.append(memo)

    def forget_calls(self) -> None:
        """Drop every prepared call and resolved problem: keys or kernels changed."""
        self.problems.clear()
        for memo in self._memos:
            memo.clear()

    def set_forward_numerics(self, mode: ForwardNumerics | str) -> None:
        mode = _numerics(mode)
        if mode is not self.forward_numerics:
            self.forward_numerics = mode
            self.keys.clear()
            self.forget_calls()

    @contextlib.contextmanager
    def python_path(self) -> Iterator[None]:
        """Within: calls prepared from here on take the Python launch path, not the native
        one. Prepared calls are forgotten on entry and on exit, so each side prepares its
        own."""
        self.forget_calls()
        previous, self.python_launch_path = self.python_launch_path, True
        try:
            yield
        finally:
            self.python_launch_path = previous
            self.forget_calls()


def _numerics(mode: ForwardNumerics | str) -> ForwardNumerics:
    try:
        return ForwardNumerics(mode)
    except ValueError:
        raise ValueError(f"forward numerics must be one of "
                         f"{[m.value for m in ForwardNumerics]}, got {mode!r}") from None


STATE = ProcessState()
