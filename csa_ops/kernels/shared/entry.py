"""One compile helper for both kernel families: a `@cute.jit` launch entry becomes a binary.

The argument list comes from ``csa_ops.launch_description`` (``ARGUMENTS``) as slots
``("ptr", dtype name, assumed alignment)`` or ``("i32",)``; the stream always comes last.
Compiles run from placeholder pointers, never from user tensors, so a key compiles the same
binary on any machine, with or without a GPU (``arch`` names the target).
"""

from __future__ import annotations

import pathlib
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
from cutlass import cute
from cutlass.base_dsl.compiler import DumpDir
from cutlass.cute.runtime import make_fake_stream, make_ptr

from .common import dsl_type

_PLACEHOLDER_ADDRESS = 1 << 20  # never dereferenced at compile time


def _placeholders(slots: Sequence[tuple], tvm_ffi: bool) -> list[Any]:
    args: list[Any] = []
    for slot in slots:
        if slot[0] == "ptr":
            _, dtype, align = slot
            args.append(make_ptr(dsl_type(dtype), _PLACEHOLDER_ADDRESS, cute.AddressSpace.gmem,
                                 assumed_align=align))
        else:
            args.append(cutlass.Int32(1))
    # TVM-FFI takes the stream as a plain handle; the DSL's own call takes a CUstream.
    args.append(make_fake_stream() if tvm_ffi else cuda.CUstream(0))
    return args


def compile_entry(launch: Callable, arch: str, slots: Sequence[tuple], *, tvm_ffi: bool,
                  dump_dir: str | None = None, engine: bool = True) -> Any:
    """Compile ``launch(*slots, stream)`` for ``arch`` ("sm_90a" / "sm_100a"). Without
    ``engine`` the DSL skips building its in-process executor (a second host codegen and
    link): the result can only be exported."""
    options: list[Any] = [cute.GPUArch(arch)]
    if dump_dir is not None:
        options += [cute.KeepPTX(), DumpDir(dump_dir)]
    flags = "--enable-tvm-ffi" if tvm_ffi else None
    return cute.compile[tuple(options)](launch, *_placeholders(slots, tvm_ffi), options=flags,
                                        no_jit_engine=not engine)


def ptx(launch: Callable, arch: str, slots: Sequence[tuple]) -> str:
    """The PTX of one entry (numerics audits, hash checks of unchanged kernels)."""
    with tempfile.TemporaryDirectory() as tmp:
        compile_entry(launch, arch, slots, tvm_ffi=False, dump_dir=tmp)
        return "".join(p.read_text() for p in sorted(pathlib.Path(tmp).glob("*.ptx")))
