"""Cross-compiles the register-window kernels for sm_90a and sm_100a without a GPU.

Runs in CI on CPU machines: compiles forward and backward over a spread of ratios, head dims
(odd ones too), coffs and dtypes, through the same csa_ops.host.precompile entry that users
call, and audits the PTX numerics the bitwise contract rests on.
"""

from __future__ import annotations

import re

import pytest
import torch
from helpers import config_id

from csa_ops import host
from csa_ops.config import (ARCHS, Direction, KernelKey, StreamingKnobs, WindowKnobs, parse_knobs,
                            with_knobs)
from csa_ops.kernels import FAMILIES, select_key
from csa_ops.kernels.streaming import plan as streaming_plan
from csa_ops.kernels.window import plan as window_plan

CONFIGS = (  # ratio, coff, head_dim, dtype
    (4, 2, 128, torch.bfloat16),
    (4, 2, 512, torch.bfloat16),
    (2, 2, 128, torch.float16),
    (1, 1, 7, torch.bfloat16),
    (3, 2, 65, torch.float16),
    (4, 1, 1, torch.bfloat16),
    (16, 2, 64, torch.bfloat16),
    (32, 1, 130, torch.float16),
    (8, 1, 96, torch.float32),
)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=[config_id(c) for c in CONFIGS])
def test_precompile_cross_arch(cfg, arch):
    ratio, coff, head_dim, dtype = cfg
    before = host.cache_info()
    keys = host.precompile(ratio, head_dim, coff, dtype, arch=arch)
    assert [k.arch for k in keys] == [arch, arch]
    assert all(k.family == "window" for k in keys)
    after = host.cache_info()
    assert after["size"] - before["size"] == 2
    host.precompile(ratio, head_dim, coff, dtype, arch=arch)
    assert host.cache_info()["misses"] == after["misses"]  # second call: cache hits only


@pytest.mark.parametrize("backward", (False, True), ids=("fwd", "bwd"))
@pytest.mark.parametrize("arch", ARCHS)
def test_ptx_pins_rounding_and_accurate_exp(arch, backward):
    # vec 8: 16-byte accesses (the default keys use narrower vectors; the arithmetic is the
    # same per element, so this key audits it and the widest access path at once).
    # fast_exp=0: the bf16 forward's default is the fast path (audited below); the exact one
    # is what fp16 and fp32 run, and what the backward always runs.
    key = KernelKey("window", 4, 2, 512, "bfloat16", arch, WindowKnobs(vec=8, threads=128))
    text = host.ptx("bwd" if backward else "fwd", key)
    assert f".target {arch}" in text
    exps = text.count("ex2.approx.ftz.f32")
    assert exps == key.window * key.knobs.vec  # one exp per window entry and column
    # libdevice expf: one fma.rm range reduction, three fma.rn, one unpinned mul and add per
    # exp; the division (common.divide_into): one div.rn reciprocal per column, four fma.rn
    # per quotient (two Markstein corrections) and the exact div.rn per quotient on the
    # rare tiny-numerator path. Any other FMA or unpinned mul/add would be a contraction of
    # the reference's separately rounded operations.
    assert text.count("fma.rm.f32") == exps
    # The backward adds torch's softmax-backward epilogue t - p * sum: one FMA per entry.
    assert text.count("fma.rn.f32") == (3 + 4 + int(backward)) * exps
    assert len(re.findall(r"\tmul\.f32", text)) == exps
    assert len(re.findall(r"\tadd\.f32", text)) == exps
    assert text.count("div.rn.f32") == exps + key.knobs.vec
    for approx in ("div.approx", "div.full", "rcp.approx", "fma.rz", "lg2.approx"):
        assert approx not in text
    assert "ld.global.v4" in text and "st.global.v4" in text  # 16-byte accesses


@pytest.mark.parametrize("arch", ARCHS)
def test_ptx_of_the_fast_forward(arch):
    # The bf16 forward default: per column one certified fast pass (ex2.approx without
    # libdevice's range reduction, one division) and the exact path as its fallback (one
    # libdevice expf and one division per entry, plus the reciprocal).
    key = window_plan.configure(4, 2, 512, "bfloat16", arch, Direction.FORWARD)
    assert key.knobs.fast_exp
    assert not window_plan.configure(4, 2, 512, "float16", arch, Direction.FORWARD).knobs.fast_exp
    assert not window_plan.configure(4, 2, 512, "bfloat16", arch, Direction.BACKWARD).knobs.fast_exp
    text = host.ptx("fwd", key)
    vec = key.knobs.vec
    entries = key.window * vec
    assert text.count("ex2.approx.ftz.f32") == 2 * entries
    assert text.count("fma.rm.f32") == entries  # the fallback's expf only
    assert text.count("div.rn.f32") == vec + (entries + vec)
    assert text.count("setp.lt.f32") == vec  # one certificate test per column


