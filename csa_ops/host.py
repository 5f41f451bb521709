"""Launch path of the CuTe-DSL compressor kernels: family and key choice, per-call problems,
prepared calls, precompile.

`supports`, `prepare`, `prepare_extend` and `precompile` are what the ops call. Everything
torch-side lives here (devices, allocation and alignment through the launch description,
the stream); the kernel families (csa_ops.kernels) are pure functions of a `KernelKey`.
Each prepared call is a `CallSpec` (csa_ops.launch_description) that the native path runs in
C++ and the Python path interprets; both launch the same kernels with the same arguments.
Process state (memos, switches, compiled kernels) lives in csa_ops.state.STATE.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import config
from .compile_cache import CompileCache, ptx
from .config import Direction, KernelKey
from .kernels import FAMILIES, extend_plan, select_key
from .kernels.epilogue import plan as epilogue_plan
from .kernels.families import KernelFamily
from .kernels.window import plan as window_plan
from .launch_description import (
    ARGUMENTS,
    CallSpec,
    Launch,
    current_stream_handle,
    launch_signature,
    python_call,
)
from .state import STATE, ForwardNumerics

__all__ = ["ARGUMENTS", "DIRECTIONS", "KERNELS", "cache_clear", "cache_info", "device_arch",
           "launch_signature", "precompile", "precompile_extend", "prepare", "prepare_extend",
           "ptx", "select_key", "set_key", "supports", "supports_config"]

_TORCH_DTYPES = {getattr(torch, name): name for name in config.DTYPES}
DIRECTIONS = (Direction.FORWARD, Direction.BACKWARD)  # csa::compressor's

# Compiled kernels, from memory, the disk cache or a compile.
KERNELS = CompileCache()
STATE.on_reset(KERNELS.clear)
cache_info = KERNELS.info


def cache_clear() -> None:
    """Drop every compiled kernel and every call prepared with one (tests, autotuning)."""
    KERNELS.clear()
    STATE.forget_calls()


# ---------------------------------------------------------------------------------------
# Devices


def device_arch(device: torch.device | int | None = None) -> str | None:
    """Compile target for a CUDA device, or None when no kernel targets it."""
    major, minor = torch.cuda.get_device_capability(device)
    return {(9, 0): "sm_90a", (10, 0): "sm_100a"}.get((major, minor))


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _device_info(device: torch.device) -> tuple[str | None, int]:
    """(arch, SM count) of a CUDA device, read from the device once."""
    index = _device_index(device)
    if index not in STATE.devices:
        STATE.devices[index] = (device_arch(index),
                                torch.cuda.get_device_properties(index).multi_processor_count)
    return STATE.devices[index]


def multi_gpu() -> bool:
    """Whether this process sees several GPUs (launches then make their device current)."""
    if STATE.multi_gpu is None:
        STATE.multi_gpu = torch.cuda.device_count() > 1
    return STATE.multi_gpu


def warm_launch_path() -> None:
    """Import what loading a cached kernel needs (tvm_ffi, the DSL runtime library), so a
    configuration's first call only reads and loads its entries."""
    from . import kernel_cache

    if kernel_cache.enabled():
        try:
            kernel_cache.preload()
        except (ImportError, OSError):  # the first load reports it, where it matters
            pass


# ---------------------------------------------------------------------------------------
# Keys


def _key_for(ratio: int, coff: int, head_dim: int, dtype: str, arch: str,
             direction: Direction) -> KernelKey | None:
    """The key of one problem and direction: the heuristic's, or one pinned by set_key; the
    forward's in the current numerics mode (csa_ops.set_forward_numerics)."""
    memo = (ratio, coff, head_dim, dtype, arch, Direction(direction))
    if memo not in STATE.keys:
        key = select_key(ratio, coff, head_dim, dtype, arch, memo[-1])
        if (key is not None and memo[-1] is Direction.FORWARD
                and STATE.forward_numerics is ForwardNumerics.FAST):
            key = FAMILIES[key.family].fast_forward(key)
        STATE.keys[memo] = key
    return STATE.keys[memo]


def set_key(key: KernelKey, direction: Direction) -> None:
    """Pins the key used for key's problem and direction (autotuning: see the families'
    enumerate_keys)."""
    memo = (key.ratio, key.coff, key.head_dim, key.dtype, key.arch, Direction(direction))
    STATE.keys[memo] = key
    STATE.forget_calls()


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
                       arch: str) -> list[tuple[Direction, KernelKey]]:
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


