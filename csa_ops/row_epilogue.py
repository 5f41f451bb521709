"""The CUDA route of the epilogue ops' row epilogue: one launch of a row-epilogue kernel
(kernels/epilogue/) after the pooling kernel, in place of the composition's few dozen torch
kernels.

- ``launch_store``: csa::compressor_extend_store's epilogue, encoding and paged store after
  the extend kernel (``STATE.store_kernel``).
- ``launch_rows``: csa::compressor_epilogue's forward epilogue after csa::compressor's
  kernel, rows packed (``STATE.training_epilogue_kernel``).
- ``launch_rows_backward``: csa::compressor_epilogue_backward's way back through the
  epilogue, from grad_out and the recomputed pooled rows to their gradient and grad_weight
  (``STATE.training_epilogue_backward_kernel``).

All three are on by default; ``torch_route()`` and ``kernel_route()`` choose for a scope.
``launch_forward_epilogue`` and ``launch_backward_epilogue`` run either direction of the
training op as one kernel with its pooling, where the register-window family pools it
(the default; ``two_launch_forward()`` and ``staged_backward()`` turn them off for a
scope).
The kernels compute the composition of ``csa_ops.reference_epilogue`` operation for
operation, so the results are the torch route's bytes (grad_weight: its column sums in the
kernel's own fixed order); calls a kernel does not take (fp64 rows, non-power-of-two
head_dim, a non-contiguous or misaligned output, other GPUs) keep the torch route. Nothing
here synchronizes: a step stays capturable in a CUDA graph.
"""

from __future__ import annotations

import contextlib

import torch

from . import dispatch
from .config import Direction
from .kernels.calls import check_lanes
from .kernels.window import plan as window_plan
from .launch_description import CallSpec, Launch, current_stream_handle, python_call
from .state import STATE

_STORE_INPUTS = ("rows", "norm_weight", "cos", "sin", "cu", "start_pos", "slots",
                 "block_table", "cache")
_ROWS_INPUTS = ("rows", "norm_weight", "cos", "sin", "cuc", "position_offset")
_ROWS_BACKWARD_INPUTS = ("grad_out", "rows", "norm_weight", "cos", "sin", "cuc",
                         "position_offset", "partials", "grad_weight")
# The backward's CTAs (each one fp32 partial row of grad_weight) at most: a CTA takes
# ceil(rows / MAX_PARTIALS) rows, so grad_weight's summation order depends on the row count
# alone, not on the device.
MAX_PARTIALS = 1024
# fp8_ds_mla page bytes the store kernels take (see _cache_taken).
_DS_MLA_PAGE_ALIGN = 16
# Call metadata -> the prepared launch (cleared with every other prepared call).
_PREPARED = dispatch.PreparedCalls()


_ROUTE_FLAGS = ("store_kernel", "training_epilogue_kernel", "training_epilogue_backward_kernel")


@contextlib.contextmanager
def _route(on: bool):
    previous = [getattr(STATE, flag) for flag in _ROUTE_FLAGS]
    for flag in _ROUTE_FLAGS:
        setattr(STATE, flag, on)
    try:
        yield
    finally:
        for flag, value in zip(_ROUTE_FLAGS, previous):
            setattr(STATE, flag, value)


@contextlib.contextmanager
def _switched(flag: str, on: bool = False):
    previous = getattr(STATE, flag)
    setattr(STATE, flag, on)
    try:
        yield
    finally:
        setattr(STATE, flag, previous)


def two_launch_step():
    """Within: csa::compressor_extend_store runs as the extend kernel, then the store kernel,
    decode steps and prefills too (the fused kernels' reference, and the benchmarks'
    baseline)."""
    return _switched("fused_store_step")


def fused_prefill(on: bool = True):
    """Within: csa::compressor_extend_store's split calls (a prefill, or a batch mixing one
    with decode requests) run as two fused launches (kernels/window/rows_store.py) where
    they take the call; off by default, so that only a scope that asks runs them."""
    return _switched("fused_store_prefill", on)


