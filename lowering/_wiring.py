"""Registers the Inductor lowerings of csa::compressor / csa::compressor_backward, and the
decompositions of the epilogue ops (csa::compressor_epilogue and its backward) under the
"generate" mode.

Each lowering asks ``policy.choose`` and either emits the generated IR (``_generate``) or
calls the opaque op as an extern kernel. ``total_comp=None`` (a data-dependent row count)
is turned into ``cu_seqlens_comp[-1].item()`` plus a static-capacity call by a
decomposition, because an Inductor Pointwise cannot define an unbacked size.
"""

from __future__ import annotations

import logging

import sympy
import torch
from torch._inductor import decomposition as inductor_decomp
from torch._inductor.lowering import fallback_handler, lowerings, register_lowering
from torch._inductor.virtualized import V

from csa_ops import reference_epilogue
from csa_ops.config import CAPACITY_MESSAGE

from . import _generate, policy

FWD = torch.ops.csa.compressor.default
BWD = torch.ops.csa.compressor_backward.default
EPILOGUE = torch.ops.csa.compressor_epilogue.default
EPILOGUE_BWD = torch.ops.csa.compressor_epilogue_backward.default
aten = torch.ops.aten
log = logging.getLogger(__name__)


def _static(value) -> int:
    return V.graph.sizevars.guard_int(value)


def _extern(op, *args):
    return fallback_handler(op, add_to_fallback_set=False)(*args)


def _head_dim_fn(kv, coff):
    return lambda: _static(kv.get_size()[1]) // coff


def _static_tokens(size) -> int | None:
    """The token count when it is a compile-time constant, else None; never adds a guard.
    size: an Inductor IR size (sympy) or a traced tensor's (int or SymInt)."""
    return int(size) if isinstance(size, (int, sympy.Integer)) else None


def _generate_or_fall_back(op, build, args):
    """Under "auto" a failure to build the IR (an Inductor internal that changed) falls back
    to the extern call; a forced "generate" surfaces it."""
    if policy.get_mode() != "auto":
        return build()
    try:
        return build()
    except Exception as error:  # noqa: BLE001  (any internal failure: the op still runs)
        log.warning("csa_ops.lowering: generating %s failed (%s); calling the op instead",
                    op, error)
        return _extern(op, *args)


def _assert_rows_fit(cuc, rows) -> None:
    """The op's row-capacity assertion in generated code, as the kernels make it: a
    device-side assert of cu_seqlens_comp[-1] <= rows (Inductor's own, no host sync)."""
    last = lowerings[aten.select.int](cuc, 0, -1)
    _extern(aten._assert_async.msg, lowerings[aten.le.Scalar](last, rows), CAPACITY_MESSAGE)


# The assertion goes after the generated IR: before it, the extern call would sit between
# the op's producers and the op, splitting kernels Inductor fuses (the generated code keeps
# every access in bounds whatever the offsets, so running first is safe).
def _generate_forward(kv, score, ape, cu, cuc, ratio, coff, total_comp):
    out = _generate.forward(_generate.make_problem(kv, score, ape, cu, cuc, ratio, coff),
                            total_comp)
    _assert_rows_fit(cuc, total_comp)
    return out


def _generate_backward(grad_out, kv, score, ape, cu, cuc, ratio, coff):
    grads = _generate.backward(_generate.make_problem(kv, score, ape, cu, cuc, ratio, coff),
                               grad_out)
    for grad in grads:
        grad.realize()
    _assert_rows_fit(cuc, grad_out.get_size()[0])
    return grads


def _lower_forward(kv, score, ape, cu, cuc, ratio, coff, total_comp=None):
    ratio, coff = _static(ratio), _static(coff)
    args = (kv, score, ape, cu, cuc, ratio, coff, total_comp)
    path = policy.choose("fwd", kv.get_device(), kv.get_dtype(), ratio, coff,
                         _head_dim_fn(kv, coff), _static_tokens(kv.get_size()[0]))
    if path == "extern" or total_comp is None:
        return _extern(FWD, *args)
    return _generate_or_fall_back(FWD, lambda: _generate_forward(*args), args)


