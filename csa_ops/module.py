"""A DeepSeek-V4-style Compressor block built on the op: linears, gated pooling, RMSNorm."""

from __future__ import annotations

import torch
from torch import nn

from .ops import compressor
from .serving import CompressorState


class Compressor(nn.Module):
    """``wkv``/``wgate`` project tokens to ``coff*head_dim`` features, the op pools every
    ``ratio`` tokens into one row, an RMSNorm over ``head_dim`` normalizes the rows."""

    def __init__(self, dim: int, head_dim: int, ratio: int, coff: int, eps: float = 1e-6,
                 device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.ratio, self.coff, self.head_dim = ratio, coff, head_dim
        self.wkv = nn.Linear(dim, coff * head_dim, bias=False, **factory)
        self.wgate = nn.Linear(dim, coff * head_dim, bias=False, **factory)
        # The position embedding of the gate logits starts fp32 whatever the factory dtype (as
        # in the official model); a later model.to(dtype) may convert it: the op takes any.
        self.ape = nn.Parameter(torch.empty(ratio, coff * head_dim, device=device,
                                            dtype=torch.float32))
        self.norm = nn.RMSNorm(head_dim, eps=eps, **factory)
        nn.init.normal_(self.ape, std=0.02)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_comp: torch.Tensor,
                total_comp: int | None = None) -> torch.Tensor:
        pooled = compressor(self.wkv(x), self.wgate(x), self.ape, cu_seqlens, cu_seqlens_comp,
                            ratio=self.ratio, coff=self.coff, total_comp=total_comp)
        return self.norm(pooled)

    @torch.no_grad()
    def extend(self, x: torch.Tensor, cu_seqlens: torch.Tensor, start_pos: torch.Tensor,
               slots: torch.Tensor, state: CompressorState, total_comp: int | None = None):
        """Inference over new tokens ``x`` (THD-packed) continuing each request's ``state``
        slot (see ``csa_ops.compressor_extend``): ``(normalized rows, cu_seqlens_comp)``."""
        pooled, cu_seqlens_comp = state.extend(self.wkv(x), self.wgate(x), self.ape,
                                               cu_seqlens, start_pos, slots, total_comp)
        return self.norm(pooled), cu_seqlens_comp


def offsets_for(lengths, ratio: int, device=None):
    """(cu_seqlens, cu_seqlens_comp) int32 for a pack of segment lengths."""
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    zero = torch.zeros(1, dtype=torch.int64)
    cu = torch.cat([zero, lengths.cumsum(0)])
    cuc = torch.cat([zero, (lengths // ratio).cumsum(0)])
    return cu.to(device=device, dtype=torch.int32), cuc.to(device=device, dtype=torch.int32)
