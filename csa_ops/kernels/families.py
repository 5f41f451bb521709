"""The kernel families by name, and the choice of one for a problem (no DSL import).

A family's plan module (kernels/<family>_plan.py) gives configure, supports, plan_forward,
plan_backward, enumerate_keys and launch_entry; only launch_entry imports the DSL.
"""

from __future__ import annotations

from ..config import KernelKey
from . import streaming_plan, window_plan

# In order of preference: the register-window kernels wherever they apply.
FAMILIES = {"window": window_plan, "streaming": streaming_plan}


def select_key(ratio: int, coff: int, head_dim: int, dtype: str, arch: str,
               backward: bool) -> KernelKey | None:
    """The heuristic key of the first family that supports this problem, else None."""
    for plan in FAMILIES.values():
        key = plan.configure(ratio, coff, head_dim, dtype, arch, backward)
        if plan.supports(key):
            return key
    return None
