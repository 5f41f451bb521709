"""The fp32-intermediate reference of both ops and the fp64 oracle, in plain torch.

This is the comparator the CUDA kernels match bit for bit (grad_kv, grad_score at small
windows), so every window sum runs in a fixed order: k ascending, one rounding per mul and
per add. Vectorized over rows, tokens and columns; the only Python loop is over the window.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class _Windows:
    """Where each (row, window entry) reads from, for ``rows`` output rows."""

    token: torch.Tensor        # (N, W) int64, clamped in bounds
    half: torch.Tensor         # (W,) int64: which coff-half of the columns entry k reads
    ape_row: torch.Tensor      # (W,) int64
    entry_valid: torch.Tensor  # (N, W) bool: a real input element feeds this entry
    row_valid: torch.Tensor    # (N,) bool: n < cu_seqlens_comp[-1]


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def segment_of(offsets: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The s with offsets[s] <= index < offsets[s+1] (a binary search per index), clamped to
    a valid segment. The search runs over the whole offsets tensor, not a slice of it:
    Inductor's Triton searchsorted before torch 2.13 drops a sliced boundary tensor's
    storage offset, which would move every index one segment on under torch.compile."""
    segment = torch.searchsorted(offsets, index, right=True) - 1
    return segment.clamp(0, max(offsets.numel() - 2, 0))


def _windows(cu_seqlens, cu_seqlens_comp, rows: int, num_tokens: int, ratio: int, coff: int):
    device = cu_seqlens.device
    cu = cu_seqlens.long()
    cuc = cu_seqlens_comp.long()
    num_segments = cu.numel() - 1
    n = torch.arange(rows, device=device)
    k = torch.arange(coff * ratio, device=device)
    seg = segment_of(cuc, n)  # the last s with cuc[s] <= n
    row_valid = (n < cuc[-1]) & (num_segments > 0)
    block = n - cuc[seg]
    t0 = cu[seg] + block * ratio
    if coff == 1:
        token = t0[:, None] + k
        half = torch.zeros_like(k)
        needs_previous_block = torch.zeros_like(k, dtype=torch.bool)
    else:
        token = t0[:, None] - ratio + k
        half = (k >= ratio).long()
        needs_previous_block = k < ratio
    in_bounds = (token >= 0) & (token < num_tokens)
    has_previous_block = ~needs_previous_block | (block[:, None] > 0)
    entry_valid = row_valid[:, None] & has_previous_block & in_bounds
    return _Windows(
        token=token.clamp(0, max(num_tokens - 1, 0)),
        half=half,
        ape_row=k % ratio,
        entry_valid=entry_valid,
        row_valid=row_valid,
    )


def _sequential_sum(terms: torch.Tensor) -> torch.Tensor:
    """Sum over dim 1, k ascending: the order the kernels reproduce."""
    total = terms[:, 0]
    for k in range(1, terms.shape[1]):
        total = total + terms[:, k]
    return total


def _sequential_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_k a_k * b_k over dim 1 with a separately rounded mul and add per term."""
    total = a[:, 0] * b[:, 0]
    for k in range(1, a.shape[1]):
        total = total + a[:, k] * b[:, k]
    return total


@functools.cache
def _settle_cpu_exp(dtype: torch.dtype) -> None:
    """One single-threaded exp per dtype before any parallel one. On the CPU, torch's exp runs
    through MKL VML, which picks its kernel on a function's first call; concurrent first calls
    from intra-op threads can run a low-accuracy kernel on one thread's chunk (relative error
    1.5e-4 instead of 6e-8, that call only: pytorch/pytorch#188792). A one-element call
    settles the choice, so every call of the reference computes the same bits."""
    torch.exp(torch.zeros(1, dtype=dtype))


def _exp(x: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu":
        _settle_cpu_exp(x.dtype)
    return torch.exp(x)


def window_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over dim 1 of (N, W, d) logits; shared with csa_ops.reference_extend so the
    serving op's rows stay bit-identical to the forward's."""
    m = logits.amax(dim=1, keepdim=True)
    e = _exp(logits - m)
    return e / _sequential_sum(e)[:, None, :]


