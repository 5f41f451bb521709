"""torch.library registration of csa::compressor and csa::compressor_backward.

Both ops are functional (outputs allocated inside). CUDA runs the CuTe-DSL kernels where
``csa_ops.host`` supports the configuration; every other device and configuration runs
``csa_ops.reference``. Fakes live in ``csa_ops.meta``; autograd is registered here.

The ops are defined with ``torch.library.Library`` and their kernels registered per dispatch
key, not through ``torch.library.custom_op``: custom_op wraps every call of a kernel in
Python layers (a dynamo-disable wrapper, an output-aliasing check) that cost about 20 us
per call on the H200's host, as much as the whole launch path. For the same reason autograd
is an autograd.Function registered at the Autograd key (csa_ops.dispatch), not
``torch.library.register_autograd``, whose wrapper costs another ~7 us per call. The public
surface is the same: schemas, tags, fakes (``torch.library.register_fake``), autograd,
opcheck.
"""

from __future__ import annotations

import torch

from . import dispatch, reference, validation

FORWARD_SCHEMA = (
    "(Tensor kv, Tensor score, Tensor ape, Tensor cu_seqlens, Tensor cu_seqlens_comp, "
    "int ratio, int coff, SymInt? total_comp=None) -> Tensor"
)
BACKWARD_SCHEMA = (
    "(Tensor grad_out, Tensor kv, Tensor score, Tensor ape, Tensor cu_seqlens, "
    "Tensor cu_seqlens_comp, int ratio, int coff) -> (Tensor, Tensor, Tensor)"
)
# The kernels index row-major memory; Inductor must hand them contiguous buffers. The ops
# pass opcheck (schema, fake, autograd registration, AOT dispatch): they are pt2-compliant.
_TAGS = (torch.Tag.needs_contiguous_strides, torch.Tag.pt2_compliant_tag)


def _contiguous(*tensors):
    return tuple(t.contiguous() for t in tensors)


_LIB = torch.library.Library("csa", "DEF")  # see the module docstring: not custom_op
_LIB.define("compressor" + FORWARD_SCHEMA, tags=_TAGS)
_LIB.define("compressor_backward" + BACKWARD_SCHEMA, tags=_TAGS)


def _compressor(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp=None):
    validation.check_arguments(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp)
    kv, score, ape = _contiguous(kv, score, ape)
    if kv.device.type == "cpu":
        validation.check_offsets(cu_seqlens, cu_seqlens_comp, kv.shape[0], ratio, total_comp)
    return reference.compressor_reference(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff,
                                          total_comp)


def _register_native_kernels(module, table) -> None:
    """With the first native prepared call (csa_ops.native), the ops get C++ kernels at the
    AutogradCUDA key: a repeated call on plain CUDA tensors that wants no gradient runs its
    prepared call from the table without entering Python; every other call reaches the
    Python Autograd kernels below, as before."""
    module.register_autograd_kernels(table, "CUDA", [
        ("compressor", _compressor_autograd),
        ("compressor_backward", _compressor_backward_autograd)])


# Metadata signature of a CUDA call -> its prepared call (host.prepare, or the reference when
# no kernel runs it); see dispatch.signature.
_PREPARED = dispatch.PreparedCalls(on_table=_register_native_kernels)


def _prepare_cuda(signature, direction, tensors, ratio, coff, total_comp, check):
    check()
    call = dispatch.launch_path(_PREPARED).prepare(direction, tensors, ratio, coff, total_comp)
    scalars = (ratio, coff) if direction == "bwd" else (ratio, coff, total_comp)
    if call is None:
        run = (reference.compressor_backward_reference if direction == "bwd"
               else reference.compressor_reference)

        rows = tensors[0].shape[0] if direction == "bwd" else total_comp

        def call(*args):
            dispatch.assert_rows_fit(args[-1], rows)  # args[-1]: cu_seqlens_comp
            return run(*_contiguous(*args), *scalars)

    return _PREPARED.remember(signature, call, (*tensors, *scalars), len(tensors))


