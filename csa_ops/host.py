"""Launch path of the CuTe-DSL compressor kernels: family choice, one compile cache, launch.

`supports`, `compressor_forward`, `compressor_backward` and `precompile` are what ops.py
calls. A kernel family is a module in csa_ops/kernels/ that satisfies `KernelFamily` below
("window" for coff*ratio <= config.WINDOW_MAX, else "streaming"); host.py owns everything
torch-side (allocation, alignment checks, pointers, stream) and the compile cache, keyed on
the frozen `config.KernelKey`. Compiles are pure functions of the key, so `arch="sm_100a"`
cross-compiles on a machine without that GPU (or without any GPU).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch

from . import config, launcher
from .config import KernelKey, LaunchPlan

_TORCH_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_FAMILY_MODULES = {"window": "csa_ops.kernels.window", "streaming": "csa_ops.kernels.streaming"}


class KernelFamily(Protocol):
    """What a family module exposes (all pure functions of their arguments).

    configure(ratio, coff, head_dim, dtype, arch, backward) -> KernelKey
        Heuristic key (launch knobs filled in) for one direction; dtype/arch as in config.
    supports(key) -> bool
        Whether this family compiles `key` (cheap, no device access).
    compile_forward(key) / compile_backward(key) -> compiled callable
        JIT from fake pointers for key.arch. Runtime arguments, in order (pointers are
        cute.runtime.make_ptr(gmem, assumed_align=key.align_bytes for the dtype tensors,
        16 for ape/grad_ape/workspace, 4 for cu/cuc); scalars are cutlass.Int32):
          fwd: kv, score, ape, cu, cuc, out, workspace, num_tokens, num_rows, num_segs, grid,
               stream
          bwd: grad_out, kv, score, ape, cu, cuc, grad_kv, grad_score, grad_ape, workspace,
               num_tokens, num_rows, num_segs, grid, stream
        num_rows = out.shape[0] (may exceed cuc[-1]); num_segs = cu.numel() - 1. Every output
        element must be written (outputs come from torch.empty), no float atomics, no read
        or write out of bounds for any cu/cuc contents.
    plan_forward(key, num_tokens, num_rows, num_sms) -> LaunchPlan
    plan_backward(key, num_tokens, num_rows, num_sms) -> LaunchPlan
        Grid size and fp32 workspace elements. Workspace content is undefined on entry; a
        family that needs it zeroed zeroes it inside its own launches (CUDA-graph safe).
        With workspace 0 the workspace argument is some other fp32 tensor: never access it.
    """

    def configure(
        self, ratio: int, coff: int, head_dim: int, dtype: str, arch: str, backward: bool
    ) -> KernelKey: ...
    def supports(self, key: KernelKey) -> bool: ...
    def compile_forward(self, key: KernelKey) -> Callable[..., Any]: ...
    def compile_backward(self, key: KernelKey) -> Callable[..., Any]: ...
    def plan_forward(
        self, key: KernelKey, num_tokens: int, num_rows: int, num_sms: int
    ) -> LaunchPlan: ...
    def plan_backward(
        self, key: KernelKey, num_tokens: int, num_rows: int, num_sms: int
    ) -> LaunchPlan: ...


# ---------------------------------------------------------------------------------------
# Family choice


_FAMILIES: dict[str, KernelFamily | None] = {}


def _family(name: str) -> KernelFamily | None:
    if name not in _FAMILIES:
        try:
            _FAMILIES[name] = importlib.import_module(_FAMILY_MODULES[name])  # type: ignore
        except ImportError:
            _FAMILIES[name] = None
    return _FAMILIES[name]


def select_key(
    ratio: int, coff: int, head_dim: int, dtype: str, arch: str, backward: bool
) -> KernelKey | None:
    """The key that would run this problem, or None when no family supports it."""
    names = ("window", "streaming") if coff * ratio <= config.WINDOW_MAX else ("streaming",)
    for name in names:
        fam = _family(name)
        if fam is None:
            continue
        key = fam.configure(ratio, coff, head_dim, dtype, arch, backward)
        if fam.supports(key):
            return key
    return None


def device_arch(device: torch.device | int | None = None) -> str | None:
    """Compile target for a CUDA device, or None when no kernel targets it."""
    major, minor = torch.cuda.get_device_capability(device)
    return {(9, 0): "sm_90a", (10, 0): "sm_100a"}.get((major, minor))


_NUM_SMS: dict[int, int] = {}
_ARCH_OF: dict[int, str | None] = {}


def _device_info(dev: torch.device) -> tuple[str | None, int]:
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx not in _ARCH_OF:
        _ARCH_OF[idx] = device_arch(idx)
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _ARCH_OF[idx], _NUM_SMS[idx]


# ---------------------------------------------------------------------------------------
# Compile cache


class _Compiled(NamedTuple):
    kernel: Any  # the DSL's compiled function
    launch: Callable[[list[int], int], None]  # launcher(values, stream), see csa_ops.launcher


class _CompileCache:
    """One cache for all families and directions, guarded against double compiles.

    One lock for all keys, not one per key: the DSL's compiler keeps per-process session
    state, and two threads compiling different kernels at once fail inside it
    (nvidia-cutlass-dsl 4.8.1: "Please start a session before accessing session data").
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, KernelKey], _Compiled] = {}
        self.hits = 0
        self.misses = 0

    def get(self, direction: str, key: KernelKey) -> _Compiled:
        entry = self._entries.get((direction, key))
        if entry is not None:
            self.hits += 1
            return entry
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"csa_ops: the {direction} kernel for {key} is not compiled and a CUDA graph "
                f"capture is active, where JIT is not allowed. Call csa_ops.precompile("
                f"ratio={key.ratio}, head_dim={key.head_dim}, coff={key.coff}, dtype=torch."
                f"{key.dtype}) (or run the op once eagerly) before capturing."
            )
        with self._lock:
            entry = self._entries.get((direction, key))
            if entry is None:
                fam = _family(key.family)
                if fam is None:
                    raise RuntimeError(f"csa_ops: kernel family {key.family!r} is unavailable")
                compile_fn = fam.compile_forward if direction == "fwd" else fam.compile_backward
                kernel = compile_fn(key)
                launch = launcher.make_launcher(kernel, launch_signature(direction, key))
                entry = self._entries[(direction, key)] = _Compiled(kernel, launch)
                self.misses += 1
            else:
                self.hits += 1
        return entry

    def info(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "size": len(self._entries)}

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0


