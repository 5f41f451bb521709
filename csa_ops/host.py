"""Launch path of the CuTe-DSL compressor kernels: family choice, one compile cache, launch.

`supports`, `compressor_forward`, `compressor_backward` and `precompile` are what ops.py
calls. A kernel family is a module in csa_ops/kernels/ that satisfies `KernelFamily` below
(csa_ops.kernels.FAMILIES: "window" for small windows, else "streaming"); host.py owns everything
torch-side (allocation, alignment checks, pointers, stream) and the compile cache, keyed on
the frozen `config.KernelKey`. Compiles are pure functions of the key, so `arch="sm_100a"`
cross-compiles on a machine without that GPU (or without any GPU). `ARGUMENTS` is the one
statement of the kernels' argument list: the compile placeholders, the launch values and the
cache identity all derive from it. Compiled kernels are TVM-FFI functions, exported to the
persistent cache of `csa_ops.kernel_cache`; a process with a warm cache never imports the DSL.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from . import config, kernel_cache, launcher
from .config import Direction, KernelKey
from .kernels import FAMILIES, extend_plan, families, select_key
from .kernels.families import KernelFamily

_TORCH_DTYPES = {getattr(torch, name): name for name in config.DTYPES}


# ---------------------------------------------------------------------------------------
# Devices


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
# The kernels' argument list

# Pointer kinds: "data" (the key's dtype, key.align_bytes), "f32" (ape, grad_ape, workspace,
# score_state; 16-byte aligned), "idx" (int32: cu, cuc, start_pos, slots). "i32" is an Int32
# scalar. The stream follows. "ext" is csa::compressor_extend's kernel (kernels/extend.py
# for register windows, kernels/streaming.py's for larger ones; a split call launches it
# twice).
ARGUMENTS = {
    "fwd": (("kv", "data"), ("score", "data"), ("ape", "f32"), ("cu", "idx"), ("cuc", "idx"),
            ("out", "data"), ("workspace", "f32"), ("num_tokens", "i32"), ("num_rows", "i32"),
            ("num_segs", "i32"), ("grid", "i32")),
    "bwd": (("grad_out", "data"), ("kv", "data"), ("score", "data"), ("ape", "f32"),
            ("cu", "idx"), ("cuc", "idx"), ("grad_kv", "data"), ("grad_score", "data"),
            ("grad_ape", "f32"), ("workspace", "f32"), ("num_tokens", "i32"),
            ("num_rows", "i32"), ("num_segs", "i32"), ("grid", "i32")),
    "ext": (("kv", "data"), ("score", "data"), ("ape", "f32"), ("cu", "idx"),
            ("start_pos", "idx"), ("slots", "idx"), ("kv_state", "data"),
            ("score_state", "f32"), ("out", "data"), ("cuc", "idx"), ("num_tokens", "i32"),
            ("num_rows", "i32"), ("num_requests", "i32"), ("num_slots", "i32"),
            ("grid", "i32")),
}
DIRECTIONS = (Direction.FORWARD, Direction.BACKWARD)  # csa::compressor's


def launch_signature(direction: str, key: KernelKey) -> tuple[tuple, ...]:
    """The argument slots of a compiled kernel, stream excluded: ("ptr", dtype name,
    assumed alignment) or ("i32",)."""
    slots = {"data": ("ptr", key.dtype, key.align_bytes), "f32": ("ptr", "float32", 16),
             "idx": ("ptr", "int32", 4), "i32": ("i32",)}
    return tuple(slots[kind] for _, kind in ARGUMENTS[direction])


def _launch_entry(direction: Direction, key: KernelKey) -> Callable[..., Any]:
    return families.launch_entry(direction, key)


def ptx(direction: str, key: KernelKey) -> str:
    """PTX of one direction of ``key`` (numerics audits and hash checks)."""
    from .kernels.shared import entry

    return entry.ptx(_launch_entry(direction, key), key.arch, launch_signature(direction, key))


# ---------------------------------------------------------------------------------------
# Compile cache


def _compile(direction: str, key: KernelKey, engine: bool = True) -> Any:
    """JIT one direction of ``key`` (the DSL is imported here, and only here); without
    ``engine`` the result is only good for export (the disk cache loads what it exports)."""
    from .kernels.shared import entry

    return entry.compile_entry(_launch_entry(direction, key), key.arch,
                               launch_signature(direction, key), tvm_ffi=launcher.TVM_FFI,
                               engine=engine)


def _identity(direction: str, key: KernelKey) -> dict[str, str]:
    """The disk-cache identity of one compiled kernel (see kernel_cache.identity)."""
    return kernel_cache.identity(f"{direction} {key!r}", launch_signature(direction, key))


class _CompileCache:
    """Kernels by (direction, key): from memory, else the disk cache, else a compile.

    One lock for all keys, not one per key: the DSL's compiler keeps per-process session
    state, and two threads compiling different kernels at once fail inside it
    (nvidia-cutlass-dsl 4.8.1: "Please start a session before accessing session data").
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, KernelKey], launcher.Launch] = {}
        self.hits = self.misses = self.disk_loads = 0

    def get(self, direction: str, key: KernelKey) -> launcher.Launch:
        entry = self._entries.get((direction, key))
        if entry is not None:
            self.hits += 1
            return entry
        with self._lock:
            entry = self._entries.get((direction, key))
            if entry is None:
                entry = self._entries[(direction, key)] = self._build(direction, key)
            else:
                self.hits += 1
        return entry

    def _build(self, direction: str, key: KernelKey) -> launcher.Launch:
        signature = launch_signature(direction, key)
        kernel = None
        if launcher.TVM_FFI and kernel_cache.enabled():
            ident = _identity(direction, key)
            # Compiled for export only: the kernel comes back loaded from the cache entry.
            kernel, built = kernel_cache.get_or_build(
                ident, lambda: self._compile_now(direction, key, engine=False))
            self.disk_loads += not built
        if kernel is None:  # no cache, or its entry could not be written or loaded
            kernel = self._compile_now(direction, key)
        return launcher.make_launcher(kernel, signature)

    def _compile_now(self, direction: str, key: KernelKey, engine: bool = True) -> Any:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # csa::compressor's directions and csa::compressor_extend's kernels each have
            # their own precompile entry.
            entry = "precompile_extend" if direction == "ext" else "precompile"
            raise RuntimeError(
                f"csa_ops: the {direction} kernel for {key} is not compiled and a CUDA graph "
                f"capture is active, where JIT is not allowed. Call csa_ops.{entry}("
                f"ratio={key.ratio}, head_dim={key.head_dim}, coff={key.coff}, dtype=torch."
                f"{key.dtype}) (or make the same call once eagerly) before capturing."
            )
        self.misses += 1
        return _compile(direction, key, engine)

    def export(self, direction: str, key: KernelKey, root) -> bool:
        """Make sure the disk cache under ``root`` holds this kernel (cross-compiling:
        nothing is loaded); True when it had to be compiled."""
        ident = _identity(direction, key)
        with self._lock:
            _, built = kernel_cache.get_or_build(
                ident, lambda: self._compile_now(direction, key, engine=False), root=root,
                load=False)
        return built

    def info(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "disk_loads": self.disk_loads,
                "size": len(self._entries)}

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = self.disk_loads = 0