def _compressor_cuda(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp=None):
    if _PREPARED.table is not None and total_comp is not None:
        out = _PREPARED.table(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff,
                              total_comp)
        if out is not None:
            return out
    args = (kv, score, ape, cu_seqlens, cu_seqlens_comp)
    if total_comp is None:
        # The documented host sync of the None form (validation first: cuc may be anything).
        validation.check_arguments(*args, ratio, coff)
        total_comp = int(cu_seqlens_comp[-1])
    signature = dispatch.signature(args, ratio, coff, total_comp)
    call = _PREPARED.get(signature) or _prepare_cuda(
        signature, "fwd", args, ratio, coff, total_comp,
        lambda: validation.check_arguments(*args, ratio, coff, total_comp))
    return call(*args)


def _compressor_backward(grad_out, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff):
    validation.check_backward_arguments(grad_out, kv, score, ape, cu_seqlens, cu_seqlens_comp,
                                        ratio, coff)
    grad_out, kv, score, ape = _contiguous(grad_out, kv, score, ape)
    if kv.device.type == "cpu":
        with validation.checking(validation.BACKWARD_OP):
            validation.check_offsets(cu_seqlens, cu_seqlens_comp, kv.shape[0], ratio,
                                     grad_out.shape[0], rows_name="`grad_out` row count")
    return reference.compressor_backward_reference(grad_out, kv, score, ape, cu_seqlens,
                                                   cu_seqlens_comp, ratio, coff)


def _compressor_backward_cuda(grad_out, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff):
    if _PREPARED.table is not None:
        grads = _PREPARED.table(grad_out, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio,
                                coff)
        if grads is not None:
            return grads
    args = (grad_out, kv, score, ape, cu_seqlens, cu_seqlens_comp)
    signature = dispatch.signature(args, ratio, coff)
    call = _PREPARED.get(signature) or _prepare_cuda(
        signature, "bwd", args, ratio, coff, None,
        lambda: validation.check_backward_arguments(*args, ratio, coff))
    return call(*args)


class _CompressorFunction(torch.autograd.Function):
    """csa::compressor where autograd records it; csa::compressor_backward is its backward."""

    @staticmethod
    def forward(ctx, keyset, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff,
                total_comp=None):
        out = dispatch.below_autograd(
            torch.ops.csa.compressor.default, _compressor_cuda, keyset,
            (kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp))
        ctx.save_for_backward(kv, score, ape, cu_seqlens, cu_seqlens_comp)
        ctx.ratio, ctx.coff = ratio, coff
        return out

    @staticmethod
    def backward(ctx, grad_out):
        kv, score, ape, cu_seqlens, cu_seqlens_comp = ctx.saved_tensors
        grads = torch.ops.csa.compressor_backward.default(
            grad_out.contiguous(), kv, score, ape, cu_seqlens, cu_seqlens_comp, ctx.ratio,
            ctx.coff)
        # keyset, then kv, score, ape; the offsets, ratio, coff and total_comp get none.
        return None, *grads, None, None, None, None, None


_BackwardFunction = dispatch.once_differentiable("compressor_backward", _compressor_backward_cuda)


# The Autograd-key kernels (see csa_ops.dispatch): an autograd.Function where a gradient is
# wanted, else the kernel below autograd without a second trip through the dispatcher.
def _compressor_autograd(keyset, kv, score, ape, *rest):
    if dispatch.wants_grad(kv, score, ape):
        return _CompressorFunction.apply(keyset, kv, score, ape, *rest)
    return dispatch.below_autograd(torch.ops.csa.compressor.default, _compressor_cuda, keyset,
                                   (kv, score, ape, *rest))


