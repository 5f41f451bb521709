"""Context parallelism for csa::compressor: a THD pack split across a torch.distributed group.

``compressor`` gives each rank the rows it owns (a row belongs to the rank holding its block's
last token), fetching the window tokens other ranks hold as a halo: one all-gather of every
chunk's last ``coff*ratio - 1`` tokens. Each rank then runs csa::compressor once on a local
pack of [halo + own tokens] per chunk, aligned to block starts, so every owned row sees the
single-process window bit for bit. The backward returns each halo element's gradient to its
holder, taken from the one rank whose row consumes it. ``gather_rows`` collects all rows on
every rank; its backward sums the ranks' row gradients onto the owner in rank order.
Design and exactness argument: docs/distributed.md.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from . import validation
from .reference import accumulate_dtype

OP = "csa_ops.distributed.compressor"
GATHER_OP = "csa_ops.distributed.gather_rows"
LAYOUTS = ("contiguous", "zigzag")
# all_gather_single replaces all_gather_tensor in newer torch; both trace under torch.compile.
_all_gather_op = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def _fail(op: str, message: str, error=ValueError):
    raise error(f"{op}: {message}")


def _shared_check(check, *args):
    """A csa_ops.validation check, its error under this module's name (validation.checking's
    context variable does not trace under torch.compile)."""
    try:
        return check(*args)
    except (ValueError, TypeError) as error:
        message = str(error).removeprefix(f"{validation.OP}: ")
        raise type(error)(f"{OP}: {message}") from None


def _wait(tensor: torch.Tensor) -> torch.Tensor:
    # Eager functional collectives return an AsyncCollectiveTensor; traced ones wait in-graph.
    return tensor.wait() if isinstance(tensor, funcol.AsyncCollectiveTensor) else tensor


def _all_gather(tensor: torch.Tensor, group) -> torch.Tensor:
    return _wait(_all_gather_op(tensor.contiguous(), 0, group))


def _all_to_all(tensor: torch.Tensor, group) -> torch.Tensor:
    return _wait(funcol.all_to_all_single(tensor.contiguous(), None, None, group))


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    """(n+1,) offsets of n counts: built on the device, no host values."""
    return torch.cat([x.new_zeros(1), x.cumsum(0)])


def _ordered_sum(parts: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 one part after another: the same order on every run and every rank."""
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


class _Geometry(NamedTuple):
    """Everything static about one call: these decide shapes, never tensor contents."""

    world: int
    rank: int
    zigzag: bool
    ratio: int
    coff: int
    head_dim: int
    segments: int        # local segments J = B * chunks_per_rank
    halo: int            # H = coff * ratio - 1: the most tokens a window reaches back
    num_tokens: int      # rows of the local kv
    capacity: int        # owned-row capacity
    local_capacity: int  # rows of the local op: capacity plus one discarded row per segment

    @property
    def chunks(self) -> int:
        return self.world * (2 if self.zigzag else 1)

    @property
    def per_rank(self) -> int:
        return 2 if self.zigzag else 1

    @property
    def extended_tokens(self) -> int:
        return self.num_tokens + self.segments * self.halo


def _chunk_owner(chunk: torch.Tensor, world: int, zigzag: bool):
    """(rank, slot) holding each chunk: zigzag rank p holds chunks p (slot 0), 2P-1-p (slot 1)."""
    if not zigzag:
        return chunk, torch.zeros_like(chunk)
    upper = chunk >= world
    return torch.where(upper, 2 * world - 1 - chunk, chunk), upper.long()


def _rank_chunks(rank: int, world: int, zigzag: bool, device) -> torch.Tensor:
    """The chunks a rank holds, in local-pack order (arange: no host-to-device copy)."""
    slots = torch.arange(2 if zigzag else 1, device=device)
    return slots * (2 * world - 1 - 2 * rank) + rank


