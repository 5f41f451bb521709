"""Output shapes and dtypes of the two ops: one formula shared by fakes and allocators."""

from __future__ import annotations

import torch


def head_dim(kv: torch.Tensor, coff: int) -> int:
    """Width of one output row: kv carries ``coff`` halves of ``head_dim`` columns."""
    return kv.shape[-1] // coff


def forward_shape(kv: torch.Tensor, coff: int, rows) -> tuple:
    return (rows, head_dim(kv, coff))


def empty_forward(kv: torch.Tensor, coff: int, rows) -> torch.Tensor:
    return kv.new_empty(forward_shape(kv, coff, rows))


def empty_backward(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor):
    """(grad_kv, grad_score, grad_ape), contiguous, in the dtypes of their inputs."""
    return (
        torch.empty(kv.shape, dtype=kv.dtype, device=kv.device),
        torch.empty(score.shape, dtype=score.dtype, device=score.device),
        torch.empty(ape.shape, dtype=ape.dtype, device=ape.device),
    )