def _compressor_backward_autograd(keyset, grad_out, kv, score, ape, *rest):
    if dispatch.wants_grad(grad_out, kv, score, ape):
        return _BackwardFunction.apply(keyset, grad_out, kv, score, ape, *rest)
    return dispatch.below_autograd(torch.ops.csa.compressor_backward.default,
                                   _compressor_backward_cuda, keyset,
                                   (grad_out, kv, score, ape, *rest))


# CompositeExplicitAutograd: the reference serves every device without its own kernel.
_LIB.impl("compressor", _compressor, "CompositeExplicitAutograd")
_LIB.impl("compressor", _compressor_cuda, "CUDA")
_LIB.impl("compressor", _compressor_autograd, "Autograd", with_keyset=True)
_LIB.impl("compressor_backward", _compressor_backward, "CompositeExplicitAutograd")
_LIB.impl("compressor_backward", _compressor_backward_cuda, "CUDA")
_LIB.impl("compressor_backward", _compressor_backward_autograd, "Autograd", with_keyset=True)


def compressor(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor,
               cu_seqlens: torch.Tensor, cu_seqlens_comp: torch.Tensor, *, ratio: int, coff: int,
               total_comp: int | None = None) -> torch.Tensor:
    """Pool every ``ratio`` tokens of each packed sequence into one row with a gated softmax.

    Inputs are THD-packed: ``kv`` and ``score`` are ``(T, coff*d)``, ``ape`` is
    ``(ratio, coff*d)`` in any float dtype (float64 only with float64 ``kv``; it is added in
    fp32 and ``grad_ape`` comes back in its dtype), ``cu_seqlens``/``cu_seqlens_comp`` are the
    int32 cumulative token and row counts (``cuc[s+1]-cuc[s] == (cu[s+1]-cu[s]) // ratio``).
    Row ``n`` of segment ``s``, block ``b = n - cuc[s]``, first token ``t0 = cu[s] + b*ratio``:

    * ``coff=1``: softmax over ``k < ratio`` of ``score[t0+k, j] + ape[k, j]`` weights
      ``kv[t0+k, j]``.
    * ``coff=2``: a ``2*ratio`` window; entries ``k < ratio`` read the previous block's
      tokens in the first ``d`` columns (``-inf`` logit and zero value when ``b == 0``),
      entries ``k >= ratio`` the own block's tokens in the second ``d`` columns.

    Tail tokens (``len % ratio``) are dropped. ``total_comp=None`` returns exactly
    ``cuc[-1]`` rows (a host sync on CUDA; an unbacked size under torch.compile); an int is a
    static capacity that never synchronizes: rows past ``cuc[-1]`` are exact zeros.

    Numerics: fp32 intermediates (fp64 for fp64 inputs), one final rounding to kv's dtype.
    The comparator is torch's eager autograd of the formula on the same device (the "eager
    region": windows gathered to ``(rows, W, d)`` fp32, ``softmax(dim=1)``, weighted sum).
    CUDA, windows up to 32 (the register-window kernels): ``grad_kv``/``grad_score``
    bit-identical to it; forward bit-identical for fp16/fp32, and for bf16 (a fast softmax
    whose error bound is checked per output column, the exact one as its fallback) within
    one rounding step everywhere and bit-identical on at least 99.99% of elements. Larger
    windows (streaming kernels): the forward within one rounding step everywhere (the same
    certificate, with torch's own CUDA order as the fallback: kernels/shared/torch_order.py), the
    gradients within one step plus fp32 summation error, all at least as close to an fp64
    oracle. CPU: ``csa_ops.reference``, torch's CPU order.
    ``grad_ape`` is within 1e-3, reduced in a fixed order without atomics. All outputs are
    bitwise run-to-run deterministic, so the op runs under
    ``torch.use_deterministic_algorithms(True)``.
    """
    # The overload itself: the packet's per-call overload resolution costs microseconds.
    return torch.ops.csa.compressor.default(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio,
                                            coff, total_comp)
