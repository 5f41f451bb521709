"""Kernel launchers: the one module that knows how a compiled DSL function takes its arguments.

The public call of a compiled function, ``compiled(*args)``, converts every argument on every
call: each ``cute.Pointer``, ``cutlass.Int32`` and ``CUstream`` goes through the DSL's
adapters into a list of C addresses (with building the Int32 and stream objects, 29.7 us
per launch on the H200's host against 11.2 us prepacked). Our argument list never changes shape, so `PrepackedLauncher`
builds that address list once, pointing at ctypes slots it owns, and per call only stores
the new values into the slots before handing the list to ``compiled.run_compiled_program``.
`current_stream_handle` reads the stream through torch's raw query under the same switch.

That layout (one address per argument, pointing at the pointer/int32/stream value) is a DSL
internal. It is checked, never assumed: `make_launcher` asks the DSL to convert a template
call with distinctive values and reads them back through the addresses it returned; any
difference (another DSL version, another argument convention) falls back to the public
`PublicLauncher`, with a warning. ``CSA_OPS_PREPACKED_LAUNCH=0`` (or setting
``csa_ops.launcher.PREPACKED = False`` before the first launch of a kernel) forces the public
path.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import torch

PREPACKED = os.environ.get("CSA_OPS_PREPACKED_LAUNCH", "1") != "0"

# A signature is a sequence of argument slots: ("ptr", torch dtype of the pointee, assumed
# alignment in bytes) or ("i32",) for a cutlass.Int32 scalar; the stream always comes last
# and is not listed.


class _Runtime:
    """DSL runtime objects, imported on first use so `import csa_ops` stays light."""

    def __init__(self) -> None:
        import cuda.bindings.driver as cuda
        import cutlass
        from cutlass import cute
        from cutlass.cute.runtime import make_ptr

        self.stream = cuda.CUstream
        self.int32 = cutlass.Int32
        self.types = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16,
                      torch.float32: cutlass.Float32, torch.int32: cutlass.Int32}
        self.gmem = cute.AddressSpace.gmem
        self.make_ptr = make_ptr

    def pointer(self, dtype: torch.dtype, address: int, align: int) -> Any:
        return self.make_ptr(self.types[dtype], address, self.gmem, align)


_RUNTIME: list[_Runtime] = []


def runtime() -> _Runtime:
    if not _RUNTIME:
        _RUNTIME.append(_Runtime())
    return _RUNTIME[0]


class PublicLauncher:
    """The supported call: DSL argument objects per call, converted by the DSL."""

    prepacked = False

    def __init__(self, compiled: Any, signature: Sequence[tuple]) -> None:
        self._compiled = compiled
        self._signature = tuple(signature)
        # Pointer objects are plain values and the caching allocator hands out the same
        # addresses step after step: memoizing them saves most of their construction.
        self._pointers: dict[tuple[int, int], Any] = {}

    def __call__(self, values: Sequence[int], stream: int) -> None:
        rt = runtime()
        args = []
        for i, (slot, value) in enumerate(zip(self._signature, values)):
            if slot[0] == "ptr":
                pointer = self._pointers.get((i, value))
                if pointer is None:
                    if len(self._pointers) > 4096:
                        self._pointers.clear()
                    pointer = self._pointers[(i, value)] = rt.pointer(slot[1], value, slot[2])
                args.append(pointer)
            else:
                args.append(rt.int32(value))
        self._compiled(*args, rt.stream(stream))


class PrepackedLauncher:
    """Stores each call's values into fixed ctypes slots whose addresses the DSL reads."""

    prepacked = True

    def __init__(self, compiled: Any, signature: Sequence[tuple]) -> None:
        self._run = compiled.run_compiled_program
        kinds = [slot[0] for slot in signature] + ["stream"]
        self._slots = [ctypes.c_int32() if kind == "i32" else ctypes.c_uint64() for kind in kinds]
        self._addresses = [ctypes.addressof(slot) for slot in self._slots]
        self._lock = threading.Lock()  # the slots are shared by all callers

    def __call__(self, values: Sequence[int], stream: int) -> None:
        slots = self._slots
        with self._lock:
            for slot, value in zip(slots, values):
                slot.value = value
            slots[-1].value = stream
            self._run(self._addresses)


def _public_stream_handle(device_index: int) -> int:
    return torch.cuda.current_stream(device_index).cuda_stream


def _stream_handle_function():
    """torch's raw current-stream query (what Inductor's generated code calls), or the public
    route when this torch lacks it or the kill switch is off: the public call builds a
    torch.cuda.Stream object per launch, a few microseconds."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw if PREPACKED and raw is not None else _public_stream_handle


current_stream_handle = _stream_handle_function()


def _template(signature: Sequence[tuple]) -> tuple[list[int], int]:
    """Distinctive, aligned values for a layout check (never dereferenced by anyone)."""
    values = [(0x7F00_0000_0000 + 0x1000 * (i + 1)) if slot[0] == "ptr" else 0x1234_0000 + i
              for i, slot in enumerate(signature)]
    return values, 0x7E00_0000_0000 + 0x40


def layout_mismatch(compiled: Any, signature: Sequence[tuple]) -> str | None:
    """Why the prepacked layout does not hold for `compiled` (None when it does).

    Converts a template call through the DSL's own argument path and reads every value
    back through the address the DSL produced for it. Needs no GPU.
    """
    rt = runtime()
    values, stream = _template(signature)
    args = [rt.pointer(slot[1], v, slot[2]) if slot[0] == "ptr" else rt.int32(v)
            for slot, v in zip(signature, values)]
    args.append(rt.stream(stream))
    try:
        addresses, _keepalive = compiled.generate_execution_args(*args)
    except Exception as error:  # noqa: BLE001  (any failure means: use the public path)
        return f"generate_execution_args raised {error!r}"
    expected = [*values, stream]
    if len(addresses) != len(expected):
        return f"{len(addresses)} packed arguments for a signature of {len(expected)}"
    kinds = [slot[0] for slot in signature] + ["stream"]
    for i, (address, want, kind) in enumerate(zip(addresses, expected, kinds)):
        if isinstance(address, ctypes.c_void_p):
            address = address.value
        if not isinstance(address, int) or address in expected or address < 0x10000:
            return f"argument {i} is not passed by address ({address!r})"
        ctype = ctypes.c_int32 if kind == "i32" else ctypes.c_uint64
        got = ctype.from_address(address).value
        if got != want:
            return f"argument {i} ({kind}) reads back {got:#x}, expected {want:#x}"
    del _keepalive
    return None


def make_launcher(compiled: Any, signature: Sequence[tuple]) -> PublicLauncher | PrepackedLauncher:
    """The fastest launcher whose argument layout is verified for this compiled function."""
    if PREPACKED:
        reason = layout_mismatch(compiled, signature)
        if reason is None:
            return PrepackedLauncher(compiled, signature)
        warnings.warn(f"csa_ops: prepacked kernel launch disabled ({reason}); "
                      f"using the DSL's public call", RuntimeWarning, stacklevel=2)
    return PublicLauncher(compiled, signature)