def extend_keys(ratio: int, head_dim: int, coff: int, dtype: torch.dtype,
                arch: str) -> tuple[KernelKey, ...]:
    """Every csa::compressor_extend kernel of one configuration (all call size classes); a
    clear error when no family has one."""
    _check_target("precompile_extend", dtype, arch)
    key = _key_for(ratio, coff, head_dim, _TORCH_DTYPES[dtype], arch, Direction.FORWARD)
    if key is None or not extend_plan.supports(key):
        raise ValueError(f"precompile_extend: no extend kernel for ratio={ratio}, coff={coff}, "
                         f"head_dim={head_dim}, dtype={dtype}")
    return extend_plan.keys(key)


def precompile(ratio: int, head_dim: int, coff: int, dtype: torch.dtype | None = None,
               arch: str | None = None) -> list[KernelKey]:
    """Compile (or load from the disk cache) both directions of one configuration; dtype
    None means bfloat16, arch None the current CUDA device ("sm_90a"/"sm_100a"
    cross-compile without a GPU)."""
    dtype, arch = _target("precompile", dtype, arch)
    keys = configuration_keys(ratio, head_dim, coff, dtype, arch)
    for direction, key in keys:
        KERNELS.get(direction, key)
    return [key for _, key in keys]


def precompile_extend(ratio: int, head_dim: int, coff: int, dtype: torch.dtype | None = None,
                      arch: str | None = None) -> tuple[KernelKey, ...]:
    """Compile (or load) csa::compressor_extend's kernels of one configuration, every kernel
    a call size class launches; dtype and arch as in precompile."""
    dtype, arch = _target("precompile_extend", dtype, arch)
    built = extend_keys(ratio, head_dim, coff, dtype, arch)
    for key in built:
        KERNELS.get(Direction.EXTEND, key)
    return built


def epilogue_key(dtype: torch.dtype, weight_dtype: torch.dtype, head_dim: int, rope_dim: int,
                 rotate: bool, cache_format: str, eps: float, arch: str | None,
                 position_offset: bool = False):
    """The row-epilogue kernels' key of one epilogue, or None where none takes it (the
    epilogue then runs as torch ops)."""
    if dtype not in _TORCH_DTYPES or weight_dtype not in _TORCH_DTYPES or arch is None:
        return None
    key = epilogue_plan.configure(_TORCH_DTYPES[dtype], _TORCH_DTYPES[weight_dtype], head_dim,
                                  rope_dim, rotate, cache_format, eps, arch, position_offset)
    return key if epilogue_plan.supports(key) else None


def precompile_store(head_dim: int, cache_format: str, rope_dim: int = 0, rotate: bool = False,
                     eps: float = 1e-6, dtype: torch.dtype | None = None,
                     weight_dtype: torch.dtype | None = None, arch: str | None = None,
                     ratio: int | None = None, coff: int | None = None):
    """Compile (or load) csa::compressor_extend_store's row-epilogue kernel of one epilogue;
    weight_dtype None means float32; the rest as in precompile. With ``ratio`` and ``coff``
    also the fused kernels of that configuration, where they take it: the decode step's,
    and within row_epilogue.fused_prefill() each split call's two (prefill_store_keys).
    Returns the epilogue's key, or None where that epilogue runs as torch ops."""
    key = _epilogue_target("precompile_store", head_dim, cache_format, rope_dim, rotate, eps,
                           dtype, weight_dtype, arch, False)
    if key is not None:
        KERNELS.get(Direction.STORE, key)
        step = decode_step_key(key, ratio, coff)
        if step is not None:
            KERNELS.get(Direction.EXTEND_STORE, step)
        if STATE.fused_store_prefill:  # only calls within fused_prefill() take them
            for size in (extend_plan.SizeClass.FEW_LARGE, extend_plan.SizeClass.LARGE):
                for direction, split_key in zip(window_plan.SPLIT_STORE,
                                                prefill_store_keys(key, ratio, coff, size)):
                    KERNELS.get(direction, split_key)
    return key