class _Sequences(NamedTuple):
    """Per sequence s and chunk c (offsets within s): where each chunk's rows and halo lie."""

    length: torch.Tensor        # (B,) tokens
    bounds: torch.Tensor        # (B, n+1) chunk c is [bounds[c], bounds[c+1])
    first_block: torch.Tensor   # (B, n+1) chunk c owns blocks [first_block[c], first_block[c+1])
    owned: torch.Tensor         # (B, n) rows chunk c owns
    window_start: torch.Tensor  # (B, n) first token of the local segment computing chunk c
    halo: torch.Tensor          # (B, n) tokens before the chunk that its rows read


def _sequences(cu: torch.Tensor, chunks: int, ratio: int, coff: int) -> _Sequences:
    cu = cu.long()
    length = cu[1:] - cu[:-1]
    bounds = torch.arange(chunks + 1, device=cu.device) * length[:, None] // chunks
    first_block = bounds // ratio
    owned = first_block[:, 1:] - first_block[:, :-1]
    # The segment starts at a block start: the first owned block's (coff=1) or the one
    # before it (coff=2), so the first owned row's left half reads real tokens.
    window_start = ((first_block[:, :-1] - (coff - 1)) * ratio).clamp(min=0)
    halo = torch.where(owned > 0, bounds[:, :-1] - window_start, 0)
    return _Sequences(length, bounds, first_block, owned, window_start, halo)


