"""Drivers for csa::compressor_extend tests on any device: whole sequences, random chunked
schedules, the one-shot csa::compressor comparator and the documented slot state written
out directly.

`expected_state` is written from the state layout alone (docs/serving.md), from the raw
tokens; it shares no code with csa_ops.reference_extend.
"""

from __future__ import annotations

import dataclasses
import random

import torch
from helpers import assert_bitwise_equal

from csa_ops import CompressorState, reference_extend, serving


@dataclasses.dataclass
class Requests:
    """Whole token sequences of several requests (what a one-shot call would see)."""

    kv: list
    score: list
    ape: torch.Tensor
    ratio: int
    coff: int
    head_dim: int

    @property
    def lengths(self) -> list:
        return [t.shape[0] for t in self.kv]

    @property
    def width(self) -> int:
        return self.coff * self.head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.kv[0].dtype

    @property
    def device(self) -> torch.device:
        return self.ape.device

    @property
    def acc(self) -> torch.dtype:
        return torch.float64 if self.dtype == torch.float64 else torch.float32


def make_requests(lengths, ratio: int, coff: int, head_dim: int, dtype=torch.float32,
                  device="cpu", seed: int = 0, ape_dtype=torch.float32) -> Requests:
    """Values drawn in fp64 on the CPU, so every dtype and device sees the same numbers."""
    gen = torch.Generator().manual_seed(seed)
    width = coff * head_dim

    def draw(rows, scale, to=dtype):
        x = torch.randn(rows, width, generator=gen, dtype=torch.float64) * scale
        return x.to(device=device, dtype=to)

    kv = [draw(n, 1.0) for n in lengths]
    score = [draw(n, 2.0) for n in lengths]
    return Requests(kv, score, draw(ratio, 0.5, ape_dtype), ratio, coff, head_dim)