def decode_step_key(epilogue, ratio: int | None, coff: int | None):
    """The fused decode-step key of an epilogue key's configuration (its head_dim, dtype and
    arch) at ``ratio`` and ``coff``; None where there is none, or no ratio is given."""
    forward = _forward_of(epilogue, ratio, coff)
    if forward is None or not extend_plan.supports(forward):
        return None
    return window_plan.extend_store_key(extend_plan.for_size(forward, extend_plan.SizeClass.STEP),
                                        epilogue)


def prefill_store_keys(epilogue, ratio: int | None, coff: int | None,
                       size=extend_plan.SizeClass.FEW_LARGE) -> tuple:
    """The two fused keys of a split call of size class ``size`` (FEW_LARGE: a prefill of
    few requests, its rows placed by lanes; LARGE: any other split call) of an epilogue
    key's configuration at ``ratio`` and ``coff``; () where there are none, or no ratio is
    given."""
    forward = _forward_of(epilogue, ratio, coff)
    if forward is None or not extend_plan.supports(forward):
        return ()
    return window_plan.split_store_keys(extend_plan.for_size(forward, size), epilogue) or ()


def training_backward_key(epilogue, ratio: int | None, coff: int | None):
    """The fused training-backward key of an epilogue key's configuration at ``ratio`` and
    ``coff`` (training_forward_key's counterpart)."""
    forward = _forward_of(epilogue, ratio, coff)
    if forward is None:
        return None
    backward = _key_for(ratio, coff, epilogue.head_dim, epilogue.dtype, epilogue.arch,
                        Direction.BACKWARD)
    return None if backward is None else window_plan.backward_epilogue_key(backward, forward,
                                                                           epilogue)


def _forward_of(epilogue, ratio: int | None, coff: int | None):
    """The forward key of an epilogue key's configuration at ``ratio`` and ``coff``; None
    where no kernel runs it, or no ratio is given."""
    if ratio is None or coff is None:
        return None
    return _key_for(ratio, coff, epilogue.head_dim, epilogue.dtype, epilogue.arch,
                    Direction.FORWARD)


def precompile_epilogue(head_dim: int, rope_dim: int = 0, rotate: bool = False,
                        eps: float = 1e-6, dtype: torch.dtype | None = None,
                        weight_dtype: torch.dtype | None = None, position_offset: bool = False,
                        arch: str | None = None, ratio: int | None = None,
                        coff: int | None = None):
    """Compile (or load) csa::compressor_epilogue's row-epilogue kernels of one epilogue,
    forward and backward; ``position_offset``: calls that pass one. With ``ratio`` and
    ``coff`` also the fused forward and backward kernels of that configuration, where they
    take it.
    Returns their key, or None where that epilogue runs as torch ops."""
    key = _epilogue_target("precompile_epilogue", head_dim, "none", rope_dim, rotate, eps,
                           dtype, weight_dtype, arch, position_offset)
    if key is not None:
        for direction in (Direction.EPILOGUE, Direction.EPILOGUE_BACKWARD):
            KERNELS.get(direction, key)
        for direction, fused in ((Direction.FORWARD_EPILOGUE,
                                  training_forward_key(key, ratio, coff)),
                                 (Direction.BACKWARD_EPILOGUE,
                                  training_backward_key(key, ratio, coff))):
            if fused is not None:
                KERNELS.get(direction, fused)
    return key


def training_forward_key(epilogue, ratio: int | None, coff: int | None):
    """The fused training-forward key of an epilogue key's configuration (its head_dim,
    dtype and arch) at ``ratio`` and ``coff``; None where there is none, or no ratio is
    given."""
    forward = _forward_of(epilogue, ratio, coff)
    return None if forward is None else window_plan.forward_epilogue_key(forward, epilogue)


def _epilogue_target(entry: str, head_dim: int, cache_format: str, rope_dim: int, rotate: bool,
                     eps: float, dtype, weight_dtype, arch, position_offset: bool):
    dtype, arch = _target(entry, dtype, arch)
    weight_dtype = torch.float32 if weight_dtype is None else weight_dtype
    _check_target(entry, weight_dtype, arch)
    return epilogue_key(dtype, weight_dtype, head_dim, rope_dim, rotate, cache_format, eps, arch,
                        position_offset)


# ---------------------------------------------------------------------------------------
# Problems (inputs arrive validated and contiguous from the ops)