def _chunk_of(offset: torch.Tensor, length: torch.Tensor, chunks: int) -> torch.Tensor:
    """The chunk holding token ``offset`` of a sequence: the last c with (c*L)//n <= offset."""
    return (((offset + 1) * chunks - 1) // length.clamp(min=1)).clamp(0, chunks - 1)


class _Plan(NamedTuple):
    """Index tensors of one call, all built on the offsets' device with static sizes."""

    tail_index: torch.Tensor        # (J*H,) local token of each slot of this rank's chunk tails
    halo_index: torch.Tensor        # (J*H,) row of the gathered tails each halo slot copies
    extended_index: torch.Tensor    # (T_ext,) row of cat([kv, halo]) of each local-pack token
    extended_cu: torch.Tensor       # (J+1,) int32 offsets of the local pack
    extended_cu_comp: torch.Tensor  # (J+1,) int32
    row_local: torch.Tensor         # (capacity,) local-op row of each owned row (trash: last)
    row_index: torch.Tensor         # (capacity,) global row of each owned row, -1 for padding
    grad_row: torch.Tensor          # (local_capacity,) owned row each local row's grad is
    halo_grad_index: torch.Tensor   # (J*H*coff,) local-pack (token, half) of each halo slot
    token_grad_index: torch.Tensor  # (T*coff,) source of each local (token, half) gradient


class _Segments(NamedTuple):
    """Per local segment j (sequence s, the rank's slot-th chunk c of it, j = s*slots + slot):
    the chunk [halo + chunk] of the local pack, and its rows."""

    start: torch.Tensor             # (J,) the chunk's first token, offset within s
    chunk_tokens: torch.Tensor      # (J,)
    owned: torch.Tensor             # (J,) rows the chunk owns
    window_start: torch.Tensor      # (J,) the segment's first token, offset within s
    halo: torch.Tensor              # (J,) halo tokens before the chunk
    first_block: torch.Tensor       # (J,) block index of the first owned row
    discard: torch.Tensor           # (J,) 1 where the segment's first row is not owned
    sequence: torch.Tensor          # (J,) s
    chunk: torch.Tensor             # (J,) c
    local_cu: torch.Tensor          # (J+1,) chunk offsets in this rank's kv
    extended_cu: torch.Tensor       # (J+1,) segment offsets in the local pack
    extended_cu_comp: torch.Tensor  # (J+1,) the local call's row offsets
    owned_cu: torch.Tensor          # (J+1,) offsets of the segments' owned rows in ``rows``
    row_start: torch.Tensor         # (J,) global index of the first owned row


def _segment_tables(seq: _Sequences, cuc: torch.Tensor, geo: _Geometry) -> _Segments:
    mine = _rank_chunks(geo.rank, geo.world, geo.zigzag, cuc.device)

    def column(table):  # (B, n) per chunk -> (J,) per local segment
        return table[:, mine].reshape(-1)

    start, owned, halo = column(seq.bounds[:, :-1]), column(seq.owned), column(seq.halo)
    first_block = column(seq.first_block[:, :-1])
    chunk_tokens = column(seq.bounds[:, 1:]) - start
    discard = ((first_block > 0) & (owned > 0)).long() * (geo.coff - 1)
    sequence = torch.arange(geo.segments, device=cuc.device) // geo.per_rank
    extended_tokens = halo + chunk_tokens
    return _Segments(
        start, chunk_tokens, owned, column(seq.window_start), halo, first_block, discard,
        sequence, mine.repeat(geo.segments // geo.per_rank), _exclusive_cumsum(chunk_tokens),
        _exclusive_cumsum(extended_tokens), _exclusive_cumsum(extended_tokens // geo.ratio),
        _exclusive_cumsum(owned), cuc.long()[sequence] + first_block)


def _segment_of(position: torch.Tensor, cu: torch.Tensor, segments: int):
    """(segment, valid) of positions >= 0 in a pack with offsets cu (cu[0] == 0, as every
    _exclusive_cumsum gives); invalid past cu[-1]."""
    # Searched over the whole of cu, never a slice such as cu[1:]: torch 2.11's Inductor
    # (Triton searchsorted, fixed by 2.13) drops a sliced boundary tensor's storage offset and
    # searches from its buffer's start, which puts every position one segment too far. Here
    # cu[0] = 0 <= position always counts once, so one less is the count over cu[1:].
    index = torch.searchsorted(cu, position, right=True) - 1
    return index.clamp(max=segments - 1), position < cu[-1]


def _exchange_indices(seq: _Sequences, seg, geo: _Geometry):
    """Tail slots (what this rank sends) and halo slots (what it copies from the gather)."""
    device, halo = seg.start.device, geo.halo
    k = torch.arange(halo, device=device)
    tail = seg.local_cu[:-1, None] + seg.chunk_tokens[:, None] - halo + k
    tail_index = tail.clamp(0, max(geo.num_tokens - 1, 0)).reshape(-1)
    # Halo slot k of a segment holds its sequence's token window_start + k (k < halo).
    offset = seg.window_start[:, None] + k
    sequence = seg.sequence[:, None]
    holder = _chunk_of(offset, seq.length[sequence], geo.chunks)
    rank, slot = _chunk_owner(holder, geo.world, geo.zigzag)
    tail_slot = offset - (seq.bounds[sequence, holder + 1] - halo)
    source = ((rank * geo.segments + sequence * geo.per_rank + slot) * halo + tail_slot)
    last = max(geo.world * geo.segments * halo - 1, 0)
    halo_index = torch.where(k < seg.halo[:, None], source, 0).clamp(0, last)
    return tail_index, halo_index.reshape(-1)


def _extended_index(seg, geo: _Geometry) -> torch.Tensor:
    """Row of cat([kv, halo]) for each token of the local pack [halo_j, chunk_j]_j."""
    x = torch.arange(geo.extended_tokens, device=seg.start.device)
    j, valid = _segment_of(x, seg.extended_cu, geo.segments)
    y = x - seg.extended_cu[j]
    in_halo = y < seg.halo[j]
    source = torch.where(in_halo, geo.num_tokens + j * geo.halo + y,
                         seg.local_cu[j] + y - seg.halo[j])
    # Tokens past the local pack are never read by the op: any in-bounds row does.
    return torch.where(valid, source, 0).clamp(0, max(geo.extended_tokens - 1, 0))


def _row_indices(seg, geo: _Geometry):
    """Owned rows <-> local-op rows: forward selection, global indices, gradient placement."""
    device = seg.start.device
    k = torch.arange(geo.capacity, device=device)
    j, valid = _segment_of(k, seg.owned_cu, geo.segments)
    within = k - seg.owned_cu[j]
    local = seg.extended_cu_comp[j] + seg.discard[j] + within
    row_local = torch.where(valid, local, geo.local_capacity)
    row_index = torch.where(valid, seg.row_start[j] + within, -1)
    m = torch.arange(geo.local_capacity, device=device)
    j, valid = _segment_of(m, seg.extended_cu_comp, geo.segments)
    block = m - seg.extended_cu_comp[j]
    position = seg.owned_cu[j] + block - seg.discard[j]
    # A discarded row (the block before a segment's first owned one) takes no gradient.
    owned = valid & (block >= seg.discard[j]) & (position < geo.capacity)
    grad_row = torch.where(owned, position, geo.capacity)
    return row_local, row_index, grad_row


def _gradient_indices(seq: _Sequences, seg, geo: _Geometry):
    """Where each gradient element comes from: halo slots of the local pack (sent back), and
    for each local (token, half) the one row that consumes it, on this rank or another."""
    device, coff, ratio, halo = seg.start.device, geo.coff, geo.ratio, geo.halo
    half = torch.arange(coff, device=device)
    k = torch.arange(halo, device=device)
    halo_token = torch.where(k < seg.halo[:, None], seg.extended_cu[:-1, None] + k, 0)
    halo_grad_index = (halo_token[..., None] * coff + half).reshape(-1)
    extended_rows = geo.extended_tokens * coff
    halo_grad_index = halo_grad_index.clamp(0, max(extended_rows - 1, 0))

    t = torch.arange(geo.num_tokens, device=device)
    j, in_pack = _segment_of(t, seg.local_cu, geo.segments)
    within = t - seg.local_cu[j]
    offset = (seg.start[j] + within)[:, None]
    sequence = seg.sequence[j][:, None]
    length = seq.length[sequence]
    # coff=2: a token's first half belongs to the next block's window, its second half to its
    # own block's; coff=1: its own block's.
    block = offset // ratio + (half == 0).long() * (coff - 1)
    consumed = in_pack[:, None] & ((block + 1) * ratio <= length)
    consumer_chunk = _chunk_of((block + 1) * ratio - 1, length, geo.chunks)
    local = consumer_chunk == seg.chunk[j][:, None]
    extended_token = (seg.extended_cu[j] + seg.halo[j] + within)[:, None]
    rank, slot = _chunk_owner(consumer_chunk, geo.world, geo.zigzag)
    halo_slot = (offset - seq.window_start[sequence, consumer_chunk]).clamp(0, max(halo - 1, 0))
    remote_segment = sequence * geo.per_rank + slot
    remote = extended_rows + ((rank * geo.segments + remote_segment) * halo + halo_slot) * coff
    zero_row = extended_rows + geo.world * geo.segments * halo * coff
    source = torch.where(local, extended_token * coff + half, remote + half)
    token_grad_index = torch.where(consumed, source, zero_row).clamp(0, zero_row).reshape(-1)
    return halo_grad_index, token_grad_index


def _plan(cu: torch.Tensor, cuc: torch.Tensor, geo: _Geometry) -> _Plan:
    seq = _sequences(cu, geo.chunks, geo.ratio, geo.coff)
    seg = _segment_tables(seq, cuc, geo)
    tail_index, halo_index = _exchange_indices(seq, seg, geo)
    row_local, row_index, grad_row = _row_indices(seg, geo)
    halo_grad_index, token_grad_index = _gradient_indices(seq, seg, geo)
    return _Plan(tail_index, halo_index, _extended_index(seg, geo),
                 seg.extended_cu.int(), seg.extended_cu_comp.int(), row_local, row_index,
                 grad_row, halo_grad_index, token_grad_index)


def _extended_pack(kv, score, halo, extended_index, width: int):
    """The local pack: each segment's halo then its chunk, gathered from kv and the halo."""
    return (torch.cat([kv, halo[:, :width]])[extended_index],
            torch.cat([score, halo[:, width:]])[extended_index])


def _with_zero_row(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])


class _CompressorFunction(torch.autograd.Function):
    """Halo exchange, one local csa::compressor call and the owned rows; the backward returns
    halo gradients to their holders and sums grad_ape over the group in rank order."""

    @staticmethod
    def forward(ctx, kv, score, ape, geo: _Geometry, group, *plan):
        plan = _Plan(*plan)
        kv, score = kv.contiguous(), score.contiguous()
        width = kv.shape[1]
        if geo.halo > 0 and geo.num_tokens > 0:
            tails = torch.cat([kv[plan.tail_index], score[plan.tail_index]], dim=1)
        else:
            tails = kv.new_zeros(geo.segments * geo.halo, 2 * width)
        halo = _all_gather(tails, group)[plan.halo_index] if geo.halo > 0 else tails
        local_kv, local_score = _extended_pack(kv, score, halo, plan.extended_index, width)
        # ape is added in the accumulation dtype anyway; in it, grad_ape's partials are not
        # rounded before the group sums them.
        ape_acc = ape.to(accumulate_dtype(kv.dtype))
        out = torch.ops.csa.compressor.default(
            local_kv, local_score, ape_acc, plan.extended_cu, plan.extended_cu_comp, geo.ratio,
            geo.coff, geo.local_capacity)
        ctx.save_for_backward(kv, score, ape_acc, halo, *plan)
        ctx.geo, ctx.group, ctx.ape_dtype = geo, group, ape.dtype
        return _with_zero_row(out)[plan.row_local]

    @staticmethod
    def backward(ctx, grad_rows):
        kv, score, ape_acc, halo, *plan = ctx.saved_tensors
        plan, geo, group = _Plan(*plan), ctx.geo, ctx.group
        local_kv, local_score = _extended_pack(kv, score, halo, plan.extended_index, kv.shape[1])
        grad_out = _with_zero_row(grad_rows.to(kv.dtype))[plan.grad_row]
        grad_local_kv, grad_local_score, grad_ape = torch.ops.csa.compressor_backward.default(
            grad_out, local_kv, local_score, ape_acc, plan.extended_cu, plan.extended_cu_comp,
            geo.ratio, geo.coff)
        grad_kv, grad_score = _holder_gradients(grad_local_kv, grad_local_score, plan, geo, group)
        grad_ape = _ordered_sum(_all_gather(grad_ape, group).view(geo.world, *grad_ape.shape))
        return grad_kv, grad_score, grad_ape.to(ctx.ape_dtype), None, None, *([None] * len(plan))


def _holder_gradients(grad_local_kv, grad_local_score, plan: _Plan, geo: _Geometry, group):
    """Each local (token, half) takes its gradient from the one row consuming it: the local
    pack's own copy, or a halo slot of the rank owning that row; +0 where none does (a sum of
    zeros would turn a true -0 into +0)."""
    d, coff = geo.head_dim, geo.coff
    rows = grad_local_kv.shape[0]
    halves = torch.cat([grad_local_kv.view(rows, coff, d), grad_local_score.view(rows, coff, d)],
                       dim=2).view(rows * coff, 2 * d)
    parts = [halves]
    if geo.halo > 0:
        parts.append(_all_gather(halves[plan.halo_grad_index], group))
    parts.append(halves.new_zeros(1, 2 * d))
    grads = torch.cat(parts)[plan.token_grad_index].view(geo.num_tokens, coff, 2 * d)
    return (grads[..., :d].reshape(geo.num_tokens, coff * d),
            grads[..., d:].reshape(geo.num_tokens, coff * d))


class _GatherRowsFunction(torch.autograd.Function):
    """All ranks' rows in global order; the backward sums every rank's gradient of a row onto
    its owner, in rank order."""

    @staticmethod
    def forward(ctx, rows, row_index, total_comp: int, world: int, group, check_indices: bool):
        rows_all, index_all = _all_gather(rows, group), _all_gather(row_index, group)
        if check_indices:
            _check_gathered_indices(index_all, total_comp, rows.shape[0])
        real = (index_all >= 0) & (index_all < total_comp)
        slots = index_all.shape[0]
        # Padding goes to distinct spare rows, so no destination is written twice.
        spare = total_comp + torch.arange(slots, device=index_all.device)
        out = rows.new_zeros(total_comp + slots, rows.shape[1])
        out.index_put_((torch.where(real, index_all, spare),), rows_all)
        ctx.save_for_backward(torch.where(real, index_all, total_comp))
        ctx.world, ctx.group = world, group
        return out[:total_comp]

    @staticmethod
    def backward(ctx, grad_all):
        (source,) = ctx.saved_tensors
        # Segment q of what is sent holds rank q's rows; what comes back holds, per rank, its
        # gradient of this rank's rows.
        received = _all_to_all(_with_zero_row(grad_all)[source], ctx.group)
        per_rank = received.view(ctx.world, -1, grad_all.shape[1])
        grad_rows = _ordered_sum(per_rank.to(accumulate_dtype(grad_all.dtype)))
        return grad_rows.to(grad_all.dtype), None, None, None, None, None


def _check_gathered_indices(index_all: torch.Tensor, total_comp: int, capacity: int) -> None:
    """On values every rank holds after the gather, so every rank raises alike."""
    real = index_all[index_all >= 0]
    if real.numel() == 0:
        return
    top = int(real.max())
    if top >= total_comp:
        rank = int((index_all == top).nonzero()[0, 0]) // max(capacity, 1)
        _fail(GATHER_OP, f"`total_comp` = {total_comp} is smaller than the row count: rank "
                         f"{rank} holds row {top}")
    counts = torch.bincount(real, minlength=total_comp)
    if int(counts.max()) > 1:
        row = int(counts.argmax())
        _fail(GATHER_OP, f"`row_index`: row {row} is held by {int(counts[row])} ranks; every "
                         f"row has one owner")


def _resolve_group(group, op: str):
    """(group, world size, rank) for a group this process belongs to."""
    if not (dist.is_available() and dist.is_initialized()):
        _fail(op, "torch.distributed is not initialized: call init_process_group before "
                  "passing a `group` (None means the default group)", RuntimeError)
    group = dist.group.WORLD if group is None else group
    rank = dist.get_rank(group)
    if rank < 0:
        _fail(op, "this process is not a member of `group`")
    return group, dist.get_world_size(group), rank


def _exchange_device(group, *candidates) -> torch.device:
    """The checks' exchange device: the CPU for gloo, else the first tensor's (NCCL: GPU)."""
    tensors = [t for t in candidates if isinstance(t, torch.Tensor)]
    if dist.get_backend(group) == "gloo" or not tensors:
        return torch.device("cpu")
    return tensors[0].device


def _agree(op: str, group, device, shared, own, error):
    """Every rank's ``shared`` (name, value) fields, ``own`` values and error flag to every
    rank; raise the same error on every rank, so that no rank is left in a collective.
    Returns each rank's ``own`` values."""
    values = [int(error is not None)] + [value for _, value in shared] + list(own)
    table = [values]
    if dist.get_world_size(group) > 1:
        mine = torch.tensor(values, dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine, group=group)
        table = [row.tolist() for row in gathered]
    for rank, row in enumerate(table):
        if row[0] and error is not None:
            raise error
        if row[0]:
            _fail(op, f"rank {rank} of the group rejected its arguments (its error names the "
                      f"argument)")
    for i, (name, _) in enumerate(shared, start=1):
        for rank, row in enumerate(table):
            if row[i] != table[0][i]:
                _fail(op, f"{name} differs between ranks 0 and {rank} of the group ({table[0][i]}"
                          f" and {row[i]}): every rank passes the same")
    return [row[1 + len(shared):] for row in table]


def _checksum(offsets: torch.Tensor) -> int:
    """Position-weighted sum (int64 wraps around): differs when the contents differ."""
    weights = torch.arange(offsets.numel(), dtype=torch.int64) * 2 + 1
    return int((offsets.long() * weights).sum())


def _rank_summary(cu_host: torch.Tensor, ratio: int, coff: int, world: int, zigzag: bool):
    """(local tokens, owned rows) of every rank of the group, from the global offsets."""
    chunks = world * (2 if zigzag else 1)
    seq = _sequences(cu_host, chunks, ratio, coff)
    rank, _ = _chunk_owner(torch.arange(chunks), world, zigzag)
    tokens = torch.zeros(world, dtype=torch.int64).index_add_(
        0, rank, (seq.bounds[:, 1:] - seq.bounds[:, :-1]).sum(0))
    rows = torch.zeros(world, dtype=torch.int64).index_add_(0, rank, seq.owned.sum(0))
    return tokens.tolist(), rows.tolist()


def _check_on_host(args, ratio, coff, layout, capacity, group, world):
    """The checks that read the offsets: local ones, then across the group. Returns the
    capacity (None: the group's largest owned-row count)."""
    kv, cu_seqlens, cu_seqlens_comp = args[0], args[3], args[4]
    names = ["the number of sequences (`cu_seqlens` length)",
             "`cu_seqlens` (a checksum of its contents)",
             "`cu_seqlens_comp` (a checksum of its contents)", "`ratio`", "`coff`",
             "`layout` (1 = zigzag)", "`capacity` (-1 = None)", "the width of `kv`",
             "the dtype of `kv` (index)"]
    error, values, own, summary = None, [-1] * len(names), [-1], ([0] * world, [0] * world)
    try:
        _shared_check(validation.check_arguments, *args, ratio, coff, capacity)
        cu_host, cuc_host = cu_seqlens.cpu(), cu_seqlens_comp.cpu()
        _shared_check(validation.check_offsets, cu_host, cuc_host, int(cu_host[-1]), ratio)
        summary = _rank_summary(cu_host, ratio, coff, world, layout == "zigzag")
        values = [cu_host.shape[0], _checksum(cu_host), _checksum(cuc_host), ratio, coff,
                  int(layout == "zigzag"), -1 if capacity is None else capacity, kv.shape[1],
                  validation.FLOAT_DTYPES.index(kv.dtype)]
        own = [kv.shape[0]]
    except (ValueError, TypeError) as caught:
        error = caught
    shared = list(zip(names, values))
    table = _agree(OP, group, _exchange_device(group, kv, cu_seqlens), shared, own, error)
    tokens, owned = summary
    for rank, (rows,) in enumerate(table):
        if rows < tokens[rank] or (capacity is None and rows != tokens[rank]):
            expected = "exactly" if capacity is None else "at least (rows past them are padding)"
            _fail(OP, f"`kv` of rank {rank} has {rows} tokens, but the {layout} layout of the "
                      f"global pack gives that rank {tokens[rank]}: it must have {expected} "
                      f"{tokens[rank]}")
    needed = max(owned, default=0)
    if capacity is not None and capacity < needed:
        rank = owned.index(needed)
        _fail(OP, f"`capacity` = {capacity} is smaller than the {needed} rows rank {rank} owns")
    return needed if capacity is None else capacity


# A graph break under torch.compile, reached only where the call reads the offsets on the host.
_check_on_host_eager = torch.compiler.disable(_check_on_host)


def _check_options(ratio, coff, layout, capacity) -> None:
    _shared_check(validation.check_ratio_coff, ratio, coff)
    if layout not in LAYOUTS:
        _fail(OP, f"`layout` must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool)
                                 or capacity < 0):
        _fail(OP, f"`capacity` must be an int >= 0 or None, got {capacity!r}")


def compressor(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor,
               cu_seqlens: torch.Tensor, cu_seqlens_comp: torch.Tensor, *, ratio: int, coff: int,
               group=None, layout: str = "contiguous", capacity: int | None = None):
    """csa::compressor over a context-parallel group; returns ``(rows, row_index)``.

    ``kv``/``score``: this rank's chunks of every sequence, in sequence order (sequence s of L
    tokens is cut at ``cu[s] + (c*L)//n``; contiguous: n = P, rank p holds chunk p; zigzag:
    n = 2P, rank p holds chunks p, 2P-1-p). The offsets are the global pack's, the same on
    every rank. ``rows``: the rows whose block's last token this rank holds, in global order,
    ``capacity`` of them (padding rows zero); ``row_index`` (int64): their global indices, -1
    for padding. ``capacity=None`` reads the offsets on the host, checks them across the group
    and sizes ``rows`` to the group's largest owned count; ``kv`` then holds exactly the
    layout's tokens. An int ``capacity`` never synchronizes on CUDA; ``kv`` may then carry
    padding tokens. Rows, ``grad_kv`` and ``grad_score`` are bit-identical to one
    csa::compressor call over the whole pack on the same device type; ``grad_ape`` (the whole
    pack's, on every rank) sums the ranks' fp32 partials in rank order. Every rank makes the
    call and runs its backward. docs/distributed.md has the design.
    """
    _check_options(ratio, coff, layout, capacity)
    group, world, rank = _resolve_group(group, OP)
    args = (kv, score, ape, cu_seqlens, cu_seqlens_comp)
    on_host = isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device.type == "cpu"
    if capacity is None or (on_host and not torch.compiler.is_compiling()):
        capacity = _check_on_host_eager(args, ratio, coff, layout, capacity, group, world)
    else:
        _shared_check(validation.check_arguments, *args, ratio, coff, capacity)
    if cu_seqlens.shape[0] == 1:  # no sequences: one empty one keeps every table non-empty
        cu_seqlens, cu_seqlens_comp = cu_seqlens.repeat(2), cu_seqlens_comp.repeat(2)
    zigzag = layout == "zigzag"
    segments = (cu_seqlens.shape[0] - 1) * (2 if zigzag else 1)
    geo = _Geometry(world, rank, zigzag, ratio, coff, kv.shape[1] // coff, segments,
                    coff * ratio - 1, kv.shape[0], capacity, capacity + segments * (coff - 1))
    plan = _plan(cu_seqlens, cu_seqlens_comp, geo)
    rows = _CompressorFunction.apply(kv, score, ape, geo, group, *plan)
    return rows, plan.row_index


def gather_rows(rows: torch.Tensor, row_index: torch.Tensor, total_comp: int, *, group=None):
    """Every rank's ``rows`` (from ``compressor``, the same shape on every rank) on every rank:
    ``(total_comp, d)`` in global order (``total_comp`` >= the true row count; rows no rank
    holds are zero). The backward sums the ranks' gradients of each row onto its owner in rank
    order, in fp32. CPU indices are checked against ``total_comp``; CUDA never synchronizes.
    """
    group, world, _ = _resolve_group(group, GATHER_OP)
    check = (isinstance(row_index, torch.Tensor) and row_index.device.type == "cpu"
             and not torch.compiler.is_compiling())
    error, values = None, [-1] * 4
    try:
        _check_gather_arguments(rows, row_index, total_comp)
        values = [rows.shape[0], rows.shape[1], validation.FLOAT_DTYPES.index(rows.dtype),
                  total_comp]
    except (ValueError, TypeError) as caught:
        if not check:
            raise
        error = caught
    if check:  # on values every rank sends: every rank raises alike, none waits in a gather
        names = ["the row count of `rows` (its capacity)", "the width of `rows`",
                 "the dtype of `rows` (index)", "`total_comp`"]
        _agree(GATHER_OP, group, _exchange_device(group, rows), list(zip(names, values)), [],
               error)
    return _GatherRowsFunction.apply(rows, row_index, total_comp, world, group, check)


def _check_gather_arguments(rows, row_index, total_comp) -> None:
    for name, tensor in (("rows", rows), ("row_index", row_index)):
        if not isinstance(tensor, torch.Tensor):
            _fail(GATHER_OP, f"`{name}` must be a tensor, got {type(tensor).__name__}", TypeError)
    if rows.dim() != 2 or rows.dtype not in validation.FLOAT_DTYPES:
        _fail(GATHER_OP, f"`rows` must be a 2-D float tensor (capacity, head_dim), got "
                         f"{rows.dtype} of shape {tuple(rows.shape)}")
    if row_index.dim() != 1 or row_index.dtype != torch.int64:
        _fail(GATHER_OP, f"`row_index` must be a 1-D int64 tensor, got {row_index.dtype} of "
                         f"shape {tuple(row_index.shape)}")
    if row_index.shape[0] != rows.shape[0]:
        _fail(GATHER_OP, f"`row_index` must have one entry per row of `rows` ({rows.shape[0]}), "
                         f"got {row_index.shape[0]}")
    if row_index.device != rows.device:
        _fail(GATHER_OP, f"`row_index` must be on the device of `rows` ({rows.device}), got "
                         f"{row_index.device}")
    if not isinstance(total_comp, int) or isinstance(total_comp, bool) or total_comp < 0:
        _fail(GATHER_OP, f"`total_comp` must be an int >= 0, got {total_comp!r}")