def two_launch_forward():
    """Within: csa::compressor_epilogue's forward runs as csa::compressor's kernel, then the
    row-epilogue kernel (the fused kernel's reference, and the benchmarks' baseline)."""
    return _switched("fused_training_forward")


@contextlib.contextmanager
def fused_training():
    """Within: csa::compressor_epilogue's forward and backward each run as one kernel with
    the pooling where the register-window family pools them (the default; for a scope
    within two_launch_forward() or staged_backward())."""
    with _switched("fused_training_forward", True), _switched("fused_training_backward", True):
        yield


def staged_backward():
    """Within: csa::compressor_epilogue_backward runs staged: the pooling forward, the
    row-epilogue backward, then csa::compressor_backward (the fused kernel's reference, and
    the benchmarks' baseline)."""
    return _switched("fused_training_backward")


def torch_route():
    """Within: the epilogue ops run their epilogue as torch ops on CUDA too, both directions
    (the composition the kernels are tested against, and the benchmarks' baseline)."""
    return _route(False)


def kernel_route():
    """Within: the epilogue ops run their epilogue by the kernels where they take the call."""
    return _route(True)


def _key(rows, norm_weight, eps: float, rope_dim: int, rotate: bool, cache_format: str,
         host, position_offset: bool = False):
    return host.epilogue_key(rows.dtype, norm_weight.dtype, rows.shape[1], rope_dim, rotate,
                             cache_format, eps, host.device_arch(rows.device), position_offset)


def _prepared(signature, direction: Direction, inputs, outputs, in_place, key_of, constants_of,
              device_index: int, *, live: str = "rows", to_float=(), restore=(),
              workspace_of=None, compiled_only=False, launched=None):
    """The memo's call for ``signature``, prepared on first use from ``key_of(host)``,
    ``constants_of(key)`` and ``workspace_of(key)`` (fp32 scratch elements, none by
    default); ``_NOT_TAKEN`` where the kernel does not take it. ``launched(key)``: the
    (direction, key) of each launch of the call, in order (by default one, ``direction``'s
    kernel of ``key``), all with ``direction``'s arguments. With ``compiled_only``: None
    (nothing remembered) while a launch's kernel is not compiled, as within a capture,
    which forbids compiling."""
    call = _PREPARED.get(signature)
    if call is not None:
        return call
    host = dispatch.launch_path(_PREPARED)
    key = key_of(host)
    if key is None:
        return _PREPARED.remember(signature, _NOT_TAKEN)
    parts = tuple(launched(key)) if launched else ((direction, key),)
    if compiled_only and not all(host.KERNELS.ready(*part) for part in parts):
        return None
    spec = CallSpec(direction=direction, key=parts[0][1], inputs=inputs, outputs=outputs,
                    launches=tuple(Launch(host.KERNELS.get(*part), constants_of(part[1]))
                                   for part in parts),
                    workspace=workspace_of(key) if workspace_of else 0, to_float=to_float,
                    restore=restore, in_place=in_place, live=live)
    return _PREPARED.remember(signature, python_call(spec, current_stream_handle, device_index,
                                                     host.multi_gpu()))


def _cache_taken(cache, cache_format: str) -> bool:
    """Whether the store kernels address ``cache``: contiguous, and fp8_ds_mla pages whose
    stride keeps the kernels' 4- and 8-byte stores aligned (the layout's own page size, a
    multiple of 576 bytes, always does)."""
    return cache.is_contiguous() and not (
        cache_format == "fp8_ds_mla" and cache.shape[1] % _DS_MLA_PAGE_ALIGN)


def _cache_constants(cos, block_table, cache, cache_format: str, page_size: int) -> dict:
    """The store kernels' launch constants of the tables and the paged cache."""
    return {"table_rows": max(cos.shape[0], 1), "table_width": block_table.shape[1],
            "num_pages": cache.shape[0], "page_size": page_size,
            "page_bytes": cache.shape[1] if cache_format == "fp8_ds_mla" else 0}


