"""What inference code runs today for the compressor's decode step: a dozen small torch ops.

Written from the serving state's layout the way DeepSeek-V4's inference code writes it
(write the token and its logit into the slot, pool the window when the token completes a
block, shift the block for coff 2), with per-request positions and no data-dependent
control flow, so it can be captured in a CUDA graph and compiled with ``fullgraph=True``. A
baseline to time, not a comparator: rows are checked against ``csa::compressor_extend``.
"""

from __future__ import annotations

import torch


def _window(state: torch.Tensor, ratio: int, coff: int, head_dim: int) -> torch.Tensor:
    """coff 2: the previous block's first-half columns ++ the current block's second half."""
    if coff == 1:
        return state
    return torch.cat([state[:, :ratio, :head_dim], state[:, ratio:, head_dim:]], dim=1)


def decode_step_eager(kv, score, ape, start_pos, slots, kv_state, score_state, ratio: int,
                      coff: int) -> torch.Tensor:
    """One new token per request: ``(B, d)`` rows, zeros for requests whose block is still
    open (not packed: row i belongs to request i). Mutates the state in place."""
    head_dim = kv.shape[1] // coff
    slot = slots.long()
    k = start_pos.long() % ratio
    entry = k + (coff - 1) * ratio
    kv_state[slot, entry] = kv
    score_state[slot, entry] = score.float() + ape.float()[k]
    kv_win = _window(kv_state[slot], ratio, coff, head_dim)
    score_win = _window(score_state[slot], ratio, coff, head_dim)
    done = (k == ratio - 1)[:, None]
    out = (kv_win.float() * score_win.softmax(dim=1)).sum(dim=1)
    if coff == 2:
        shift = done[:, :, None]
        kv_state[slot, :ratio] = torch.where(shift, kv_state[slot, ratio:], kv_state[slot, :ratio])
        score_state[slot, :ratio] = torch.where(shift, score_state[slot, ratio:],
                                                score_state[slot, :ratio])
    return torch.where(done, out, 0.0).to(kv.dtype)
