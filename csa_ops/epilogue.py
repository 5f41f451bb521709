"""csa::compressor_epilogue and its backward: the pooled rows with RMSNorm, RoPE, rotation.

Both ops are functional and serve every device with the composition of
``csa_ops.reference_epilogue``: the csa::compressor op (its CUDA kernels on CUDA), then the
epilogue in torch; the backward recomputes the pooled rows, runs the epilogue's backward
and then csa::compressor_backward. Autograd is an autograd.Function at the Autograd key,
as in csa_ops.ops; the fakes live in ``csa_ops.meta.epilogue``. The argument checks here
are shared with csa_ops.serving_store.
"""

from __future__ import annotations

import math

import torch

from . import dispatch, reference_epilogue, row_epilogue, validation
from .reference_epilogue import EpilogueParams

OP = "csa.compressor_epilogue"
BACKWARD_OP = "csa.compressor_epilogue_backward"
_EPILOGUE_ARGS = ("Tensor norm_weight, float eps, Tensor? cos, Tensor? sin, int rope_dim, "
                  "Tensor? position_offset, bool rotate")
FORWARD_SCHEMA = ("(Tensor kv, Tensor score, Tensor ape, Tensor cu_seqlens, "
                  f"Tensor cu_seqlens_comp, int ratio, int coff, {_EPILOGUE_ARGS}, "
                  "SymInt? total_comp=None) -> Tensor")
BACKWARD_SCHEMA = ("(Tensor grad_out, Tensor kv, Tensor score, Tensor ape, Tensor cu_seqlens, "
                   f"Tensor cu_seqlens_comp, int ratio, int coff, {_EPILOGUE_ARGS}) "
                   "-> (Tensor, Tensor, Tensor, Tensor)")
# The forward's arguments in schema order: autograd returns one gradient (or None) each.
FORWARD_ARGS = ("kv", "score", "ape", "cu_seqlens", "cu_seqlens_comp", "ratio", "coff",
                "norm_weight", "eps", "cos", "sin", "rope_dim", "position_offset", "rotate",
                "total_comp")
_TAGS = (torch.Tag.needs_contiguous_strides, torch.Tag.pt2_compliant_tag)
NORM_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fail(op: str, message: str, error=ValueError):
    raise error(f"{op}: {message}")


def check_tensor(op: str, name: str, tensor, kv) -> None:
    if not isinstance(tensor, torch.Tensor):
        _fail(op, f"`{name}` must be a tensor, got {type(tensor).__name__}", TypeError)
    if tensor.device != kv.device:
        _fail(op, f"`{name}` must be on the device of `kv` ({kv.device}), got {tensor.device}")


