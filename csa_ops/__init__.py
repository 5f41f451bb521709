"""csa-ops: the CSA/HCA Compressor as a first-class PyTorch op, ``torch.ops.csa.compressor``.

Importing the package registers the ops, their fakes and autograd. It imports neither
Inductor nor the CuTe DSL, so that importing it costs little more than importing torch: the
Inductor integration, ``csa_ops.lowering``, is registered by the fake kernels when a trace
first meets the op, and the DSL only when a kernel must be compiled (a warm kernel cache
loads kernels without it). On a machine with CUDA it imports the launch path (csa_ops.host,
tvm_ffi) so that first calls stay short.
"""

import contextlib  # noqa: I001  (the ops are defined before meta registers their fakes)
import importlib

import torch

from . import ops
from . import epilogue, serving_store  # noqa: F401  (the fused-epilogue ops)
from . import meta  # noqa: F401  (registers the fake kernels)
from .module import Compressor, offsets_for
from .ops import compressor
from .serving import CompressorState, compressor_extend
from .state import STATE, ForwardNumerics

__version__ = "0.1.0"

if torch.cuda.is_available():  # no CUDA context is created here
    from . import host

    # Where kernels can run, pay the launch path's imports now, well inside the import
    # budget, rather than inside a configuration's first call.
    host.warm_launch_path()


def precompile(ratio: int, head_dim: int, coff: int, dtype: torch.dtype | None = None,
               arch: str | None = None):
    """Compile both kernel directions of one configuration ahead of use; returns their keys.

    dtype None means torch.bfloat16. arch None means the current CUDA device; "sm_90a" or
    "sm_100a" cross-compiles on a machine without a GPU.
    """
    from . import host

    return host.precompile(ratio, head_dim, coff, dtype, arch)


def precompile_extend(ratio: int, head_dim: int, coff: int, dtype: torch.dtype | None = None,
                      arch: str | None = None):
    """Compile csa::compressor_extend's kernels of one configuration ahead of use (every
    kernel its call sizes launch: decode steps, decode-sized calls, the two launches of
    larger calls; a CUDA graph capture cannot compile one); returns their keys. dtype and
    arch as in precompile.
    """
    from . import host

    return host.precompile_extend(ratio, head_dim, coff, dtype, arch)


def precompile_store(head_dim: int, cache_format: str, rope_dim: int = 0,
                     rotate: bool = False, eps: float = 1e-6, dtype: torch.dtype | None = None,
                     weight_dtype: torch.dtype | None = None, arch: str | None = None, *,
                     ratio: int | None = None, coff: int | None = None):
    """Compile csa_ops.serving_store.compressor_extend_store's epilogue kernel (RMSNorm with
    ``eps``, RoPE on ``rope_dim`` columns, the rotation, ``cache_format`` and the paged
    store) ahead of use, as a CUDA graph capture needs; returns its key, or None where that
    epilogue runs as torch ops. dtype (the rows') and arch as in precompile; weight_dtype
    (norm_weight's) None means float32. With ``ratio`` and ``coff``, also the kernel that
    runs a whole decode step of that configuration (one new token per request) in one
    launch; a step captured without it runs as two launches, the same bytes."""
    from . import host

    return host.precompile_store(head_dim, cache_format, rope_dim, rotate, eps, dtype,
                                 weight_dtype, arch, ratio, coff)


def precompile_epilogue(head_dim: int, rope_dim: int = 0, rotate: bool = False,
                        eps: float = 1e-6, dtype: torch.dtype | None = None,
                        weight_dtype: torch.dtype | None = None, position_offset: bool = False,
                        arch: str | None = None, *, ratio: int | None = None,
                        coff: int | None = None):
    """Compile csa_ops.epilogue.compressor_epilogue's row-epilogue kernels (its forward's
    and its backward's) ahead of use, as a CUDA graph capture needs; ``position_offset``:
    for calls that pass one. Returns their key, or None where that epilogue runs as torch
    ops. With ``ratio`` and ``coff``, also the kernels that run its whole forward and whole
    backward in one launch each where the register-window family pools that
    configuration; a step captured without them runs the separate kernels. Arguments
    otherwise as in precompile_store."""
    from . import host

    return host.precompile_epilogue(head_dim, rope_dim, rotate, eps, dtype, weight_dtype,
                                    position_offset, arch, ratio, coff)


def set_forward_numerics(mode: str) -> None:
    """The forward's numerics mode for this process: "certified" (the default: every output
    element within one rounding step of torch's eager region on the same device) or "fast"
    (the ratio-128 kernels skip recomputing in torch's order the few columns their bound
    cannot certify: within one step except on rare cancelling columns, 28-51% faster there;
    the register-window kernels do not change). Calls prepared before are prepared again."""
    STATE.set_forward_numerics(mode)


def get_forward_numerics() -> str:
    """The forward's numerics mode ("certified" or "fast")."""
    return STATE.forward_numerics.value


@contextlib.contextmanager
def forward_numerics(mode: str):
    """Within: the forward's numerics mode is `mode` (see set_forward_numerics); the mode
    before is restored on exit. The mode is the process's, not the thread's."""
    previous = STATE.forward_numerics
    STATE.set_forward_numerics(mode)
    try:
        yield
    finally:
        STATE.set_forward_numerics(previous)


def __getattr__(name: str):
    # ``csa_ops.lowering`` without importing Inductor at package import, and
    # ``csa_ops.distributed`` without the functional collectives' imports (PEP 562).
    if name in ("lowering", "distributed"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Compressor", "CompressorState", "ForwardNumerics", "compressor",
           "compressor_extend", "forward_numerics", "get_forward_numerics", "offsets_for", "ops",
           "precompile", "precompile_extend", "precompile_store", "precompile_epilogue",
           "set_forward_numerics"]
