"""Inductor integration of csa::compressor: generated kernels or the opaque op, by policy.

``csa_ops.lowering.mode`` ("auto" | "extern" | "generate", initial value from the
environment variable CSA_OPS_LOWERING) picks the path; see ``policy``.
``csa_ops.lowering.fuse_rms_norm = True`` (or CSA_OPS_FUSE_RMSNORM=1) rewrites the op
followed by an RMSNorm into csa::compressor_epilogue (``_fuse_norm``). The integration uses
Inductor internals, so it is registered only on the tested torch releases (``TORCH_RANGE``:
2.11 to 2.15) and can be switched off with CSA_OPS_LOWERING_DISABLE=1; without it the op
compiles as an opaque extern call. ``available`` says whether it is registered.
``import csa_ops`` does not import this package (it imports Inductor); the fake kernels
import it when a trace first meets the op.
"""

from __future__ import annotations

import os
import sys
import types
import warnings

import torch
from torch.utils._python_dispatch import _disable_current_modes

from . import _versions, policy
from .policy import MODES, get_fuse_rms_norm, get_mode, set_fuse_rms_norm, set_mode

# The tested range, first and last (major, minor): the lowering's tests pass on torch 2.11,
# 2.12, 2.13, 2.14 and 2.15, one code path with two version adapters in _generate (the
# round-to-nearest ops, which 2.11 lacks; the C++ backend's conversion cache before 2.13).
# A release outside it may have moved the Inductor internals used here: there torch.compile
# keeps the opaque op, and warns.
TORCH_RANGE = ((2, 11), (2, 15))
DISABLE_ENV = "CSA_OPS_LOWERING_DISABLE"


def tested_range() -> str:
    (first_major, first_minor), (last_major, last_minor) = TORCH_RANGE
    return f"{first_major}.{first_minor}-{last_major}.{last_minor}"


def torch_supported(version: str | None = None) -> bool:
    """Whether ``version`` (default: the running torch's) is a release of the tested range."""
    return TORCH_RANGE[0] <= _versions.release(version) <= TORCH_RANGE[1]


def _register() -> bool:
    if os.environ.get(DISABLE_ENV, "0") not in ("", "0"):
        return False
    if not torch_supported():
        warnings.warn(f"csa_ops.lowering: torch {torch.__version__} is outside the tested range "
                      f"{tested_range()}; torch.compile calls csa::compressor as an opaque op",
                      stacklevel=2)
        return False
    policy.init_from_env()
    # Usually imported from inside a fake kernel, under the trace's fake and proxy modes:
    # nothing Inductor's modules run at import may be faked or recorded into the graph.
    with _disable_current_modes():
        try:
            from . import _wiring
        except ImportError as error:  # the op still compiles, as an opaque extern call
            warnings.warn(f"csa_ops.lowering unavailable ({error}); torch.compile calls "
                          "csa::compressor as an opaque op", stacklevel=2)
            return False
        _wiring.register()
        _refresh_decomposition_table()
    return True


def _refresh_decomposition_table() -> None:
    """Inductor memoizes a copy of its decomposition table on its first compile; one made
    before this registration would lack the total_comp=None decomposition."""
    from torch._inductor import decomposition

    memoized = getattr(decomposition, "fast_random_decomps", None)
    if hasattr(memoized, "cache_clear"):
        memoized.cache_clear()


available = _register()


def ensure_registered() -> bool:
    """Whether the integration is registered; importing this package registers it, so the
    fake kernels call this on every trace at the cost of an attribute lookup."""
    return available


class _PolicyModule(types.ModuleType):
    """Makes ``csa_ops.lowering.mode = ...`` validate and invalidate like ``set_mode``."""

    @property
    def mode(self) -> str:
        return get_mode()

    @mode.setter
    def mode(self, value: str) -> None:
        set_mode(value)

    @property
    def fuse_rms_norm(self) -> bool:
        return get_fuse_rms_norm()

    @fuse_rms_norm.setter
    def fuse_rms_norm(self, value: bool) -> None:
        set_fuse_rms_norm(value)


sys.modules[__name__].__class__ = _PolicyModule

__all__ = ["MODES", "TORCH_RANGE", "available", "ensure_registered", "fuse_rms_norm",
           "get_fuse_rms_norm", "get_mode", "mode", "set_fuse_rms_norm", "set_mode",
           "tested_range", "torch_supported"]