def _NOT_TAKEN(*tensors):  # a signature the kernel does not take
    return None


def launch_store(rows, cu_seqlens_comp, num_tokens: int, cu_seqlens, start_pos, slots,
                 num_slots: int, norm_weight, eps: float, cos, sin, rope_dim: int,
                 rotate: bool, cache_format: str, cache, block_table, page_size: int,
                 ratio: int) -> bool:
    """Launch the store kernel for serving_store.epilogue_store's arguments (``rows``: the
    extend kernel's output); False where it does not take the call (nothing launched)."""
    if not (STATE.store_kernel and rows.is_cuda and rows.shape[0]
            and _cache_taken(cache, cache_format)):
        return False
    # The kernel places the rows as the extend kernel did, from cu_seqlens and start_pos
    # (before its PDL wait): it does not read cu_seqlens_comp.
    tensors = (rows, norm_weight, cos, sin, cu_seqlens, start_pos, slots, block_table, cache)
    signature = dispatch.signature(tensors, Direction.STORE, float(eps), rope_dim, rotate,
                                   cache_format, page_size, ratio, num_tokens, num_slots)

    def constants(key):
        return {"num_rows": rows.shape[0], "num_requests": start_pos.shape[0],
                "num_tokens": num_tokens, "num_slots": num_slots, "ratio": ratio,
                "grid": rows.shape[0],
                **_cache_constants(cos, block_table, cache, cache_format, page_size)}

    call = _prepared(
        signature, Direction.STORE, _STORE_INPUTS, {}, ("cache",),
        lambda host: _key(rows, norm_weight, eps, rope_dim, rotate, cache_format, host),
        constants, rows.device.index or 0)
    return call(*tensors) is not None


_STEP_INPUTS = ("kv", "score", "ape", "cu", "start_pos", "slots", "kv_state", "score_state",
                "norm_weight", "cos", "sin", "block_table", "cache")


def launch_extend_store(kv, score, ape, cu_seqlens, start_pos, slots, kv_state, score_state,
                        norm_weight, eps: float, cos, sin, rope_dim: int, rotate: bool,
                        cache_format: str, cache, block_table, page_size: int, ratio: int,
                        coff: int, num_rows: int):
    """csa::compressor_extend_store's whole call by the register-window family's fused
    kernels: a decode step in one launch (kernels/window/extend_store.py), and within
    fused_prefill() a split call in two (its head rows and states, then its other rows:
    rows_store.py). The
    state is updated in place, the rows the requests complete go through the epilogue into
    ``cache``; returns cu_seqlens_comp, or None where no fused kernel takes the call
    (nothing launched: the extend and store kernels run it). ``num_rows``: the call's row
    capacity, which cu_seqlens_comp[-1] must not pass (serving_store's bound)."""
    if not (STATE.store_kernel and STATE.fused_store_step and kv.is_cuda
            and start_pos.shape[0] and _cache_taken(cache, cache_format)
            and kv_state.is_contiguous() and score_state.is_contiguous()
            and kv_state is not score_state):
        return None
    num_requests = start_pos.shape[0]
    tensors = (kv, score, ape, cu_seqlens, start_pos, slots, kv_state, score_state,
               norm_weight, cos, sin, block_table, cache)
    prefill = STATE.fused_store_prefill
    signature = dispatch.signature(tensors, Direction.EXTEND_STORE, float(eps), rope_dim,
                                   rotate, cache_format, page_size, ratio, coff, num_rows,
                                   prefill)

    def constants(key):
        if isinstance(key, window_plan.RowsStoreKey):
            check_lanes(key.rows, num_requests)
            sms = torch.cuda.get_device_properties(kv.device).multi_processor_count
            grid = window_plan.plan_row_share(key, num_rows, sms)[0].grid
        else:
            grid = window_plan.plan_extend_store(key, num_requests).grid
        return {"num_tokens": kv.shape[0], "num_rows": num_rows, "num_requests": num_requests,
                "num_slots": kv_state.shape[0], "grid": grid,
                **_cache_constants(cos, block_table, cache, cache_format, page_size)}

    # Not compiled (a capture forbids compiling): None, so the extend and store kernels run
    # the call.
    call = _prepared(
        signature, Direction.EXTEND_STORE, _STEP_INPUTS, {"cuc": ("cu", None)},
        ("kv_state", "score_state", "cache"),
        lambda host: _fused_store_keys(kv, num_requests, norm_weight, eps, rope_dim, rotate,
                                       cache_format, ratio, coff, prefill, host),
        constants, kv.device.index or 0, live="ape", to_float=("ape",), compiled_only=True,
        launched=lambda keys: zip(window_plan.SPLIT_STORE, keys))
    return None if call is None else call(*tensors)


