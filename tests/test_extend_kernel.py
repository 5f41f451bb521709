"""csa::compressor_extend's CuTe-DSL kernel without a GPU: it cross-compiles for sm_90a and
sm_100a through the shared compile cache, its launch plan and support envelope, and a PTX
audit that its rows pool with exactly the forward kernel's per-column operations (the
bitwise contract against the CUDA csa::compressor rests on it; tests/gpu checks the bits).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
import torch
from helpers import config_id

from csa_ops import host
from csa_ops.config import ARCHS, Direction, LaunchPlan, with_knobs
from csa_ops.kernels import extend_plan, sm
from csa_ops.kernels.streaming import plan as streaming_plan
from csa_ops.kernels.window import plan as window_plan

CONFIGS = (  # ratio, coff, head_dim, dtype: the production CSA configs, dtypes, the
    (4, 2, 512, torch.bfloat16),  # streaming family's (r128)
    (4, 1, 128, torch.bfloat16),
    (2, 2, 512, torch.bfloat16),
    (4, 2, 512, torch.float16),
    (4, 2, 128, torch.float32),
    (128, 1, 512, torch.bfloat16),
)
# The widest register window (W 32) and the streaming family at coff 2 in fp16 (its torch-order
# parity path): a minute of compiling per arch each, so sm_100a only, which no device here
# runs. Neither family has per-arch code: the configs above compile every key of both
# families for both archs, and the H200 suite runs sm_90a streaming coff 2 (r128 c2 d128).
WIDE_CONFIGS = ((16, 2, 64, torch.bfloat16), (128, 2, 128, torch.float16))
CROSS_COMPILES = [pytest.param(cfg, arch, id=f"{config_id(cfg)}-{arch}")
                  for cfg in CONFIGS for arch in ARCHS]
CROSS_COMPILES += [pytest.param(cfg, "sm_100a", id=f"{config_id(cfg)}-sm_100a")
                   for cfg in WIDE_CONFIGS]


@pytest.mark.parametrize("cfg, arch", CROSS_COMPILES)
def test_extend_kernel_cross_compiles(cfg, arch):
    ratio, coff, head_dim, dtype = cfg
    before = host.cache_info()
    built = host.precompile_extend(ratio, head_dim, coff, dtype, arch=arch)
    forward = host.select_key(ratio, coff, head_dim, built[0].dtype, arch, Direction.FORWARD)
    assert built == extend_plan.keys(forward)
    if forward.family == "window":
        assert extend_plan.configure(ratio, coff, head_dim, forward.dtype, arch) == forward
    else:  # narrower CTAs for decode-sized calls and steps, two parts (PDL) for larger
        # calls (the rows launch narrower, of few requests by lanes), the forward's CTAs
        # for steps past decode-sized; each computes its failing columns in their rows
        in_rows = with_knobs(forward, deferred=False)
        narrow = streaming_plan.narrow(in_rows)
        requests = with_knobs(in_rows, part=1, pdl=True)
        rows = with_knobs(streaming_plan.narrow(requests), part=2)
        by_lanes = with_knobs(rows, lane_requests=True)
        assert built == (narrow, requests, rows, by_lanes, in_rows)
    # Each size class launches the forward's geometry-free knobs differently; the flags
    # that fix a row's bits (fast_exp) are the forward's.
    assert all(key.knobs.fast_exp == forward.knobs.fast_exp for key in built)
    after = host.cache_info()
    assert after["size"] - before["size"] == len(built)
    host.precompile_extend(ratio, head_dim, coff, dtype, arch=arch)
    assert host.cache_info()["misses"] == after["misses"]  # second call: a cache hit


# PTX by (direction, key), generated once per test process: the audits below compare
# several extend keys against the same forward key, and a key's PTX takes seconds.
_ptx = functools.cache(host.ptx)

_POOL_OPS = ("ex2.approx", "fma.rn.f32", "fma.rm.f32", r"\tmul.f32", r"\tadd.f32", "selp.f32",
             "mul.rn.f32", "div.rn.f32", "max.NaN.f32", "setp.ge.f32")


@pytest.mark.parametrize("cfg", [(4, 2, 512, "bfloat16"), (4, 1, 128, "bfloat16"),
                                 (4, 2, 128, "float16")], ids=("r4c2_bf16", "r4c1", "fp16"))
def test_rows_pool_with_the_forward_operations(cfg):
    # Every extend kernel pools at one site per head row (they may read the state) and one
    # for rows of new tokens (row items, or a request's rows past coff): coff + 1 sites, a
    # split call's parts coff (requests' items) and 1 (row items). Each must compile to the
    # forward's per-row operations at the key's vector width, no more and no fewer (a folded
    # select, say, would let an FMA contract). The only other float arithmetic is the
    # logits' adds (one rounding each), counted exactly on the forward-knob parts: the
    # state's, one per entry, half and column, in the part that updates it. One placement
    # difference is allowed: the compiler may sink a softmax's sum (window - 1 adds) into
    # both arms of cm.divide_into's branch, where each arm still adds once, in the extend
    # kernel or in the forward it is compared with.
    forward = extend_plan.configure(*cfg, "sm_90a")
    parts = extend_plan.launches(extend_plan.for_size(forward, 1))
    few_items = with_knobs(forward, vec=min(forward.knobs.vec, 2), threads=128)
    assert parts == (with_knobs(few_items, part=1), with_knobs(forward, part=2))
    parts += extend_plan.launches(extend_plan.for_size(forward, extend_plan.SizeClass.FEW_LARGE))[1:]
    assert parts[2] == with_knobs(forward, part=2, lane_requests=True)
    for key in extend_plan.keys(forward):
        sites = {0: forward.coff + 1, 1: forward.coff, 2: 1}[key.knobs.part]
        ext = _ptx("ext", key)
        fwd = _ptx("fwd", with_knobs(forward, vec=key.knobs.vec, threads=key.knobs.threads))
        for op in _POOL_OPS:
            assert len(re.findall(op, ext)) == sites * len(re.findall(op, fwd)), (key, op)
        assert "ld.local" not in ext and "st.local" not in ext
        if key in parts:
            state_logits = key.window * key.coff * key.knobs.vec if key.knobs.part == 1 else 0
            sunk = ext.count("add.rn.f32") - sites * fwd.count("add.rn.f32") - state_logits
            sums = sunk // (key.window - 1)
            assert sunk == sums * (key.window - 1), (key, sunk)
            assert abs(sums) <= sites * key.knobs.vec, (key, sunk)


@pytest.mark.parametrize("cfg", [(4, 2, 512, "bfloat16"), (4, 1, 128, "bfloat16")],
                         ids=("r4c2", "r4c1"))
def test_preloaded_decode_updates_add_only_the_token_logits(cfg):
    # The decode key's preloaded updates (preload_decode) store what update_state stores:
    # against the same key without them, every pooling operation is unchanged and the only
    # new float operations are the token's logits, one add per coff-half and column.
    decode = extend_plan.for_size(extend_plan.configure(*cfg, "sm_90a"), 0)
    assert decode.knobs.preload_decode
    with_preload = _ptx("ext", decode)
    without = _ptx("ext", with_knobs(decode, preload_decode=0))
    for op in _POOL_OPS:
        assert len(re.findall(op, with_preload)) == len(re.findall(op, without)), op
    extra = decode.coff * decode.knobs.vec
    assert with_preload.count("add.rn.f32") == without.count("add.rn.f32") + extra
    assert "ld.local" not in with_preload and "st.local" not in with_preload


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_decode_step_reads_no_window_register_before_its_row_sums(dtype):
    # The step's window, token and moved entries load as 32-bit words and each 16-bit
    # element leaves its word where it is read (a bf16 by bit operations, an fp16 truncated
    # then converted), so no 16-bit register is unpacked (mov.b32 {%rs, %rs}, cvt.u16.u32)
    # where the gather's branches merge, before the row sums' barrier: such an unpack waits
    # for the window's DRAM round trip and makes the barrier wait with it (bench/README,
    # "Window registers as 32-bit words").
    step = extend_plan.for_size(extend_plan.configure(4, 2, 512, dtype, "sm_90a"),
                                extend_plan.SizeClass.STEP)
    assert step.knobs.request_rows and step.knobs.vec == 2
    ptx = _ptx("ext", step)
    before_barrier = ptx[:ptx.index("bar.sync")]
    assert "ld.global" in before_barrier  # the window's loads are issued before it
    assert not re.findall(r"mov\.b32\s+\{%rs|cvt\.u16\.u32", before_barrier)
    if dtype == "float16":  # its elements do convert, after the barrier
        assert "cvt.f32.f16" in ptx[ptx.index("bar.sync"):]


@pytest.mark.parametrize("cfg", [(128, 1, 512, "bfloat16"), (128, 2, 512, "bfloat16")],
                         ids=("r128c1", "r128c2"))
def test_streaming_rows_pool_with_the_forward_operations(cfg):
    # Two pooling sites (state-reading rows, rows of new tokens), each the forward's `_row`
    # with its logits read from the fp32 tile: the forward's operations twice, but for the
    # adds, where each site lacks the forward's kt*vec logit adds and the gathers (twice),
    # the state update (per coff-half) add fp32(score) + ape once per entry and column, and
    # the subwarp update of requests that complete no block once per column of each of the
    # QUIET_UNROLL pieces it loads before storing.
    # (Without the exact columns, parity 0: their code is shared too, but the compiler folds
    # a few of its selects differently at the two sites; test_cross_compile audits it.)
    from csa_ops.kernels.streaming import extend as streaming  # the DSL: host.ptx imports it

    ratio, coff, head_dim, dtype = cfg
    forward = host.select_key(ratio, coff, head_dim, dtype, "sm_90a", Direction.FORWARD)
    key = with_knobs(forward, parity=0, deferred=False)
    assert key.family == "streaming"
    ext, fwd = _ptx("ext", key), _ptx("fwd", key)
    for op in _POOL_OPS:
        if op != r"\tadd.f32":
            assert len(re.findall(op, ext)) == 2 * len(re.findall(op, fwd)), op
    k = key.knobs
    per_entry = -(-key.window * k.cv // k.threads) * k.vec
    adds = len(re.findall(r"\tadd.f32", fwd))
    assert len(re.findall(r"\tadd.f32", ext)) == (2 * (adds - k.kt * k.vec) + 2 * per_entry
                                                  + key.coff * per_entry
                                                  + streaming.QUIET_UNROLL * k.vec)
    assert "ld.local" not in ext and "st.local" not in ext


def test_plan_covers_requests_then_rows():
    key = extend_plan.configure(4, 2, 512, "bfloat16", "sm_90a")
    rpc = window_plan.geometry(key).rpc
    assert extend_plan.plan(key, 4096, 0, 0, 132) == LaunchPlan(grid=1)  # still writes cuc
    assert extend_plan.plan(key, 4096, 256, 64, 132) == LaunchPlan(grid=-(-320 // rpc))
    assert extend_plan.plan(key, 4096, 1, 0, 132) == LaunchPlan(grid=1)
    # A split call: the requests' items, then the row items (at least one CTA: cuc).
    assert extend_plan.launches(key) == (key,)
    requests, rows = extend_plan.launches(with_knobs(key, part=1))
    assert (requests.knobs.part, rows.knobs.part) == (1, 2)
    assert (requests.knobs.vec, requests.knobs.threads, rows.knobs.vec) == (2, 128, 4)
    assert extend_plan.plan(requests, 4096, 256, 64, 132) == LaunchPlan(
        grid=-(-256 // window_plan.geometry(requests).rpc))
    assert extend_plan.plan(rows, 4096, 256, 64, 132) == LaunchPlan(grid=-(-64 // rpc))
    assert extend_plan.plan(rows, 4096, 3, 0, 132) == LaunchPlan(grid=1)
    assert extend_plan.launches(with_knobs(key, part=2)) == (requests, rows)
    with pytest.raises(ValueError, match=r"part must be one of \[0, 1, 2\]"):
        with_knobs(key, part=3)
    # Row items by lanes: the same first part; the second takes at most a warp's requests.
    lanes = with_knobs(key, part=1, lane_requests=True)
    assert extend_plan.launches(lanes) == (requests, with_knobs(rows, lane_requests=True))
    by_lanes = extend_plan.launches(lanes)[1]
    assert (extend_plan.plan(by_lanes, 4096, 32, 64, 132)
            == extend_plan.plan(rows, 4096, 32, 64, 132))
    with pytest.raises(ValueError, match="at most 32 requests in a warp's lanes, got 33"):
        extend_plan.plan(by_lanes, 4096, 33, 64, 132)
    with pytest.raises(ValueError, match="lane_requests needs a split call"):
        with_knobs(key, lane_requests=True)
    # Streaming: column blocks times item groups, at most MAX_ROWS items per CTA. Items
    # that pool windows run one after another in a CTA: up to EXTEND_WAVES waves of CTA
    # slots (132 SMs x 2 CTAs / 8 blocks per wave), one item each where they reach.
    key = host.select_key(128, 1, 512, "bfloat16", "sm_90a", Direction.FORWARD)
    key = with_knobs(key, deferred=False)  # what every extend key of it computes in place
    blocks = -(-key.head_dim // (key.knobs.cv * key.knobs.vec))
    assert (blocks, key.knobs.ctas, streaming_plan.EXTEND_WAVES) == (8, 2, 4)
    assert extend_plan.plan(key, 8192, 4, 64, 132) == LaunchPlan(grid=68 * blocks)
    assert extend_plan.plan(key, 8192, 200, 64, 132) == LaunchPlan(grid=132 * blocks)
    # A decode step (as many tokens as requests): one wave, an odd number of groups where
    # CTAs share items; a CTA per item where they reach (B1: the request, its row).
    assert extend_plan.plan(key, 1024, 1024, 1024, 132) == LaunchPlan(grid=33 * blocks)
    assert extend_plan.plan(key, 256, 256, 256, 100) == LaunchPlan(grid=25 * blocks)
    assert extend_plan.plan(key, 1, 1, 1, 132) == LaunchPlan(grid=2 * blocks)
    assert extend_plan.plan(key, 16, 16, 16, 132) == LaunchPlan(grid=32 * blocks)
    assert extend_plan.plan(key, 0, 0, 0, 132) == LaunchPlan(grid=blocks)  # writes cuc
    assert extend_plan.plan(key, 10**5, 10**5, 10**5, 132) == LaunchPlan(grid=782 * blocks)
    for tokens in (10**6, 10**7):
        many = extend_plan.plan(key, tokens, 10**6, 0, 132).grid // blocks
        assert -(-10**6 // many) <= streaming_plan.MAX_ROWS
    # A split call: the requests' items (one CTA per request where they reach), then the
    # rows in CTAs half as wide, 4 per SM (shared memory holds 4), in one wave beside the
    # requests' CTAs less a group: 132 x 4 slots, less 2 per requests' CTA (2 per SM: their
    # registers are 2 of ours), over 16 column blocks, 29 groups, 28 planned.
    requests, rows = extend_plan.launches(extend_plan.for_size(key, 1))
    assert (requests.knobs.part, rows.knobs.part, rows.knobs.pdl) == (1, 2, True)
    assert requests == with_knobs(key, part=1, pdl=True)
    assert (rows.knobs.cv, rows.knobs.ctas) == (key.knobs.cv // 2, 4)
    assert dataclasses.replace(rows, knobs=key.knobs) == key  # launch knobs only
    assert extend_plan.plan(requests, 8192, 4, 64, 132) == LaunchPlan(grid=4 * blocks)
    assert extend_plan.plan(requests, 8192, 0, 0, 132) == LaunchPlan(grid=blocks)  # cuc
    split = extend_plan.for_size(key, 1)
    assert extend_plan.plans(split, 8192, 4, 64, 132) == (
        (requests, LaunchPlan(grid=4 * blocks)), (rows, LaunchPlan(grid=28 * 2 * blocks)))
    # Fewer rows than that: a CTA per row; none: one CTA per column block.
    assert extend_plan.plans(split, 8192, 4, 20, 132)[1] == (rows, LaunchPlan(grid=40 * blocks))
    assert extend_plan.plans(split, 8192, 4, 0, 132)[1] == (rows, LaunchPlan(grid=2 * blocks))
    # Where the requests' CTAs take most of a wave: half a wave (132 x 4 / 2 / 16 = 16
    # groups); at most MAX_ROWS rows per CTA.
    assert (extend_plan.plans(split, 8192, 64, 64, 132)[1]
            == (rows, LaunchPlan(grid=16 * 2 * blocks)))
    many = extend_plan.plans(split, 8192, 4, 10**6, 132)[1][1].grid // (2 * blocks)
    assert -(-10**6 // many) <= streaming_plan.MAX_ROWS
    with pytest.raises(ValueError, match="planned beside its requests"):
        extend_plan.plan(rows, 8192, 4, 64, 132)
    with pytest.raises(ValueError, match="first part"):
        extend_plan.launches(rows)
    # Few requests (FEW_LARGE): the same requests' launch and grid; the rows by lanes where
    # the fullest group holds two rows or more (60 rows past the heads over 28 groups), by
    # the scan where each holds one (28 over 28) or where there are none.
    few = extend_plan.for_size(key, extend_plan.SizeClass.FEW_LARGE)
    assert few == with_knobs(split, lane_requests=True)
    by_lanes = with_knobs(rows, lane_requests=True)
    assert extend_plan.plans(few, 8192, 4, 64, 132) == (
        (requests, LaunchPlan(grid=4 * blocks)), (by_lanes, LaunchPlan(grid=28 * 2 * blocks)))
    for num_rows in (0, 20, 32):
        assert (extend_plan.plans(few, 8192, 4, num_rows, 132)
                == extend_plan.plans(split, 8192, 4, num_rows, 132))
    assert extend_plan.plans(few, 8192, 4, 33, 132)[1][0] == by_lanes
    assert extend_plan.plans(few, 8192, 4, 10**4, 132)[1][0] == by_lanes
    assert extend_plan.plans(few, 8192, 32, 10**4, 132)[1][0] == by_lanes
    with pytest.raises(ValueError, match="at most 32 requests in a warp's lanes"):
        extend_plan.plans(few, 8192, 33, 10**4, 132)


def test_extend_launches_take_the_ctas_per_sm_that_shared_memory_holds():
    for problem in ((128, 1, 512), (128, 2, 128), (256, 2, 64), (512, 1, 64)):
        for key in streaming_plan.enumerate_keys(*problem, "bfloat16", "sm_90a", Direction.FORWARD):
            k = key.knobs
            narrow = streaming_plan.narrow(key)
            n = narrow.knobs
            assert n.cv == max(1, k.cv // 2) or narrow == key
            smem = streaming_plan.key_smem_bytes(narrow, False)
            fit = min(4, sm.SMEM_FOR_CTAS // smem)
            assert n.ctas == max(k.ctas, fit) or narrow == key
            assert n.ctas == k.ctas or smem * n.ctas <= sm.SMEM_FOR_CTAS
            assert dataclasses.replace(narrow, knobs=k) == key  # launch knobs only
            assert extend_plan.for_size(key, extend_plan.SizeClass.STEP) == narrow
            in_rows = with_knobs(key, deferred=False)  # extend keys compute columns in rows
            assert extend_plan.for_size(key, extend_plan.SizeClass.LARGE_STEP) == in_rows
    # A rows launch by lanes keeps a third row table (each entry's output row).
    rows = with_knobs(streaming_plan.narrow(host.select_key(128, 1, 512, "bfloat16", "sm_90a",
                                                            Direction.FORWARD)), part=2)
    lanes = with_knobs(rows, lane_requests=True)
    assert (streaming_plan.key_smem_bytes(lanes, False)
            == streaming_plan.key_smem_bytes(rows, False) + 4 * streaming_plan.MAX_ROWS)
    assert streaming_plan.key_smem_bytes(lanes, False) * lanes.knobs.ctas <= (
        sm.SMEM_FOR_CTAS)
    # r256 c2 d64 at one column vector, 2 CTAs per SM: a third would not fit.
    key = streaming_plan.configure(256, 2, 64, "bfloat16", "sm_90a", Direction.FORWARD, cv=1,
                                   ctas=2)
    assert streaming_plan.narrow(key).knobs.ctas == 2


def test_support_covers_both_families():
    assert extend_plan.supports(extend_plan.configure(16, 2, 64, "bfloat16", "sm_90a"))
    assert extend_plan.supports(extend_plan.configure(32, 1, 64, "float32", "sm_100a"))
    assert not extend_plan.supports(extend_plan.configure(32, 2, 64, "bfloat16", "sm_90a"))
    forward = host.select_key(128, 1, 512, "bfloat16", "sm_90a", Direction.FORWARD)
    streaming = with_knobs(forward, deferred=False)  # every extend key's
    assert extend_plan.for_size(forward, 0) == extend_plan.for_size(streaming, 0)
    assert streaming.family == "streaming" and extend_plan.supports(streaming)
    narrow = streaming_plan.narrow(streaming)
    assert (narrow.knobs.cv, narrow.knobs.ctas) == (streaming.knobs.cv // 2, 4)
    assert extend_plan.for_size(streaming, 0) == narrow
    assert extend_plan.for_size(streaming, extend_plan.SizeClass.STEP) == narrow
    assert extend_plan.for_size(streaming, extend_plan.SizeClass.LARGE_STEP) == streaming
    split = with_knobs(streaming, part=1, pdl=True)
    assert extend_plan.for_size(streaming, 1) == split
    assert extend_plan.for_size(streaming, extend_plan.SizeClass.FEW_LARGE) == with_knobs(
        split, lane_requests=True)
    with pytest.raises(ValueError, match=r"StreamingKnobs.part must be one of \[0, 1, 2\]"):
        with_knobs(streaming, part=3)
    # No family runs fp32 at ratio 128 (the streaming kernels take bf16 and fp16).
    with pytest.raises(ValueError, match="no extend kernel for ratio=128"):
        host.precompile_extend(128, 512, 1, torch.float32, arch="sm_90a")
    with pytest.raises(ValueError, match="arch"):
        host.precompile_extend(4, 128, 2, torch.bfloat16, arch="sm_75")
    with pytest.raises(ValueError, match="dtype"):
        host.precompile_extend(4, 128, 2, torch.float64, arch="sm_90a")


def test_argument_table_of_the_extend_kernel():
    names = [name for name, _ in host.ARGUMENTS["ext"]]
    assert names[-5:] == ["num_tokens", "num_rows", "num_requests", "num_slots", "grid"]
    key = extend_plan.configure(4, 2, 128, "bfloat16", "sm_90a")
    signature = host.launch_signature("ext", key)
    assert signature[names.index("score_state")] == ("ptr", "float32", 16)
    assert signature[names.index("kv_state")] == ("ptr", "bfloat16", key.align_bytes)
    assert host.DIRECTIONS == ("fwd", "bwd")  # precompile's pair stays the compressor's


def test_call_size_classes_pick_the_measured_launch_shapes():
    forward = extend_plan.configure(4, 2, 512, "bfloat16", "sm_90a")
    sizes = (0, 1, 256, 257, 2048, 3071, 3072, 10**6)
    few = extend_plan.SizeClass.FEW_LARGE
    assert [extend_plan.size_class(n, 3) for n in sizes] == [0, 0, 0, 1, 1, 1, few, few]
    # Row items by lanes only for batches a warp holds.
    assert [extend_plan.size_class(3072, b) for b in (1, 32, 33)] == [few, few, 1]
    # As many tokens as requests: a decode step, past decode-sized ones a large one.
    assert [extend_plan.size_class(n, n) for n in sizes] == (
        [extend_plan.SizeClass.STEP] * 3 + [extend_plan.SizeClass.LARGE_STEP] * 5)
    decode, larger, few_large = (extend_plan.for_size(forward, size) for size in range(3))
    assert few_large == with_knobs(forward, part=1, lane_requests=True)
    assert (decode.knobs.vec, decode.knobs.threads) == (2, 128)
    assert decode.knobs.preload_decode and not (larger.knobs.preload_decode or
                                                forward.knobs.preload_decode)
    assert larger == with_knobs(forward, part=1)  # split
    step = extend_plan.for_size(forward, extend_plan.SizeClass.STEP)
    assert step == with_knobs(decode, request_rows=True)
    assert extend_plan.for_size(forward, extend_plan.SizeClass.LARGE_STEP) == step
    assert not any(key.knobs.request_rows for key in (decode, larger))
    assert not any(key.knobs.part for key in (decode, step))
    rows = with_knobs(forward, part=2)
    by_lanes = with_knobs(rows, lane_requests=True)
    requests = extend_plan.launches(larger)[0]  # at a decode-sized call's width
    assert requests == with_knobs(forward, part=1, vec=2, threads=128)
    assert extend_plan.keys(forward) == (decode, requests, rows, by_lanes, step)
    for key in extend_plan.keys(forward):  # only launch knobs differ from the forward's
        assert dataclasses.replace(key, knobs=forward.knobs) == forward
        assert extend_plan.supports(key)


def test_requests_pool_their_own_rows_in_decode_step_grids():
    """request_rows keys launch one item per request (no row items), at least one CTA."""
    forward = extend_plan.configure(4, 2, 512, "bfloat16", "sm_90a")
    step = extend_plan.for_size(forward, extend_plan.SizeClass.STEP)
    rpc = window_plan.geometry(step).rpc
    assert extend_plan.plan(step, 256, 256, 256, 132).grid == -(-256 // rpc)
    assert extend_plan.plan(step, 256, 0, 7, 132).grid == 1
    general = extend_plan.for_size(forward, 0)
    assert extend_plan.plan(general, 256, 256, 256, 132).grid == -(-512 // rpc)
