"""Fake (meta) kernel of csa::compressor_extend.

It validates like the real kernel and allocates the two outputs; the state tensors are
mutated in place by the real kernel (Tensor(a!), Tensor(b!)), which leaves nothing for a
fake to do to their metadata.
"""

from __future__ import annotations

import torch

from csa_ops import serving, shapes


@torch.library.register_fake("csa::compressor_extend")
def compressor_extend_fake(kv, score, ape, cu_seqlens, start_pos, slots, kv_state, score_state,
                           ratio, coff, total_comp=None):
    serving.check_arguments(kv, score, ape, cu_seqlens, start_pos, slots, kv_state, score_state,
                            ratio, coff, total_comp)
    # None: the row count follows from start_pos and cu_seqlens, known only from the data.
    rows = total_comp if total_comp is not None else torch.library.get_ctx().new_dynamic_size()
    return shapes.empty_forward(kv, coff, rows), cu_seqlens.new_empty(cu_seqlens.shape)