def one_shot_rows(req: Requests) -> list:
    """Rows of each request from one csa::compressor call over the whole sequences."""
    lengths = req.lengths
    as_int32 = {"dtype": torch.int32, "device": req.device}
    cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], **as_int32)
    counts = [n // req.ratio for n in lengths]
    cuc = torch.tensor([0] + [sum(counts[:i + 1]) for i in range(len(counts))], **as_int32)
    # fp32(ape) is exactly what both ops add, whatever ape's dtype.
    out = torch.ops.csa.compressor(torch.cat(req.kv), torch.cat(req.score), req.ape.to(req.acc),
                                   cu, cuc, req.ratio, req.coff, None)
    return list(out.split(counts))


def random_schedule(lengths, ratio: int, seed: int, decode_tail: int = 0) -> list:
    """Steps of (request, new tokens) lists: random subsets in random order, until every
    request has consumed its sequence. Prefill pieces have length 0, 1, around ratio or
    larger; the last ``decode_tail`` tokens of a request come one per step (decode), mixed
    into the same batches as other requests' prefill."""
    rng = random.Random(seed)
    prefill = [max(n - decode_tail, 0) for n in lengths]
    consumed = [0] * len(lengths)
    steps = []

    def size(i: int) -> int:
        if consumed[i] >= prefill[i]:  # this request decodes while others may still prefill
            return min(rng.choice([0, 1, 1]), lengths[i] - consumed[i])
        want = rng.choice([0, 1, 1, 2, ratio - 1, ratio, ratio + 1, 2 * ratio + 3,
                           rng.randint(0, max(prefill[i], 1))])
        return max(0, min(want, prefill[i] - consumed[i]))

    while any(c < n for c, n in zip(consumed, lengths)):
        chosen = [i for i in range(len(lengths)) if rng.random() < 0.6] or [0]
        rng.shuffle(chosen)
        step = []
        for i in chosen:
            piece = size(i)
            consumed[i] += piece
            step.append((i, piece))
        steps.append(step)
    return steps


def run_schedule(req: Requests, schedule, state: CompressorState, slot_of, extra_rows=None,
                 start=None):
    """Drive ``schedule`` through csa::compressor_extend; return (rows per request, positions).

    ``extra_rows`` None passes total_comp=None; an int passes the true count plus that many
    padding rows, which must come back exact zeros. ``start``: the positions the requests
    have consumed before (None: all 0); the rows are those of this schedule's calls only.
    """
    consumed = list(start) if start is not None else [0] * len(req.kv)
    rows = [[] for _ in req.kv]
    for step in schedule:
        out, cuc, true_rows = extend_step(req, step, consumed, state, slot_of, extra_rows)
        if extra_rows is not None:
            assert out.shape[0] == true_rows + extra_rows
            assert int(torch.count_nonzero(out[true_rows:])) == 0, "padding rows not zero"
        bounds = cuc.tolist()
        assert bounds[-1] == true_rows
        for j, (i, piece) in enumerate(step):
            rows[i].append(out[bounds[j]:bounds[j + 1]])
            consumed[i] += piece
    per_request = [torch.cat(r) if r else req.kv[i].new_zeros(0, req.head_dim)
                   for i, r in enumerate(rows)]
    return per_request, consumed


def step_inputs(req: Requests, step, consumed, slot_of):
    """Packed (kv, score, cu_seqlens, start_pos, slots) of one step."""
    kv = [req.kv[i][consumed[i]:consumed[i] + n] for i, n in step]
    score = [req.score[i][consumed[i]:consumed[i] + n] for i, n in step]
    empty = req.kv[0].new_zeros(0, req.width)
    as_int32 = {"dtype": torch.int32, "device": req.device}
    cu = [0]
    for _, n in step:
        cu.append(cu[-1] + n)
    return (torch.cat(kv + [empty]), torch.cat(score + [empty]), torch.tensor(cu, **as_int32),
            torch.tensor([consumed[i] for i, _ in step], **as_int32),
            torch.tensor([slot_of[i] for i, _ in step], **as_int32))


def extend_step(req: Requests, step, consumed, state, slot_of, extra_rows=None):
    kv, score, cu, start_pos, slots = step_inputs(req, step, consumed, slot_of)
    true_rows = sum((consumed[i] + n) // req.ratio - consumed[i] // req.ratio for i, n in step)
    total_comp = None if extra_rows is None else true_rows + extra_rows
    out, cuc = torch.ops.csa.compressor_extend(kv, score, req.ape, cu, start_pos, slots,
                                               state.kv, state.score, req.ratio, req.coff,
                                               total_comp)
    return out, cuc, true_rows


def check_forked_prompt(ratio: int, coff: int, head_dim: int, dtype, device, prompt: int,
                        tails, sizes, fork) -> None:
    """Parallel samples of one prompt: requests that share request 0's first ``prompt``
    tokens and then go their own ways (``tails`` more tokens each, ``sizes`` a step, in
    mixed batches). Request 0 prefills the prompt into a slot; fork(state, src, dst) gives
    the other requests' slots (garbage before) that state; then all extend. Every request's
    rows (the prompt's counted for each) and state must equal one csa::compressor call over
    its whole sequence."""
    req = make_requests([prompt + t for t in tails], ratio, coff, head_dim, dtype, device,
                        seed=ratio + coff)
    for tokens in (req.kv, req.score):
        for i in range(1, len(tails)):
            tokens[i][:prompt] = tokens[0][:prompt]
    slot_of = permuted_slots(len(tails), len(tails) + 2, seed=ratio)
    state = CompressorState(len(tails) + 2, ratio, coff, head_dim, dtype, device)
    state.kv.fill_(float("nan"))
    state.score.fill_(float("nan"))
    prompt_rows = run_schedule(req, [[(0, prompt)]], state, slot_of)[0][0]
    fork(state, [slot_of[0]] * (len(tails) - 1), slot_of[1:])
    steps = max(-(-t // n) for n, t in zip(sizes, tails))
    schedule = [[(i, min(n, t - k * n)) for i, (n, t) in enumerate(zip(sizes, tails)) if k * n < t]
                for k in range(steps)]
    rows, consumed = run_schedule(req, schedule, state, slot_of, start=[prompt] * len(tails))
    assert_rows(req, [torch.cat([prompt_rows, r]) for r in rows], assert_bitwise_equal)
    assert_state(req, state, slot_of, consumed, assert_bitwise_equal)


def expected_state(req: Requests, i: int, position: int):
    """(kv, logits, specified) of request i's slot after ``position`` tokens, per the state
    layout."""
    r, window = req.ratio, req.coff * req.ratio
    kv = req.kv[i].new_zeros(window, req.width)
    logits = torch.full((window, req.width), float("-inf"), dtype=req.acc, device=req.device)
    specified = torch.zeros(window, dtype=torch.bool)
    q, m = divmod(position, r)

    def put(entry, token):
        kv[entry] = req.kv[i][token]
        logits[entry] = req.score[i][token].to(req.acc) + req.ape[token % r].to(req.acc)
        specified[entry] = True

    own = (req.coff - 1) * r
    for k in range(m):
        put(own + k, q * r + k)
    if req.coff == 2:
        specified[:r] = True  # the initial state while q == 0
        for k in range(r if q > 0 else 0):
            put(k, (q - 1) * r + k)
    return kv, logits, specified


def assert_state(req: Requests, state: CompressorState, slot_of, consumed, assert_equal):
    for i, position in enumerate(consumed):
        kv, logits, specified = expected_state(req, i, position)
        slot = slot_of[i]
        assert_equal(state.kv[slot][specified], kv[specified], f"kv_state of request {i}")
        assert_equal(state.score[slot][specified], logits[specified],
                     f"score_state of request {i}")


def assert_rows(req: Requests, rows, assert_equal):
    for i, (got, want) in enumerate(zip(rows, one_shot_rows(req))):
        assert_equal(got, want, f"rows of request {i}")


def permuted_slots(num_requests: int, num_slots: int, seed: int) -> list:
    return random.Random(seed).sample(range(num_slots), num_requests)


def case_id(case) -> str:
    """Test id of an invariant case (ratio, coff, head_dim, dtype, lengths, decode_tail,
    extra_rows)."""
    ratio, coff, head_dim, dtype, lengths, tail, extra = case
    return (f"r{ratio}c{coff}_d{head_dim}_{str(dtype).split('.')[-1]}_"
            f"L{'-'.join(map(str, lengths))}_tail{tail}_pad{extra}")


INT32_MAX = 2**31 - 1
NUM_ISOLATED = 9  # requests of check_invalid_requests_isolated's batch


def drawer(device, dtype, seed: int):
    """draw(*shape, to=dtype): normal values drawn in fp64 on the CPU (any device and dtype
    sees the same numbers)."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape, to=dtype):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device=device,
                                                                         dtype=to)

    return draw


def twin_states(draw, num_slots, ratio, coff, head_dim, dtype, device):
    """(state, clean): two CompressorStates holding the same random content."""
    state = CompressorState(num_slots, ratio, coff, head_dim, dtype, device)
    state.kv.copy_(draw(*state.kv.shape))
    state.score.copy_(draw(*state.score.shape, to=torch.float32))
    clean = CompressorState(num_slots, ratio, coff, head_dim, dtype, device)
    clean.kv.copy_(state.kv)
    clean.score.copy_(state.score)
    return state, clean


def check_invalid_requests_isolated(extend, ratio: int, coff: int, head_dim: int, tokens: int,
                                    dtype, device) -> None:
    """assert_invalid_requests_isolated on a fixed batch of NUM_ISOLATED requests: invalid
    ones of every kind (slot out of range, negative or overflowing positions, tokens past T
    or reversed), slots -1 and 9 next to the valid slots 0 and 8 (the first and last of 9:
    the op's shape check wants a slot per request), and valid requests that each emit rows
    at any ratio."""
    draw = drawer(device, dtype, 3)
    width = coff * head_dim
    kv, score = draw(tokens, width), draw(tokens, width)
    ape = draw(ratio, width, to=torch.float32)
    cu = [0, 10, 14, 20, 24, tokens + 12, 30, 40, 45, 47]
    start = [ratio - 3, 3, ratio - 4, -4, 1, 2, INT32_MAX - 5, 2 * ratio - 2, ratio - 1]
    slots = [2, 9, 5, -1, 3, 4, 6, 0, 8]
    valid = [0, 2, 7, 8]
    assert len(slots) == NUM_ISOLATED and valid == valid_requests(cu, start, slots, tokens, 9)
    assert all(rows_of(start[b], cu[b + 1] - cu[b], ratio) > 0 for b in valid)
    state, clean = twin_states(draw, 9, ratio, coff, head_dim, dtype, device)
    assert_invalid_requests_isolated(extend, kv, score, ape, cu, start, slots, state, clean,
                                     ratio, coff)


def unchecked_extend(*args):
    """The path a CUDA call of the op takes, on any device: every metadata check, no check
    of contents (slots, positions, offsets), then the reference, which runs where the
    kernels do not."""
    serving.check_arguments(*args)
    return reference_extend.compressor_extend_reference(*args)


def valid_requests(cu, start, slots, num_tokens: int, num_slots: int) -> list:
    """The valid requests (slot in range, position >= 0, tokens inside the pack), from
    Python lists (written apart from the reference)."""
    return [b for b in range(len(start))
            if 0 <= slots[b] < num_slots and start[b] >= 0 and 0 <= cu[b] <= cu[b + 1]
            <= num_tokens and start[b] + cu[b + 1] - cu[b] <= INT32_MAX]


def rows_of(start: int, length: int, ratio: int) -> int:
    """A request's rows as the serving contract counts them (negative positions and
    lengths as 0)."""
    start, length = max(start, 0), max(length, 0)
    return (start + length) // ratio - start // ratio


def int32_wrap(value: int) -> int:
    """`value` as int32 arithmetic leaves it (two's complement wrap)."""
    return (value + 2**31) % 2**32 - 2**31


def int32_tensor(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def assert_invalid_requests_isolated(extend, kv, score, ape, cu, start, slots, state, clean,
                                     ratio: int, coff: int, total_comp=None) -> None:
    """One call of `extend` (the op's signature) on a batch that mixes valid and invalid
    requests (`cu`, `start`, `slots`: Python lists of int32 values; the valid ones' tokens
    must not overlap): invalid requests get zero rows and leave every slot alone, the valid
    ones get the rows and state of a clean call of them alone (`clean`: a copy of `state`),
    cu_seqlens_comp counts every request's rows (lengths in int32, like the op's; offsets
    saturating at INT32_MAX), and padding rows past them are zeros."""
    device, batch = kv.device, len(start)
    valid = valid_requests(cu, start, slots, kv.shape[0], state.kv.shape[0])
    untouched_kv, untouched_score = state.kv.clone(), state.score.clone()
    out, cuc = extend(kv, score, ape, int32_tensor(cu, device), int32_tensor(start, device),
                      int32_tensor(slots, device), state.kv, state.score, ratio, coff,
                      total_comp)
    rows = [rows_of(start[b], int32_wrap(cu[b + 1] - cu[b]), ratio) for b in range(batch)]
    bounds = [min(sum(rows[:b]), INT32_MAX) for b in range(batch + 1)]
    assert cuc.tolist() == bounds
    assert out.shape == (bounds[-1] if total_comp is None else total_comp, kv.shape[1] // coff)
    assert int(torch.count_nonzero(out[bounds[-1]:])) == 0, "padding rows"
    want_bounds, want = [0], None
    if valid:
        pieces = [(cu[b], cu[b + 1]) for b in valid]
        clean_cu = [0]
        for lo, hi in pieces:
            clean_cu.append(clean_cu[-1] + hi - lo)
        want, want_cuc = extend(torch.cat([kv[lo:hi] for lo, hi in pieces]),
                                torch.cat([score[lo:hi] for lo, hi in pieces]), ape,
                                int32_tensor(clean_cu, device),
                                int32_tensor([start[b] for b in valid], device),
                                int32_tensor([slots[b] for b in valid], device), clean.kv,
                                clean.score, ratio, coff, None)
        want_bounds = want_cuc.tolist()
    for b in range(batch):
        got = out[bounds[b]:bounds[b + 1]]
        if b in valid:
            j = valid.index(b)
            assert_bitwise_equal(got, want[want_bounds[j]:want_bounds[j + 1]], f"rows of {b}")
        else:
            assert int(torch.count_nonzero(got)) == 0, f"rows of invalid request {b}"
    valid_slots = [slots[b] for b in valid]
    for slot in range(state.kv.shape[0]):
        expect = (clean.kv[slot], clean.score[slot]) if slot in valid_slots else (
            untouched_kv[slot], untouched_score[slot])
        assert_bitwise_equal(state.kv[slot], expect[0], f"kv_state slot {slot}")
        assert_bitwise_equal(state.score[slot], expect[1], f"score_state slot {slot}")


def check_rows_past_int32(extend, ratio: int, coff: int, head_dim: int, tokens: int,
                          batch: int, extra_rows: int, dtype, device) -> None:
    """assert_invalid_requests_isolated at a static capacity of `extra_rows` past request
    0's rows: request 0 is valid (all `tokens` new tokens, from position 3, slot 0); requests
    1.. are invalid, each counting int32-wrapped 2**31 - 1 tokens, so the batch counts rows
    past int32 and the offsets must saturate."""
    draw = drawer(device, dtype, 7)
    width = coff * head_dim
    kv, score, ape = draw(tokens, width), draw(tokens, width), draw(ratio, width,
                                                                      to=torch.float32)
    cu = [0] + [int32_wrap(tokens + b * INT32_MAX) for b in range(batch)]
    start = [3] + [5 * b for b in range(1, batch)]
    rows = [rows_of(p, int32_wrap(hi - lo), ratio) for p, lo, hi in zip(start, cu[:-1], cu[1:])]
    assert sum(rows) > INT32_MAX, "the batch must count rows past int32"
    assert valid_requests(cu, start, list(range(batch)), tokens, batch) == [0]
    state, clean = twin_states(draw, batch, ratio, coff, head_dim, dtype, device)
    assert_invalid_requests_isolated(extend, kv, score, ape, cu, start, list(range(batch)),
                                     state, clean, ratio, coff, rows[0] + extra_rows)
