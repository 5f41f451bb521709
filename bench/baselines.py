"""What users run today: a Megatron/DeepSeek-style eager compressor over THD-packed tokens.

Deliberately written the way a model file would (gather each block's tokens, add the
position embedding, overlap transform for coff=2, fp32 ``torch.softmax``, weighted sum) and
differentiated by autograd. It is a baseline to time, not a comparator: correctness is
judged against ``csa_ops.reference``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _block_starts(cu_seqlens, cu_seqlens_comp, total_comp: int, ratio: int):
    """First token and block index of every output row; rows past cuc[-1] are padding."""
    cu = cu_seqlens.long()
    cuc = cu_seqlens_comp.long()
    rows = torch.arange(total_comp, device=cu.device)
    # Segment = how many segment ends lie at or before the row. A comparison count, not
    # searchsorted: torch 2.11's CUDA Inductor cannot lower searchsorted over a sliced tensor.
    seg = (rows[:, None] >= cuc[None, 1:]).sum(dim=1).clamp(max=max(cu.numel() - 2, 0))
    block = rows - cuc[seg]
    return cu[seg] + block * ratio, block, rows < cuc[-1]


def _overlap_transform(kv_blocks, score_blocks, first_block, head_dim: int):
    """coff=2: window = previous block's first-half columns ++ own block's second half.

    A segment's first block has no previous block: its first ``ratio`` entries get a
    ``-inf`` logit and a zero value, as in DeepSeek-V4's ``overlap_transform``.
    """
    prev_kv = kv_blocks[:, :, :head_dim].roll(1, dims=0)
    prev_score = score_blocks[:, :, :head_dim].roll(1, dims=0)
    first = first_block[:, None, None]
    prev_kv = prev_kv.masked_fill(first, 0.0)
    prev_score = prev_score.masked_fill(first, float("-inf"))
    kv_win = torch.cat([prev_kv, kv_blocks[:, :, head_dim:]], dim=1)
    score_win = torch.cat([prev_score, score_blocks[:, :, head_dim:]], dim=1)
    return kv_win, score_win


def compressor_eager(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio: int, coff: int,
                     total_comp: int) -> torch.Tensor:
    """(total_comp, d) in kv's dtype; same contract as ``csa::compressor`` with an int capacity."""
    num_tokens, width = kv.shape
    head_dim = width // coff
    t0, block, valid = _block_starts(cu_seqlens, cu_seqlens_comp, total_comp, ratio)
    token = t0[:, None] + torch.arange(ratio, device=kv.device)
    token = token.clamp(max=max(num_tokens - 1, 0))  # padding rows read a real token, masked
    kv_blocks = kv[token]                                  # (N, ratio, coff*d) gather
    score_blocks = score[token].float() + ape              # fp32 logits + position embedding
    if coff == 2:
        kv_blocks, score_blocks = _overlap_transform(kv_blocks, score_blocks, block == 0, head_dim)
    probs = torch.softmax(score_blocks, dim=1)             # fp32 softmax over the window
    out = (kv_blocks.float() * probs).sum(dim=1)
    return torch.where(valid[:, None], out, 0.0).to(kv.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The RMSNorm that follows the compressor in the model block (fusion target)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)