_CACHE = _CompileCache()
cache_info = _CACHE.info
# Memos of prepared calls (ops' call signatures) hold keys and kernels: cleared with them.
_DEPENDENT_MEMOS: list[dict] = []


def register_dependent_memo(memo: dict) -> None:
    _DEPENDENT_MEMOS.append(memo)


def _forget_prepared_calls() -> None:
    _PROBLEMS.clear()
    for memo in _DEPENDENT_MEMOS:
        memo.clear()


def cache_clear() -> None:
    """Drop every compiled kernel and every call prepared with one (tests, autotuning)."""
    _CACHE.clear()
    _forget_prepared_calls()


def warm_launch_path() -> None:
    """Import what loading a cached kernel needs (tvm_ffi, the DSL runtime library), so a
    configuration's first call only reads and loads its entries."""
    if launcher.TVM_FFI and kernel_cache.enabled():
        try:
            kernel_cache.preload()
        except (ImportError, OSError):  # the first load reports it, where it matters
            pass


def _check_target(caller: str, dtype: torch.dtype, arch: str) -> None:
    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"{caller}: dtype must be one of {list(_TORCH_DTYPES)}, got {dtype}")
    if arch not in config.ARCHS:
        raise ValueError(f"{caller}: arch must be one of {config.ARCHS}, got {arch!r}")