def _lower_backward(grad_out, kv, score, ape, cu, cuc, ratio, coff):
    ratio, coff = _static(ratio), _static(coff)
    args = (grad_out, kv, score, ape, cu, cuc, ratio, coff)
    path = policy.choose("bwd", kv.get_device(), kv.get_dtype(), ratio, coff,
                         _head_dim_fn(kv, coff))
    if path == "extern":
        return _extern(BWD, *args)
    return _generate_or_fall_back(BWD, lambda: _generate_backward(*args), args)


def _decompose_data_dependent(kv, score, ape, cu, cuc, ratio, coff, total_comp=None):
    if total_comp is not None:
        return NotImplemented
    def head_dim():  # int() specialises a symbolic width: asked only when the answer needs it
        return int(kv.shape[1]) // coff

    tokens = _static_tokens(kv.shape[0])
    if policy.choose("fwd", kv.device, kv.dtype, ratio, coff, head_dim, tokens) == "extern":
        return NotImplemented
    rows = cuc[-1].item()
    torch._check(rows >= 0)
    return FWD(kv, score, ape, cu, cuc, ratio, coff, rows)


# The epilogue ops under "generate": their composition (csa::compressor's rows, then the
# norm, RoPE and rotation as torch ops; the backward recomputes the rows), so that Inductor
# generates the pooling and fuses the epilogue into it. Elsewhere they stay opaque: compiled
# code then runs the op's own implementation and gives eager's bits.
def _epilogue_generates(kv) -> bool:
    """"generate", for rows whose roundings Inductor keeps: fp32 and fp64 rows, or 16-bit
    ones under torch._inductor.config.emulate_precision_casts. Without it Inductor drops the
    rounding to bf16/fp16 between the epilogue's steps inside a fused kernel (bf16 rows came
    out up to 73 steps off eager on the CPU), so 16-bit rows keep the opaque op."""
    if policy.get_mode() != "generate":
        return False
    return (kv.dtype in (torch.float32, torch.float64)
            or bool(torch._inductor.config.emulate_precision_casts))


def _decompose_epilogue(kv, score, ape, cu, cuc, ratio, coff, norm_weight, eps, cos, sin,
                        rope_dim, position_offset, rotate, total_comp=None):
    if not _epilogue_generates(kv):
        return NotImplemented
    params = reference_epilogue.EpilogueParams(norm_weight, eps, cos, sin, rope_dim, rotate)
    return reference_epilogue.compressor_epilogue_reference(
        kv, score, ape, cu, cuc, ratio, coff, params, position_offset, total_comp)


def _decompose_epilogue_backward(grad_out, kv, score, ape, cu, cuc, ratio, coff, norm_weight,
                                 eps, cos, sin, rope_dim, position_offset, rotate):
    if not _epilogue_generates(kv):
        return NotImplemented
    params = reference_epilogue.EpilogueParams(norm_weight, eps, cos, sin, rope_dim, rotate)
    return reference_epilogue.compressor_epilogue_backward_reference(
        grad_out, kv, score, ape, cu, cuc, ratio, coff, params, position_offset)


def register() -> None:
    register_lowering(FWD, type_promotion_kind=None)(_lower_forward)
    register_lowering(BWD, type_promotion_kind=None)(_lower_backward)
    inductor_decomp.register_decomposition(FWD)(_decompose_data_dependent)
    for op, decompose in ((EPILOGUE, _decompose_epilogue),
                          (EPILOGUE_BWD, _decompose_epilogue_backward)):
        inductor_decomp.register_decomposition(op)(decompose)
        # Where the decomposition declines: the opaque op (Inductor refuses an implicit
        # fallback for an op with a decomposition).
        register_lowering(op, type_promotion_kind=None)(
            lambda *args, op=op: _extern(op, *args))
