"""csa-ops: the CSA/HCA Compressor as a first-class PyTorch op, ``torch.ops.csa.compressor``.

Importing the package registers both ops, their fakes and autograd. It imports neither
Inductor nor the CuTe DSL (SPEC 7): the Inductor integration, ``csa_ops.lowering``, is
registered by the fake kernels when a trace first meets the op, and the DSL only when a
kernel must be compiled (a warm kernel cache loads kernels without it). On a machine with
CUDA it imports the launch path (csa_ops.host, tvm_ffi) so that first calls stay short.
"""

import importlib  # noqa: I001  (ops defines the ops before meta registers their fakes)

import torch

from . import ops
from . import meta  # noqa: F401  (registers the fake kernels)
from .module import Compressor, offsets_for
from .ops import compressor
from .serving import CompressorState, compressor_extend

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


def __getattr__(name: str):
    # ``csa_ops.lowering`` without importing Inductor at package import (PEP 562).
    if name == "lowering":
        return importlib.import_module(f"{__name__}.lowering")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Compressor", "CompressorState", "compressor", "compressor_extend", "offsets_for",
           "ops", "precompile", "precompile_extend"]
