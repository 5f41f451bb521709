"""Vectorized reference of csa::compressor_extend; it serves every device.

A request's sequence position ``p`` lives either in its slot's state (``p < start_pos``)
or among the new tokens. Emitted rows gather their windows from those two sources into the
``(rows, window, d)`` layout of ``csa_ops.reference`` and pool them with the same helper, so
they are bit-identical to ``compressor_reference`` over the whole sequences. Every index is
clamped in bounds and no tensor content steers control flow: with an int ``total_comp`` a
call never synchronizes, whatever the slots and positions hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .reference import accumulate_dtype, pool_windows, segment_of
from .validation import INT32_MAX


@dataclass(frozen=True)
class _Sources:
    """Views of the new tokens and the state as (rows, coff, d), plus per-request (B,) int64
    quantities: slot, first new token, positions before (start) and after (end) the call."""

    kv: torch.Tensor            # (T', coff, d) kv dtype; T' >= 1
    score: torch.Tensor         # (T', coff, d) kv dtype
    ape: torch.Tensor           # (ratio, coff, d) accumulation dtype
    kv_state: torch.Tensor      # (S, W, coff, d) view of the caller's tensor
    score_state: torch.Tensor   # (S, W, coff, d) view of the caller's tensor
    slot: torch.Tensor
    ok: torch.Tensor            # (B,) bool: `valid_requests` (always, on CPU)
    first_token: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    ratio: int
    coff: int

    @property
    def window(self) -> int:
        return self.coff * self.ratio


def valid_requests(cu_seqlens, start_pos, slots, num_tokens: int, num_slots: int):
    """(B,) bool: the requests whose slot is in range, position >= 0, tokens in
    [0, num_tokens) in order, and start + new tokens within int32. The CPU op refuses any
    other; CUDA does not check contents, and there such a request gets zero rows and leaves
    every slot alone (its rows still count, so the offsets agree on every device)."""
    first, last = cu_seqlens[:-1].long(), cu_seqlens[1:].long()
    start = start_pos.long()
    return ((slots >= 0) & (slots < num_slots) & (start >= 0) & (first >= 0) & (first <= last)
            & (last <= num_tokens) & (start + last - first <= INT32_MAX))


def _sources(kv, score, ape, cu_seqlens, start_pos, slots, kv_state, score_state, ratio, coff):
    num_slots, window, width = kv_state.shape
    head_dim = width // coff
    ok = valid_requests(cu_seqlens, start_pos, slots, kv.shape[0], num_slots)
    if kv.shape[0] == 0:  # a zero row keeps every clamped token index in bounds
        kv, score = kv.new_zeros(1, width), score.new_zeros(1, width)
    acc = accumulate_dtype(kv.dtype)
    cu = cu_seqlens.long()
    start = start_pos.long().clamp(min=0)
    slot = slots.long()
    return _Sources(
        kv=kv.view(-1, coff, head_dim),
        score=score.view(-1, coff, head_dim),
        ape=ape.to(acc).view(ratio, coff, head_dim),
        kv_state=kv_state.view(num_slots, window, coff, head_dim),
        score_state=score_state.view(num_slots, window, coff, head_dim),
        slot=slot.clamp(0, num_slots - 1),
        ok=ok,
        first_token=cu[:-1],
        start=start,
        end=start + (cu[1:] - cu[:-1]).clamp(min=0),
        ratio=ratio,
        coff=coff,
    )


def _state_entry(src: _Sources, req, pos):
    """State entry holding position ``pos`` (< start) of request ``req``: the current block
    sits at entries ``(coff-1)*ratio + pos % ratio``, for coff 2 the block before it at
    ``[0, ratio)``."""
    block = src.start[req] // src.ratio
    own = pos - block * src.ratio + (src.coff - 1) * src.ratio
    if src.coff == 2:
        own = torch.where(pos >= block * src.ratio, own, pos - (block - 1) * src.ratio)
    return own.clamp(0, src.window - 1)


def _read(src: _Sources, req, pos, half):
    """(value in kv's dtype, fp32 logit) of shape broadcast(req, pos, half) + (d,): position
    ``pos`` of request ``req``, column half ``half``, from the new tokens or the state."""
    start = src.start[req]
    is_new = (pos >= start)[..., None]
    token = (src.first_token[req] + pos - start).clamp(0, src.kv.shape[0] - 1)
    slot, entry = src.slot[req], _state_entry(src, req, pos)
    value = torch.where(is_new, src.kv[token, half], src.kv_state[slot, entry, half])
    # The logit the forward builds, fp32(score) + fp32(ape), is what the state stores.
    new_logit = src.score[token, half].to(src.ape.dtype) + src.ape[pos % src.ratio, half]
    logit = torch.where(is_new, new_logit, src.score_state[slot, entry, half])
    return value, logit


def _rows(src: _Sources, cu_seqlens_comp, rows: int, out_dtype) -> torch.Tensor:
    """Emitted rows: block ``start // ratio + n - cuc[req]`` of request ``req``; rows past
    cuc[-1] and rows of invalid requests are exact zeros."""
    device = src.start.device
    cuc = cu_seqlens_comp.long()
    n = torch.arange(rows, device=device)
    req = segment_of(cuc, n)
    block = src.start[req] // src.ratio + n - cuc[req]
    k = torch.arange(src.window, device=device)
    # The window starts coff-1 blocks before the row's own block (with coff 2 the first
    # half of the columns reads the previous block).
    pos = (block[:, None] - (src.coff - 1)) * src.ratio + k
    half = k // src.ratio
    value, logit = _read(src, req[:, None], pos, half)
    acc = src.ape.dtype
    before_sequence = (pos < 0)[..., None]  # coff 2, block 0: the -inf / 0 constants
    logits = torch.where(before_sequence, float("-inf"), logit)
    values = torch.where(before_sequence, 0.0, value.to(acc))
    # The forward masks with where(valid, x, const); the selected values are the same.
    out = pool_windows(logits, values)
    emitted = (n < cuc[-1]) & src.ok[req]
    return torch.where(emitted[:, None], out, 0.0).to(out_dtype)


def _owner_of_tokens(src: _Sources, cu: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """(T,) int64: the ok request whose new tokens hold token t, or -1. Where ok requests
    overlap (only bad cu_seqlens make them, unchecked on CUDA) the one starting last owns the
    token. A running maximum over the ok requests' first tokens, not a search over
    cu_seqlens: a search needs them sorted, and invalid requests can break that."""
    device = src.start.device
    num_requests = src.start.numel()
    first, last = cu[:-1], cu[1:]
    holds = src.ok & (first < last)
    # first * (B + 1) + request + 1: the largest key has the last first token.
    key = first * (num_requests + 1) + torch.arange(1, num_requests + 1, device=device)
    size = max(num_tokens, 1)  # no tokens: no owner, and an index in bounds for the scatter
    marks = torch.zeros(size, dtype=torch.long, device=device).scatter_reduce(
        0, first.clamp(0, size - 1), torch.where(holds, key, 0), "amax")
    owner = marks.cummax(0).values[:num_tokens] % (num_requests + 1) - 1
    token = torch.arange(num_tokens, device=device)
    return torch.where((owner >= 0) & (token < last[owner.clamp(min=0)]), owner, -1)


def _write_targets(src: _Sources, cu: torch.Tensor, num_tokens: int):
    """(request, entry, writes) triples: the entry of every new token, and for coff 2 the
    ``[0, ratio)`` entries of every request (the completed block or the initial state).
    `writes` is False where the entry keeps its content: a token no ok request holds, a
    request that is not ok."""
    device = src.start.device
    owner = _owner_of_tokens(src, cu, num_tokens)
    req, writes = owner.clamp(min=0), owner >= 0
    pos = src.start[req] + torch.arange(num_tokens, device=device) - src.first_token[req]
    entry = pos % src.ratio
    if src.coff == 2:
        current = pos >= src.end[req] // src.ratio * src.ratio
        entry = entry + src.ratio * current.long()
        num_requests = src.start.numel()
        every = torch.arange(num_requests, device=device).repeat_interleave(src.ratio)
        req = torch.cat([req, every])
        entry = torch.cat([entry, torch.arange(src.ratio, device=device).repeat(num_requests)])
        writes = torch.cat([writes, src.ok[every]])
    return req, entry, writes


def _one_writer(slot, entry, writes, window: int, num_slots: int) -> torch.Tensor:
    """Per target, the target whose value its (slot, entry) receives: the last writing one
    naming it, else itself (a kept entry: its old content). The scatter's order among
    duplicates is unspecified, so a target that keeps an entry must not carry a value of
    its own where another rewrites it (an invalid request's slot, clamped into range, can
    be a valid one's)."""
    target = torch.arange(slot.numel(), device=slot.device)
    flat = slot * window + entry
    last = torch.zeros(num_slots * window, dtype=torch.long, device=slot.device).scatter_reduce(
        0, flat, torch.where(writes, target + 1, 0), "amax")[flat] - 1
    return torch.where(last >= 0, last, target)


def _final_state(src: _Sources, req, entry, writes):
    """Entry ``entry`` of request ``req``'s slot after the call, both column halves.

    Entry e holds position ``(end // ratio - (coff-1)) * ratio + e``. Unconsumed positions
    keep the old content, and so do targets that do not write; positions before the
    sequence get the initial state. Several targets of one request may name one (slot,
    entry): all of them carry this same value.
    """
    pos = (src.end[req] // src.ratio - (src.coff - 1)) * src.ratio + entry
    half = torch.arange(src.coff, device=pos.device)
    value, logit = _read(src, req[:, None], pos[:, None], half)
    slot = src.slot[req]
    old_value, old_logit = src.kv_state[slot, entry], src.score_state[slot, entry]
    keep = (~((pos < src.end[req]) & writes))[:, None, None]
    initial = (pos < 0)[:, None, None] & ~keep
    value = torch.where(initial, 0.0, torch.where(keep, old_value, value))
    logit = torch.where(initial, float("-inf"), torch.where(keep, old_logit, logit))
    return slot, value.to(old_value.dtype), logit


def rows_of_requests(cu_seqlens, start_pos, ratio: int) -> torch.Tensor:
    """(B,) int64: the rows each request emits, blocks start // ratio up to
    (start + new tokens) // ratio - 1 (negative positions and lengths count as 0)."""
    start = start_pos.long().clamp(min=0)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long().clamp(min=0)
    return (start + lengths) // ratio - start // ratio


def compressor_extend_reference(kv, score, ape, cu_seqlens, start_pos, slots, kv_state,
                                score_state, ratio: int, coff: int, total_comp=None):
    """(out, cu_seqlens_comp); writes the state for start_pos + new tokens in place."""
    num_requests = start_pos.shape[0]
    head_dim = kv.shape[1] // coff
    rows_per_request = rows_of_requests(cu_seqlens, start_pos, ratio)
    cu_seqlens_comp = torch.zeros(num_requests + 1, dtype=torch.int32, device=kv.device)
    # Saturating offsets: invalid requests may count rows past int32 (CUDA does not check
    # contents), and wrapped offsets would land later rows on earlier ones.
    cu_seqlens_comp[1:] = rows_per_request.cumsum(0).clamp(max=INT32_MAX)
    rows = int(cu_seqlens_comp[-1]) if total_comp is None else total_comp
    if num_requests == 0 or kv_state.shape[0] == 0:
        return kv.new_zeros(rows, head_dim), cu_seqlens_comp
    src = _sources(kv, score, ape, cu_seqlens, start_pos, slots, kv_state, score_state, ratio,
                   coff)
    out = _rows(src, cu_seqlens_comp, rows, kv.dtype)
    # Every read above and in _final_state happens before the scatter below.
    req, entry, writes = _write_targets(src, cu_seqlens.long(), kv.shape[0])
    slot, value, logit = _final_state(src, req, entry, writes)
    chosen = _one_writer(slot, entry, writes, src.window, kv_state.shape[0])
    src.kv_state[slot, entry] = value[chosen]
    src.score_state[slot, entry] = logit[chosen]
    return out, cu_seqlens_comp