def check_int(op: str, name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        _fail(op, f"`{name}` must be an int, got {value!r}")


def _check_norm(op: str, kv, head_dim: int, norm_weight, eps) -> None:
    check_tensor(op, "norm_weight", norm_weight, kv)
    if tuple(norm_weight.shape) != (head_dim,):
        _fail(op, f"`norm_weight` must have shape (head_dim,) = ({head_dim},), got "
                  f"{tuple(norm_weight.shape)}")
    allowed = NORM_WEIGHT_DTYPES + ((torch.float64,) if kv.dtype == torch.float64 else ())
    if norm_weight.dtype not in allowed:
        _fail(op, f"`norm_weight` must be float32, bfloat16 or float16 (float64 only with "
                  f"float64 `kv`), got {norm_weight.dtype}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (
            math.isfinite(eps) and eps >= 0):
        _fail(op, f"`eps` must be a finite float >= 0, got {eps!r}")


def _check_rope(op: str, kv, head_dim: int, cos, sin, rope_dim) -> None:
    check_int(op, "rope_dim", rope_dim)
    if not 0 <= rope_dim <= head_dim or rope_dim % 2:
        _fail(op, f"`rope_dim` must be even and in [0, head_dim={head_dim}], got {rope_dim}")
    if rope_dim == 0:
        return  # the tables are not read
    table_dtypes = (torch.float32, torch.float64) if kv.dtype == torch.float64 else (
        torch.float32,)
    for name, table in (("cos", cos), ("sin", sin)):
        if table is None:
            _fail(op, f"`{name}` is required when rope_dim > 0 (rope_dim={rope_dim})")
        check_tensor(op, name, table, kv)
        if table.dim() != 2 or table.shape[1] != rope_dim // 2 or table.shape[0] < 1:
            _fail(op, f"`{name}` must have shape (max_position >= 1, rope_dim // 2 = "
                      f"{rope_dim // 2}), got {tuple(table.shape)}")
        if table.dtype not in table_dtypes:
            _fail(op, f"`{name}` must be float32 (float64 also with float64 `kv`), got "
                      f"{table.dtype}")
    if cos.shape != sin.shape:
        _fail(op, f"`sin` must have the shape of `cos` {tuple(cos.shape)}, got "
                  f"{tuple(sin.shape)}")


def check_epilogue(op: str, kv, head_dim: int, norm_weight, eps, cos, sin, rope_dim,
                   rotate) -> None:
    """Metadata checks of the epilogue's arguments (runs on fake tensors, never syncs)."""
    _check_norm(op, kv, head_dim, norm_weight, eps)
    _check_rope(op, kv, head_dim, cos, sin, rope_dim)
    if not isinstance(rotate, bool):
        _fail(op, f"`rotate` must be a bool, got {rotate!r}")
    if rotate and head_dim & (head_dim - 1):
        _fail(op, f"`rotate` needs a power-of-two head_dim (the Walsh-Hadamard transform), "
                  f"got head_dim={head_dim}")


def _check_position_offset(op: str, position_offset, num_segments, kv) -> None:
    if position_offset is None:
        return
    check_tensor(op, "position_offset", position_offset, kv)
    if (position_offset.dim() != 1 or position_offset.dtype != torch.int32
            or position_offset.shape[0] != num_segments):
        _fail(op, f"`position_offset` must be an int32 tensor of shape (B,) = "
                  f"({num_segments},), got shape {tuple(position_offset.shape)} and "
                  f"{position_offset.dtype}")


def check_arguments(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, norm_weight, eps,
                    cos, sin, rope_dim, position_offset, rotate, total_comp=None,
                    op: str = OP) -> int:
    """Everything metadata decides, errors naming ``op``; returns head_dim."""
    with validation.checking(op):
        head_dim = validation.check_arguments(kv, score, ape, cu_seqlens, cu_seqlens_comp,
                                              ratio, coff, total_comp)
    check_epilogue(op, kv, head_dim, norm_weight, eps, cos, sin, rope_dim, rotate)
    _check_position_offset(op, position_offset, cu_seqlens.shape[0] - 1, kv)
    return head_dim


def check_backward_arguments(grad_out, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio,
                             coff, norm_weight, eps, cos, sin, rope_dim, position_offset,
                             rotate) -> None:
    head_dim = check_arguments(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff,
                               norm_weight, eps, cos, sin, rope_dim, position_offset, rotate,
                               op=BACKWARD_OP)
    with validation.checking(BACKWARD_OP):
        validation.check_grad_out(grad_out, kv, head_dim)


def _check_positions(op: str, cu_seqlens_comp, position_offset, ratio: int, cos) -> None:
    """Content check (host tensors): every real row's position lies in the RoPE tables."""
    cuc = cu_seqlens_comp.tolist()
    offsets = position_offset.tolist() if position_offset is not None else [0] * (len(cuc) - 1)
    for s, offset in enumerate(offsets):
        rows = cuc[s + 1] - cuc[s]
        if rows <= 0:
            continue
        first, last = offset, (rows - 1) * ratio + offset
        if first < 0:
            _fail(op, f"`position_offset[{s}]` = {offset} puts row 0 of segment {s} at a "
                      f"negative position")
        if last >= cos.shape[0]:
            _fail(op, f"`cos`/`sin` hold {cos.shape[0]} positions, but row {rows - 1} of "
                      f"segment {s} sits at position {last} ({rows - 1} * ratio {ratio} + "
                      f"position_offset {offset})")


def _check_contents(op, kv, cu_seqlens, cu_seqlens_comp, ratio, cos, rope_dim, position_offset,
                    rows=None, rows_name="`total_comp`") -> None:
    with validation.checking(op):
        validation.check_offsets(cu_seqlens, cu_seqlens_comp, kv.shape[0], ratio, rows,
                                 rows_name=rows_name)
    if rope_dim:
        _check_positions(op, cu_seqlens_comp, position_offset, ratio, cos)


def _params(norm_weight, eps, cos, sin, rope_dim, rotate) -> EpilogueParams:
    return EpilogueParams(norm_weight, float(eps), cos, sin, rope_dim, rotate)


_LIB = torch.library.Library("csa", "FRAGMENT")
_LIB.define("compressor_epilogue" + FORWARD_SCHEMA, tags=_TAGS)
_LIB.define("compressor_epilogue_backward" + BACKWARD_SCHEMA, tags=_TAGS)


def _compressor_epilogue(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, norm_weight,
                         eps, cos, sin, rope_dim, position_offset, rotate, total_comp=None):
    check_arguments(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, norm_weight, eps,
                    cos, sin, rope_dim, position_offset, rotate, total_comp)
    if kv.device.type == "cpu":
        _check_contents(OP, kv, cu_seqlens, cu_seqlens_comp, ratio, cos, rope_dim,
                        position_offset, total_comp)
    params = _params(norm_weight, eps, cos, sin, rope_dim, rotate)
    if row_epilogue.takes_fused_forward(kv):
        if total_comp is None:  # csa::compressor's documented host sync, taken here once
            total_comp = int(cu_seqlens_comp[-1])
            check_arguments(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff,
                            norm_weight, eps, cos, sin, rope_dim, position_offset, rotate,
                            total_comp)
        rows = row_epilogue.launch_forward_epilogue(
            kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp, norm_weight,
            eps, cos, sin, rope_dim, position_offset, rotate)
        if rows is not None:
            return rows
    pooled = torch.ops.csa.compressor.default(kv, score, ape, cu_seqlens, cu_seqlens_comp,
                                              ratio, coff, total_comp)
    rows = row_epilogue.launch_rows(pooled, cu_seqlens_comp, position_offset, ratio,
                                    norm_weight, eps, cos, sin, rope_dim, rotate)
    if rows is not None:
        return rows
    return reference_epilogue.training_rows(pooled, cu_seqlens_comp, position_offset, ratio,
                                            params)


def _compressor_epilogue_backward(grad_out, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio,
                                  coff, norm_weight, eps, cos, sin, rope_dim, position_offset,
                                  rotate):
    check_backward_arguments(grad_out, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff,
                             norm_weight, eps, cos, sin, rope_dim, position_offset, rotate)
    rows = grad_out.shape[0]
    if kv.device.type == "cpu":
        _check_contents(BACKWARD_OP, kv, cu_seqlens, cu_seqlens_comp, ratio, cos, rope_dim,
                        position_offset, rows, rows_name="`grad_out` row count")
    grads = row_epilogue.launch_backward_epilogue(
        grad_out.contiguous(), kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff,
        norm_weight, eps, cos, sin, rope_dim, position_offset, rotate)
    if grads is not None:
        return grads
    return reference_epilogue.compressor_epilogue_backward_reference(
        grad_out, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff,
        _params(norm_weight, eps, cos, sin, rope_dim, rotate), position_offset,
        _rows_backward)


def _rows_backward(grad_out, pooled, cu_seqlens_comp, position_offset, ratio: int,
                   params: EpilogueParams):
    """The backward's way through the epilogue: the kernel where it takes the call."""
    grads = row_epilogue.launch_rows_backward(
        grad_out, pooled, cu_seqlens_comp, position_offset, ratio, params.norm_weight,
        params.eps, params.cos, params.sin, params.rope_dim, params.rotate)
    if grads is not None:
        return grads
    return reference_epilogue.training_rows_backward(grad_out, pooled, cu_seqlens_comp,
                                                     position_offset, ratio, params)


# What the forward keeps for the backward: its inputs, never rows.
_SAVED = ("kv", "score", "ape", "cu_seqlens", "cu_seqlens_comp", "norm_weight", "cos", "sin",
          "position_offset")


class _EpilogueFunction(torch.autograd.Function):
    """csa::compressor_epilogue where autograd records it; its backward op is the backward."""

    @staticmethod
    def forward(ctx, keyset, *args):
        out = dispatch.below_autograd(torch.ops.csa.compressor_epilogue.default,
                                      _compressor_epilogue, keyset, args)
        named = dict(zip(FORWARD_ARGS, args))
        ctx.save_for_backward(*(named[name] for name in _SAVED))
        ctx.scalars = {name: named[name] for name in ("ratio", "coff", "eps", "rope_dim",
                                                      "rotate")}
        return out

    @staticmethod
    def backward(ctx, grad_out):
        named = {**dict(zip(_SAVED, ctx.saved_tensors)), **ctx.scalars}
        grads = torch.ops.csa.compressor_epilogue_backward.default(
            grad_out.contiguous(), *(named[name] for name in FORWARD_ARGS[:-1]))
        by_name = dict(zip(("kv", "score", "ape", "norm_weight"), grads))
        return None, *(by_name.get(name) for name in FORWARD_ARGS)  # None: the keyset


_BackwardFunction = dispatch.once_differentiable("compressor_epilogue_backward",
                                                 _compressor_epilogue_backward)


def _differentiable(args, names) -> list:
    named = dict(zip(names, args))
    return [named[name] for name in ("grad_out", "kv", "score", "ape", "norm_weight")
            if name in named]


def _epilogue_autograd(keyset, *args):
    if dispatch.wants_grad(*_differentiable(args, FORWARD_ARGS)):
        return _EpilogueFunction.apply(keyset, *args)
    return dispatch.below_autograd(torch.ops.csa.compressor_epilogue.default,
                                   _compressor_epilogue, keyset, args)


def _epilogue_backward_autograd(keyset, *args):
    if dispatch.wants_grad(*_differentiable(args, ("grad_out", *FORWARD_ARGS[:-1]))):
        return _BackwardFunction.apply(keyset, *args)
    return dispatch.below_autograd(torch.ops.csa.compressor_epilogue_backward.default,
                                   _compressor_epilogue_backward, keyset, args)


# CompositeExplicitAutograd: the composition serves every device (on CUDA it calls the
# pooling kernels through csa::compressor and csa::compressor_backward).
_LIB.impl("compressor_epilogue", _compressor_epilogue, "CompositeExplicitAutograd")
_LIB.impl("compressor_epilogue", _epilogue_autograd, "Autograd", with_keyset=True)
_LIB.impl("compressor_epilogue_backward", _compressor_epilogue_backward,
          "CompositeExplicitAutograd")
_LIB.impl("compressor_epilogue_backward", _epilogue_backward_autograd, "Autograd",
          with_keyset=True)


def compressor_epilogue(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor,
                        cu_seqlens: torch.Tensor, cu_seqlens_comp: torch.Tensor, *, ratio: int,
                        coff: int, norm_weight: torch.Tensor, eps: float = 1e-6,
                        cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                        rope_dim: int = 0, position_offset: torch.Tensor | None = None,
                        rotate: bool = False, total_comp: int | None = None) -> torch.Tensor:
    """``csa_ops.compressor``'s rows, then per row: RMSNorm, RoPE, optional rotation.

    Pooling is exactly ``csa::compressor`` (same arguments, same rows). Then per row ``y``
    (rounded to kv's dtype), each step in fp32 (fp64 for fp64 kv) and rounded to kv's
    dtype: ``y * rsqrt(mean(y^2) + eps) * norm_weight`` (``(d,)`` fp32/bf16/fp16); GPT-J
    RoPE on the last ``rope_dim`` columns (0: none, ``cos``/``sin`` unread), pairs
    ``(x[2i], x[2i+1])`` turned by ``cos``/``sin`` ``(max_position, rope_dim // 2)`` fp32
    at the row's position ``b * ratio + position_offset[s]`` (row b of sequence s; int32
    ``(B,)``, None = 0); ``rotate``: a Walsh-Hadamard transform over all d columns (d a
    power of two) times ``d ** -0.5``. Padding rows are exact zeros. Positions outside the
    tables are an error on CPU; on CUDA they are not checked and read the nearest table row.

    Differentiable in kv, score, ape and norm_weight (``grad_weight`` in its dtype). The
    backward recomputes the pooled rows, goes back through rotation, RoPE and norm in fp32
    (gradients rounded to kv's dtype where the forward rounds) and then through
    ``csa::compressor_backward``. Numerics: the composition in torch on every device (the
    comparator), on CUDA with the pooling kernels' rows; everything is bitwise run-to-run
    deterministic, reductions in a fixed order, no float atomics.
    """
    return torch.ops.csa.compressor_epilogue.default(
        kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, norm_weight, eps, cos, sin,
        rope_dim, position_offset, rotate, total_comp)