def _fused_store_keys(kv, num_requests: int, norm_weight, eps: float, rope_dim: int,
                      rotate: bool, cache_format: str, ratio: int, coff: int, prefill: bool,
                      host):
    """The fused keys of a call's launches: a decode step's one, whose extend kernel pools
    each request's rows in the request's item (a call of one token per request does), or,
    with ``prefill``, a split call's two; None where the call is neither or the fused
    kernels cannot hold the epilogue."""
    problem = host.extend_problem(kv, ratio, coff, num_requests)
    if problem is None:
        return None
    epilogue = host.epilogue_key(kv.dtype, norm_weight.dtype, kv.shape[1] // coff, rope_dim,
                                 rotate, cache_format, eps, problem.key.arch)
    if epilogue is None:
        return None
    step = window_plan.extend_store_key(problem.key, epilogue)
    if step is not None:
        return (step,)
    return window_plan.split_store_keys(problem.key, epilogue) if prefill else None


def takes_fused_forward(kv) -> bool:
    """Whether launch_forward_epilogue may take a call on ``kv`` (its switches are on)."""
    return STATE.training_epilogue_kernel and STATE.fused_training_forward and kv.is_cuda


_FORWARD_INPUTS = ("kv", "score", "ape", "cu", "cuc", "norm_weight", "cos", "sin",
                   "position_offset")


