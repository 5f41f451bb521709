"""A DeepSeek-V4-style Compressor block built on the op: linears, gated pooling, RMSNorm,
and with RoPE tables RoPE on the last columns (the indexer's compressor also rotates)."""

from __future__ import annotations

import torch
from torch import nn

from .epilogue import compressor_epilogue
from .ops import compressor
from .serving import CompressorState
from .serving_store import compressor_extend_store


class Compressor(nn.Module):
    """``wkv``/``wgate`` project tokens to ``coff*head_dim`` features, the op pools every
    ``ratio`` tokens into one row, an RMSNorm over ``head_dim`` normalizes the rows.

    With ``rope_dim`` > 0 (the model's: 64) the forward takes RoPE tables ``cos``/``sin``
    (``(max_position, rope_dim // 2)`` fp32) and turns the last ``rope_dim`` columns of
    each row at its block's first position (plus ``position_offset`` per sequence);
    ``rotate`` adds the indexer's Hadamard rotation. Those forwards run the fused op
    ``csa::compressor_epilogue`` (``csa_ops.epilogue.compressor_epilogue``), the others the op
    and ``nn.RMSNorm``."""

    def __init__(self, dim: int, head_dim: int, ratio: int, coff: int, eps: float = 1e-6,
                 device=None, dtype=None, rope_dim: int = 0, rotate: bool = False):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.ratio, self.coff, self.head_dim = ratio, coff, head_dim
        self.rope_dim, self.rotate = rope_dim, rotate
        self.wkv = nn.Linear(dim, coff * head_dim, bias=False, **factory)
        self.wgate = nn.Linear(dim, coff * head_dim, bias=False, **factory)
        # The position embedding of the gate logits starts fp32 whatever the factory dtype (as
        # in the official model); a later model.to(dtype) may convert it: the op takes any.
        self.ape = nn.Parameter(torch.empty(ratio, coff * head_dim, device=device,
                                            dtype=torch.float32))
        self.norm = nn.RMSNorm(head_dim, eps=eps, **factory)
        nn.init.normal_(self.ape, std=0.02)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_comp: torch.Tensor,
                total_comp: int | None = None, cos: torch.Tensor | None = None,
                sin: torch.Tensor | None = None,
                position_offset: torch.Tensor | None = None) -> torch.Tensor:
        kv, score = self.wkv(x), self.wgate(x)
        if self.rope_dim == 0 and not self.rotate:
            if cos is not None or sin is not None or position_offset is not None:
                raise ValueError("Compressor: `cos`, `sin` and `position_offset` need a block "
                                 "built with rope_dim > 0")
            pooled = compressor(kv, score, self.ape, cu_seqlens, cu_seqlens_comp,
                                ratio=self.ratio, coff=self.coff, total_comp=total_comp)
            return self.norm(pooled)
        return compressor_epilogue(
            kv, score, self.ape, cu_seqlens, cu_seqlens_comp, ratio=self.ratio, coff=self.coff,
            norm_weight=self.norm.weight, eps=self.norm.eps, cos=cos, sin=sin,
            rope_dim=self.rope_dim, position_offset=position_offset, rotate=self.rotate,
            total_comp=total_comp)

    @torch.no_grad()
    def extend(self, x: torch.Tensor, cu_seqlens: torch.Tensor, start_pos: torch.Tensor,
               slots: torch.Tensor, state: CompressorState, total_comp: int | None = None, *,
               cache: torch.Tensor | None = None, cache_format: str = "none",
               block_table: torch.Tensor | None = None, page_size: int | None = None,
               cos: torch.Tensor | None = None, sin: torch.Tensor | None = None):
        """Inference over new tokens ``x`` (THD-packed) continuing each request's ``state``
        slot (see ``csa_ops.compressor_extend``).

        Without ``cache``: ``(rows, cu_seqlens_comp)``, the rows RMS-normalized (no RoPE).
        With a paged ``cache`` of ``cache_format`` (``serving_store.new_cache``), its
        ``block_table`` and ``page_size``: the whole serving stage, the rows normalized,
        turned by ``cos``/``sin`` (a block built with rope_dim > 0), rotated (rotate=True),
        encoded and stored (``serving_store.compressor_extend_store``); returns
        ``cu_seqlens_comp``."""
        kv, score = self.wkv(x), self.wgate(x)
        if cache is None:
            if block_table is not None or page_size is not None or cache_format != "none":
                raise ValueError("Compressor.extend: `block_table`, `page_size` and "
                                 "`cache_format` describe a `cache`; pass one")
            pooled, cu_seqlens_comp = state.extend(kv, score, self.ape, cu_seqlens, start_pos,
                                                   slots, total_comp)
            return self.norm(pooled), cu_seqlens_comp
        if block_table is None or page_size is None:
            raise ValueError("Compressor.extend: a `cache` needs its `block_table` and "
                             "`page_size`")
        if total_comp is not None:
            raise ValueError("Compressor.extend: `total_comp` sizes returned rows; with a "
                             "`cache` the rows are stored (pass None)")
        return compressor_extend_store(
            kv, score, self.ape, cu_seqlens, start_pos, slots, state.kv, state.score,
            norm_weight=self.norm.weight, cache_format=cache_format, cache=cache,
            block_table=block_table, page_size=page_size, ratio=self.ratio, coff=self.coff,
            eps=self.norm.eps, cos=cos, sin=sin, rope_dim=self.rope_dim, rotate=self.rotate)


def offsets_for(lengths, ratio: int, device=None):
    """(cu_seqlens, cu_seqlens_comp) int32 for a pack of segment lengths."""
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    zero = torch.zeros(1, dtype=torch.int64)
    cu = torch.cat([zero, lengths.cumsum(0)])
    cuc = torch.cat([zero, (lengths // ratio).cumsum(0)])
    return cu.to(device=device, dtype=torch.int32), cuc.to(device=device, dtype=torch.int32)
