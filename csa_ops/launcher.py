"""Kernel launchers: the one module that knows how a compiled kernel takes its arguments.

Kernels compile with TVM-FFI (apache-tvm-ffi), the DSL's supported low-overhead call and the
route of the CuTe-DSL kernel libraries: the compiled function takes pointers, scalars and
the stream as plain integers and converts them in C. Without tvm_ffi installed, or with
``CSA_OPS_TVM_FFI=0``, kernels compile for the DSL's own call instead (``PublicLauncher``:
DSL argument objects per call, several times slower per launch, and no disk cache).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

TVM_FFI = (os.environ.get("CSA_OPS_TVM_FFI", "1") != "0"
           and importlib.util.find_spec("tvm_ffi") is not None)

Launch = Callable[..., None]  # launch(*values in ARGUMENTS order, stream)


class PublicLauncher:
    """The DSL's own call: DSL argument objects per call, converted by the DSL."""

    def __init__(self, compiled: Any, signature: Sequence[tuple]) -> None:
        import cuda.bindings.driver as cuda
        import cutlass
        from cutlass import cute
        from cutlass.cute.runtime import make_ptr

        from .kernels.shared.common import dsl_type

        self._compiled = compiled
        self._stream = cuda.CUstream
        self._int32 = cutlass.Int32
        gmem = cute.AddressSpace.gmem
        self._makers = [self._pointer_maker(make_ptr, dsl_type(slot[1]), gmem, slot[2])
                        if slot[0] == "ptr" else None for slot in signature]

    @staticmethod
    def _pointer_maker(make_ptr, dtype, space, align):
        return lambda address: make_ptr(dtype, address, space, assumed_align=align)

    def __call__(self, *values_and_stream: int) -> None:
        *values, stream = values_and_stream
        args = [make(v) if make else self._int32(v) for make, v in zip(self._makers, values)]
        self._compiled(*args, self._stream(stream))


def make_launcher(compiled: Any, signature: Sequence[tuple]) -> Launch:
    """A TVM-FFI function (compiled now or loaded from the disk cache) is called as it is:
    it takes the values and the stream as plain ints."""
    return compiled if TVM_FFI else PublicLauncher(compiled, signature)


def _public_stream_handle(device_index: int) -> int:
    return torch.cuda.current_stream(device_index).cuda_stream


def _stream_handle_function():
    """torch's raw current-stream query (what Inductor's generated code calls), or the public
    route when this torch lacks it: the public call builds a torch.cuda.Stream object per
    launch, a few microseconds."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw if raw is not None else _public_stream_handle


current_stream_handle = _stream_handle_function()