def launch_forward_epilogue(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio: int,
                            coff: int, total_comp: int, norm_weight, eps: float, cos, sin,
                            rope_dim: int, position_offset, rotate: bool):
    """csa::compressor_epilogue's whole forward in one launch (the register-window family's
    fused kernel, kernels/window/forward_epilogue.py): ``launch_rows``' rows of
    csa::compressor's ``total_comp`` rows, or None where that kernel does not take the call
    (nothing launched: the pooling and row-epilogue kernels run it)."""
    if not (takes_fused_forward(kv) and total_comp > 0):
        return None
    offsets = position_offset is not None
    offset, cos, sin = _readable(kv, cu_seqlens_comp, position_offset, rope_dim, cos, sin)
    tensors = (kv, score, ape, cu_seqlens, cu_seqlens_comp, norm_weight, cos, sin, offset)
    signature = dispatch.signature(tensors, Direction.FORWARD_EPILOGUE, float(eps), rope_dim,
                                   rotate, offsets, ratio, coff, total_comp)

    def key_of(host):
        found = host.problem(Direction.FORWARD, kv, score, cu_seqlens, cu_seqlens_comp, ratio,
                             coff)
        if found is None:
            return None
        epilogue = host.epilogue_key(kv.dtype, norm_weight.dtype, found.key.head_dim,
                                     rope_dim, rotate, "none", eps, found.key.arch, offsets)
        return None if epilogue is None else window_plan.forward_epilogue_key(found.key,
                                                                             epilogue)

    def constants(key):
        sms = torch.cuda.get_device_properties(kv.device).multi_processor_count
        plan, rows_per_cta = window_plan.plan_row_share(key, total_comp, sms)
        return {"num_tokens": kv.shape[0], "num_rows": total_comp,
                "num_segs": cu_seqlens.shape[0] - 1, "table_rows": max(cos.shape[0], 1),
                "rows_per_cta": rows_per_cta, "grid": plan.grid}

    # Not compiled (a capture forbids compiling): None, so the two launches run it.
    call = _prepared(
        signature, Direction.FORWARD_EPILOGUE, _FORWARD_INPUTS,
        {"out": ("kv", (total_comp, kv.shape[1] // coff))}, (), key_of, constants,
        kv.device.index or 0, live="kv", to_float=("ape",), compiled_only=True)
    return None if call is None else call(*tensors)


_BACKWARD_INPUTS = ("grad_out", "kv", "score", "ape", "cu", "cuc", "norm_weight", "cos",
                    "sin", "position_offset")


def launch_backward_epilogue(grad_out, kv, score, ape, cu_seqlens, cu_seqlens_comp,
                             ratio: int, coff: int, norm_weight, eps: float, cos, sin,
                             rope_dim: int, position_offset, rotate: bool):
    """csa::compressor_epilogue_backward in one launch and its two sums (the register-window
    family's fused kernel, kernels/window/backward_epilogue.py): (grad_kv, grad_score,
    grad_ape, grad_weight), or None where that kernel does not take the call (nothing
    launched: the staged route runs it)."""
    if not (STATE.training_epilogue_backward_kernel and STATE.fused_training_backward
            and kv.is_cuda and grad_out.shape[0] and grad_out.dtype == kv.dtype):
        return None
    offsets = position_offset is not None
    offset, cos, sin = _readable(kv, cu_seqlens_comp, position_offset, rope_dim, cos, sin)
    tensors = (grad_out, kv, score, ape, cu_seqlens, cu_seqlens_comp, norm_weight, cos, sin,
               offset)
    signature = dispatch.signature(tensors, Direction.BACKWARD_EPILOGUE, float(eps),
                                   rope_dim, rotate, offsets, ratio, coff)
    def key_of(host):
        keys = [host.problem(direction, kv, score, cu_seqlens, cu_seqlens_comp, ratio, coff)
                for direction in (Direction.BACKWARD, Direction.FORWARD)]
        if None in keys:
            return None
        backward, forward = (found.key for found in keys)
        epilogue = host.epilogue_key(kv.dtype, norm_weight.dtype, backward.head_dim, rope_dim,
                                     rotate, "none", eps, backward.arch, offsets)
        return None if epilogue is None else window_plan.backward_epilogue_key(
            backward, forward, epilogue)

    def plan(key):
        sms = torch.cuda.get_device_properties(kv.device).multi_processor_count
        return window_plan.plan_backward_epilogue(key, kv.shape[0], grad_out.shape[0], sms)

    def constants(key):
        return {"num_tokens": kv.shape[0], "num_rows": grad_out.shape[0],
                "num_segs": cu_seqlens.shape[0] - 1, "table_rows": max(cos.shape[0], 1),
                "grid": plan(key).grid}

    head_dim = kv.shape[1] // coff
    call = _prepared(
        signature, Direction.BACKWARD_EPILOGUE, _BACKWARD_INPUTS,
        {"grad_kv": ("kv", None), "grad_score": ("score", None), "grad_ape": ("ape", None),
         "grad_weight": ("ape", (head_dim,))}, (), key_of, constants, kv.device.index or 0,
        live="kv", to_float=("ape",), restore=(("grad_ape", "ape"),),
        workspace_of=lambda key: plan(key).workspace, compiled_only=True)
    if call is None:
        return None
    grads = call(*tensors)
    if grads is None:
        return None
    grad_kv, grad_score, grad_ape, grad_weight = grads
    return grad_kv, grad_score, grad_ape, grad_weight.to(norm_weight.dtype)


def launch_rows(rows, cu_seqlens_comp, position_offset, ratio: int, norm_weight, eps: float,
                cos, sin, rope_dim: int, rotate: bool):
    """The training forward's epilogue of csa::compressor's ``rows`` by the kernel: the
    rows ``reference_epilogue.epilogue_rows`` computes at the training positions, or None
    where the kernel does not take the call (nothing launched)."""
    if not (STATE.training_epilogue_kernel and rows.is_cuda and rows.shape[0]):
        return None
    offsets = position_offset is not None
    offset, cos, sin = _readable(rows, cu_seqlens_comp, position_offset, rope_dim, cos, sin)
    tensors = (rows, norm_weight, cos, sin, cu_seqlens_comp, offset)
    signature = dispatch.signature(tensors, Direction.EPILOGUE, float(eps), rope_dim, rotate,
                                   offsets, ratio)

    def constants(key):
        return {"num_rows": rows.shape[0], "num_segs": cu_seqlens_comp.shape[0] - 1,
                "table_rows": max(cos.shape[0], 1), "ratio": ratio, "grid": rows.shape[0]}

    call = _prepared(
        signature, Direction.EPILOGUE, _ROWS_INPUTS, {"out": ("rows", None)}, (),
        lambda host: _key(rows, norm_weight, eps, rope_dim, rotate, "none", host, offsets),
        constants, rows.device.index or 0)
    return call(*tensors)


def launch_rows_backward(grad_out, rows, cu_seqlens_comp, position_offset, ratio: int,
                         norm_weight, eps: float, cos, sin, rope_dim: int, rotate: bool):
    """(grad_rows, grad_weight) of reference_epilogue.epilogue_rows_backward at the training
    positions by the kernel, from ``grad_out`` and the recomputed pooled ``rows``; None
    where the kernel does not take the call (nothing launched)."""
    if not (STATE.training_epilogue_backward_kernel and rows.is_cuda and rows.shape[0]):
        return None
    if grad_out.shape != rows.shape or grad_out.dtype != rows.dtype:
        return None  # the kernel reads grad_out as rows of the rows' dtype
    offsets = position_offset is not None
    offset, cos, sin = _readable(rows, cu_seqlens_comp, position_offset, rope_dim, cos, sin)
    num_rows, head_dim = rows.shape
    rows_per_cta = -(-num_rows // MAX_PARTIALS)
    grid = -(-num_rows // rows_per_cta)
    partials = torch.empty(grid, head_dim, dtype=torch.float32, device=rows.device)
    grad_weight = torch.empty(head_dim, dtype=torch.float32, device=rows.device)
    tensors = (grad_out, rows, norm_weight, cos, sin, cu_seqlens_comp, offset, partials,
               grad_weight)
    signature = dispatch.signature(tensors, Direction.EPILOGUE_BACKWARD, float(eps), rope_dim,
                                   rotate, offsets, ratio)

    def constants(key):
        return {"num_rows": num_rows, "num_segs": cu_seqlens_comp.shape[0] - 1,
                "table_rows": max(cos.shape[0], 1), "ratio": ratio,
                "rows_per_cta": rows_per_cta, "grid": grid}

    call = _prepared(
        signature, Direction.EPILOGUE_BACKWARD, _ROWS_BACKWARD_INPUTS,
        {"grad_rows": ("rows", None)}, ("partials", "grad_weight"),
        lambda host: _key(rows, norm_weight, eps, rope_dim, rotate, "none", host, offsets),
        constants, rows.device.index or 0)
    grad_rows = call(*tensors)
    if grad_rows is None:
        return None
    return grad_rows, grad_weight.to(norm_weight.dtype)


def _readable(rows, cu_seqlens_comp, position_offset, rope_dim: int, cos, sin):
    """(position_offset, cos, sin) as the training kernels take them: the tensors a key
    never reads (no offsets, no RoPE) replaced by live ones."""
    offset = position_offset if position_offset is not None else cu_seqlens_comp
    if rope_dim == 0:  # the tables are never read (and may be None)
        cos = sin = rows.new_empty(0, 0, dtype=torch.float32)
    return offset, cos, sin