_CACHE = _CompileCache()
cache_info = _CACHE.info
cache_clear = _CACHE.clear


def precompile(
    ratio: int,
    head_dim: int,
    coff: int,
    dtype: torch.dtype = torch.bfloat16,
    arch: str | None = None,
) -> list[KernelKey]:
    """Compile forward and backward kernels for one configuration; returns their keys.

    arch None means the current CUDA device; "sm_90a"/"sm_100a" cross-compile without a GPU.
    """
    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"precompile: dtype must be one of {list(_TORCH_DTYPES)}, got {dtype}")
    if arch is None:
        if not torch.cuda.is_available():
            raise RuntimeError("precompile: no CUDA device; pass arch='sm_90a' or 'sm_100a'")
        arch = device_arch()
        if arch is None:
            raise RuntimeError(
                f"precompile: no kernel targets compute capability "
                f"{torch.cuda.get_device_capability()}; supported: {config.ARCHS}"
            )
    if arch not in config.ARCHS:
        raise ValueError(f"precompile: arch must be one of {config.ARCHS}, got {arch!r}")
    keys = []
    for direction, backward in (("fwd", False), ("bwd", True)):
        key = _key_for(ratio, coff, head_dim, _TORCH_DTYPES[dtype], arch, backward)
        if key is None:
            raise ValueError(
                f"precompile: no kernel family supports ratio={ratio}, coff={coff}, "
                f"head_dim={head_dim}, dtype={dtype}"
            )
        _CACHE.get(direction, key)
        keys.append(key)
    return keys


# ---------------------------------------------------------------------------------------
# Per-call path (inputs arrive validated and contiguous from ops.py)

_KEYS: dict[tuple, KernelKey | None] = {}


def _key_for(
    ratio: int, coff: int, head_dim: int, dtype: str, arch: str, backward: bool
) -> KernelKey | None:
    memo = (ratio, coff, head_dim, dtype, arch, bool(backward))
    if memo not in _KEYS:
        _KEYS[memo] = select_key(ratio, coff, head_dim, dtype, arch, backward)
    return _KEYS[memo]


def set_key(key: KernelKey, backward: bool) -> None:
    """Pins the key used for key's problem and direction (autotuning; see config enumerators)."""
    _KEYS[(key.ratio, key.coff, key.head_dim, key.dtype, key.arch, bool(backward))] = key