def _target(caller: str, dtype: torch.dtype | None, arch: str | None) -> tuple[torch.dtype, str]:
    """(dtype, arch) of a precompile call: dtype None means bfloat16, arch None the current
    CUDA device's; both checked."""
    dtype = torch.bfloat16 if dtype is None else dtype
    if arch is None:
        if not torch.cuda.is_available():
            raise RuntimeError(f"{caller}: no CUDA device; pass arch='sm_90a' or 'sm_100a'")
        arch = device_arch()
        if arch is None:
            raise RuntimeError(
                f"{caller}: no kernel targets compute capability "
                f"{torch.cuda.get_device_capability()}; supported: {config.ARCHS}"
            )
    _check_target(caller, dtype, arch)
    return dtype, arch


def configuration_keys(ratio: int, head_dim: int, coff: int, dtype: torch.dtype,
                       arch: str) -> list[tuple[str, KernelKey]]:
    """(direction, key) of both directions of one configuration; a clear error when no
    kernel family covers it."""
    _check_target("precompile", dtype, arch)
    keys = []
    for direction in DIRECTIONS:
        key = _key_for(ratio, coff, head_dim, _TORCH_DTYPES[dtype], arch, direction)
        if key is None:
            raise ValueError(
                f"precompile: no kernel family supports ratio={ratio}, coff={coff}, "
                f"head_dim={head_dim}, dtype={dtype}"
            )
        keys.append((direction, key))
    return keys


def precompile(ratio: int, head_dim: int, coff: int, dtype: torch.dtype | None = None,
               arch: str | None = None) -> list[KernelKey]:
    """Compile (or load from the disk cache) both directions of one configuration.

    dtype None means bfloat16; arch None means the current CUDA device; "sm_90a"/"sm_100a"
    cross-compile without a GPU.
    """
    dtype, arch = _target("precompile", dtype, arch)
    keys = configuration_keys(ratio, head_dim, coff, dtype, arch)
    for direction, key in keys:
        _CACHE.get(direction, key)
    return [key for _, key in keys]


# ---------------------------------------------------------------------------------------
# Per-call path (inputs arrive validated and contiguous from ops.py)

_KEYS: dict[tuple, KernelKey | None] = {}


def _key_for(ratio: int, coff: int, head_dim: int, dtype: str, arch: str,
             direction: Direction) -> KernelKey | None:
    direction = Direction(direction)
    memo = (ratio, coff, head_dim, dtype, arch, direction)
    if memo not in _KEYS:
        _KEYS[memo] = select_key(ratio, coff, head_dim, dtype, arch, direction)
    return _KEYS[memo]


def set_key(key: KernelKey, direction: Direction) -> None:
    """Pins the key used for key's problem and direction (autotuning: see the families'
    enumerate_keys)."""
    direction = Direction(direction)
    _KEYS[(key.ratio, key.coff, key.head_dim, key.dtype, key.arch, direction)] = key
    _forget_prepared_calls()