def supports(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, cu: torch.Tensor,
             cuc: torch.Tensor, ratio: int, coff: int) -> bool:
    """Whether the CUDA kernels run this call as given (fp32 ape, no upcast)."""
    return ape.dtype == torch.float32 and problem(Direction.FORWARD, kv, score, cu, cuc, ratio,
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


def _resolve(device: torch.device, dtype: torch.dtype, ratio: int, coff: int, head_dim: int,
             direction: Direction) -> Problem | None:
    memo = (device, dtype, ratio, coff, head_dim, direction)
    found = STATE.problems.get(memo)
    if found is None:
        arch, num_sms = _device_info(device)
        if arch is None:
            return None
        key = _key_for(ratio, coff, head_dim, _TORCH_DTYPES[dtype], arch, direction)
        if key is None:
            return None
        found = STATE.problems[memo] = Problem(key, FAMILIES[key.family], num_sms,
                                               _device_index(device))
    return found


def problem(direction: Direction, kv: torch.Tensor, score: torch.Tensor, cu: torch.Tensor,
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
    return _resolve(kv.device, kv.dtype, ratio, coff, kv.shape[1] // coff, Direction(direction))


def extend_problem(kv: torch.Tensor, ratio: int, coff: int,
                   num_requests: int) -> Problem | None:
    """The extend kernel's problem of a validated call (the forward's key, launched with the
    knobs of the call's size class: the key's flags fix the rows' bits), None when the
    reference runs it: no forward key for this device and shape, or one whose family has no
    extend kernel for it."""
    if not kv.is_cuda or kv.dtype not in _TORCH_DTYPES or kv.dim() != 2:
        return None
    if kv.shape[1] == 0 or kv.shape[1] % coff:
        return None
    found = _resolve(kv.device, kv.dtype, ratio, coff, kv.shape[1] // coff, Direction.FORWARD)
    if found is None or not extend_plan.supports(found.key):
        return None
    size = extend_plan.size_class(kv.shape[0], num_requests)
    return found._replace(key=extend_plan.for_size(found.key, size))


# ---------------------------------------------------------------------------------------
# Prepared calls: everything that depends only on a call's metadata, computed once; each
# call makes its inputs contiguous, upcasts ape to the kernels' fp32 (exact), allocates its
# outputs and launches.


def _prepared(spec: CallSpec, device_index: int):
    """The native prepared call of `spec`, else its Python path."""
    if not STATE.python_launch_path:
        from . import native  # not with this module: `python -m csa_ops.native` runs it

        call = native.prepared_call(spec)
        if call is not None:
            return call
    return python_call(spec, current_stream_handle, device_index, multi_gpu())


def prepare_forward(found: Problem, num_tokens: int, total_comp: int, num_segs: int,
                    dtype: torch.dtype, device: torch.device, upcast_ape: bool):
    """forward(kv, score, ape, cu, cuc) -> out for one validated call signature."""
    key = found.key
    shape = (total_comp, key.head_dim)
    if total_comp == 0:
        return lambda *tensors: torch.empty(shape, dtype=dtype, device=device)
    plan = found.family.plan_forward(key, num_tokens, total_comp, found.num_sms)
    constants = {"num_tokens": num_tokens, "num_rows": total_comp, "num_segs": num_segs,
                 "grid": plan.grid}
    return _prepared(CallSpec(
        Direction.FORWARD, key, inputs=("kv", "score", "ape", "cu", "cuc"),
        outputs={"out": ("kv", shape)},
        launches=(Launch(KERNELS.get(Direction.FORWARD, key), constants),),
        workspace=plan.workspace, workspace_alias="out", to_float=("ape",) * upcast_ape),
        found.device_index)


def prepare_backward(found: Problem, num_tokens: int, num_rows: int, num_segs: int,
                     ape_dtype: torch.dtype):
    """backward(grad_out, kv, score, ape, cu, cuc) -> (grad_kv, grad_score, grad_ape) for
    one validated call signature; never-consumed elements are exact zeros, grad_ape is
    reduced in fp32 and rounded once to ape's dtype."""
    key = found.key
    plan = found.family.plan_backward(key, num_tokens, num_rows, found.num_sms)
    upcast_ape = ape_dtype != torch.float32
    constants = {"num_tokens": num_tokens, "num_rows": num_rows, "num_segs": num_segs,
                 "grid": plan.grid}
    return _prepared(CallSpec(
        Direction.BACKWARD, key, inputs=("grad_out", "kv", "score", "ape", "cu", "cuc"),
        outputs={"grad_kv": ("kv", None), "grad_score": ("score", None),
                 "grad_ape": ("ape", None)},
        launches=(Launch(KERNELS.get(Direction.BACKWARD, key), constants),),
        workspace=plan.workspace, workspace_alias="grad_ape", to_float=("ape",) * upcast_ape,
        restore=(("grad_ape", "ape"),) * upcast_ape), found.device_index)


def prepare(direction: Direction, tensors, ratio: int, coff: int, total_comp):
    """The prepared kernel call of a validated call signature (the op's tensor arguments in
    schema order), None when no kernel runs it (the reference does)."""
    direction = Direction(direction)
    kv, score, ape, cu, cuc = tensors[-5:]
    found = problem(direction, kv, score, cu, cuc, ratio, coff)
    if found is None:
        return None
    if direction is Direction.BACKWARD:
        return prepare_backward(found, kv.shape[0], tensors[0].shape[0], cu.shape[0] - 1,
                                ape.dtype)
    return prepare_forward(found, kv.shape[0], total_comp, cu.shape[0] - 1, kv.dtype,
                           kv.device, ape.dtype != torch.float32)


def prepare_extend(found: Problem, num_tokens: int, num_rows: int, num_requests: int,
                   num_slots: int):
    """extend(kv, score, ape, cu, start_pos, slots, kv_state, score_state) -> (out
    (num_rows, head_dim), cu_seqlens_comp) for one validated call signature; writes the
    state in place. Returns None instead where the state tensors' bases break the kernel's
    alignment (they are written in place, so they cannot be copied): the reference runs
    that call. A split call launches twice."""
    launches = tuple(
        Launch(KERNELS.get(Direction.EXTEND, part),
               {"num_tokens": num_tokens, "num_rows": num_rows, "num_requests": num_requests,
                "num_slots": num_slots, "grid": laid.grid})
        for part, laid in extend_plan.plans(found.key, num_tokens, num_requests, num_rows,
                                            found.num_sms))
    return _prepared(CallSpec(
        Direction.EXTEND, found.key,
        inputs=("kv", "score", "ape", "cu", "start_pos", "slots", "kv_state", "score_state"),
        outputs={"out": ("kv", (num_rows, found.key.head_dim)), "cuc": ("cu", None)},
        launches=launches, to_float=("ape",), in_place=("kv_state", "score_state"),
        live="ape"), found.device_index)


def _prepared_or_fail(direction, tensors, ratio, coff, total_comp):
    call = prepare(direction, tensors, ratio, coff, total_comp)
    if call is None:
        kv = tensors[-5]
        raise RuntimeError(f"csa_ops: no CUDA kernel for ratio={ratio} coff={coff} "
                           f"width={kv.shape[1]} {kv.dtype} on {kv.device}")
    return call


def run_forward(kv, score, ape, cu, cuc, ratio: int, coff: int, total_comp: int):
    """The forward kernel on validated inputs (tests and benchmarks call the kernels here)."""
    tensors = (kv, score, ape, cu, cuc)
    return _prepared_or_fail(Direction.FORWARD, tensors, ratio, coff, total_comp)(*tensors)


def run_backward(grad_out, kv, score, ape, cu, cuc, ratio: int, coff: int):
    """The backward kernels on validated inputs; grad_ape in ape's dtype."""
    tensors = (grad_out, kv, score, ape, cu, cuc)
    return _prepared_or_fail(Direction.BACKWARD, tensors, ratio, coff, None)(*tensors)


def launch_key(direction: Direction, key: KernelKey, tensors, sizes, grid: int) -> None:
    """Launch any key of a family (autotuning, launch-plan tests) on the current stream:
    ``tensors`` in ARGUMENTS order (workspace included), ``sizes`` the scalars before
    ``grid``."""
    launch = KERNELS.get(direction, key)
    index = tensors[0].device.index or 0
    launch(*[t.data_ptr() for t in tensors], *sizes, grid, current_stream_handle(index))


def python_launch_path():
    """Within: calls prepared from here on take the Python launch path (benchmarks and tests
    compare the two paths); see ProcessState.python_path."""
    return STATE.python_path()
