"""The ops' autograd-key kernels: the short route below autograd for plain CUDA tensors.

A Python kernel at the Autograd key that only passes a call on (no tensor requires grad)
would normally redispatch through torch's dispatcher, a second Python-to-C++-to-Python trip
of several microseconds per call, as much as the kernel launch (torch.library's
``register_autograd`` pays it, plus building its metadata). When the keys left below
autograd are exactly those of plain CUDA tensors, the dispatcher can only pick the op's
CUDA kernel, so ``below_autograd`` calls that kernel itself. Any other key set (fake or
functional tensors under torch.compile, ``__torch_dispatch__`` modes, meta, CPU) goes back
to the dispatcher, which decides as it always does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_Key = torch._C.DispatchKey
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
# The key set torch hands a with_keyset kernel leaves out fallthrough keys; ADInplaceOrView
# (where these ops register nothing) is accepted too, in case a torch version keeps it.
_CUDA = torch._C.DispatchKeySet(_Key.CUDA)
_PLAIN_CUDA = frozenset((_CUDA.raw_repr(), _CUDA.add(_Key.ADInplaceOrView).raw_repr()))


def below_autograd(op: torch._ops.OpOverload, cuda_kernel: Callable, keyset, args):
    """``op``'s kernel below autograd for the dispatch key set ``keyset``."""
    below = keyset & _AFTER_AUTOGRAD
    if below.raw_repr() in _PLAIN_CUDA:
        return cuda_kernel(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op.redispatch(below, *args)


def wants_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd must record a call on these (floating-point) tensor arguments."""
    if torch.is_grad_enabled():
        for tensor in tensors:  # a loop: any() over a generator costs ~0.5 us more per call
            if tensor.requires_grad:
                return True
    return False
