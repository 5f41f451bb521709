"""Fake (meta) kernels of csa::compressor_epilogue, its backward and
csa::compressor_extend_store.

They validate like the real kernels and allocate through ``csa_ops.shapes``, so shapes,
dtypes and (contiguous) strides match the real outputs. The store op writes its state and
cache in place (Tensor(a!), (b!), (c!)), which leaves their metadata unchanged.
"""

from __future__ import annotations

import torch

from csa_ops import epilogue, serving_store, shapes

from ._lowering import register_lowering


@torch.library.register_fake("csa::compressor_epilogue")
def compressor_epilogue_fake(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff,
                             norm_weight, eps, cos, sin, rope_dim, position_offset, rotate,
                             total_comp=None):
    register_lowering()  # its "generate" decomposition
    epilogue.check_arguments(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff,
                             norm_weight, eps, cos, sin, rope_dim, position_offset, rotate,
                             total_comp)
    # None: the row count is cu_seqlens_comp[-1], known only from the data.
    rows = total_comp if total_comp is not None else torch.library.get_ctx().new_dynamic_size()
    return shapes.empty_forward(kv, coff, rows)


@torch.library.register_fake("csa::compressor_epilogue_backward")
def compressor_epilogue_backward_fake(grad_out, kv, score, ape, cu_seqlens, cu_seqlens_comp,
                                      ratio, coff, norm_weight, eps, cos, sin, rope_dim,
                                      position_offset, rotate):
    register_lowering()
    epilogue.check_backward_arguments(grad_out, kv, score, ape, cu_seqlens, cu_seqlens_comp,
                                      ratio, coff, norm_weight, eps, cos, sin, rope_dim,
                                      position_offset, rotate)
    grad_weight = torch.empty(norm_weight.shape, dtype=norm_weight.dtype,
                              device=norm_weight.device)
    return (*shapes.empty_backward(kv, score, ape), grad_weight)


@torch.library.register_fake("csa::compressor_extend_store")
def compressor_extend_store_fake(kv, score, ape, cu_seqlens, start_pos, slots, kv_state,
                                 score_state, norm_weight, eps, cos, sin, rope_dim, rotate,
                                 cache_format, cache, block_table, page_size, ratio, coff):
    serving_store.check_arguments(kv, score, ape, cu_seqlens, start_pos, slots, kv_state,
                                  score_state, norm_weight, eps, cos, sin, rope_dim, rotate,
                                  cache_format, cache, block_table, page_size, ratio, coff)
    return cu_seqlens.new_empty(cu_seqlens.shape)