@pytest.mark.parametrize("arch", ARCHS)
def test_ptx_of_the_streaming_forward_parity(arch):
    # parity 1 and 2 add the exact columns: one libdevice expf (its fma.rm range reduction)
    # and one IEEE division per window entry and column. In their rows, parity 1 gates them
    # on a warp vote, each column of a vector its own copy; deferred, the row loop ballots
    # a word of failing columns and a second kernel holds one copy of a column's code.
    base = with_knobs(streaming_plan.configure(128, 1, 512, "bfloat16", arch,
                                               Direction.FORWARD), deferred=True)
    entries = base.knobs.wpc * base.knobs.kt  # a column's entries per lane
    in_place = with_knobs(base, deferred=False)
    texts = {p: host.ptx("fwd", with_knobs(in_place, parity=p)) for p in (0, 1, 2)}
    deferred = {p: host.ptx("fwd", with_knobs(base, parity=p)) for p in (1, 2)}
    assert "vote.sync" not in texts[0] and "fma.rm.f32" not in texts[0]
    assert texts[0].count("div.rn.f32") == 1  # the fast path's out = a / s
    assert texts[0].count(".entry") == 1
    for parity in (1, 2):
        assert texts[parity].count("fma.rm.f32") == entries * base.knobs.vec
        assert texts[parity].count("div.rn.f32") == 1 + entries * base.knobs.vec
        assert deferred[parity].count("fma.rm.f32") == entries
        assert deferred[parity].count("div.rn.f32") == 1 + entries
        assert deferred[parity].count(".entry") == 2
        assert "vote.sync.ballot" in deferred[parity]
    assert "vote.sync.any" in texts[1]
    assert not streaming_plan.supports(with_knobs(base, parity=0))  # nothing to defer
    assert not streaming_plan.fast_forward(base).knobs.deferred


@pytest.mark.parametrize("arch", ARCHS)
def test_deferral_is_the_certified_default_where_two_warps_share_a_vector(arch):
    def knobs(coff, head_dim, direction=Direction.FORWARD):
        return streaming_plan.configure(128, coff, head_dim, "bfloat16", arch, direction).knobs

    assert knobs(2, 512).parity == 1 and knobs(2, 512).deferred and knobs(2, 512).wpc == 2
    assert knobs(1, 512).parity == 1 and not knobs(1, 512).deferred
    assert not knobs(2, 128).deferred
    assert not knobs(2, 512, Direction.EXTEND).deferred  # extend keys: in their rows


def _vec_threads(ratio, coff, head_dim, dtype, backward):
    knobs = window_plan.configure(ratio, coff, head_dim, dtype, "sm_90a",
                                  Direction.of(backward)).knobs
    return knobs.vec, knobs.threads


def test_wide_windows_trade_vector_width():
    # Past window 8 the register budget sets the vector: 64 elements per tensor per thread.
    assert _vec_threads(16, 2, 512, "bfloat16", True)[0] == 2
    assert _vec_threads(32, 1, 512, "float16", False)[0] == 2
    assert _vec_threads(16, 2, 512, "bfloat16", False)[1] == 128
    assert _vec_threads(1, 1, 7, "bfloat16", False)[0] == 1


def test_short_windows_trade_vector_width_for_threads():
    # The H200 sweeps (window_plan._vec_threads): latency-bound kernels want threads.
    for head_dim in (128, 512):
        assert _vec_threads(4, 2, head_dim, "bfloat16", True) == (2, 256)
    assert _vec_threads(4, 2, 128, "bfloat16", False) == (2, 256)
    assert _vec_threads(4, 2, 512, "bfloat16", False) == (4, 128)
    assert _vec_threads(4, 2, 512, "float32", False)[0] == 4


def test_select_key_picks_the_family_by_window():
    assert select_key(4, 2, 128, "bfloat16", "sm_90a", Direction.BACKWARD).family == "window"
    assert select_key(16, 2, 128, "bfloat16", "sm_90a", Direction.BACKWARD).family == "window"
    assert select_key(128, 2, 512, "float16", "sm_90a", Direction.FORWARD).family == "streaming"
    # streaming: 16-bit only
    assert select_key(128, 2, 512, "float32", "sm_90a", Direction.FORWARD) is None
    for name, plan in FAMILIES.items():
        key = plan.configure(64 if name == "streaming" else 4, 2, 128, "bfloat16", "sm_90a",
                             Direction.BACKWARD)
        assert plan.supports(key) and list(plan.enumerate_keys(
            key.ratio, 2, 128, "bfloat16", "sm_90a", Direction.BACKWARD))


def test_each_knob_has_one_default():
    # pdl: both families launch with PDL unless their heuristic says otherwise.
    assert WindowKnobs(vec=2, threads=256).pdl and StreamingKnobs(8, 8, 1, 4, 2, 2).pdl
    stream_fwd = streaming_plan.configure(128, 2, 512, "bfloat16", "sm_90a", Direction.FORWARD)
    assert not stream_fwd.knobs.pdl  # two warps per column vector: measured slower with PDL
    assert streaming_plan.configure(128, 1, 512, "bfloat16", "sm_90a", Direction.FORWARD).knobs.pdl


