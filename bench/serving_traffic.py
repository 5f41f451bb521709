"""The DRAM traffic any csa::compressor_extend implementation must move, from the serving
state's layout: the floor that bench_serving.py sets beside its timings.

Counted per request, in bytes: the new tokens (kv and score), the emitted rows, the old
state's (entry, column half) pairs that emitted windows or moved entries read, and the new
state's pairs whose content changes. A pair is head_dim values in kv's dtype plus head_dim
fp32 logits. Entries that keep their content where they are cost nothing; nothing is
counted twice within a request. A lower bound: it assumes every byte crosses DRAM once.
"""

from __future__ import annotations


def _state_entry(position: int, consumed: int, ratio: int, coff: int) -> int | None:
    """The entry holding `position` in a slot that has consumed `consumed` tokens, or None
    when the state does not hold it."""
    block = consumed // ratio
    if block * ratio <= position < consumed:
        return (coff - 1) * ratio + position - block * ratio
    if coff == 2 and (block - 1) * ratio <= position < block * ratio:
        return position - (block - 1) * ratio
    return None


def request_bytes(start: int, length: int, ratio: int, coff: int, head_dim: int,
                  itemsize: int) -> int:
    """Bytes one request of a call moves at least: `length` new tokens from position
    `start`."""
    end = start + length
    pair = head_dim * (itemsize + 4)
    reads: set[tuple[int, int]] = set()  # (position, half) of the old state
    rows = end // ratio - start // ratio
    for block in range(start // ratio, end // ratio):
        first = (block - (coff - 1)) * ratio
        for k in range(coff * ratio):
            if 0 <= first + k < start:
                reads.add((first + k, k // ratio))
    writes = 0
    base = (end // ratio - (coff - 1)) * ratio  # the new state's entry 0
    for entry in range(coff * ratio):
        position = base + entry
        if position < 0 or position >= end:
            continue  # the initial state or an unspecified entry: nothing to write
        if position >= start:
            writes += coff  # a new token lands in the state
            continue
        if _state_entry(position, start, ratio, coff) != entry:
            reads.update((position, half) for half in range(coff))
            writes += coff  # an old entry moves
    tokens = 2 * length * coff * head_dim * itemsize
    return tokens + rows * head_dim * itemsize + (len(reads) + writes) * pair


def call_bytes(starts, lengths, ratio: int, coff: int, head_dim: int, itemsize: int) -> int:
    """Bytes of a whole call (requests never share a slot), plus cu_seqlens, start_pos and
    slots (int32 each) and cu_seqlens_comp."""
    metadata = 4 * (4 * len(starts) + 2)
    return metadata + sum(request_bytes(int(p), int(n), ratio, coff, head_dim, itemsize)
                          for p, n in zip(starts, lengths, strict=True))
