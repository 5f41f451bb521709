"""csa::compressor_extend on the CPU: the serving invariant, errors, opcheck, compile, helpers.

The invariant: any chunking of the requests' tokens into calls (pieces of length 0 and 1,
mixed prefill/decode batches, permuted slots) emits rows bit-identical to one
csa::compressor call over the whole sequences and leaves each slot holding the documented
state (docs/serving.md).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_bitwise_equal
from hypothesis import given, settings
from hypothesis import strategies as st
from serving_helpers import (
    INT32_MAX,
    assert_invalid_requests_isolated,
    assert_rows,
    assert_state,
    case_id,
    check_forked_prompt,
    check_invalid_requests_isolated,
    check_rows_past_int32,
    drawer,
    make_requests,
    permuted_slots,
    random_schedule,
    run_schedule,
    step_inputs,
    twin_states,
    unchecked_extend,
)

import csa_ops
from csa_ops import Compressor, CompressorState, reference_extend

ROOT = Path(__file__).resolve().parents[1]
OP = torch.ops.csa.compressor_extend.default

# (ratio, coff, head_dim, dtype, lengths, decode_tail, extra_rows): every ratio of the matrix
# with both coff, odd head dims, empty requests and requests shorter than a block.
CASES = [
    (1, 1, 7, torch.float32, (5, 0, 9), 3, None),
    (1, 2, 1, torch.bfloat16, (6, 2), 4, 2),
    (2, 2, 65, torch.bfloat16, (11, 0, 1, 7), 5, None),
    (2, 1, 3, torch.float16, (9, 4), 5, 1),
    (4, 2, 128, torch.bfloat16, (13, 0, 1, 40), 9, 2),
    (4, 1, 7, torch.float32, (21, 3, 8), 9, None),
    (4, 2, 7, torch.float64, (19, 6), 9, 1),
    (5, 2, 7, torch.bfloat16, (23, 4, 0, 12), 11, None),
    (5, 1, 65, torch.float32, (17, 5), 11, 3),
    (128, 1, 7, torch.bfloat16, (300, 129, 0, 5), 130, 2),
    (128, 2, 3, torch.float32, (300, 260, 127), 140, None),
]


def _check_invariant(ratio, coff, head_dim, dtype, lengths, tail, extra_rows, seed=0,
                     ape_dtype=torch.float32):
    req = make_requests(lengths, ratio, coff, head_dim, dtype, seed=seed, ape_dtype=ape_dtype)
    num_slots = len(lengths) + 3
    slot_of = permuted_slots(len(lengths), num_slots, seed)
    state = CompressorState(num_slots, ratio, coff, head_dim, dtype)
    schedule = random_schedule(lengths, ratio, seed, decode_tail=tail)
    rows, consumed = run_schedule(req, schedule, state, slot_of, extra_rows)
    assert consumed == list(lengths)
    assert_rows(req, rows, assert_bitwise_equal)
    assert_state(req, state, slot_of, consumed, assert_bitwise_equal)


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
@pytest.mark.parametrize("seed", [0, 1])
def test_chunked_extend_matches_one_shot_compressor(case, seed):
    _check_invariant(*case, seed=seed)


@pytest.mark.parametrize("ape_dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_ape_in_any_float_dtype(ape_dtype):
    _check_invariant(4, 2, 7, torch.bfloat16, (19, 0, 6), 9, 1, ape_dtype=ape_dtype)


@settings(max_examples=30, deadline=None)
@given(ratio=st.sampled_from([1, 2, 3, 4, 5, 8]), coff=st.sampled_from([1, 2]),
       head_dim=st.sampled_from([1, 3, 8]), dtype=st.sampled_from([torch.float32,
                                                                    torch.bfloat16]),
       lengths=st.lists(st.integers(0, 40), min_size=1, max_size=4),
       tail=st.integers(0, 12), extra_rows=st.sampled_from([None, 0, 3]),
       seed=st.integers(0, 2**16))
def test_property_any_chunking(ratio, coff, head_dim, dtype, lengths, tail, extra_rows, seed):
    _check_invariant(ratio, coff, head_dim, dtype, tuple(lengths), tail, extra_rows, seed=seed)


@pytest.mark.parametrize("ratio,coff", [(4, 2), (5, 1), (128, 1)])
def test_state_equals_one_call_over_all_tokens(ratio, coff):
    lengths = (301, 7, 0, 130)
    req = make_requests(lengths, ratio, coff, 5, torch.bfloat16, seed=3)
    slot_of = permuted_slots(len(lengths), 6, 3)
    chunked = CompressorState(6, ratio, coff, 5, torch.bfloat16)
    run_schedule(req, random_schedule(lengths, ratio, 3, decode_tail=20), chunked, slot_of)
    whole = CompressorState(6, ratio, coff, 5, torch.bfloat16)
    rows, _ = run_schedule(req, [[(i, n) for i, n in enumerate(lengths)]], whole, slot_of)
    assert_rows(req, rows, assert_bitwise_equal)
    # Only the state layout's entries are specified: the current block (and the last complete
    # one).
    for i, n in enumerate(lengths):
        m = n % ratio
        entries = list(range(ratio * (coff - 1), ratio * (coff - 1) + m))
        entries += list(range(ratio)) if coff == 2 else []
        for state_a, state_b in ((chunked.kv, whole.kv), (chunked.score, whole.score)):
            a, b = state_a[slot_of[i], entries], state_b[slot_of[i], entries]
            assert_bitwise_equal(a, b, f"request {i}")


def test_fresh_request_reads_nothing_from_its_slot():
    """start_pos 0 starts a sequence: a slot full of garbage (NaN) needs no reset."""
    req = make_requests((13, 6), 4, 2, 8, torch.float32, seed=5)
    state = CompressorState(2, 4, 2, 8, torch.float32)
    state.kv.fill_(float("nan"))
    state.score.normal_()
    rows, consumed = run_schedule(req, random_schedule((13, 6), 4, 5, decode_tail=5), state,
                                  [1, 0])
    assert_rows(req, rows, assert_bitwise_equal)
    assert_state(req, state, [1, 0], consumed, assert_bitwise_equal)


def _decode_batch(ratio=4, coff=2, head_dim=8, batch=3, num_slots=5, dtype=torch.float32,
                  seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = coff * head_dim
    state = CompressorState(num_slots, ratio, coff, head_dim, dtype)
    state.kv.copy_(torch.randn(state.kv.shape, generator=gen))
    state.score.copy_(torch.randn(state.score.shape, generator=gen))
    return {
        "kv": torch.randn(batch, width, generator=gen).to(dtype),
        "score": torch.randn(batch, width, generator=gen).to(dtype),
        "ape": torch.randn(ratio, width, generator=gen),
        "cu_seqlens": torch.arange(batch + 1, dtype=torch.int32),
        "start_pos": torch.tensor([3, 6, 0, 11, 7][:batch], dtype=torch.int32),
        "slots": torch.tensor([4, 0, 2, 1, 3][:batch], dtype=torch.int32),
        "kv_state": state.kv, "score_state": state.score, "ratio": ratio, "coff": coff,
        "total_comp": batch,
    }


def _args(d: dict) -> tuple:
    names = ("kv", "score", "ape", "cu_seqlens", "start_pos", "slots", "kv_state", "score_state",
             "ratio", "coff", "total_comp")
    return tuple(d[n] for n in names)


def test_padding_rows_are_exact_zeros():
    d = _decode_batch()
    d["start_pos"] = torch.tensor([0, 1, 4], dtype=torch.int32)  # no block completes
    d["score_state"].fill_(float("-inf"))  # a window of all -inf would pool to NaN
    out, cuc = OP(*_args(d))
    assert cuc.tolist() == [0, 0, 0, 0]
    assert out.shape == (3, 8) and int(torch.count_nonzero(out)) == 0
    assert not bool(out.isnan().any())


def test_total_comp_none_returns_true_count():
    d = _decode_batch()
    d["total_comp"] = None
    out, cuc = OP(*_args(d))
    assert cuc.tolist() == [0, 1, 1, 1]  # only start_pos 3 completes block 0
    assert out.shape == (1, 8)


def test_empty_batch_and_no_tokens():
    d = _decode_batch()
    kv_before, score_before = d["kv_state"].clone(), d["score_state"].clone()
    empty = dict(d, kv=d["kv"][:0], score=d["score"][:0],
                 cu_seqlens=torch.zeros(1, dtype=torch.int32),
                 start_pos=d["start_pos"][:0], slots=d["slots"][:0], total_comp=2)
    out, cuc = OP(*_args(empty))
    assert out.shape == (2, 8) and int(torch.count_nonzero(out)) == 0 and cuc.tolist() == [0]
    no_tokens = dict(d, kv=d["kv"][:0], score=d["score"][:0],
                     cu_seqlens=torch.zeros(4, dtype=torch.int32), total_comp=None)
    out, cuc = OP(*_args(no_tokens))
    assert out.shape == (0, 8) and cuc.tolist() == [0, 0, 0, 0]
    # Requests still in their first block (start_pos 3 in slot 4, 0 in slot 2) hold the
    # initial state in entries [0, ratio); nothing else changes.
    kv_before[[4, 2], :4] = 0.0
    score_before[[4, 2], :4] = float("-inf")
    assert_bitwise_equal(d["kv_state"], kv_before, "kv_state")
    assert_bitwise_equal(d["score_state"], score_before, "score_state")


OPCHECK_CASES = {
    "decode_static": {},
    "decode_none": {"total_comp": None},
    "coff1_fp64": {"coff": 1, "dtype": torch.float64},
    "bf16_ape_bf16": {"dtype": torch.bfloat16, "ape_dtype": torch.bfloat16},
}


@pytest.mark.parametrize("name", list(OPCHECK_CASES))
def test_opcheck(name):
    opts = dict(OPCHECK_CASES[name])
    ape_dtype = opts.pop("ape_dtype", None)
    total_comp = opts.pop("total_comp", 3)
    d = _decode_batch(**opts)
    d["total_comp"] = total_comp
    if ape_dtype is not None:
        d["ape"] = d["ape"].to(ape_dtype)
    torch.library.opcheck(OP, _args(d))


def test_opcheck_mixed_prefill_and_decode():
    req = make_requests((9, 1, 0, 14), 4, 2, 6, torch.float32, seed=2)
    state = CompressorState(6, 4, 2, 6, torch.float32)
    state.kv.normal_()
    state.score.normal_()
    consumed = [3, 0, 0, 5]
    step = [(3, 9), (1, 1), (2, 0), (0, 6)]
    kv, score, cu, start_pos, slots = step_inputs(req, step, consumed, [5, 2, 0, 3])
    for total_comp in (None, 7):
        torch.library.opcheck(OP, (kv, score, req.ape, cu, start_pos, slots, state.kv,
                                   state.score, 4, 2, total_comp))


def test_gradient_request_is_refused():
    d = _decode_batch()
    d["kv"] = d["kv"].requires_grad_(True)
    with pytest.raises(RuntimeError, match="compressor_extend: inference only"):
        OP(*_args(d))
    with torch.no_grad():
        OP(*_args(d))
    d["kv"] = d["kv"].detach()
    d["ape"] = torch.nn.Parameter(d["ape"])  # a module's ape, under no_grad: fine
    with pytest.raises(RuntimeError, match="inference only"):
        OP(*_args(d))
    with torch.inference_mode():
        OP(*_args(d))


def _run_decode(fn, d, steps: int):
    """``steps`` decode steps over advancing positions; the outputs of each step."""
    outs = []
    start = d["start_pos"].clone()
    for step in range(steps):
        d["start_pos"] = start + step
        out, cuc = fn(*_args(d))
        outs.append((out.clone(), cuc.clone()))
    return outs


@pytest.mark.parametrize("ratio,coff", [(4, 2), (5, 1)])
def test_compile_fullgraph_decode_step(compile_env, ratio, coff):
    eager = _decode_batch(ratio=ratio, coff=coff, batch=4, num_slots=6)
    compiled_in = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in eager.items()}

    def step(*args):
        out, cuc = torch.ops.csa.compressor_extend(*args)
        return out * 1.0, cuc  # a consumer, so the op's outputs feed a fused kernel

    compiled = torch.compile(step, fullgraph=True)
    want = _run_decode(step, eager, 2 * ratio + 1)
    got = _run_decode(compiled, compiled_in, 2 * ratio + 1)
    for i, ((a, ca), (b, cb)) in enumerate(zip(got, want)):
        assert_bitwise_equal(a, b, f"rows of step {i}")
        assert_bitwise_equal(ca, cb, f"cu_seqlens_comp of step {i}")
    assert_bitwise_equal(compiled_in["kv_state"], eager["kv_state"], "kv_state")
    assert_bitwise_equal(compiled_in["score_state"], eager["score_state"], "score_state")


def test_compile_fullgraph_true_row_count(compile_env):
    d = _decode_batch()
    d["total_comp"] = None
    compiled = torch.compile(lambda *a: torch.ops.csa.compressor_extend(*a)[0] + 1.0,
                             fullgraph=True)
    want = OP(*_args({**d, "kv_state": d["kv_state"].clone(),
                      "score_state": d["score_state"].clone()}))[0] + 1.0
    assert_bitwise_equal(compiled(*_args(d)), want, "rows")


def test_compressor_state():
    state = CompressorState(3, 4, 2, 5, torch.bfloat16)
    assert state.kv.shape == state.score.shape == (3, 8, 10)
    assert state.kv.dtype == torch.bfloat16 and state.score.dtype == torch.float32
    assert state.num_slots == 3
    assert int(torch.count_nonzero(state.kv)) == 0 and bool((state.score == -torch.inf).all())
    state.kv.fill_(1.0)
    state.score.fill_(2.0)
    state.reset([2])
    state.reset(torch.tensor([0], dtype=torch.int32))
    for slot, fresh in ((0, True), (1, False), (2, True)):
        assert bool((state.kv[slot] == 0).all()) == fresh
        assert bool((state.score[slot] == -torch.inf).all()) == fresh
    state.reset()
    assert int(torch.count_nonzero(state.kv)) == 0
    with pytest.raises(ValueError, match="`coff` must be 1 or 2"):
        CompressorState(3, 4, 3, 5)


# (ratio, coff, head_dim, dtype, prompt, tails, sizes) of check_forked_prompt: a tail
# continuing by prefill chunks, one by decode, an empty one; the prompt ends mid-block.
FORKS = [
    (4, 2, 6, torch.bfloat16, 13, (9, 1, 0, 6), (1, 1, 1, 4)),
    (5, 1, 7, torch.float32, 12, (8, 3, 11), (3, 1, 11)),
    (128, 1, 7, torch.bfloat16, 300, (90, 0, 130), (1, 1, 45)),
    (128, 2, 3, torch.float32, 260, (140, 5), (70, 1)),
]


@pytest.mark.parametrize("case", FORKS, ids=[f"r{c[0]}c{c[1]}" for c in FORKS])
def test_copy_slots_forks_a_prompt_for_parallel_samples(case):
    ratio, coff, head_dim, dtype, prompt, tails, sizes = case
    check_forked_prompt(ratio, coff, head_dim, dtype, "cpu", prompt, tails, sizes,
                        lambda state, src, dst: state.copy_slots(src, dst))


def test_copy_slots_reads_every_slot_before_writing():
    state = CompressorState(4, 4, 2, 5, torch.float32)
    state.kv.normal_()
    state.score.normal_()
    kv, score = state.kv.clone(), state.score.clone()
    # A swap, a slot copied onto itself and a source read by two copies, one of them into a
    # slot that is itself a source.
    src, dst = [0, 1, 2, 1], [1, 0, 2, 3]
    state.copy_slots(torch.tensor(src), torch.tensor(dst, dtype=torch.int32))
    for s, d in zip(src, dst):
        assert_bitwise_equal(state.kv[d], kv[s], f"kv of slot {d}")
        assert_bitwise_equal(state.score[d], score[s], f"score of slot {d}")
    state.copy_slots([], [])
    assert_bitwise_equal(state.kv[3], kv[1], "kv of slot 3")


@pytest.mark.parametrize("call,error,message", [
    (lambda s: s.reset([-1]), ValueError, r"reset: `slots` holds slot -1, outside .*\[0, 3\)"),
    (lambda s: s.reset(torch.tensor([1, 3])), ValueError, r"`slots` holds slot 3"),
    (lambda s: s.reset(torch.tensor([0.0])), TypeError, r"`slots` must be slot numbers.*float"),
    (lambda s: s.reset(True), TypeError, r"`slots` must be slot numbers.*bool"),
    (lambda s: s.reset(torch.zeros(2, 2, dtype=torch.int32)), TypeError,
     r"`slots` must be slot numbers.*shape \(2, 2\)"),
    (lambda s: s.copy_slots([0], [1, 2]), ValueError, r"`src` and `dst` must pair up, got 1 and 2"),
    (lambda s: s.copy_slots([0, 1], [2, 2]), ValueError, r"`dst` must not repeat a slot"),
    (lambda s: s.copy_slots([3], [0]), ValueError, r"copy_slots: `src` holds slot 3"),
    (lambda s: s.copy_slots([0], [-3]), ValueError, r"copy_slots: `dst` holds slot -3"),
    (lambda s: s.copy_slots([0], torch.tensor([1], dtype=torch.int16)), TypeError,
     r"`dst` must be slot numbers.*int16"),
], ids=["reset-negative", "reset-past", "reset-float", "reset-bool", "reset-2d",
        "copy-unpaired", "copy-repeated-dst", "copy-src-past", "copy-dst-negative",
        "copy-int16"])
def test_state_helpers_name_bad_slots(call, error, message):
    state = CompressorState(3, 4, 2, 5, torch.float32)
    state.kv.normal_()
    kv = state.kv.clone()
    with pytest.raises(error, match=message):
        call(state)
    assert_bitwise_equal(state.kv, kv, "kv_state after a refused call")


@pytest.mark.parametrize("ratio,coff", [(4, 2), (128, 1)])
def test_module_extend_matches_forward(ratio, coff):
    torch.manual_seed(0)
    block = Compressor(16, 8, ratio, coff, dtype=torch.float32)
    lengths = (2 * ratio + 3, ratio - 1, 3 * ratio)
    x = [torch.randn(n, 16) for n in lengths]
    cu, cuc = csa_ops.offsets_for(lengths, ratio)
    with torch.no_grad():
        want = block(torch.cat(x), cu, cuc).split([n // ratio for n in lengths])
    state = CompressorState(4, ratio, coff, 8, torch.float32)
    slot_of, consumed = [3, 1, 0], [0, 0, 0]
    got = [[] for _ in lengths]
    for step in random_schedule(lengths, ratio, 7, decode_tail=ratio + 1):
        pieces = [x[i][consumed[i]:consumed[i] + n] for i, n in step]
        step_cu, _ = csa_ops.offsets_for([n for _, n in step], ratio)
        rows, step_cuc = block.extend(
            torch.cat(pieces), step_cu, torch.tensor([consumed[i] for i, _ in step],
                                                     dtype=torch.int32),
            torch.tensor([slot_of[i] for i, _ in step], dtype=torch.int32), state)
        assert not rows.requires_grad
        for j, (i, n) in enumerate(step):
            got[i].append(rows[step_cuc[j]:step_cuc[j + 1]])
            consumed[i] += n
    # Not bitwise: the linears see different token counts per call, and BLAS rounds a row's
    # product differently with the matrix shape; the op itself is bitwise (tests above).
    for i in range(len(lengths)):
        torch.testing.assert_close(torch.cat(got[i]), want[i], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------
# Bad inputs: every one names the argument.


def _bad(name, mutate, match, error=ValueError):
    return pytest.param(mutate, match, error, id=name)


def _set(**changes):
    return lambda d: d.update(changes)


BAD_INPUTS = [
    _bad("kv_not_tensor", lambda d: d.update(kv=[1.0]),  # the dispatcher's own check
         "Expected a value of type 'Tensor' for argument 'kv'", RuntimeError),
    _bad("kv_1d", lambda d: d.update(kv=d["kv"][:, 0]), "`kv` must be 2-D"),
    _bad("kv_int", lambda d: d.update(kv=d["kv"].int()), "`kv` must be one of"),
    _bad("kv_width", lambda d: d.update(kv=d["kv"][:, :3], score=d["score"][:, :3]),
         "`kv` width must be a positive multiple of coff=2"),
    _bad("score_shape", lambda d: d.update(score=d["score"][:2]), "`score` must match `kv`"),
    _bad("score_dtype", lambda d: d.update(score=d["score"].double()), "`score` must match"),
    _bad("score_device", lambda d: d.update(score=d["score"].to("meta")),
         "`score` must be on the device of `kv`"),
    _bad("ape_shape", lambda d: d.update(ape=d["ape"][:3]), r"`ape` must have shape \(ratio"),
    _bad("ape_int", lambda d: d.update(ape=d["ape"].int()), "`ape` must be a floating-point"),
    _bad("cu_int64", lambda d: d.update(cu_seqlens=d["cu_seqlens"].long()),
         "`cu_seqlens` must be a 1-D int32"),
    _bad("cu_empty", lambda d: d.update(cu_seqlens=d["cu_seqlens"][:0]),
         "`cu_seqlens` must be a 1-D int32"),
    _bad("start_pos_int64", lambda d: d.update(start_pos=d["start_pos"].long()),
         r"`start_pos` must be an int32 tensor of shape \(B,\) = \(3,\)"),
    _bad("start_pos_length", lambda d: d.update(start_pos=d["start_pos"][:2]),
         "`start_pos` must be an int32 tensor of shape"),
    _bad("slots_int64", lambda d: d.update(slots=d["slots"].long()),
         "`slots` must be an int32 tensor"),
    _bad("slots_2d", lambda d: d.update(slots=d["slots"][None]), "`slots` must be an int32"),
    _bad("kv_state_window", lambda d: d.update(kv_state=d["kv_state"][:, :4].contiguous()),
         r"`kv_state` must have shape \(num_slots, coff\*ratio, coff\*head_dim\) = \(S, 8, 16\)"),
    _bad("kv_state_dtype", lambda d: d.update(kv_state=d["kv_state"].double()),
         "`kv_state` must be torch.float32"),
    _bad("score_state_dtype", lambda d: d.update(score_state=d["score_state"].bfloat16()),
         "`score_state` must be torch.float32"),
    _bad("score_state_slots", lambda d: d.update(score_state=d["score_state"][:4].contiguous()),
         "`score_state` must have the slot count of `kv_state`"),
    _bad("kv_state_noncontiguous",
         lambda d: d.update(kv_state=d["kv_state"].transpose(0, 1).contiguous().transpose(0, 1)),
         "`kv_state` must be contiguous"),
    _bad("same_state_tensor", lambda d: d.update(score_state=d["kv_state"]),
         "must be different tensors"),
    _bad("ratio_zero", _set(ratio=0), "`ratio` must be an int >= 1"),
    _bad("coff_three", _set(coff=3), "`coff` must be 1 or 2"),
    _bad("total_comp_negative", _set(total_comp=-1), "`total_comp` must be >= 0"),
    _bad("total_comp_small", _set(total_comp=0), "`total_comp` = 0 is smaller than the true "
         "row count 1"),
    _bad("cu_first", lambda d: d.update(cu_seqlens=d["cu_seqlens"] + 1),
         r"`cu_seqlens\[0\]` must be 0"),
    _bad("cu_decreasing", lambda d: d.update(cu_seqlens=torch.tensor([0, 2, 1, 3],
                                                                      dtype=torch.int32)),
         "`cu_seqlens` must be non-decreasing"),
    _bad("cu_beyond_tokens", lambda d: d.update(cu_seqlens=torch.tensor([0, 1, 2, 9],
                                                                        dtype=torch.int32)),
         r"`cu_seqlens\[-1\]` = 9 exceeds the number of tokens T = 3"),
    _bad("negative_position", lambda d: d["start_pos"].__setitem__(1, -1),
         r"`start_pos\[1\]` must be >= 0, got -1"),
    _bad("position_overflow", lambda d: d["start_pos"].__setitem__(0, 2**31 - 1),
         r"`start_pos\[0\]` \+ new tokens = 2147483648 overflows int32"),
    _bad("slot_out_of_range", lambda d: d["slots"].__setitem__(2, 5),
         r"`slots\[2\]` = 5 is out of range \[0, 5\)"),
    _bad("slot_negative", lambda d: d["slots"].__setitem__(0, -1),
         r"`slots\[0\]` = -1 is out of range"),
    _bad("slot_repeated", lambda d: d["slots"].__setitem__(2, 4),
         "`slots` must be distinct: slot 4 appears at 0 and 2"),
    _bad("more_requests_than_slots",
         lambda d: d.update(kv_state=d["kv_state"][:2].clone(),
                            score_state=d["score_state"][:2].clone(),
                            slots=torch.tensor([0, 1, 0], dtype=torch.int32)),
         "3 requests cannot have distinct slots among 2"),
]


@pytest.mark.parametrize("mutate,match,error", BAD_INPUTS)
def test_bad_input_raises(mutate, match, error):
    d = _decode_batch()
    mutate(d)
    with pytest.raises(error, match=rf"csa(\.|::)compressor_extend.*{match}"):
        OP(*_args(d))


@pytest.mark.parametrize("mutate,match,error", [p for p in BAD_INPUTS
                                                if p.id in ("kv_1d", "ape_shape",
                                                            "kv_state_dtype", "ratio_zero")])
def test_fake_raises_like_the_kernel(mutate, match, error):
    from torch._subclasses.fake_tensor import FakeTensorMode

    d = _decode_batch()
    mutate(d)
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(error, match=match):
        OP(*_args(d))


def test_adversarial_inputs_stay_in_bounds():
    """The path CUDA takes (no content checks): any slots, positions and offsets index in
    bounds; on the CPU an out-of-bounds index would raise."""
    gen = torch.Generator().manual_seed(0)
    for ratio, coff in ((4, 2), (5, 1), (1, 2)):
        d = _decode_batch(ratio=ratio, coff=coff, batch=3)
        for trial in range(20):
            starts = torch.randint(-2**31, 2**31 - 1, (3,), generator=gen, dtype=torch.int64)
            d["start_pos"] = starts.int()
            d["slots"] = torch.randint(-9, 9, (3,), generator=gen, dtype=torch.int32)
            d["cu_seqlens"] = torch.randint(-5, 8, (4,), generator=gen, dtype=torch.int32)
            out, cuc = reference_extend.compressor_extend_reference(*_args(d))
            assert out.shape == (3, 8) and cuc.shape == (4,)


# How a request of test_property_invalid_requests_are_isolated is made invalid, if at all.
BREAKS = ("none", "none", "slot_high", "slot_low", "start_low", "start_high", "tokens_past")


@settings(max_examples=60, deadline=None)
@given(ratio=st.sampled_from([1, 2, 3, 4, 5, 8, 16]), coff=st.sampled_from([1, 2]),
       requests=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 50),
                                   st.sampled_from(BREAKS)), min_size=1, max_size=8),
       seed=st.integers(0, 2**16))
def test_property_invalid_requests_are_isolated(ratio, coff, requests, seed):
    """Random batches of (new tokens, start, break) mixing valid requests with invalid ones
    of every kind, on the path CUDA takes (no content checks): invalid requests are
    isolated, slots clamped onto valid ones' included (assert_invalid_requests_isolated).
    A request whose tokens lie past T takes its successor's first token with it."""
    batch = len(requests)
    num_slots = batch + 1
    cu = [0]
    for n, _, _ in requests:
        cu.append(cu[-1] + n)
    tokens = cu[-1]
    slots = random.Random(seed).sample(range(num_slots), batch)
    start = [p for _, p, _ in requests]
    for b, (_, p, kind) in enumerate(requests):
        if kind == "slot_high":
            slots[b] = num_slots + p  # the reference clamps it onto slot num_slots - 1
        elif kind == "slot_low":
            slots[b] = -1 - p  # ... onto slot 0
        elif kind == "start_low":
            start[b] = -1 - p
        elif kind == "start_high":
            start[b] = INT32_MAX - p % 3  # invalid where more new tokens than p % 3
        elif kind == "tokens_past":
            cu[b + 1] = tokens + 1 + p
    draw = drawer("cpu", torch.float32, seed)
    width = coff * 4
    state, clean = twin_states(draw, num_slots, ratio, coff, 4, torch.float32, "cpu")
    assert_invalid_requests_isolated(unchecked_extend, draw(tokens, width),
                                     draw(tokens, width), draw(ratio, width), cu, start, slots,
                                     state, clean, ratio, coff)


