"""Fake (meta) kernels of csa::compressor and csa::compressor_backward.

They validate exactly like the real kernels and allocate through ``csa_ops.shapes``, so
shapes, dtypes and (contiguous) strides match the real outputs.
"""

from __future__ import annotations

import torch

from csa_ops import shapes, validation

from . import epilogue, serving  # noqa: F401  (the fakes of the epilogue and serving ops)
from ._lowering import register_lowering


@torch.library.register_fake("csa::compressor")
def compressor_fake(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp=None):
    register_lowering()
    validation.check_arguments(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp)
    # None: the row count is cu_seqlens_comp[-1], known only from the data.
    rows = total_comp if total_comp is not None else torch.library.get_ctx().new_dynamic_size()
    return shapes.empty_forward(kv, coff, rows)


@torch.library.register_fake("csa::compressor_backward")
def compressor_backward_fake(grad_out, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff):
    register_lowering()
    validation.check_backward_arguments(grad_out, kv, score, ape, cu_seqlens, cu_seqlens_comp,
                                        ratio, coff)
    return shapes.empty_backward(kv, score, ape)
