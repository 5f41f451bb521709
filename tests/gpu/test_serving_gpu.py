"""csa::compressor_extend on CUDA: the serving invariant against the CUDA csa::compressor,
a decode step in a CUDA graph, no host sync, and memory safety for any slots and positions
(run the `adversarial` tests under compute-sanitizer memcheck)."""

from __future__ import annotations

import random
import re
import subprocess
import sys

import pytest
import torch
from helpers import assert_bitwise_equal, assert_within_one_step, cancel_in_pairs
from serving_helpers import (
    NUM_ISOLATED,
    assert_rows,
    assert_state,
    case_id,
    check_forked_prompt,
    check_invalid_requests_isolated,
    make_requests,
    permuted_slots,
    random_schedule,
    run_schedule,
)

import csa_ops
from csa_ops import CompressorState
from csa_ops.reference_extend import rows_of_requests

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
OP = torch.ops.csa.compressor_extend.default

# (ratio, coff, head_dim, dtype, lengths, decode_tail, extra_rows): the production configs
# first, then odd ones.
CASES = [
    (4, 2, 512, torch.bfloat16, (700, 0, 1, 129), 20, 2),
    (4, 2, 128, torch.bfloat16, (1000, 3, 517), 30, None),
    (128, 1, 512, torch.bfloat16, (1300, 127, 0, 300), 140, 1),
    (128, 2, 128, torch.bfloat16, (600, 260), 130, None),
    (2, 2, 512, torch.bfloat16, (333, 2, 90), 9, 3),
    (4, 2, 512, torch.float16, (257, 1, 40), 12, 1),
    (4, 1, 256, torch.float16, (257, 8), 9, None),
    (5, 2, 65, torch.float32, (211, 0, 14), 11, 1),
    (1, 1, 64, torch.float16, (40, 7), 5, 2),
    # streaming-family windows past the register windows: odd widths, one-element vectors
    (64, 2, 65, torch.float16, (300, 129, 0, 64), 70, 2),
    (33, 1, 96, torch.bfloat16, (200, 33, 5), 40, None),
]


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_chunked_extend_matches_cuda_compressor(case):
    """Bitwise against the CUDA csa::compressor over whole sequences: the serving contract."""
    ratio, coff, head_dim, dtype, lengths, tail, extra_rows = case
    req = make_requests(lengths, ratio, coff, head_dim, dtype, device="cuda", seed=1)
    slot_of = permuted_slots(len(lengths), len(lengths) + 5, 1)
    state = CompressorState(len(lengths) + 5, ratio, coff, head_dim, dtype, "cuda")
    rows, consumed = run_schedule(req, random_schedule(lengths, ratio, 1, decode_tail=tail),
                                  state, slot_of, extra_rows)
    assert_rows(req, rows, assert_bitwise_equal)
    assert_state(req, state, slot_of, consumed, assert_bitwise_equal)


# (first pieces, the second call's pieces, padding rows): 2000-odd tokens each, then
# bench_serving.py's prefill (4 x 2048 new tokens).
SPLIT_PREFILLS = [((53, 300, 70, 129), (2047, 1929, 0, 1921), 3),
                  ((1000, 37, 4099, 5), (2048,) * 4, None)]