@pytest.mark.parametrize("ratio,coff", [(4, 2), (128, 2), (16, 1)])
def test_invalid_requests_are_isolated(ratio, coff):
    """The path CUDA takes (no content checks): the reference treats invalid requests as the
    kernels do, slots that clamp onto valid ones included."""
    check_invalid_requests_isolated(unchecked_extend, ratio, coff, head_dim=8, tokens=48,
                                    dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("ratio,coff", [(4, 2), (17, 2), (5, 1)])
def test_row_offsets_saturate_past_int32(ratio, coff):
    """Invalid requests counting rows past int32 (the path CUDA takes: no content checks):
    cu_seqlens_comp saturates, the valid request before them is untouched by them."""
    check_rows_past_int32(unchecked_extend, ratio, coff, head_dim=8, tokens=45, batch=40,
                          extra_rows=6, dtype=torch.float32, device="cpu")


# ---------------------------------------------------------------------------------------
# The benchmark's CPU smoke path.


def test_bench_serving_smoke(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "bench_serving.py"), "--smoke",
           "--out", str(tmp_path)]
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env,
                          check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "serving.json").read_text())
    assert results["meta"]["device"] == "cpu"
    rows = results["results"]
    assert {r["variant"] for r in rows} >= {"op", "eager step", "compiled step",
                                            "training forward", "DRAM floor"}
    floors = {r["case"]: r for r in rows if r["variant"] == "DRAM floor"}
    assert set(floors) == {r["case"] for r in rows}  # one per case
    for r in rows:
        if r["variant"] == "op" and r["timing"] == "call":
            assert r["op_over_floor"] == r["median_s"] / floors[r["case"]]["median_s"]
        if r["timing"] in ("graph", "kernel"):
            assert r["status"] == "n/a (CUDA only)"
        else:
            assert r["status"] == "ok", r
            assert 0 < r["median_s"] < 10
    table = (tmp_path / "serving.md").read_text()
    assert "| case | variant | timing | time us |" in table
    png = (tmp_path / "serving.png").read_bytes()  # per-call times: CPU has no graphs
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