def supports(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    cu: torch.Tensor,
    cuc: torch.Tensor,
    ratio: int,
    coff: int,
) -> bool:
    """Whether the CUDA kernels run this call as given (fp32 ape, no upcast)."""
    return ape.dtype == torch.float32 and problem("fwd", kv, score, cu, cuc, ratio,
                                                  coff) is not None


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
    return all(_key_for(ratio, coff, head_dim, name, arch, d) is not None for d in DIRECTIONS)


class Problem(NamedTuple):
    """What a call of one direction needs besides its tensors, resolved once per
    (device, dtype, ratio, coff, head_dim, direction)."""

    key: KernelKey
    family: KernelFamily
    num_sms: int
    device_index: int


_PROBLEMS: dict[tuple, Problem] = {}


def _resolve(device: torch.device, dtype: torch.dtype, ratio: int, coff: int, head_dim: int,
             direction: str) -> Problem | None:
    memo = (device, dtype, ratio, coff, head_dim, direction)
    problem = _PROBLEMS.get(memo)
    if problem is None:
        arch, num_sms = _device_info(device)
        if arch is None:
            return None
        key = _key_for(ratio, coff, head_dim, _TORCH_DTYPES[dtype], arch, direction)
        if key is None:
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        problem = _PROBLEMS[memo] = Problem(key, FAMILIES[key.family], num_sms, index)
    return problem