def test_knob_overrides_are_checked():
    key = window_plan.configure(4, 2, 128, "bfloat16", "sm_90a", Direction.BACKWARD)
    assert with_knobs(key, **parse_knobs("pdl=0,min_ctas=3")).knobs == WindowKnobs(
        vec=2, threads=256, pdl=False, min_ctas=3)
    assert repr(with_knobs(key, pdl=0)) == repr(with_knobs(key, pdl=False))  # one spelling
    with pytest.raises(ValueError, match="no knob lnear"):
        with_knobs(key, lnear=0)
    with pytest.raises(ValueError, match="no knob cv"):  # a streaming knob
        window_plan.configure(4, 2, 128, "bfloat16", "sm_90a", Direction.BACKWARD, cv=4)
    with pytest.raises(ValueError, match="bool"):
        with_knobs(key, pdl=2)
    with pytest.raises(ValueError, match="name=integer"):
        parse_knobs("pdl")


def test_key_rejects_bad_values():
    knobs = WindowKnobs(vec=1, threads=128)
    with pytest.raises(ValueError, match="arch"):
        KernelKey("window", 4, 2, 128, "bfloat16", "sm_80", knobs)
    with pytest.raises(ValueError, match="dtype"):
        KernelKey("window", 4, 2, 128, "int8", "sm_90a", knobs)
    with pytest.raises(ValueError, match="vec"):
        KernelKey("window", 4, 2, 100, "bfloat16", "sm_90a", WindowKnobs(vec=8, threads=128))
    with pytest.raises(ValueError, match="StreamingKnobs"):
        KernelKey("streaming", 128, 2, 128, "bfloat16", "sm_90a", knobs)
    with pytest.raises(ValueError, match="arch"):
        host.precompile(4, 128, 2, torch.bfloat16, arch="sm_75")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("backward", (False, True), ids=("fwd", "bwd"))
@pytest.mark.parametrize("ratio", (4, 128), ids=("window", "streaming"))
def test_argument_table_compiles_both_families(ratio, backward, arch):
    # The entries compile from placeholders built from host.ARGUMENTS alone (a slot too many
    # or too few, or a wrong pointer type, fails the compile), for both families and archs.
    direction = "bwd" if backward else "fwd"
    key = host.select_key(ratio, 2, 64, "bfloat16", arch, Direction.of(backward))
    assert callable(host.KERNELS.get(direction, key))
    names = [name for name, _ in host.ARGUMENTS[direction]]
    assert names[-4:] == ["num_tokens", "num_rows", "num_segs", "grid"]
    assert len(host.launch_signature(direction, key)) == len(names)


def test_supports_config_is_the_metadata_half_of_supports(monkeypatch):
    # A pretend SM90 device: the decision must come from dtype and family support alone.
    monkeypatch.setattr(host, "_device_info", lambda device: ("sm_90a", 132))
    cuda = torch.device("cuda", 0)
    assert host.supports_config(cuda, torch.bfloat16, 4, 2, 128)
    assert host.supports_config(cuda, torch.float16, 128, 2, 512)
    assert not host.supports_config(cuda, torch.float64, 4, 2, 128)
    assert not host.supports_config(torch.device("cpu"), torch.bfloat16, 4, 2, 128)
    monkeypatch.setattr(host, "_device_info", lambda device: (None, 132))
    assert not host.supports_config(cuda, torch.bfloat16, 4, 2, 128)


# Every call's launches stop on more rows than the output holds: (family, ratio, coff,
# head_dim, direction, knob overrides, whether this launch holds the check). Of a split
# extend call's two launches, the one that writes the row total checks it: the second for
# register windows, the first for the streaming family.
ROW_CAPACITY_CASES = (
    ("window", 4, 2, 128, "fwd", {}, True),
    ("window", 4, 2, 128, "bwd", {}, True),
    ("streaming", 128, 2, 512, "fwd", {}, True),
    ("streaming", 128, 1, 128, "bwd", {}, True),
    ("window", 4, 2, 512, "ext", {}, True),
    ("window", 4, 2, 512, "ext", {"vec": 2, "threads": 128, "request_rows": 1}, True),
    ("window", 4, 2, 512, "ext", {"part": 1}, False),
    ("window", 4, 2, 512, "ext", {"part": 2}, True),
    ("window", 4, 2, 512, "ext", {"part": 2, "lane_requests": 1}, True),
    ("streaming", 128, 1, 512, "ext", {}, True),
    ("streaming", 128, 1, 512, "ext", {"part": 1}, True),
    ("streaming", 128, 1, 512, "ext", {"part": 2}, False),
)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", ROW_CAPACITY_CASES,
                         ids=[f"{c[0]}-{c[4]}-" + ("-".join(f"{k}{v}" for k, v in c[5].items())
                                                   or "default") for c in ROW_CAPACITY_CASES])
def test_kernels_assert_the_row_capacity(case, arch):
    family, ratio, coff, head_dim, direction, knobs, checks = case
    key = with_knobs(FAMILIES[family].configure(ratio, coff, head_dim, "bfloat16", arch,
                                                Direction(direction)), **knobs)
    main = host.ptx(direction, key).split(".entry")[1]  # the grad_ape sum reads no offsets
    # The message goes out before the trap: one printf and one trap per check site.
    assert main.count("trap;") == main.count("vprintf,") == int(checks)
