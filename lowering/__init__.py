"""Inductor integration of csa::compressor: generated kernels or the opaque op, by policy.

``csa_ops.lowering.mode`` ("auto" | "extern" | "generate", initial value from the
environment variable CSA_OPS_LOWERING) picks the path; see ``policy``. The integration uses
Inductor internals, so it is registered only for torch 2.11 to 2.13 and can be switched off
with CSA_OPS_LOWERING_DISABLE=1; without it the op compiles as an opaque extern call.
``available`` says whether it is registered.
"""

from __future__ import annotations

import os
import sys
import types
import warnings

import torch

from . import policy
from .policy import MODES, get_mode, set_mode

TORCH_RANGE = ((2, 11), (2, 13))
DISABLE_ENV = "CSA_OPS_LOWERING_DISABLE"


def _torch_supported() -> bool:
    major_minor = tuple(int(part) for part in torch.__version__.split(".")[:2])
    return TORCH_RANGE[0] <= major_minor <= TORCH_RANGE[1]


def _register() -> bool:
    if os.environ.get(DISABLE_ENV, "0") not in ("", "0"):
        return False
    if not _torch_supported():
        warnings.warn(f"csa_ops.lowering: torch {torch.__version__} is outside the tested range "
                      f"{TORCH_RANGE}; torch.compile calls csa::compressor as an opaque op",
                      stacklevel=2)
        return False
    policy.init_from_env()
    from . import _wiring

    _wiring.register()
    return True


available = _register()


class _PolicyModule(types.ModuleType):
    """Makes ``csa_ops.lowering.mode = ...`` validate and invalidate like ``set_mode``."""

    @property
    def mode(self) -> str:
        return get_mode()

    @mode.setter
    def mode(self, value: str) -> None:
        set_mode(value)


sys.modules[__name__].__class__ = _PolicyModule

__all__ = ["MODES", "available", "get_mode", "mode", "set_mode"]