def supports(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    cu: torch.Tensor,
    cuc: torch.Tensor,
    ratio: int,
    coff: int,
) -> bool:
    """Whether the CUDA kernels run this call (dtypes, device arch, a family for the shape)."""
    if not kv.is_cuda or kv.dtype not in _TORCH_DTYPES or score.dtype != kv.dtype:
        return False
    if ape.dtype != torch.float32 or cu.dtype != torch.int32 or cuc.dtype != torch.int32:
        return False
    if kv.dim() != 2 or kv.shape[1] % coff or kv.shape[1] == 0 or cu.numel() < 1:
        return False
    return supports_config(kv.device, kv.dtype, ratio, coff, kv.shape[1] // coff)


def supports_config(device: torch.device, dtype: torch.dtype, ratio: int, coff: int,
                    head_dim: int) -> bool:
    """The metadata half of `supports` (device arch, dtype, a family for both directions):
    what a compiler deciding at trace time can ask without tensors."""
    if device.type != "cuda" or dtype not in _TORCH_DTYPES:
        return False
    arch, _ = _device_info(device)
    if arch is None:
        return False
    name = _TORCH_DTYPES[dtype]
    return all(_key_for(ratio, coff, head_dim, name, arch, b) is not None for b in (0, 1))


def _aligned(t: torch.Tensor, align: int) -> torch.Tensor:
    # A contiguous view can start at any element; the kernels assume aligned vectors.
    return t if t.data_ptr() % align == 0 else t.clone()


# Pointer arguments of each direction, in the order of KernelFamily's runtime arguments:
# "data" (the key's dtype), "f32" (ape, grad_ape, workspace), "idx" (cu, cuc). Four Int32
# scalars follow (num_tokens, num_rows, num_segs, grid), then the stream.
_POINTERS = {
    "fwd": ("data", "data", "f32", "idx", "idx", "data", "f32"),
    "bwd": ("data", "data", "data", "f32", "idx", "idx", "data", "data", "f32", "f32"),
}
_SCALARS = 4


def launch_signature(direction: str, key: KernelKey) -> tuple[tuple, ...]:
    """The argument slots of a compiled kernel (see csa_ops.launcher), stream excluded."""
    slots = {"data": ("ptr", getattr(torch, key.dtype), key.align_bytes),
             "f32": ("ptr", torch.float32, 16), "idx": ("ptr", torch.int32, 4)}
    return tuple(slots[kind] for kind in _POINTERS[direction]) + (("i32",),) * _SCALARS


def _launch(direction: str, key: KernelKey, plan: LaunchPlan, tensors: list[torch.Tensor],
            sizes: list[int], ape: torch.Tensor) -> None:
    """One launch on the current stream of the tensors' device; `tensors` in signature order
    without the workspace, `sizes` = (num_tokens, num_rows, num_segs)."""
    launch = _CACHE.get(direction, key).launch
    device = ape.device
    # With no workspace the slot gets some fp32 pointer the kernel never touches.
    work = (torch.empty(plan.workspace, dtype=torch.float32, device=device)
            if plan.workspace else ape)
    values = [t.data_ptr() for t in tensors]
    values.append(work.data_ptr())
    values.extend(sizes)
    values.append(plan.grid)
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = launcher.current_stream_handle(index)
    if index == torch.cuda.current_device():
        launch(values, stream)
        return
    # The DSL launches into the current context: make it the tensors' device for this call.
    with torch.cuda.device(device):
        launch(values, stream)


def _resolve(kv: torch.Tensor, ratio: int, coff: int, head_dim: int, backward: bool):
    """(key, family module, SM count) of one direction for kv's device and dtype."""
    arch, num_sms = _device_info(kv.device)
    key = _key_for(ratio, coff, head_dim, _TORCH_DTYPES[kv.dtype], arch, backward)
    if key is None:
        raise RuntimeError(f"csa_ops: no CUDA kernel for ratio={ratio} coff={coff} d={head_dim}")
    return key, _family(key.family), num_sms


def compressor_forward(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    cu: torch.Tensor,
    cuc: torch.Tensor,
    ratio: int,
    coff: int,
    total_comp: int,
) -> torch.Tensor:
    """out (total_comp, head_dim): every row written, padding rows n >= cuc[-1] as zeros."""
    head_dim = kv.shape[1] // coff
    out = torch.empty((total_comp, head_dim), dtype=kv.dtype, device=kv.device)
    if total_comp == 0:
        return out
    key, fam, num_sms = _resolve(kv, ratio, coff, head_dim, backward=False)
    plan = fam.plan_forward(key, kv.shape[0], total_comp, num_sms)
    kv, score = _aligned(kv, key.align_bytes), _aligned(score, key.align_bytes)
    ape = _aligned(ape, 16)
    sizes = [kv.shape[0], total_comp, cu.numel() - 1]
    _launch("fwd", key, plan, [kv, score, ape, cu, cuc, out], sizes, ape)
    return out


def compressor_backward(
    grad_out: torch.Tensor,
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    cu: torch.Tensor,
    cuc: torch.Tensor,
    ratio: int,
    coff: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_kv, grad_score, grad_ape); never-consumed elements are exact zeros."""
    num_tokens, width = kv.shape
    head_dim = width // coff
    grad_kv = torch.empty_like(kv)
    grad_score = torch.empty_like(score)
    grad_ape = torch.empty((ratio, width), dtype=torch.float32, device=kv.device)
    key, fam, num_sms = _resolve(kv, ratio, coff, head_dim, backward=True)
    num_rows = grad_out.shape[0]
    plan = fam.plan_backward(key, num_tokens, num_rows, num_sms)
    a = key.align_bytes
    grad_out, kv, score = _aligned(grad_out, a), _aligned(kv, a), _aligned(score, a)
    ape = _aligned(ape, 16)
    tensors = [grad_out, kv, score, ape, cu, cuc, grad_kv, grad_score, grad_ape]
    _launch("bwd", key, plan, tensors, [num_tokens, num_rows, cu.numel() - 1], ape)
    return grad_kv, grad_score, grad_ape
