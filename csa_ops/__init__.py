"""csa-ops: the CSA/HCA Compressor as a first-class PyTorch op, ``torch.ops.csa.compressor``.

Importing the package registers both ops, their fakes, autograd and (where the installed
torch supports it) the Inductor integration.
"""

from . import ops
from . import meta  # noqa: F401  (registers the fake kernels)
from .module import Compressor, offsets_for
from .ops import compressor

try:
    from . import lowering  # noqa: F401  (Inductor integration; version-gated inside)
except ImportError as error:  # the op works without it, only unfused under torch.compile
    import warnings

    warnings.warn(f"csa_ops.lowering unavailable ({error}); torch.compile uses the extern op")

__version__ = "0.1.0"


def precompile(ratio: int, head_dim: int, coff: int, dtype=None, arch=None):
    """Compile both kernel directions of one configuration ahead of use (see ``host``)."""
    from . import host
    return host.precompile(ratio, head_dim, coff, dtype=dtype, arch=arch)


__all__ = ["Compressor", "compressor", "offsets_for", "precompile", "ops"]