def problem(direction: str, kv: torch.Tensor, score: torch.Tensor, cu: torch.Tensor,
            cuc: torch.Tensor, ratio: int, coff: int) -> Problem | None:
    """The kernel problem of a validated call, None when no kernel runs it (the reference
    does). ape may have any float dtype: the kernels take it upcast to fp32."""
    if not kv.is_cuda or kv.dtype not in _TORCH_DTYPES or score.dtype != kv.dtype:
        return None
    if cu.dtype != torch.int32 or cuc.dtype != torch.int32 or cu.numel() < 1:
        return None
    if kv.dim() != 2 or kv.shape[1] % coff or kv.shape[1] == 0:
        return None
    if not supports_config(kv.device, kv.dtype, ratio, coff, kv.shape[1] // coff):
        return None
    return _resolve(kv.device, kv.dtype, ratio, coff, kv.shape[1] // coff, direction)


_MULTI_GPU: list[bool] = []


def _multi_gpu() -> bool:
    if not _MULTI_GPU:
        _MULTI_GPU.append(torch.cuda.device_count() > 1)
    return _MULTI_GPU[0]


def _launcher_for(problem: Problem, direction: str):
    """kernel(*values, stream) of one direction of the problem; on a machine with several
    GPUs, the call first makes the problem's device current (kernels launch into the
    current context)."""
    kernel = _CACHE.get(direction, problem.key)
    if not _multi_gpu():
        return kernel

    def switching(*values):
        with torch.cuda.device(problem.device_index):
            kernel(*values)

    return switching


def _realigned(tensors: list[torch.Tensor], align: tuple[int, ...]):
    """(addresses, copies) where a tensor's base breaks the kernels' assumed alignment (a
    contiguous view can start at any element). The caller holds the copies until the
    launch is queued; after that the caching allocator reuses their memory only for work
    ordered after the kernel."""
    copies = [t if t.data_ptr() % a == 0 else t.clone() for t, a in zip(tensors, align)]
    return [t.data_ptr() for t in copies], copies


_PYTHON_PATH: list[bool] = []  # non-empty within python_launch_path()


def _native_call(*args, **kwargs):
    """csa_ops.native.prepared_call, or None within python_launch_path(). The module is
    imported here, not with this one: `python -m csa_ops.native` runs it as __main__ in a
    process that has imported the package (and, on CUDA, this module)."""
    if _PYTHON_PATH:
        return None
    from . import native

    return native.prepared_call(*args, **kwargs)


@contextlib.contextmanager
def python_launch_path():
    """Within: calls prepared from here on take the Python launch path, not the native one
    (benchmarks and tests compare the two). Prepared calls are forgotten on entry and on
    exit, so each side prepares its own."""
    _forget_prepared_calls()
    _PYTHON_PATH.append(True)
    try:
        yield
    finally:
        _PYTHON_PATH.pop()
        _forget_prepared_calls()


# The prepared calls below are the per-call hot path: everything that depends only on the
# call's metadata is computed once in prepare_*, and each call makes its inputs contiguous,
# upcasts ape to the kernels' fp32 (exact) and allocates its outputs, then launches.


def prepare_forward(problem: Problem, num_tokens: int, total_comp: int, num_segs: int,
                    dtype: torch.dtype, device: torch.device, upcast_ape: bool):
    """forward(kv, score, ape, cu, cuc) -> out for one validated call signature."""
    key = problem.key
    shape = (total_comp, key.head_dim)
    if total_comp == 0:
        return lambda *tensors: torch.empty(shape, dtype=dtype, device=device)
    plan = problem.family.plan_forward(key, num_tokens, total_comp, problem.num_sms)
    call = _native_call(
        _CACHE.get("fwd", key), ARGUMENTS["fwd"], launch_signature("fwd", key),
        inputs=("kv", "score", "ape", "cu", "cuc"), outputs={"out": ("kv", shape)},
        constants={"num_tokens": num_tokens, "num_rows": total_comp, "num_segs": num_segs,
                   "grid": plan.grid},
        workspace=plan.workspace, workspace_alias="out", to_float=("ape",) * upcast_ape)
    if call is not None:
        return call
    kernel = _launcher_for(problem, "fwd")
    stream, index = launcher.current_stream_handle, problem.device_index
    align = (key.align_bytes, key.align_bytes, 16, 4, 4, key.align_bytes)
    data_align, tail = key.align_bytes, (num_tokens, total_comp, num_segs, plan.grid)
    workspace = plan.workspace

    def forward(kv, score, ape, cu, cuc):
        kv, score, ape = kv.contiguous(), score.contiguous(), ape.contiguous()
        cu, cuc = cu.contiguous(), cuc.contiguous()
        if upcast_ape:
            ape = ape.float()
        out = kv.new_empty(shape)
        tensors = [kv, score, ape, cu, cuc, out]
        pointers = [t.data_ptr() for t in tensors]
        if (pointers[0] | pointers[1]) % data_align or pointers[2] % 16:
            pointers, tensors = _realigned(tensors, align)
        work = torch.empty(workspace, dtype=torch.float32, device=device) if workspace else out
        kernel(*pointers, work.data_ptr(), *tail, stream(index))
        return out

    return forward


def prepare_backward(problem: Problem, num_tokens: int, num_rows: int, num_segs: int,
                     ape_dtype: torch.dtype, device: torch.device):
    """backward(grad_out, kv, score, ape, cu, cuc) -> (grad_kv, grad_score, grad_ape) for
    one validated call signature; never-consumed elements are exact zeros, grad_ape is
    reduced in fp32 and rounded once to ape's dtype."""
    key = problem.key
    plan = problem.family.plan_backward(key, num_tokens, num_rows, problem.num_sms)
    upcast_ape = ape_dtype != torch.float32
    call = _native_call(
        _CACHE.get("bwd", key), ARGUMENTS["bwd"], launch_signature("bwd", key),
        inputs=("grad_out", "kv", "score", "ape", "cu", "cuc"),
        outputs={"grad_kv": ("kv", None), "grad_score": ("score", None),
                 "grad_ape": ("ape", None)},
        constants={"num_tokens": num_tokens, "num_rows": num_rows, "num_segs": num_segs,
                   "grid": plan.grid},
        workspace=plan.workspace, workspace_alias="grad_ape", to_float=("ape",) * upcast_ape,
        restore=(("grad_ape", "ape"),) * upcast_ape)
    if call is not None:
        return call
    kernel = _launcher_for(problem, "bwd")
    stream, index = launcher.current_stream_handle, problem.device_index
    a = key.align_bytes
    align = (a, a, a, 16, 4, 4, a, a, 16)
    tail = (num_tokens, num_rows, num_segs, plan.grid)
    workspace = plan.workspace

    def backward(grad_out, kv, score, ape, cu, cuc):
        grad_out, kv, score = grad_out.contiguous(), kv.contiguous(), score.contiguous()
        ape, cu, cuc = ape.contiguous(), cu.contiguous(), cuc.contiguous()
        if upcast_ape:
            ape = ape.float()
        grad_kv = torch.empty_like(kv)
        grad_score = torch.empty_like(score)
        # empty_like: no size, dtype or device for torch to parse (half torch.empty's cost)
        grad_ape = torch.empty_like(ape)
        tensors = [grad_out, kv, score, ape, cu, cuc, grad_kv, grad_score, grad_ape]
        pointers = [t.data_ptr() for t in tensors]
        if (pointers[0] | pointers[1] | pointers[2]) % a or pointers[3] % 16:
            pointers, tensors = _realigned(tensors, align)
        work = torch.empty(workspace, dtype=torch.float32, device=device) if workspace \
            else grad_ape
        kernel(*pointers, work.data_ptr(), *tail, stream(index))
        return grad_kv, grad_score, grad_ape.to(ape_dtype) if upcast_ape else grad_ape

    return backward


def prepare(direction: str, tensors, ratio: int, coff: int, total_comp):
    """The prepared kernel call of a validated call signature (the op's tensor arguments in
    schema order), None when no kernel runs it (the reference does)."""
    kv, score, ape, cu, cuc = tensors[-5:]
    found = problem("bwd" if direction == "bwd" else "fwd", kv, score, cu, cuc, ratio, coff)
    if found is None:
        return None
    if direction == "bwd":
        return prepare_backward(found, kv.shape[0], tensors[0].shape[0], cu.shape[0] - 1,
                                ape.dtype, kv.device)
    return prepare_forward(found, kv.shape[0], total_comp, cu.shape[0] - 1, kv.dtype,
                           kv.device, ape.dtype != torch.float32)


def _prepared(direction, tensors, ratio, coff, total_comp):
    call = prepare(direction, tensors, ratio, coff, total_comp)
    if call is None:
        kv = tensors[-5]
        raise RuntimeError(f"csa_ops: no CUDA kernel for ratio={ratio} coff={coff} "
                           f"width={kv.shape[1]} {kv.dtype} on {kv.device}")
    return call


def run_forward(kv, score, ape, cu, cuc, ratio: int, coff: int, total_comp: int):
    """The forward kernel on validated inputs (tests and benchmarks call the kernels here)."""
    tensors = (kv, score, ape, cu, cuc)
    return _prepared("fwd", tensors, ratio, coff, total_comp)(*tensors)


def run_backward(grad_out, kv, score, ape, cu, cuc, ratio: int, coff: int):
    """The backward kernels on validated inputs; grad_ape in ape's dtype."""
    tensors = (grad_out, kv, score, ape, cu, cuc)
    return _prepared("bwd", tensors, ratio, coff, None)(*tensors)


def launch_key(direction: str, key: KernelKey, tensors, sizes, grid: int) -> None:
    """Launch any key of a family (autotuning, launch-plan tests) on the current stream:
    ``tensors`` in ARGUMENTS order (workspace included), ``sizes`` = (num_tokens, num_rows,
    num_segs)."""
    launch = _CACHE.get(direction, key)
    index = tensors[0].device.index or 0
    launch(*[t.data_ptr() for t in tensors], *sizes, grid,
           launcher.current_stream_handle(index))


# ---------------------------------------------------------------------------------------
# csa::compressor_extend (SPEC 8): each family's extend kernel, compiled from the forward's key


def extend_problem(kv: torch.Tensor, ratio: int, coff: int,
                   num_requests: int) -> Problem | None:
    """The extend kernel's problem of a validated call (the forward's key, launched with the
    knobs of the call's size class: the key's flags fix the rows' bits), None when the
    reference runs it: no forward key for this device and shape, or one whose family has no
    extend kernel for it (extend_plan.supports)."""
    if not kv.is_cuda or kv.dtype not in _TORCH_DTYPES or kv.dim() != 2:
        return None
    if kv.shape[1] == 0 or kv.shape[1] % coff:
        return None
    found = _resolve(kv.device, kv.dtype, ratio, coff, kv.shape[1] // coff, Direction.FORWARD)
    if found is None or not extend_plan.supports(found.key):
        return None
    size = extend_plan.size_class(kv.shape[0], num_requests)
    problem = _EXTEND.get((found, size))
    if problem is None:
        problem = found._replace(key=extend_plan.for_size(found.key, size))
        _EXTEND[(found, size)] = problem
    return problem


_EXTEND: dict[tuple[Problem, int], Problem] = {}  # (forward problem, size class) -> extend


def prepare_extend(problem: Problem, num_tokens: int, num_rows: int, num_requests: int,
                   num_slots: int, dtype: torch.dtype, device: torch.device):
    """extend(kv, score, ape, cu, start_pos, slots, kv_state, score_state) -> (out
    (num_rows, head_dim), cu_seqlens_comp) for one validated call signature; writes the
    state in place. Returns None instead where the state tensors' bases break the kernel's
    alignment (they are written in place, so they cannot be copied): the reference runs
    that call. Inputs other than the state are made contiguous, ape fp32 (exact)."""
    key = problem.key
    a = key.align_bytes
    # (kernel, its grid) per launch: one, or a split call's two parts
    launches = [(_launcher_for(problem._replace(key=part), "ext"), laid.grid)
                for part, laid in extend_plan.plans(key, num_tokens, num_requests, num_rows,
                                                    problem.num_sms)]
    stream, index = launcher.current_stream_handle, problem.device_index
    sizes = (num_tokens, num_rows, num_requests, num_slots)
    out_shape = (num_rows, key.head_dim)

    def extend(kv, score, ape, cu, start_pos, slots, kv_state, score_state):
        if kv_state.data_ptr() % a or score_state.data_ptr() % 16:
            return None
        kv, score, cu = kv.contiguous(), score.contiguous(), cu.contiguous()
        start_pos, slots, ape = start_pos.contiguous(), slots.contiguous(), ape.contiguous()
        kv, score = (t if t.data_ptr() % a == 0 else t.clone() for t in (kv, score))
        ape = ape.float()
        ape = ape if ape.data_ptr() % 16 == 0 else ape.clone()
        out = torch.empty(out_shape, dtype=dtype, device=device)
        cuc = torch.empty(num_requests + 1, dtype=torch.int32, device=device)
        tensors = (kv, score, ape, cu, start_pos, slots, kv_state, score_state, out, cuc)
        # An empty tensor may sit at address 0; the kernel never touches one, and any live
        # address serves: ape's (never empty, 16-byte aligned).
        values = [t.data_ptr() or ape.data_ptr() for t in tensors]
        for kernel, grid in launches:
            kernel(*values, *sizes, grid, stream(index))
        return out, cuc

    return extend


def precompile_extend(ratio: int, head_dim: int, coff: int, dtype: torch.dtype | None = None,
                      arch: str | None = None) -> tuple[KernelKey, ...]:
    """Compile (or load from the disk cache) csa::compressor_extend's kernels of one
    configuration, every kernel a call size class launches; dtype None means bfloat16, arch
    None the current CUDA device."""
    dtype, arch = _target("precompile_extend", dtype, arch)
    key = _key_for(ratio, coff, head_dim, _TORCH_DTYPES[dtype], arch, Direction.FORWARD)
    if key is None or not extend_plan.supports(key):
        raise ValueError(f"precompile_extend: no extend kernel for ratio={ratio}, coff={coff}, "
                         f"head_dim={head_dim}, dtype={dtype}")
    built = extend_plan.keys(key)
    for extend_key in built:
        _CACHE.get("ext", extend_key)
    return built