@pytest.mark.parametrize("pieces", SPLIT_PREFILLS, ids=("uneven", "bench"))
@pytest.mark.parametrize("ratio,coff,head_dim", [(128, 1, 512), (128, 2, 128)])
def test_split_prefill_from_state_matches_cuda_compressor(ratio, coff, head_dim, pieces):
    """Long pieces continuing from state (chunked prefill: four requests, then each one's
    next 2000-odd tokens in one call) split into the requests' launch and the rows' launch,
    which runs the forward's own loop (at d512 r128 c1 its rows placed by lanes): rows
    bitwise those of csa::compressor over the whole sequences, padding rows zeros, the state
    that of one call over all tokens."""
    from csa_ops import host
    from csa_ops.kernels import extend_plan

    first, second, extra_rows = pieces
    lengths = [f + n for f, n in zip(first, second, strict=True)]
    req = make_requests(lengths, ratio, coff, head_dim, torch.bfloat16, device="cuda", seed=5)
    slot_of = permuted_slots(len(lengths), 7, 5)
    state = CompressorState(7, ratio, coff, head_dim, torch.bfloat16, "cuda")
    schedule = [list(enumerate(first)), list(enumerate(second))]
    tokens = sum(second)
    problem = host.extend_problem(req.kv[0].new_empty(tokens, req.width), ratio, coff,
                                  len(lengths))
    assert problem.key.family == "streaming" and problem.key.knobs.part == 1
    num_rows = sum((f + n) // ratio - f // ratio for f, n in zip(first, second, strict=True))
    planned = extend_plan.plans(problem.key, tokens, len(lengths),
                                num_rows + (extra_rows or 0), problem.num_sms)
    (requests_launch, _), (rows_launch, _) = planned
    assert not requests_launch.knobs.lane_requests
    if (ratio, coff, head_dim) == (128, 1, 512):  # 2 rows or more per group
        assert rows_launch.knobs.lane_requests
    rows, consumed = run_schedule(req, schedule, state, slot_of, extra_rows=extra_rows)
    assert_rows(req, rows, assert_bitwise_equal)
    assert_state(req, state, slot_of, consumed, assert_bitwise_equal)


@pytest.mark.parametrize("ratio,coff", [(4, 2), (4, 1)])
def test_decode_batch_with_a_long_piece_and_padding(ratio, coff):
    """A decode step whose every request completes a block, batched with one long piece
    whose rows (state-reading ones, then rows of new tokens only) follow theirs, then 300
    padding rows: row items of every kind in one launch."""
    decoders, long = 40, 11 * ratio + 3
    lengths = [2 * ratio] * decoders + [long]
    req = make_requests(lengths, ratio, coff, 128, torch.bfloat16, device="cuda", seed=4)
    schedule = [[(i, 2 * ratio - 1) for i in range(decoders)],
                [(i, 1) for i in range(decoders)] + [(decoders, long)]]
    slot_of = permuted_slots(len(lengths), len(lengths) + 3, 4)
    state = CompressorState(len(lengths) + 3, ratio, coff, 128, torch.bfloat16, "cuda")
    rows, consumed = run_schedule(req, schedule, state, slot_of, extra_rows=300)
    assert consumed == lengths
    assert_rows(req, rows, assert_bitwise_equal)
    assert_state(req, state, slot_of, consumed, assert_bitwise_equal)


@pytest.mark.parametrize("ratio,coff", [(4, 2), (4, 1)])
def test_long_calls_of_few_requests_place_rows_by_lanes(ratio, coff):
    """Calls of at least LANE_TOKENS new tokens and at most LANE_BATCH requests run their
    row items through the lanes kernel: a prefill, then a call continuing two requests from
    state beside a short and a one-token request, then padding rows. Bitwise against the
    CUDA csa::compressor over the whole sequences."""
    from csa_ops import host
    from csa_ops.kernels import extend_plan

    lengths = (5000, 4200, 37, 1)
    schedule = [[(0, 2100), (1, 2000)], [(0, 2900), (1, 2200), (2, 37), (3, 1)]]
    req = make_requests(lengths, ratio, coff, 128, torch.bfloat16, device="cuda", seed=6)
    for call in schedule:
        tokens = sum(n for _, n in call)
        problem = host.extend_problem(req.kv[0].new_empty(tokens, req.width), ratio, coff,
                                      len(call))
        assert problem.key.knobs.lane_requests, call
        assert extend_plan.size_class(tokens, len(call)) == extend_plan.SizeClass.FEW_LARGE
    slot_of = permuted_slots(len(lengths), len(lengths) + 2, 6)
    state = CompressorState(len(lengths) + 2, ratio, coff, 128, torch.bfloat16, "cuda")
    rows, consumed = run_schedule(req, schedule, state, slot_of, extra_rows=3)
    assert consumed == list(lengths)
    assert_rows(req, rows, assert_bitwise_equal)
    assert_state(req, state, slot_of, consumed, assert_bitwise_equal)


@pytest.mark.parametrize("ratio,coff", [(4, 2), (4, 1), (2, 2)])
def test_one_token_per_request_calls_with_uneven_pieces(ratio, coff):
    """Calls with as many new tokens as requests take the decode-step kernel, in which each
    request pools all of its rows: pieces of 0, 1 and many tokens (rows past coff, pooled one
    after another), then padding rows, which that kernel's items zero."""
    from csa_ops import host

    rng = random.Random(11)
    num_requests, head_dim = 12, 128
    lengths = [8 * num_requests] * num_requests
    req = make_requests(lengths, ratio, coff, head_dim, torch.bfloat16, device="cuda", seed=6)
    one_each = req.kv[0][:num_requests]  # a call's kv: as many tokens as requests
    assert host.extend_problem(one_each, ratio, coff, num_requests).key.knobs.request_rows
    schedule = [[(i, 0) for i in range(num_requests - 1)] + [(num_requests - 1, num_requests)],
                [(i, 1) for i in range(num_requests)]]
    consumed = [1] * (num_requests - 1) + [num_requests + 1]  # after the first two steps
    for _ in range(5):  # random compositions of k tokens into k pieces
        members = rng.sample(range(num_requests), rng.randint(1, num_requests))
        cuts = sorted(rng.randint(0, len(members)) for _ in range(len(members) - 1))
        pieces = [b - a for a, b in zip([0, *cuts], [*cuts, len(members)])]
        schedule.append(list(zip(members, pieces)))
        for i, piece in zip(members, pieces):
            consumed[i] += piece
    schedule.append([(i, n - c) for i, (n, c) in enumerate(zip(lengths, consumed))])
    slot_of = permuted_slots(num_requests, num_requests + 4, 6)
    state = CompressorState(num_requests + 4, ratio, coff, head_dim, torch.bfloat16, "cuda")
    rows, consumed = run_schedule(req, schedule, state, slot_of, extra_rows=5)
    assert consumed == lengths
    assert_rows(req, rows, assert_bitwise_equal)
    assert_state(req, state, slot_of, consumed, assert_bitwise_equal)


@pytest.mark.parametrize("ratio,coff", [(4, 2), (128, 1)], ids=("window", "streaming"))
def test_many_requests_count_rows_over_several_chunks(ratio, coff):
    """1030 requests: a call of their first tokens (pieces of 0 included), then two decode
    steps. Each thread counts the rows of several chunks of requests (Batch.load_counts),
    the last one partial: in the first call's batch scans and in the steps' row sums
    (register windows) or scans (streaming). Rows, cu_seqlens_comp, padding and state
    bitwise against the one-shot csa::compressor and the documented state."""
    from csa_ops import host
    from csa_ops.kernels.shared import requests

    num_requests, head_dim, num_slots = 1030, 64, 1037
    rng = random.Random(5)
    prefix = [rng.randint(0, 2 * ratio + 1) for _ in range(num_requests)]
    lengths = [p + 2 for p in prefix]
    req = make_requests(lengths, ratio, coff, head_dim, torch.bfloat16, device="cuda", seed=8)
    step_kv = torch.empty(num_requests, coff * head_dim, dtype=torch.bfloat16, device="cuda")
    threads = host.extend_problem(step_kv, ratio, coff, num_requests).key.knobs.threads
    assert num_requests > 2 * requests.COUNTS_AHEAD * threads  # at least three chunks
    one_each = [(i, 1) for i in range(num_requests)]
    schedule = [list(enumerate(prefix)), one_each, one_each]
    slot_of = permuted_slots(num_requests, num_slots, 3)
    state = CompressorState(num_slots, ratio, coff, head_dim, torch.bfloat16, "cuda")
    rows, consumed = run_schedule(req, schedule, state, slot_of, extra_rows=4)
    assert consumed == lengths
    assert_rows(req, rows, assert_bitwise_equal)
    assert_state(req, state, slot_of, consumed, assert_bitwise_equal)


def _decode_inputs(batch, ratio, coff, head_dim, num_slots, steps, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    width = coff * head_dim

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", generator=gen).to(dtype)

    tokens = [(randn(batch, width), randn(batch, width)) for _ in range(steps)]
    state = CompressorState(num_slots, ratio, coff, head_dim, torch.bfloat16, "cuda")
    state.kv.copy_(randn(*state.kv.shape))
    state.score.copy_(randn(*state.score.shape, dtype=torch.float32))
    slots = torch.randperm(num_slots, device="cuda", generator=gen)[:batch].int()
    # Every request completes a block within 4 steps, some their first (coff 2: no history).
    blocks = torch.randint(0, 3, (batch,), device="cuda", generator=gen)
    start = (blocks * ratio + ratio - 1 - torch.arange(batch, device="cuda") % min(ratio, 4))
    start = start.clamp(min=0).int()
    return tokens, state, slots, start, randn(ratio, width, dtype=torch.float32)


@pytest.mark.parametrize("ratio,coff", [(4, 2), (128, 1)])
def test_decode_graph_replays_match_eager_bitwise(ratio, coff):
    _replay_decode_steps(ratio, coff, 512, 64, warm_up=True)


def test_a_capture_names_the_precompile_its_kernels_need():
    # A configuration no other test runs: nothing has compiled its kernels. The capture's
    # error names the call that compiles them; after it the step captures with no eager
    # call first.
    ratio, coff, head_dim, batch = 6, 2, 48, 8
    tokens, state, slots, start, ape = _decode_inputs(batch, ratio, coff, head_dim, 16, 1)
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    named = "csa_ops.precompile_extend(ratio=6, head_dim=48, coff=2, dtype=torch.bfloat16)"
    with pytest.raises(RuntimeError, match=re.escape(named)), \
            torch.cuda.graph(torch.cuda.CUDAGraph()):
        OP(*tokens[0], ape, cu, start, slots, state.kv, state.score, ratio, coff, batch)
    csa_ops.precompile_extend(ratio, head_dim, coff, torch.bfloat16)
    _replay_decode_steps(ratio, coff, head_dim, batch, warm_up=False)


def _replay_decode_steps(ratio, coff, head_dim, batch, warm_up):
    """A decode step captured in a CUDA graph (after an eager one on a scratch state where
    `warm_up`), replayed over advancing positions: rows, offsets and state bitwise those of
    eager steps."""
    steps = min(2 * ratio + 3, 9)
    tokens, state, slots, start, ape = _decode_inputs(batch, ratio, coff, head_dim, 96, steps)
    eager = CompressorState(96, ratio, coff, head_dim, torch.bfloat16, "cuda")
    eager.kv.copy_(state.kv)
    eager.score.copy_(state.score)
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    static_kv, static_score = (t.clone() for t in tokens[0])
    static_pos = start.clone()

    def step(kv_state, score_state, kv, score, pos):
        return OP(kv, score, ape, cu, pos, slots, kv_state, score_state, ratio, coff, batch)

    if warm_up:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # outside the capture, on a scratch state
            scratch = CompressorState(96, ratio, coff, head_dim, torch.bfloat16, "cuda")
            step(scratch.kv, scratch.score, static_kv, static_score, static_pos)
        torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out, graph_cuc = step(state.kv, state.score, static_kv, static_score, static_pos)
    for i, (kv, score) in enumerate(tokens):
        static_kv.copy_(kv)
        static_score.copy_(score)
        static_pos.copy_(start + i)
        graph.replay()
        want, want_cuc = step(eager.kv, eager.score, kv, score, start + i)
        assert_bitwise_equal(graph_out, want, f"rows of step {i}")
        assert_bitwise_equal(graph_cuc, want_cuc, f"cu_seqlens_comp of step {i}")
    assert_bitwise_equal(state.kv, eager.kv, "kv_state")
    assert_bitwise_equal(state.score, eager.score, "score_state")


@pytest.mark.parametrize("piece", [150, 1400], ids=("scan", "lanes"))
@pytest.mark.parametrize("ratio,coff", [(4, 2), (4, 1), (128, 1)])
def test_split_calls_in_one_graph_match_eager_bitwise(ratio, coff, piece):
    """Calls past the decode-sized class run as two launches whose second starts without
    waiting for the first (PDL): three chunked-prefill calls captured back to back in one
    graph, each continuing the state the one before it wrote, equal eager calls bitwise.
    With 3 x 1400 new tokens the register-window row items go by lanes (r128: the
    streaming family, whose rows run in the forward's loop)."""
    from csa_ops import host

    gen = torch.Generator(device="cuda").manual_seed(12)
    batch, head_dim, num_slots, calls = 3, 256, 5, 3
    width = coff * head_dim

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", generator=gen).to(dtype)

    pieces = [(randn(batch * piece, width), randn(batch * piece, width)) for _ in range(calls)]
    key = host.extend_problem(pieces[0][0], ratio, coff, batch).key
    assert key.knobs.part == 1
    assert getattr(key.knobs, "lane_requests", piece == 1400) == (piece == 1400)
    ape = randn(ratio, width, dtype=torch.float32)
    cu = torch.arange(0, (batch + 1) * piece, piece, dtype=torch.int32, device="cuda")
    first = torch.tensor([0, 7, 1001], dtype=torch.int32, device="cuda")
    slots = torch.tensor([4, 0, 2], dtype=torch.int32, device="cuda")
    capacity = batch * (piece // ratio + 1)
    graph_state, eager_state, scratch = (
        CompressorState(num_slots, ratio, coff, head_dim, torch.bfloat16, "cuda")
        for _ in range(3))
    graph_state.kv.copy_(randn(*graph_state.kv.shape))
    graph_state.score.copy_(randn(*graph_state.score.shape, dtype=torch.float32))
    for other in (eager_state, scratch):
        other.kv.copy_(graph_state.kv)
        other.score.copy_(graph_state.score)

    def run(state):
        return [OP(kv, score, ape, cu, first + i * piece, slots, state.kv, state.score, ratio,
                   coff, capacity) for i, (kv, score) in enumerate(pieces)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(scratch)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = run(graph_state)
    graph.replay()
    want = run(eager_state)
    for i, ((rows, cuc), (want_rows, want_cuc)) in enumerate(zip(got, want, strict=True)):
        assert_bitwise_equal(rows, want_rows, f"rows of call {i}")
        assert_bitwise_equal(cuc, want_cuc, f"cu_seqlens_comp of call {i}")
    assert_bitwise_equal(graph_state.kv, eager_state.kv, "kv_state")
    assert_bitwise_equal(graph_state.score, eager_state.score, "score_state")


def _fork_in_graph(state, src, dst):
    """copy_slots from device tensors, captured in a CUDA graph and replayed."""
    src, dst = (torch.tensor(s, dtype=torch.int32, device="cuda") for s in (src, dst))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        state.copy_slots(src, dst)
    graph.replay()


@pytest.mark.parametrize("ratio,coff,prompt,tails,sizes", [
    (4, 2, 701, (40, 1, 0, 300), (1, 1, 1, 100)),
    (128, 1, 1300, (150, 0, 300), (1, 1, 129)),
])
@pytest.mark.parametrize("captured", [False, True], ids=["eager", "graph"])
def test_copy_slots_forks_a_prompt_for_parallel_samples(ratio, coff, prompt, tails, sizes,
                                                        captured):
    """Rows and state of forked requests equal the CUDA csa::compressor over each whole
    sequence bitwise, with the fork eager (host slots) or replayed from a graph."""
    fork = _fork_in_graph if captured else (lambda state, src, dst: state.copy_slots(src, dst))
    check_forked_prompt(ratio, coff, 512, torch.bfloat16, "cuda", prompt, tails, sizes, fork)


@pytest.mark.parametrize("call", ["reset(minus_one)", "copy_slots(zero, minus_one)",
                                  "copy_slots(minus_one, zero)"])
def test_negative_device_slots_stop_at_torchs_index_assertion(call):
    """A device tensor's slots are not read on the host; a negative one must not wrap to a
    slot counted from the end (torch's indexing would), but trip the device-side index
    assertion, which ends the process's CUDA context: hence a process of its own."""
    code = ("import torch, csa_ops\n"
            "state = csa_ops.CompressorState(3, 4, 2, 8, torch.bfloat16, 'cuda')\n"
            "zero, minus_one = (torch.tensor([v], device='cuda') for v in (0, -1))\n"
            "state.kv.fill_(1.0)\n"
            f"state.{call}\n"
            "print('last slot kept:', bool((state.kv[2] == 1).all()))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode != 0, result.stdout
    assert "device-side assert" in result.stderr, result.stderr[-2000:]


def test_static_capacity_never_syncs():
    tokens, state, slots, start, ape = _decode_inputs(16, 4, 2, 128, 32, 1)
    cu = torch.arange(17, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        OP(*tokens[0], ape, cu, start, slots, state.kv, state.score, 4, 2, 16)
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def test_opcheck_cuda():
    tokens, state, slots, start, ape = _decode_inputs(8, 4, 2, 64, 16, 1)
    cu = torch.arange(9, dtype=torch.int32, device="cuda")
    for total_comp in (8, None):
        torch.library.opcheck(OP, (*tokens[0], ape, cu, start, slots, state.kv, state.score, 4,
                                   2, total_comp))


def test_compile_decode_step_matches_eager(compile_env):
    tokens, state, slots, start, ape = _decode_inputs(32, 4, 2, 128, 40, 9)
    eager_kv, eager_score = state.kv.clone(), state.score.clone()
    cu = torch.arange(33, dtype=torch.int32, device="cuda")

    def step(kv, score, pos, kv_state, score_state):
        out, cuc = OP(kv, score, ape, cu, pos, slots, kv_state, score_state, 4, 2, 32)
        return out * 1.0, cuc

    compiled = torch.compile(step, fullgraph=True)
    for i, (kv, score) in enumerate(tokens):
        got = compiled(kv, score, start + i, state.kv, state.score)
        want = step(kv, score, start + i, eager_kv, eager_score)
        assert_bitwise_equal(got[0], want[0], f"rows of step {i}")
    assert_bitwise_equal(state.kv, eager_kv, "kv_state")
    assert_bitwise_equal(state.score, eager_score, "score_state")


def test_more_requests_than_slots_is_an_error_on_cuda():
    tokens, _state, slots, start, ape = _decode_inputs(8, 4, 2, 64, 8, 1)
    cu = torch.arange(9, dtype=torch.int32, device="cuda")
    small = CompressorState(4, 4, 2, 64, torch.bfloat16, "cuda")
    with pytest.raises(ValueError, match="8 requests cannot have distinct slots among 4"):
        OP(*tokens[0], ape, cu, start, slots, small.kv, small.score, 4, 2, 8)


@pytest.mark.parametrize("ratio,coff", [(4, 2), (128, 1), (1, 2)])
def test_adversarial_slots_and_positions_stay_in_bounds(ratio, coff):
    """No content checks run on CUDA: any slots, positions and offsets must index in bounds
    (PyTorch's device-side index asserts fire otherwise; memcheck sees the rest). Inputs
    sit at tensor ends (no caching allocator under the sanitizer job)."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    batch, head_dim, num_slots = 6, 64, 8  # more slots than requests: metadata passes
    width = coff * head_dim
    state = CompressorState(num_slots, ratio, coff, head_dim, torch.bfloat16, "cuda")
    ape = torch.randn(ratio, width, device="cuda", generator=gen)
    for trial in range(12):
        tokens = int(torch.randint(0, 20, (), generator=gen, device="cuda"))
        kv = torch.randn(tokens, width, device="cuda", generator=gen).bfloat16()
        score = torch.randn(tokens, width, device="cuda", generator=gen).bfloat16()
        cu = torch.randint(-30, 40, (batch + 1,), device="cuda", generator=gen).int()
        start = torch.randint(-2**31, 2**31 - 1, (batch,), device="cuda", generator=gen,
                              dtype=torch.int64).int()
        if trial % 2:
            start = start % (4 * ratio)
        slots = torch.randint(-2 * num_slots, 2 * num_slots, (batch,), device="cuda",
                              generator=gen).int()
        # Padding past the true count: below it the kernel stops the call.
        rows = max(7, int(rows_of_requests(cu, start, ratio).sum()))
        out, cuc = OP(kv, score, ape, cu, start, slots, state.kv, state.score, ratio, coff,
                      rows)
        torch.cuda.synchronize()
        assert out.shape == (rows, head_dim) and cuc.shape == (batch + 1,)


@pytest.mark.parametrize("ratio,coff,head_dim", [(4, 2, 512), (4, 1, 128), (2, 2, 512),
                                                 (128, 1, 512), (128, 2, 128)])
def test_configs_run_the_extend_kernel(ratio, coff, head_dim):
    """Both families (register windows, streaming for r128) run a kernel through a prepared
    call: a repeated signature looks nothing up."""
    from csa_ops import host, serving

    batch, num_slots = 4, 8
    tokens, state, slots, start, ape = _decode_inputs(batch, ratio, coff, head_dim, num_slots, 1)
    problem = host.extend_problem(tokens[0][0], ratio, coff, batch)
    assert problem is not None
    assert problem.key.family == ("streaming" if ratio * coff > 32 else "window")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    OP(*tokens[0], ape, cu, start, slots, state.kv, state.score, ratio, coff, batch)  # warm
    serving._PREPARED.clear()
    before = host.cache_info()
    OP(*tokens[0], ape, cu, start, slots, state.kv, state.score, ratio, coff, batch)
    after = host.cache_info()
    assert after["hits"] == before["hits"] + 1 and after["size"] == before["size"]
    # A signature seen before launches its prepared call: no lookup at all.
    OP(*tokens[0], ape, cu, start, slots, state.kv, state.score, ratio, coff, batch)
    assert host.cache_info() == after


def test_state_the_kernel_cannot_take_runs_the_reference():
    """A state view whose base breaks the kernel's alignment (it is written in place, so it
    cannot be copied) runs the reference, call by call under one prepared signature: the
    new state equals the kernel's on an aligned copy bit for bit, the rows are within one
    rounding step (the reference's order is the CPU's)."""
    ratio, coff, head_dim, batch, num_slots = 4, 2, 64, 4, 8
    tokens, state, slots, start, ape = _decode_inputs(batch, ratio, coff, head_dim, num_slots, 1)
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    shape = state.kv.shape
    # Views one element into larger buffers: contiguous, misaligned for the kernel.
    kv_big = torch.empty(state.kv.numel() + 1, dtype=state.kv.dtype, device="cuda")
    ss_big = torch.empty(state.score.numel() + 1, dtype=state.score.dtype, device="cuda")
    kv_view, ss_view = kv_big[1:].view(shape), ss_big[1:].view(shape)
    kv0, ss0 = state.kv.clone(), state.score.clone()
    rows, cuc = OP(*tokens[0], ape, cu, start, slots, state.kv, state.score, ratio, coff, batch)
    for _ in range(2):  # the second call takes the prepared signature
        kv_view.copy_(kv0)
        ss_view.copy_(ss0)
        got, got_cuc = OP(*tokens[0], ape, cu, start, slots, kv_view, ss_view, ratio, coff,
                          batch)
        assert_within_one_step(got, rows, "rows")
        assert_bitwise_equal(got_cuc, cuc, "cu_seqlens_comp")
        assert_bitwise_equal(kv_view, state.kv, "kv_state")
        assert_bitwise_equal(ss_view, state.score, "score_state")


@pytest.mark.parametrize("tokens", [48, 300, 4200], ids=("one_launch", "split", "lanes"))
@pytest.mark.parametrize("ratio,coff", [(4, 2), (128, 2), (16, 1)])
def test_adversarial_requests_are_isolated_by_the_kernel(ratio, coff, tokens):
    """Invalid requests (slot out of range, negative or overflowing positions, tokens past T
    or reversed) get zero rows and leave every slot alone; the valid ones in the same batch
    match a clean call; cu_seqlens_comp counts rows as the reference does. With 300 tokens
    the calls split into two launches (the clean call's 24 do not), with 4200 the
    register-window calls' row items go by lanes."""
    from csa_ops import host
    from csa_ops.kernels import extend_plan

    kv = torch.empty(tokens, coff * 64, dtype=torch.bfloat16, device="cuda")
    key = host.extend_problem(kv, ratio, coff, NUM_ISOLATED).key
    assert (tokens > extend_plan.DECODE_SIZED) == bool(key.knobs.part)
    lanes = tokens >= extend_plan.LANE_TOKENS
    assert lanes == getattr(key.knobs, "lane_requests", False)
    check_invalid_requests_isolated(OP, ratio, coff, 64, tokens, torch.bfloat16, "cuda")


@pytest.mark.parametrize("padding", (5, 600), ids=("padded", "long"))
@pytest.mark.parametrize("lanes", (False, True), ids=("scan", "lanes"))
@pytest.mark.parametrize("ratio,coff,head_dim", [(4, 2, 256), (128, 1, 512), (128, 2, 128)])
def test_rows_launch_alone_leaves_the_heads_and_the_state(ratio, coff, head_dim, lanes,
                                                          padding):
    """A split call's second launch (its rows placed by a batch scan or by lanes), run alone
    into a NaN-filled output: exactly the requests' head rows stay NaN (the first launch's),
    every other row equals the whole call's bitwise, padding rows are zeros, nothing past
    the output is written, and the state is untouched. The streaming rows launch runs
    three row groups, so that each holds several rows; with long padding more than its
    threads (the placement's later passes).
    cu_seqlens_comp is one launch's: the register-window kernel writes it beside its
    row items (this launch), the streaming kernel beside its requests' (the other). In a
    whole call a head row the second launch wrongly wrote could still end up right, if the
    first launch's write landed after it."""
    from csa_ops import host
    from csa_ops.config import with_knobs
    from csa_ops.kernels import extend_plan
    from csa_ops.kernels.streaming import plan as streaming_plan

    gen = torch.Generator(device="cuda").manual_seed(4)
    width, num_slots = coff * head_dim, 6

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", generator=gen).to(dtype)

    def as_int32(values):
        return torch.tensor(values, dtype=torch.int32, device="cuda")

    lengths, start = [700, 300, 0, 900, 650, 500], [5, 130, 0, 300, -3, 64]
    slots = [0, 1, 2, 3, 4, 9]  # the last two requests are not ok: start < 0, slot >= 6
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    tokens, batch = cu[-1], len(lengths)
    kv, score = randn(tokens, width), randn(tokens, width)
    ape = randn(ratio, width, dtype=torch.float32)
    kv_state = randn(num_slots, coff * ratio, width)
    score_state = randn(num_slots, coff * ratio, width, dtype=torch.float32)
    heads, total = set(), 0
    for n, p in zip(lengths, start, strict=True):
        rows = (max(p, 0) + n) // ratio - max(p, 0) // ratio
        heads |= set(range(total, total + min(rows, coff)))
        total += rows
    num_rows = total + padding
    heads = {n for n in heads if n < num_rows}
    want, want_cuc = OP(kv, score, ape, as_int32(cu), as_int32(start), as_int32(slots),
                        kv_state.clone(), score_state.clone(), ratio, coff,
                        max(total + 5, num_rows))
    want = want[:num_rows]

    problem = host.extend_problem(kv, ratio, coff, batch)
    (requests_launch, _), (rows_launch, rows_plan) = extend_plan.plans(
        problem.key, tokens, batch, num_rows, problem.num_sms)
    assert (requests_launch.knobs.part, rows_launch.knobs.part) == (1, 2)
    rows_launch = with_knobs(rows_launch, lane_requests=lanes)
    grid = rows_plan.grid
    if rows_launch.family == "streaming":
        grid = 3 * streaming_plan.column_blocks(rows_launch)
        places = num_rows - len(heads)
        assert (-(-places // 3) > rows_launch.knobs.threads) == (padding > 100)
    backing = torch.full((num_rows + 8, head_dim), float("nan"), dtype=torch.bfloat16,
                         device="cuda")
    out = backing[:num_rows]
    cuc = torch.full((batch + 1,), -7, dtype=torch.int32, device="cuda")
    kv_after, score_after = kv_state.clone(), score_state.clone()
    tensors = (kv, score, ape, as_int32(cu), as_int32(start), as_int32(slots), kv_after,
               score_after, out, cuc)
    host.launch_key("ext", rows_launch, tensors, (tokens, num_rows, batch, num_slots), grid)
    torch.cuda.synchronize()
    assert bool(torch.isnan(backing[num_rows:].float()).all()), "rows past the output written"
    left = set(torch.isnan(out.float()).any(dim=1).nonzero().flatten().tolist())
    assert left == heads
    others = [n for n in range(num_rows) if n not in heads]
    assert_bitwise_equal(out[others], want[others], "rows of the second launch")
    assert int(torch.count_nonzero(out[total:])) == 0, "padding rows not zero"
    assert_bitwise_equal(kv_after, kv_state, "kv_state")
    assert_bitwise_equal(score_after, score_state, "score_state")
    writes_cuc = problem.key.family == "window"
    assert cuc.tolist() == (want_cuc.tolist() if writes_cuc else [-7] * (batch + 1))


@pytest.mark.parametrize("ratio,coff", [(4, 1), (4, 2), (128, 1)])
def test_adversarial_extend_kernel_extremes(ratio, coff):
    """Empty batches and token sets, repeated slots: in bounds, cu_seqlens_comp as the
    reference counts it. (Capacities below the true row count stop the call:
    test_row_capacity_gpu.)"""
    head_dim = 64
    width = coff * head_dim
    ape = torch.randn(ratio, width, device="cuda")
    state = CompressorState(2, ratio, coff, head_dim, torch.bfloat16, "cuda")

    def call(num_tokens, cu, start, slots, total_comp):
        kv = torch.randn(num_tokens, width, device="cuda").bfloat16()
        score = torch.randn(num_tokens, width, device="cuda").bfloat16()
        as_int32 = {"dtype": torch.int32, "device": "cuda"}
        out, cuc = OP(kv, score, ape, torch.tensor(cu, **as_int32),
                      torch.tensor(start, **as_int32), torch.tensor(slots, **as_int32),
                      state.kv, state.score, ratio, coff, total_comp)
        torch.cuda.synchronize()
        return out, cuc.tolist()

    out, cuc = call(0, [0], [], [], 3)  # no requests: padding only
    assert cuc == [0] and int(torch.count_nonzero(out)) == 0
    out, cuc = call(0, [0], [], [], None)
    assert out.shape == (0, head_dim)
    _, cuc = call(0, [0, 0], [6], [0], 2)  # no tokens
    assert cuc == [0, 0]
    r = ratio
    _, cuc = call(5 * r, [0, 2 * r + 2, 5 * r], [0, 3], [1, 1], 7)  # one slot, repeated
    assert cuc == [0, 2, 5]


@pytest.mark.parametrize("ratio,coff", [(128, 1), (128, 2)])
def test_extend_rows_through_the_exact_columns(ratio, coff):
    """Requests whose windows cancel (helpers.cancel_in_pairs): no column certifies, so
    every row goes through the exact columns, whose logits the extend kernel reads from the
    state as well as from new tokens. Rows and state stay bitwise the one-shot forward's."""
    lengths = (1024, 512, 0, 256)
    req = make_requests(lengths, ratio, coff, 128, torch.bfloat16, device="cuda", seed=3)
    for kv, score in zip(req.kv, req.score):
        cancel_in_pairs(kv, score)
    req.ape.zero_()
    slot_of = permuted_slots(len(lengths), len(lengths) + 2, 3)
    state = CompressorState(len(lengths) + 2, ratio, coff, 128, torch.bfloat16, "cuda")
    rows, consumed = run_schedule(req, random_schedule(lengths, ratio, 3, decode_tail=130),
                                  state, slot_of)
    assert_rows(req, rows, assert_bitwise_equal)
    assert_state(req, state, slot_of, consumed, assert_bitwise_equal)
