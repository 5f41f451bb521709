"""The ops' per-call fast paths: the short route below autograd for plain CUDA tensors,
and the memo of prepared calls by metadata signature.

A Python kernel at the Autograd key that only passes a call on (no tensor requires grad)
would normally redispatch through torch's dispatcher, a second Python-to-C++-to-Python trip
of several microseconds per call, as much as the kernel launch (torch.library's
``register_autograd`` pays it, plus building its metadata). When the keys left below
autograd are exactly those of plain CUDA tensors, the dispatcher can only pick the op's
CUDA kernel, so ``below_autograd`` calls that kernel itself. Any other key set (fake or
functional tensors under torch.compile, ``__torch_dispatch__`` modes, meta, CPU) goes back
to the dispatcher, which decides as it always does. Where the native launch path is built,
its C++ kernels at the AutogradCUDA key run a repeated plain call before any of this
(csa_ops.native) and hand every other call to these Python kernels.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import torch

from .config import CAPACITY_MESSAGE
from .state import STATE

_Key = torch._C.DispatchKey
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
# The key set torch hands a with_keyset kernel leaves out fallthrough keys; ADInplaceOrView
# (where these ops register nothing) is accepted too, in case a torch version keeps it.
_CUDA = torch._C.DispatchKeySet(_Key.CUDA)
_PLAIN_CUDA = frozenset((_CUDA.raw_repr(), _CUDA.add(_Key.ADInplaceOrView).raw_repr()))


def assert_rows_fit(cu_seqlens_comp: torch.Tensor, num_rows: int) -> None:
    """The kernels' row-capacity assertion where a CUDA call runs the torch reference: a
    device-side assert of cu_seqlens_comp[-1] <= num_rows (no host sync, capturable)."""
    torch._assert_async(cu_seqlens_comp[-1] <= num_rows, CAPACITY_MESSAGE)


def below_autograd(op: torch._ops.OpOverload, cuda_kernel: Callable, keyset, args):
    """``op``'s kernel below autograd for the dispatch key set ``keyset``."""
    below = keyset & _AFTER_AUTOGRAD
    if below.raw_repr() in _PLAIN_CUDA:
        return cuda_kernel(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op.redispatch(below, *args)


def inference_only(op_name: str, cuda_kernel: Callable):
    """The Autograd kernel of an inference-only op `csa::<op_name>`: a gradient request is
    refused, anything else runs below autograd (the pattern opcheck asks of
    non-differentiable ops)."""

    def autograd_kernel(keyset, *args):
        if wants_grad(*(a for a in args if isinstance(a, torch.Tensor))):
            raise RuntimeError(f"csa.{op_name}: inference only: no gradient is defined; call "
                               "it under torch.no_grad() or torch.inference_mode(), or "
                               "detach the inputs")
        return below_autograd(getattr(torch.ops.csa, op_name).default, cuda_kernel, keyset,
                              args)

    return autograd_kernel


def once_differentiable(op_name: str, cuda_kernel: Callable) -> type:
    """An autograd.Function that runs a backward op `csa::<op_name>` where autograd records
    it, and refuses a gradient of its gradients (no double backward)."""

    def forward(ctx, keyset, *args):
        return below_autograd(getattr(torch.ops.csa, op_name).default, cuda_kernel, keyset,
                              args)

    def backward(ctx, *grads):
        raise NotImplementedError(f"csa.{op_name}: double backward (a gradient of the "
                                  "gradients) is not implemented")

    return type(f"{op_name}_function", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})


def wants_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd must record a call on these (floating-point) tensor arguments."""
    if torch.is_grad_enabled():
        for tensor in tensors:  # a loop: any() over a generator costs ~0.5 us more per call
            if tensor.requires_grad:
                return True
    return False


def signature(tensors, *scalars) -> tuple | None:
    """A call's metadata signature: shape, dtype and device of each tensor, then the
    scalars. A signature seen before passed every metadata check and was resolved to a
    prepared call, so repeated calls skip both (they cost more Python than the launch).
    None where an argument is not a tensor: the full check names it."""
    try:
        return (*[(t.shape, t.dtype, t.device) for t in tensors], *scalars)
    except AttributeError:
        return None


class PreparedCalls(dict):
    """Signature -> prepared call, cleared when it reaches `limit` entries (shapes that
    change every call must not grow it without bound).

    Native prepared calls (csa_ops.native) are also entered in `table`, a C++ CallTable
    that builds a call's signature, finds its call and makes it in one step; a call it
    does not hold returns None there and takes the Python route. `on_table(module, table)`
    runs once, when the first native call creates the table (the ops register their C++
    Autograd kernels on it)."""

    def __init__(self, limit: int = 4096, on_table=None) -> None:
        super().__init__()
        self.limit = limit
        self.registered = False  # with the launch path, which clears it (see launch_path)
        self.table = None
        self._on_table = on_table  # on_table(native module, table) once the table exists
        self._lock = threading.Lock()

    def remember(self, signature: tuple | None, call, args: tuple = (), tensors: int = 0):
        """Enter `call` for `signature`; `args` (the call's arguments, `tensors` of them
        the prepared call's own) enter a native call in the C++ table too."""
        if signature is not None:
            if len(self) >= self.limit:
                self.clear()
            self[signature] = call
            if args and _native().is_prepared_call(call):
                self._table().insert(call, tensors, *args)
        return call

    def _table(self):
        """The C++ table, created (and handed to on_table) once, under a lock: a second
        table would leave the C++ kernels reading one that clear() no longer reaches."""
        with self._lock:
            if self.table is None:
                module = _native_module()
                table = module.CallTable()
                if self._on_table is not None:
                    try:
                        self._on_table(module, table)
                    except RuntimeError as error:  # the table still serves the Python route
                        warnings.warn(f"csa_ops: the native Autograd kernels were not "
                                      f"registered ({error})", RuntimeWarning, stacklevel=4)
                self.table = table
            return self.table

    def clear(self) -> None:
        super().clear()
        if self.table is not None:
            self.table.clear()


def _native():
    from . import native  # not at import: `python -m csa_ops.native` runs it as __main__

    return native


def _native_module():
    return _native().module()


def launch_path(memo: PreparedCalls):
    """csa_ops.host, the kernels' launch path (imported on first CUDA use, not with the
    package), with `memo` registered to be cleared whenever kernels or keys change."""
    from . import host

    if not memo.registered:
        STATE.register_memo(memo)
        memo.registered = True
    return host
