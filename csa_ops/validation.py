"""Argument checks shared by both ops, the fakes and the kernels' launch path.

``check_arguments`` reads metadata only, so it runs on fake tensors and never syncs.
``check_offsets`` reads the offset tensors' contents and is called where that is free (CPU).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

OP = "csa.compressor"
BACKWARD_OP = "csa.compressor_backward"
_op_name = contextvars.ContextVar("csa_ops_validated_op", default=OP)
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
INT32_MAX = 2**31 - 1


def definitely(condition) -> bool:
    """True only when ``condition`` is provable; symbolic sizes get no guard (so export with
    an unbounded Dim works), and concrete sizes are checked exactly when the kernel runs."""
    if isinstance(condition, bool):  # concrete sizes: no need to import sympy (~0.4 s)
        return condition
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(condition)


@contextlib.contextmanager
def checking(op: str):
    """Errors raised inside name ``op`` (the checks are shared by both ops)."""
    token = _op_name.set(op)
    try:
        yield
    finally:
        _op_name.reset(token)


def _fail(message: str, error=ValueError):
    raise error(f"{_op_name.get()}: {message}")


def _check_same_device(name: str, tensor: torch.Tensor, kv: torch.Tensor) -> None:
    if tensor.device != kv.device:
        _fail(f"`{name}` must be on the device of `kv` ({kv.device}), got {tensor.device}")


def _check_offsets_tensor(name: str, tensor: torch.Tensor, kv: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        _fail(f"`{name}` must be a tensor, got {type(tensor).__name__}", TypeError)
    if tensor.dim() != 1:
        _fail(f"`{name}` must be 1-D (B+1,), got shape {tuple(tensor.shape)}")
    if tensor.dtype != torch.int32:
        _fail(f"`{name}` must be int32, got {tensor.dtype}")
    if tensor.shape[0] < 1:
        _fail(f"`{name}` must hold at least one offset (B+1 >= 1), got 0")
    _check_same_device(name, tensor, kv)


def check_ratio_coff(ratio, coff) -> None:
    if not isinstance(ratio, int) or isinstance(ratio, bool) or ratio < 1:
        _fail(f"`ratio` must be an int >= 1, got {ratio!r}")
    if not isinstance(coff, int) or isinstance(coff, bool) or coff not in (1, 2):
        _fail(f"`coff` must be 1 or 2, got {coff!r}")


def check_kv(kv, coff: int) -> int:
    """kv's rank, dtype and width; return its width (coff * head_dim)."""
    if kv.dim() != 2:
        _fail(f"`kv` must be 2-D (T, coff*head_dim), got shape {tuple(kv.shape)}")
    if kv.dtype not in FLOAT_DTYPES:
        _fail(f"`kv` must be one of bfloat16, float16, float32, float64, got {kv.dtype}")
    width = kv.shape[1]
    if width < coff or width % coff != 0:
        _fail(f"`kv` width must be a positive multiple of coff={coff}, got {width}")
    return width


