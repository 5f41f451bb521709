"""The CUDA route of csa::compressor_extend_store's epilogue: one launch of the row-epilogue
kernel (kernels/epilogue/) after the extend kernel, in place of the epilogue, the encoding
and the paged store written as torch ops (a few dozen small kernels per decode step).

The kernel computes the composition of ``csa_ops.reference_epilogue`` operation for
operation, so the cache receives the same bytes either way (tested on the H200); calls the
kernel does not take (fp64 rows, non-power-of-two head_dim, a non-contiguous or misaligned
cache, other GPUs) keep the torch route. Nothing here synchronizes: a decode step stays
capturable in a CUDA graph.
"""

from __future__ import annotations

import contextlib

import torch

from . import dispatch
from .config import DTYPES, Direction
from .kernels.epilogue import plan
from .launch_description import CallSpec, Launch, current_stream_handle, python_call
from .state import STATE

_DTYPE_NAMES = {getattr(torch, name): name for name in DTYPES}
_INPUTS = ("rows", "norm_weight", "cos", "sin", "cu", "start_pos", "slots", "cuc",
           "block_table", "cache")
# Call metadata -> the prepared launch (cleared with every other prepared call).
_PREPARED = dispatch.PreparedCalls()


@contextlib.contextmanager
def torch_route():
    """Within: csa::compressor_extend_store runs its epilogue as torch ops on CUDA too (the
    composition the kernel is tested against, and the benchmarks' baseline)."""
    previous, STATE.store_kernel = STATE.store_kernel, False
    try:
        yield
    finally:
        STATE.store_kernel = previous


def _key(rows, norm_weight, eps: float, rope_dim: int, rotate: bool, cache_format: str,
         host) -> plan.EpilogueKey | None:
    dtype = _DTYPE_NAMES.get(rows.dtype)
    weight_dtype = _DTYPE_NAMES.get(norm_weight.dtype)
    arch = host.device_arch(rows.device)
    if dtype is None or weight_dtype is None or arch is None:
        return None
    key = plan.configure(dtype, weight_dtype, rows.shape[1], rope_dim, rotate, cache_format,
                         eps, arch)
    return key if plan.supports(key) else None


def _prepare(signature, host, key: plan.EpilogueKey, constants: dict[str, int],
             device_index: int):
    spec = CallSpec(direction=Direction.STORE, key=key, inputs=_INPUTS, outputs={},
                    launches=(Launch(host.KERNELS.get(Direction.STORE, key), constants),),
                    in_place=("cache",), live="rows")
    return _PREPARED.remember(signature, python_call(spec, current_stream_handle,
                                                     device_index, host.multi_gpu()))


def launch(rows, cu_seqlens_comp, num_tokens: int, cu_seqlens, start_pos, slots,
           num_slots: int, norm_weight, eps: float, cos, sin, rope_dim: int, rotate: bool,
           cache_format: str, cache, block_table, page_size: int, ratio: int) -> bool:
    """Launch the kernel for serving_store.epilogue_store's arguments (``rows``: the extend
    kernel's output); False where it does not take the call (nothing launched)."""
    if not (STATE.store_kernel and rows.is_cuda and rows.shape[0] and cache.is_contiguous()):
        return False
    tensors = (rows, norm_weight, cos, sin, cu_seqlens, start_pos, slots, cu_seqlens_comp,
               block_table, cache)
    signature = dispatch.signature(tensors, float(eps), rope_dim, rotate, cache_format,
                                   page_size, ratio, num_tokens, num_slots)
    call = _PREPARED.get(signature)
    if call is None:
        host = dispatch.launch_path(_PREPARED)
        key = _key(rows, norm_weight, eps, rope_dim, rotate, cache_format, host)
        if key is None:
            _PREPARED.remember(signature, _NOT_TAKEN)
            return False
        num_rows = rows.shape[0]
        constants = {
            "num_rows": num_rows, "num_requests": start_pos.shape[0],
            "num_tokens": num_tokens, "num_slots": num_slots,
            "table_rows": max(cos.shape[0], 1), "table_width": block_table.shape[1],
            "num_pages": cache.shape[0], "page_size": page_size,
            "page_bytes": cache.shape[1] if cache_format == "fp8_ds_mla" else 0,
            "ratio": ratio, "grid": num_rows}
        call = _prepare(signature, host, key, constants, rows.device.index or 0)
    if call is _NOT_TAKEN:
        return False
    return call(*tensors) is not None


def _NOT_TAKEN(*tensors):  # a signature the kernel does not take
    return None

