"""What the streaming kernels pass between their parts: a row's flags in the row tables, a
thread's coordinates, a row's global and shared-memory tensors, and flat views of sliced
vectors."""

from __future__ import annotations

import enum
from typing import NamedTuple

from cutlass import Int32, cute


class RowFlag(enum.IntFlag):
    """A row's flags in the row tables: REAL, a row of data (n < cuc[-1]); PREVIOUS, its
    block has a previous block in its segment; FULL, every window entry exists (the lean
    path skips the masks); SKIP, a split extend call's rows launch leaves the row to its
    requests' launch (the flag alone: no data, no zeros)."""

    REAL = 1
    PREVIOUS = 2
    FULL = 4
    SKIP = 8


def flat(t: cute.Tensor, n: int, h: int = 0) -> cute.Tensor:
    """Elements [h * n, (h + 1) * n) of a sliced vector as a flat view (the shape cute.copy
    expects; h > 0: one 16-byte fp32 access of a wider vector)."""
    return cute.make_tensor(t.iterator + h * n if h else t.iterator, cute.make_layout(n))


class Thread(NamedTuple):
    """A thread's coordinates in a streaming CTA: thread and block index, its column block
    and row group, its lane, its warp's column vector (cvw) and that warp's index among the
    warps of the vector (wp)."""

    tid: Int32
    bid: Int32
    cb: Int32
    rg: Int32
    lane: Int32
    cvw: Int32
    wp: Int32


class RowTensors(NamedTuple):
    """The global tensors a row reads and writes: the window's kv and score, ape, grad_out
    (the backward's; the forward passes its output), the output rows, grad_kv, grad_score,
    and the deferred forward's words of failing columns and saved columns (kernels.py
    _save_columns; None elsewhere)."""

    kv: cute.Tensor
    score: cute.Tensor
    ape: cute.Tensor
    grad_out: cute.Tensor
    out: cute.Tensor
    grad_kv: cute.Tensor
    grad_score: cute.Tensor
    flags: cute.Tensor | None = None
    saved: cute.Tensor | None = None


class RowTiles(NamedTuple):
    """The shared-memory tensors a row's pooling reads and writes: the window tiles (score
    in slot 0, kv in slot 1, one stage per row in flight), the CTA's ape tile (None where
    the logits are given), the cross-warp partials, the scratch (the backward's grad_out
    rows, or the forward's exact columns' terms) and the extend kernel's fp32 logit tile
    (None: the logits are score + ape from the tiles)."""

    tile: cute.Tensor
    ape: cute.Tensor | None
    red: cute.Tensor
    scratch: cute.Tensor
    logits: cute.Tensor | None = None