def check_arguments(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp=None):
    """Validate everything that metadata alone decides; return head_dim."""
    for name, tensor in (("kv", kv), ("score", score), ("ape", ape)):
        if not isinstance(tensor, torch.Tensor):
            _fail(f"`{name}` must be a tensor, got {type(tensor).__name__}", TypeError)
    check_ratio_coff(ratio, coff)
    width = check_kv(kv, coff)
    head_dim = width // coff
    if score.shape != kv.shape:
        _fail(f"`score` must have the shape of `kv` {tuple(kv.shape)}, got {tuple(score.shape)}")
    if score.dtype != kv.dtype:
        _fail(f"`score` must have the dtype of `kv` ({kv.dtype}), got {score.dtype}")
    _check_same_device("score", score, kv)
    if tuple(ape.shape) != (ratio, width):
        _fail(f"`ape` must have shape (ratio, coff*head_dim) = ({ratio}, {width}), "
              f"got {tuple(ape.shape)}")
    # Added to the logits in the accumulation dtype, so any float ape that converts to it
    # exactly (a model cast to bf16 makes ape bf16); fp64 ape only where the math is fp64.
    fp64 = kv.dtype == torch.float64
    if ape.dtype not in (FLOAT_DTYPES if fp64 else FLOAT_DTYPES[:3]):
        expected = "float32, float64" if fp64 else "float32 (float64 only with float64 `kv`)"
        _fail(f"`ape` must be one of bfloat16, float16, {expected}, got {ape.dtype}")
    _check_same_device("ape", ape, kv)
    _check_offsets_tensor("cu_seqlens", cu_seqlens, kv)
    _check_offsets_tensor("cu_seqlens_comp", cu_seqlens_comp, kv)
    if cu_seqlens.shape[0] != cu_seqlens_comp.shape[0]:
        _fail(f"`cu_seqlens` and `cu_seqlens_comp` must have the same length B+1, got "
              f"{cu_seqlens.shape[0]} and {cu_seqlens_comp.shape[0]}")
    if total_comp is not None:
        if definitely(total_comp < 0):
            _fail(f"`total_comp` must be >= 0 or None, got {total_comp}")
        if definitely(total_comp * head_dim > INT32_MAX):
            _fail(f"`total_comp` * head_dim = {total_comp * head_dim} overflows int32 offsets")
    if definitely(kv.shape[0] * width > INT32_MAX):
        _fail(f"`kv` has {kv.shape[0] * width} elements, which overflows int32 offsets "
              f"(at most {INT32_MAX})")
    return head_dim


def check_grad_out(grad_out, kv, head_dim: int) -> None:
    if not isinstance(grad_out, torch.Tensor):
        _fail(f"`grad_out` must be a tensor, got {type(grad_out).__name__}", TypeError)
    if grad_out.dim() != 2 or grad_out.shape[1] != head_dim:
        _fail(f"`grad_out` must be 2-D (rows, head_dim={head_dim}), got {tuple(grad_out.shape)}")
    if grad_out.dtype != kv.dtype:
        _fail(f"`grad_out` must have the dtype of `kv` ({kv.dtype}), got {grad_out.dtype}")
    _check_same_device("grad_out", grad_out, kv)
    if definitely(grad_out.shape[0] * head_dim > INT32_MAX):
        _fail(f"`grad_out` has {grad_out.shape[0] * head_dim} elements, which overflows int32")


def check_backward_arguments(grad_out, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff):
    """The forward's metadata checks plus grad_out's, with errors naming the backward op."""
    with checking(BACKWARD_OP):
        head_dim = check_arguments(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff)
        check_grad_out(grad_out, kv, head_dim)


def check_offsets(cu_seqlens, cu_seqlens_comp, num_tokens: int, ratio: int, total_comp=None,
                  rows_name: str = "`total_comp`"):
    """Content checks of the offsets (host-side tensors only); return the true row count.

    ``rows_name`` names where the row capacity came from (the backward has no total_comp).
    """
    cu = cu_seqlens.tolist()
    cuc = cu_seqlens_comp.tolist()
    if cu[0] != 0:
        _fail(f"`cu_seqlens[0]` must be 0, got {cu[0]}")
    if cuc[0] != 0:
        _fail(f"`cu_seqlens_comp[0]` must be 0, got {cuc[0]}")
    for s in range(len(cu) - 1):
        length = cu[s + 1] - cu[s]
        if length < 0:
            _fail(f"`cu_seqlens` must be non-decreasing, got {cu[s]} then {cu[s + 1]} at {s}")
        rows = cuc[s + 1] - cuc[s]
        if rows != length // ratio:
            _fail(f"`cu_seqlens_comp` must count len // ratio rows per segment: segment {s} has "
                  f"{length} tokens, so {length // ratio} rows at ratio {ratio}, got {rows}")
    if cu[-1] > num_tokens:
        _fail(f"`cu_seqlens[-1]` = {cu[-1]} exceeds the number of tokens T = {num_tokens}")
    if total_comp is not None and total_comp < cuc[-1]:
        _fail(f"{rows_name} = {total_comp} is smaller than the true row count "
              f"cu_seqlens_comp[-1] = {cuc[-1]}")
    return cuc[-1]
