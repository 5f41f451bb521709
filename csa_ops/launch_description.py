"""The kernels' launch description: one argument list per direction, and the prepared call of
one call signature that both launch paths run (csa_ops.native in C++, `python_call` here).

`ARGUMENTS` is the one statement of a kernel's argument list: the compile placeholders, the
cache identity, the launch values and the alignments a call checks all derive from it. A
`CallSpec` says what one validated call does with its tensors: which it reads (fp32 where
the kernels take fp32, copied where a view breaks the assumed alignment, never copied where
written in place), what it allocates, which constants and launches follow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Callable

import torch

from .config import TYPES, Direction, KernelKey


class Arg(enum.Enum):
    """What a kernel argument is: a pointer to the key's dtype (aligned to the key's vector
    width), to fp32 (ape, grad_ape, workspace, score_state, RoPE tables: 16-byte aligned),
    to int32 (offsets, positions, slots, block tables), to the norm weight's dtype, to the
    cache (the key's dtype or bytes, 16-byte aligned), or an Int32 scalar."""

    DATA = "data"
    F32 = "f32"
    IDX = "idx"
    I32 = "i32"
    WEIGHT = "weight"
    CACHE = "cache"


# csa::compressor_extend_store's fused kernels.
_STORE_CALL = (
    ("kv", Arg.DATA), ("score", Arg.DATA), ("ape", Arg.F32), ("cu", Arg.IDX),
    ("start_pos", Arg.IDX), ("slots", Arg.IDX), ("kv_state", Arg.DATA),
    ("score_state", Arg.F32), ("cuc", Arg.IDX), ("norm_weight", Arg.WEIGHT),
    ("cos", Arg.F32), ("sin", Arg.F32), ("block_table", Arg.IDX), ("cache", Arg.CACHE),
    ("num_tokens", Arg.I32), ("num_rows", Arg.I32), ("num_requests", Arg.I32),
    ("num_slots", Arg.I32), ("table_rows", Arg.I32), ("table_width", Arg.I32),
    ("num_pages", Arg.I32), ("page_size", Arg.I32), ("page_bytes", Arg.I32),
    ("grid", Arg.I32))

ARGUMENTS: dict[Direction, tuple[tuple[str, Arg], ...]] = {
    Direction.FORWARD: (
        ("kv", Arg.DATA), ("score", Arg.DATA), ("ape", Arg.F32), ("cu", Arg.IDX),
        ("cuc", Arg.IDX), ("out", Arg.DATA), ("workspace", Arg.F32), ("num_tokens", Arg.I32),
        ("num_rows", Arg.I32), ("num_segs", Arg.I32), ("grid", Arg.I32)),
    Direction.BACKWARD: (
        ("grad_out", Arg.DATA), ("kv", Arg.DATA), ("score", Arg.DATA), ("ape", Arg.F32),
        ("cu", Arg.IDX), ("cuc", Arg.IDX), ("grad_kv", Arg.DATA), ("grad_score", Arg.DATA),
        ("grad_ape", Arg.F32), ("workspace", Arg.F32), ("num_tokens", Arg.I32),
        ("num_rows", Arg.I32), ("num_segs", Arg.I32), ("grid", Arg.I32)),
    Direction.EXTEND: (
        ("kv", Arg.DATA), ("score", Arg.DATA), ("ape", Arg.F32), ("cu", Arg.IDX),
        ("start_pos", Arg.IDX), ("slots", Arg.IDX), ("kv_state", Arg.DATA),
        ("score_state", Arg.F32), ("out", Arg.DATA), ("cuc", Arg.IDX), ("num_tokens", Arg.I32),
        ("num_rows", Arg.I32), ("num_requests", Arg.I32), ("num_slots", Arg.I32),
        ("grid", Arg.I32)),
    Direction.STORE: (
        ("rows", Arg.DATA), ("norm_weight", Arg.WEIGHT), ("cos", Arg.F32), ("sin", Arg.F32),
        ("cu", Arg.IDX), ("start_pos", Arg.IDX), ("slots", Arg.IDX),
        ("block_table", Arg.IDX), ("cache", Arg.CACHE), ("num_rows", Arg.I32),
        ("num_requests", Arg.I32), ("num_tokens", Arg.I32), ("num_slots", Arg.I32),
        ("table_rows", Arg.I32), ("table_width", Arg.I32), ("num_pages", Arg.I32),
        ("page_size", Arg.I32), ("page_bytes", Arg.I32), ("ratio", Arg.I32),
        ("grid", Arg.I32)),
    Direction.EXTEND_STORE: _STORE_CALL,
    # A split call's rows launch, beside its first (an EXTEND_STORE kernel): one call's
    # launches take one argument list.
    Direction.ROWS_STORE: _STORE_CALL,
    Direction.FORWARD_EPILOGUE: (
        ("kv", Arg.DATA), ("score", Arg.DATA), ("ape", Arg.F32), ("cu", Arg.IDX),
        ("cuc", Arg.IDX), ("norm_weight", Arg.WEIGHT), ("cos", Arg.F32), ("sin", Arg.F32),
        ("position_offset", Arg.IDX), ("out", Arg.DATA), ("num_tokens", Arg.I32),
        ("num_rows", Arg.I32), ("num_segs", Arg.I32), ("table_rows", Arg.I32),
        ("rows_per_cta", Arg.I32), ("grid", Arg.I32)),
    Direction.BACKWARD_EPILOGUE: (
        ("grad_out", Arg.DATA), ("kv", Arg.DATA), ("score", Arg.DATA), ("ape", Arg.F32),
        ("cu", Arg.IDX), ("cuc", Arg.IDX), ("norm_weight", Arg.WEIGHT), ("cos", Arg.F32),
        ("sin", Arg.F32), ("position_offset", Arg.IDX), ("grad_kv", Arg.DATA),
        ("grad_score", Arg.DATA), ("grad_ape", Arg.F32), ("grad_weight", Arg.F32),
        ("workspace", Arg.F32), ("num_tokens", Arg.I32), ("num_rows", Arg.I32),
        ("num_segs", Arg.I32), ("table_rows", Arg.I32), ("grid", Arg.I32)),
    Direction.EPILOGUE: (
        ("rows", Arg.DATA), ("norm_weight", Arg.WEIGHT), ("cos", Arg.F32), ("sin", Arg.F32),
        ("cuc", Arg.IDX), ("position_offset", Arg.IDX), ("out", Arg.DATA),
        ("num_rows", Arg.I32), ("num_segs", Arg.I32), ("table_rows", Arg.I32),
        ("ratio", Arg.I32), ("grid", Arg.I32)),
    Direction.EPILOGUE_BACKWARD: (
        ("grad_out", Arg.DATA), ("rows", Arg.DATA), ("norm_weight", Arg.WEIGHT),
        ("cos", Arg.F32), ("sin", Arg.F32), ("cuc", Arg.IDX), ("position_offset", Arg.IDX),
        ("grad_rows", Arg.DATA), ("partials", Arg.F32), ("grad_weight", Arg.F32),
        ("num_rows", Arg.I32), ("num_segs", Arg.I32), ("table_rows", Arg.I32),
        ("ratio", Arg.I32), ("rows_per_cta", Arg.I32), ("grid", Arg.I32)),
}


def launch_signature(direction: Direction, key: KernelKey) -> tuple[tuple, ...]:
    """The argument slots of a compiled kernel, stream excluded: ("ptr", dtype name,
    assumed alignment) or ("i32",)."""
    return tuple(_slot(kind, key) for _, kind in ARGUMENTS[Direction(direction)])


def _slot(kind: Arg, key) -> tuple:
    if kind is Arg.DATA:
        return ("ptr", key.dtype, key.align_bytes)
    if kind is Arg.WEIGHT:  # an EpilogueKey's
        return ("ptr", key.weight_dtype, TYPES[key.weight_dtype].bytes)
    if kind is Arg.CACHE:
        return ("ptr", key.cache_dtype, 16)
    return {Arg.F32: ("ptr", "float32", 16), Arg.IDX: ("ptr", "int32", 4),
            Arg.I32: ("i32",)}[kind]


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch of a call: the kernel (a TVM-FFI function) and its scalars."""

    kernel: Callable[..., None]
    constants: dict[str, int]


@dataclasses.dataclass(frozen=True)
class CallSpec:
    """One validated call signature of one direction.

    inputs: the call's tensors, in the order it takes them. outputs: name -> (the input
    whose dtype and device it takes, its shape or None for that input's). workspace: fp32
    scratch elements; with none, the workspace argument is output `workspace_alias` (never
    accessed). to_float: inputs read as fp32; restore: (output, input) pairs, the output
    cast back to that input's dtype as passed. in_place: inputs the kernels write, which a
    call cannot copy: where one breaks its alignment the call returns None (the caller runs
    the reference). A zero address (an empty tensor) is passed as input `live`'s: kernels
    never touch an empty tensor, and any live address serves.
    """

    direction: Direction
    key: KernelKey
    inputs: tuple[str, ...]
    outputs: dict[str, tuple[str, tuple[int, ...] | None]]
    launches: tuple[Launch, ...]
    workspace: int = 0
    workspace_alias: str | None = None
    to_float: tuple[str, ...] = ()
    restore: tuple[tuple[str, str], ...] = ()
    in_place: tuple[str, ...] = ()
    live: str | None = None

    def slots(self) -> list[tuple[str, str | None]]:
        """(source, name) per kernel argument: ("input" | "output", name), ("workspace",
        None) or ("constant", name)."""
        result = []
        for name, kind in ARGUMENTS[self.direction]:
            if name in self.inputs:
                result.append(("input", name))
            elif name in self.outputs:
                result.append(("output", name))
            elif name == "workspace":
                result.append(("workspace", None) if self.workspace
                              else ("output", self.workspace_alias))
            else:
                result.append(("constant", name))
        return result

    def alignments(self) -> dict[str, int]:
        """Byte alignment each pointer argument assumes, by name."""
        arguments = ARGUMENTS[self.direction]
        return {name: slot[2] for (name, _), slot in
                zip(arguments, launch_signature(self.direction, self.key)) if slot[0] == "ptr"}


def python_call(spec: CallSpec, stream: Callable[[int], int], device_index: int,
                device_guard: bool) -> Callable[..., object]:
    """The Python launch path of `spec`: call(*tensors) -> its outputs (one, or a tuple), or
    None where an in-place input breaks its alignment. `device_guard` makes the call's
    device current around the launches (several GPUs: kernels launch into the current
    context)."""
    names = spec.inputs
    align = spec.alignments()
    to_float = [names.index(n) for n in spec.to_float]
    checks = [(i, align[n], n in spec.in_place) for i, n in enumerate(names) if n in align]
    outputs = [(names.index(like), shape) for like, shape in spec.outputs.values()]
    out_names = list(spec.outputs)
    restore = [(out_names.index(o), names.index(i)) for o, i in spec.restore]
    live = names.index(spec.live) if spec.live else None
    slots = [(source, names.index(name) if source == "input" else
              out_names.index(name) if source == "output" else name)
             for source, name in spec.slots()]
    launches = [(launch.kernel, [launch.constants[name] if source == "constant" else None
                                 for source, name in spec.slots()]) for launch in spec.launches]

    def call(*tensors: torch.Tensor):
        passed = [t.dtype for t in tensors]
        inp = [t.contiguous() for t in tensors]
        for i in to_float:
            inp[i] = inp[i].float()
        for i, alignment, in_place in checks:
            if inp[i].data_ptr() % alignment:
                if in_place:
                    return None
                inp[i] = inp[i].clone()  # a fresh allocation is aligned
        out = [torch.empty(shape if shape is not None else inp[like].shape,
                           dtype=inp[like].dtype, device=inp[like].device)
               for like, shape in outputs]
        work = (torch.empty(spec.workspace, dtype=torch.float32, device=inp[0].device)
                if spec.workspace else None)
        addresses = []
        for source, index in slots:
            if source == "input":
                address = inp[index].data_ptr()
            elif source == "output":
                address = out[index].data_ptr()
            elif source == "workspace":
                address = work.data_ptr()
            else:
                address = None
            if address == 0 and live is not None:
                address = inp[live].data_ptr()
            addresses.append(address)
        handle = stream(device_index)
        with torch.cuda.device(device_index) if device_guard else _NO_GUARD:
            for kernel, constants in launches:
                kernel(*[a if c is None else c for a, c in zip(addresses, constants)], handle)
        for o, i in restore:
            out[o] = out[o].to(passed[i])
        return out[0] if len(out) == 1 else tuple(out)

    return call


_NO_GUARD = contextlib.nullcontext()


def _public_stream_handle(device_index: int) -> int:
    return torch.cuda.current_stream(device_index).cuda_stream


def _stream_handle_function():
    """torch's raw current-stream query (what Inductor's generated code calls), or the public
    route when this torch lacks it: the public call builds a torch.cuda.Stream object per
    launch, a few microseconds."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw if raw is not None else _public_stream_handle


current_stream_handle = _stream_handle_function()  # device index -> the stream's handle