def pool_windows(logits: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """(N, W, d) masked logits and values -> (N, d) rows: the forward's exact operations."""
    return _sequential_dot(window_softmax(logits), values)


def _gather(x: torch.Tensor, win: _Windows, coff: int, acc: torch.dtype) -> torch.Tensor:
    """(N, W, d) window view of x (T, coff*d), upcast to the accumulation dtype."""
    per_half = x.reshape(x.shape[0], coff, -1)
    return per_half[win.token, win.half].to(acc)


def _probs_and_values(kv, score, ape, win: _Windows, coff: int):
    acc = accumulate_dtype(kv.dtype)
    head_dim = kv.shape[1] // coff
    ape_w = ape.reshape(ape.shape[0], coff, head_dim)[win.ape_row, win.half].to(acc)  # (W, d)
    valid = win.entry_valid[:, :, None]
    logits = torch.where(valid, _gather(score, win, coff, acc) + ape_w, float("-inf"))
    values = torch.where(valid, _gather(kv, win, coff, acc), 0.0)
    return window_softmax(logits), values


def _is_empty(kv, cu_seqlens, rows: int) -> bool:
    return rows == 0 or kv.shape[0] == 0 or cu_seqlens.numel() < 2


def compressor_reference(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio: int, coff: int,
                         total_comp=None):
    """Forward: (total_comp, d) in kv's dtype; rows past cu_seqlens_comp[-1] are zeros."""
    rows = int(cu_seqlens_comp[-1]) if total_comp is None else total_comp
    head_dim = kv.shape[1] // coff
    if _is_empty(kv, cu_seqlens, rows):
        return kv.new_zeros(rows, head_dim)
    win = _windows(cu_seqlens, cu_seqlens_comp, rows, kv.shape[0], ratio, coff)
    p, values = _probs_and_values(kv, score, ape, win, coff)
    out = _sequential_dot(p, values)
    return torch.where(win.row_valid[:, None], out, 0.0).to(kv.dtype)


def compressor_backward_reference(grad_out, kv, score, ape, cu_seqlens, cu_seqlens_comp,
                                  ratio: int, coff: int):
    """(grad_kv, grad_score, grad_ape): the exact gradient of ``compressor_reference``."""
    rows, head_dim = grad_out.shape
    num_tokens = kv.shape[0]
    grad_kv = torch.zeros(num_tokens, coff, head_dim, dtype=kv.dtype, device=kv.device)
    grad_score = torch.zeros_like(grad_kv)
    if _is_empty(kv, cu_seqlens, rows):
        return grad_kv.view_as(kv), grad_score.view_as(score), torch.zeros_like(ape)
    win = _windows(cu_seqlens, cu_seqlens_comp, rows, num_tokens, ratio, coff)
    p, values = _probs_and_values(kv, score, ape, win, coff)
    g = grad_out.to(p.dtype)[:, None, :]
    grad_values = p * g
    grad_p = g * values
    dot = _sequential_dot(grad_p, p)
    grad_logits = p * (grad_p - dot[:, None, :])
    # Invalid entries are constants (-inf logit, zero value) and padding rows are constant
    # zeros: neither depends on any input, so neither passes gradient anywhere.
    valid = win.entry_valid
    grad_logits = torch.where(valid[:, :, None], grad_logits, 0.0)
    token = win.token.expand_as(valid)[valid]
    half = win.half.expand_as(valid)[valid]
    grad_kv[token, half] = grad_values[valid].to(kv.dtype)
    grad_score[token, half] = grad_logits[valid].to(score.dtype)
    grad_ape = grad_logits.sum(dim=0).reshape(coff, ratio, head_dim).transpose(0, 1)
    return (grad_kv.view_as(kv), grad_score.view_as(score),
            grad_ape.reshape(ape.shape).to(ape.dtype).contiguous())


def _to_fp64(*tensors):
    return [t.to(torch.float64) for t in tensors]


def compressor_oracle(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp=None):
    """fp64 forward with no final rounding: the ground truth both fp32 paths are judged by."""
    kv64, score64, ape64 = _to_fp64(kv, score, ape)
    return compressor_reference(kv64, score64, ape64, cu_seqlens, cu_seqlens_comp, ratio, coff,
                                total_comp)


def compressor_backward_oracle(grad_out, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff):
    g64, kv64, score64, ape64 = _to_fp64(grad_out, kv, score, ape)
    return compressor_backward_reference(g64, kv64, score64, ape64, cu_seqlens, cu_seqlens_comp,
                                         ratio, coff)
