"""The row-epilogue kernels without a GPU: the store's every format and the epilogue's
options cross-compile for sm_90a and sm_100a through the users' entry
(csa_ops.precompile_store), the training forward's too, the PTX pins what the bitwise
contract rests on, and the key's and support's rules. Their bytes are tested on the H200
(tests/gpu/test_store_kernel_gpu.py).
"""

from __future__ import annotations

import math
import re
import shutil

import pytest
import torch
from helpers import bench_module

import csa_ops
from csa_ops import cache_formats, compile_cache, host, reference_epilogue
from csa_ops.config import ARCHS, Direction
from csa_ops.kernels import sm
from csa_ops.kernels.calls import SizeClass
from csa_ops.kernels.epilogue import plan
from csa_ops.kernels.window import plan as window_plan

# (cache_format, dtype, weight dtype, head_dim, rope_dim, rotate): every format, each dtype,
# each thread shape (8 to 128 threads, 2 to 8 columns each), RoPE on and off, rotation.
CONFIGS = (
    ("fp8_ds_mla", torch.bfloat16, torch.float32, 512, 64, False),
    ("fp8_ds_mla", torch.float16, torch.bfloat16, 512, 64, True),
    ("mxfp4", torch.bfloat16, torch.bfloat16, 128, 64, True),
    ("mxfp4", torch.float32, torch.float32, 64, 0, False),
    ("fp8_block128", torch.bfloat16, torch.float32, 1024, 64, True),
    ("fp8_block128", torch.float16, torch.float16, 128, 0, False),
    ("none", torch.float32, torch.float32, 512, 64, True),
    ("none", torch.bfloat16, torch.float32, 32, 2, False),
    ("none", torch.bfloat16, torch.float32, 128, 64, True),  # two warps of 2 columns
)


def _id(config) -> str:
    fmt, dtype, weight, d, rope, rotate = config
    return f"{fmt}-{str(dtype)[6:]}-w{str(weight)[6:]}-d{d}-rope{rope}{'-rot' if rotate else ''}"


def _key(config, arch):
    fmt, dtype, weight, d, rope, rotate = config
    return csa_ops.precompile_store(d, fmt, rope, rotate, 1e-6, dtype, weight, arch=arch)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("config", CONFIGS, ids=[_id(c) for c in CONFIGS])
def test_every_configuration_compiles_and_pins_its_rounding(config, arch):
    key = _key(config, arch)
    assert key is not None and key.arch == arch
    ptx = compile_cache.ptx(Direction.STORE, key)
    # No contracted FMA, only rounding-pinned fp32 arithmetic, no flush to zero.
    assert not re.search(r"\bfma\.", ptx)
    assert not re.search(r"\b(mul|add|sub)\.f32\b", ptx)
    assert ".ftz" not in ptx
    # The mean's correctly rounded square root and IEEE divisions, never approximations.
    assert ptx.count("sqrt.rn.f32") == 1
    assert "approx" not in ptx and "rsqrt" not in ptx
    assert "div.rn.f32" in ptx
    # Everything in registers and shared memory; the PDL wait before the first access.
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert "griddepcontrol.wait" in ptx
    assert_lookups_before_the_wait(ptx)
    fmt = config[0]
    conversions = len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx))
    assert (conversions > 0) == (fmt in ("fp8_ds_mla", "fp8_block128"))


def assert_lookups_before_the_wait(ptx: str) -> None:
    """The row's lookups (32-bit index loads) are issued before the PDL wait, while the
    pooling kernel runs; the pooled row is read after it."""
    body = ptx[ptx.index(".entry"):]
    wait = body.index("griddepcontrol.wait")
    assert re.search(r"ld\.global(\.\w+)*\.b32", body[:wait])
    assert re.search(r"ld\.global", body[wait:])


TRAINING = (  # dtype, weight dtype, head_dim, rope_dim, rotate, position_offset
    ("bfloat16", "float32", 512, 64, False, False),
    ("float16", "bfloat16", 128, 64, True, True),
    ("float32", "float32", 64, 0, False, True),
    ("bfloat16", "bfloat16", 1024, 0, True, False),
    ("bfloat16", "float32", 4096, 64, True, True),
)


@pytest.mark.parametrize("direction", [Direction.EPILOGUE, Direction.EPILOGUE_BACKWARD])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("config", TRAINING, ids=["-".join(map(str, c)) for c in TRAINING])
def test_training_kernels_compile_and_pin_their_rounding(config, arch, direction):
    """Both directions: rounding-pinned fp32 (the backward's one root is the forward's
    inverse RMS recomputed), registers and shared memory only, the PDL wait."""
    dtype, weight, d, rope, rotate, offsets = config
    key = plan.configure(dtype, weight, d, rope, rotate, "none", 1e-5, arch, offsets)
    assert plan.supports(key)
    ptx = compile_cache.ptx(direction, key)
    assert not re.search(r"\bfma\.", ptx) and not re.search(r"\b(mul|add|sub)\.f32\b", ptx)
    assert ".ftz" not in ptx and "approx" not in ptx and ptx.count("sqrt.rn.f32") == 1
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert "griddepcontrol.wait" in ptx
    if direction is Direction.EPILOGUE:
        assert_lookups_before_the_wait(ptx)


@pytest.mark.parametrize("arch", ARCHS)
def test_precompile_epilogue_compiles_both_training_directions(arch):
    from csa_ops import host

    key = csa_ops.precompile_epilogue(512, 64, False, 1e-6, torch.bfloat16, torch.float32,
                                      position_offset=True, arch=arch)
    assert key == plan.configure("bfloat16", "float32", 512, 64, False, "none", 1e-6, arch,
                                 True)
    hits = host.KERNELS.hits
    for direction in (Direction.EPILOGUE, Direction.EPILOGUE_BACKWARD):
        host.KERNELS.get(direction, key)
    assert host.KERNELS.hits == hits + 2  # both were held in memory by the call
    assert csa_ops.precompile_epilogue(96, arch=arch) is None  # not a power of two
    with pytest.raises(ValueError, match="precompile_epilogue"):
        csa_ops.precompile_epilogue(128, dtype=torch.float64, arch=arch)


def test_precompile_store_declines_what_the_kernel_does_not_take():
    assert csa_ops.precompile_store(96, "none", arch="sm_90a") is None  # not a power of two
    assert csa_ops.precompile_store(256, "fp8_ds_mla", 64, arch="sm_90a") is None
    assert csa_ops.precompile_store(64, "fp8_block128", arch="sm_90a") is None
    with pytest.raises(ValueError, match="dtype"):
        csa_ops.precompile_store(128, "none", dtype=torch.float64, arch="sm_90a")
    with pytest.raises(ValueError, match="arch"):
        csa_ops.precompile_store(128, "none", arch="sm_80")


def test_key_shapes_and_checks():
    key = plan.configure("bfloat16", "float32", 512, 64, False, "fp8_ds_mla", 1e-6, "sm_90a")
    assert (key.threads, key.vec, key.cache_dtype, key.align_bytes) == (128, 4, "uint8", 8)
    wide = plan.configure("float32", "float32", 4096, 0, True, "none", 0.0, "sm_100a")
    assert (wide.threads, wide.vec, wide.cache_dtype) == (128, 32, "float32")
    assert plan.supports(wide)
    assert not plan.supports(plan.configure("bfloat16", "float32", 8192, 0, False, "none",
                                            1e-6, "sm_90a"))
    assert not plan.supports(plan.configure("bfloat16", "float32", 128, 3, False, "none",
                                            1e-6, "sm_90a"))
    # mxfp4 rows of 32 columns are 17 bytes: every other row would misalign the 2-byte
    # code stores, so those calls keep the torch route.
    assert not plan.supports(plan.configure("bfloat16", "float32", 32, 0, False, "mxfp4",
                                            1e-6, "sm_90a"))
    assert plan.supports(plan.configure("bfloat16", "float32", 64, 0, False, "mxfp4", 1e-6,
                                        "sm_90a"))
    for bad in ({"dtype": "float64"}, {"cache_format": "fp8"}, {"eps": float("nan")},
                {"arch": "sm_80"}, {"weight_dtype": "int32"}):
        fields = {"dtype": "bfloat16", "weight_dtype": "float32", "head_dim": 128,
                  "rope_dim": 0, "rotate": False, "cache_format": "none", "eps": 1e-6,
                  "arch": "sm_90a"} | bad
        with pytest.raises(ValueError, match="EpilogueKey"):
            plan.EpilogueKey(**fields)


def test_routes_and_defaults():
    """Every row-epilogue kernel is on by default; torch_route() turns them off and
    kernel_route() on, each restoring the state before; on the CPU no kernel takes a call."""
    from csa_ops import row_epilogue
    from csa_ops.state import STATE

    def flags():
        return (STATE.store_kernel, STATE.training_epilogue_kernel,
                STATE.training_epilogue_backward_kernel)

    assert STATE.fused_store_step
    assert not STATE.fused_store_prefill  # a scope asks for the prefill's fused launches
    with row_epilogue.fused_prefill():
        assert STATE.fused_store_prefill
        with row_epilogue.fused_prefill(False):
            assert not STATE.fused_store_prefill
        assert STATE.fused_store_prefill
    assert not STATE.fused_store_prefill
    assert STATE.fused_training_forward and STATE.fused_training_backward
    with row_epilogue.two_launch_forward(), row_epilogue.staged_backward():
        assert not (STATE.fused_training_forward or STATE.fused_training_backward)
        with row_epilogue.fused_training():
            assert STATE.fused_training_forward and STATE.fused_training_backward
    with row_epilogue.fused_training():
        assert STATE.fused_training_forward and STATE.fused_training_backward
        for two_launches, flag in ((row_epilogue.two_launch_step, "fused_store_step"),
                                   (row_epilogue.two_launch_forward, "fused_training_forward"),
                                   (row_epilogue.staged_backward, "fused_training_backward")):
            with two_launches():
                assert not getattr(STATE, flag)
            assert getattr(STATE, flag)
    assert STATE.fused_training_forward and STATE.fused_training_backward

    assert flags() == (True, True, True)
    with row_epilogue.torch_route():
        assert flags() == (False, False, False)
        with row_epilogue.kernel_route():
            assert flags() == (True, True, True)
            rows = torch.randn(6, 64)
            cuc = torch.tensor([0, 4, 6], dtype=torch.int32)
            assert row_epilogue.launch_rows(rows, cuc, None, 4, torch.ones(64), 1e-6, None,
                                            None, 0, False) is None
            assert row_epilogue.launch_rows_backward(rows, rows, cuc, None, 4, torch.ones(64),
                                                     1e-6, None, None, 0, False) is None
            kv = torch.randn(24, 128)
            cu = torch.tensor([0, 16, 24], dtype=torch.int32)
            with row_epilogue.fused_training():
                assert row_epilogue.launch_forward_epilogue(
                    kv, kv, torch.zeros(4, 128), cu, cuc, 4, 2, 6, torch.ones(64), 1e-6, None,
                    None, 0, None, False) is None
                assert row_epilogue.launch_backward_epilogue(
                    rows, kv, kv, torch.zeros(4, 128), cu, cuc, 4, 2, torch.ones(64), 1e-6,
                    None, None, 0, None, False) is None
        assert flags() == (False, False, False)
    assert flags() == (True, True, True)


# csa::compressor_extend_store's decode step in one kernel (kernels/window/extend_store.py):
# (ratio, coff, cache_format, dtype, weight dtype, head_dim, rope_dim, rotate), rows of one
# to four warps, both coffs, both 2-byte dtypes (the GPU suite runs more, fp32 included).
DECODE_STEPS = (
    (4, 2, "fp8_ds_mla", torch.bfloat16, torch.float32, 512, 64, False),
    (4, 2, "mxfp4", torch.bfloat16, torch.bfloat16, 128, 64, True),
    (4, 1, "fp8_block128", torch.float16, torch.float32, 256, 0, False),
)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("config", DECODE_STEPS,
                         ids=["-".join(map(str, (r, c, f, d))) for r, c, f, _, _, d, _, _ in
                              DECODE_STEPS])
def test_the_decode_step_kernel_compiles_for_its_configuration(config, arch):
    ratio, coff, fmt, dtype, weight, d, rope, rotate = config
    key = csa_ops.precompile_store(d, fmt, rope, rotate, 1e-6, dtype, weight, arch=arch,
                                   ratio=ratio, coff=coff)
    step = host.decode_step_key(key, ratio, coff)
    assert step is not None and step.epilogue == key and step.arch == arch
    assert (step.extend.knobs.vec, step.extend.knobs.threads) == (key.vec, key.threads)
    assert step.extend.knobs.request_rows  # a request's item pools its rows
    ptx = compile_cache.ptx(Direction.EXTEND_STORE, step)
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
    # The epilogue's rounding at each of its rows' sites (the head rows, the later rows):
    # the correctly rounded square root, no approximate one. (The pooling's certified fast
    # softmax has its own audit: tests/test_extend_kernel.py.)
    assert ptx.count("sqrt.rn.f32") == coff + 1
    assert "sqrt.approx" not in ptx and "rsqrt" not in ptx


@pytest.mark.parametrize("ratio, coff, d, dtype, why", [
    (16, 2, 512, "bfloat16", "ape's window-32 rows past the shared memory it takes"),
    (4, 2, 64, "bfloat16", "half a warp per row"),
    (4, 2, 1024, "float32", "32-byte vectors"),
])
def test_the_decode_step_kernel_declines_what_one_cta_cannot_hold(ratio, coff, d, dtype, why):
    epilogue = plan.configure(dtype, "float32", d, 0, False, "none", 1e-6, "sm_90a")
    assert plan.supports(epilogue)
    assert host.decode_step_key(epilogue, ratio, coff) is None, why
    assert host.decode_step_key(epilogue, None, None) is None


def test_the_decode_step_key_holds_its_two_keys_together():
    from csa_ops.config import with_knobs
    from csa_ops.kernels.window.plan import ExtendStoreKey

    epilogue = plan.configure("bfloat16", "float32", 512, 64, False, "fp8_ds_mla", 1e-6,
                              "sm_90a")
    step = host.decode_step_key(epilogue, 4, 2)
    with pytest.raises(ValueError, match="agree on dtype, arch and head_dim"):
        ExtendStoreKey(step.extend, plan.configure("float16", "float32", 512, 64, False,
                                                   "fp8_ds_mla", 1e-6, "sm_90a"))
    with pytest.raises(ValueError, match="in the epilogue's CTA"):
        ExtendStoreKey(with_knobs(step.extend, vec=2, threads=256), epilogue)
    with pytest.raises(ValueError, match="in the epilogue's CTA"):  # row items: another CTA's
        ExtendStoreKey(with_knobs(step.extend, request_rows=False), epilogue)


@pytest.mark.parametrize("size", [SizeClass.FEW_LARGE, SizeClass.LARGE],
                         ids=["lanes", "scan"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("config", DECODE_STEPS,
                         ids=["-".join(map(str, (r, c, f, d))) for r, c, f, _, _, d, _, _ in
                              DECODE_STEPS])
def test_the_prefill_kernels_compile_for_their_configuration(config, arch, size):
    """A split call: the decode step's kernel for the head rows and states, then the rows
    launch (its rows' requests by lanes or by a scan), in the epilogue's CTA, pooling with
    the forward key's bits, the rows launch starting beside the first (no wait before its
    loads) and within the registers of the CTAs an SM its plan fills."""
    ratio, coff, fmt, dtype, weight, d, rope, rotate = config
    key = csa_ops.precompile_store(d, fmt, rope, rotate, 1e-6, dtype, weight, arch=arch,
                                   ratio=ratio, coff=coff)
    heads, rows = host.prefill_store_keys(key, ratio, coff, size)
    forward = host.select_key(ratio, coff, d, str(dtype)[6:], arch, Direction.FORWARD)
    for fused in (heads, rows):
        assert fused.epilogue == key and fused.arch == arch
        assert (fused.pooling.knobs.vec, fused.pooling.knobs.threads) == (key.vec, key.threads)
        assert fused.pooling.knobs.fast_exp == forward.knobs.fast_exp
    assert heads.head_rows_only and not heads.extend.knobs.request_rows
    assert heads == host.prefill_store_keys(key, ratio, coff, SizeClass.LARGE)[0]
    assert rows.rows.knobs.lane_requests == (size == SizeClass.FEW_LARGE)
    head_ptx = compile_cache.ptx(Direction.EXTEND_STORE, heads)
    rows_ptx = compile_cache.ptx(Direction.ROWS_STORE, rows)
    for ptx in (head_ptx, rows_ptx):
        assert "ld.local" not in ptx and "st.local" not in ptx
        assert "sqrt.approx" not in ptx and "rsqrt" not in ptx
        if shutil.which("ptxas"):
            (_, _, _, spill_stores, spill_loads), *_ = bench_module(
                "kernel_resources").ptxas_resources(ptx, arch)
            assert spill_stores == spill_loads == 0
    assert head_ptx.count("sqrt.rn.f32") == coff  # the head rows only
    assert head_ptx.index("griddepcontrol.wait") < head_ptx.index("ld.global")
    assert rows_ptx.count("sqrt.rn.f32") == 1
    # Its only wait is its last CTA's, at its end.
    assert rows_ptx.count("griddepcontrol.wait") == 1
    assert rows_ptx.index("griddepcontrol.wait") > rows_ptx.rindex("ld.global")
    assert f".minnctapersm {rows.rows.knobs.min_ctas}" in rows_ptx
    if shutil.which("ptxas"):
        (_, registers, *_), *_ = bench_module("kernel_resources").ptxas_resources(rows_ptx,
                                                                                 arch)
        assert _an_sm_holds(rows.rows.knobs.min_ctas, key.threads, registers)


@pytest.mark.parametrize("config, size", [(DECODE_STEPS[0], SizeClass.FEW_LARGE),
                                          (DECODE_STEPS[2], SizeClass.LARGE)],
                         ids=["r4c2-lanes", "r4c1-fp16-scan"])
def test_the_rows_launch_pools_with_the_forward_operations(config, size):
    """The rows launch's pooling compiles to the forward kernel's per-row operations at its
    vector width, no more and no fewer, and its other float arithmetic is the store
    kernel's; the forward's selects of a sequence's first block fold away (a row past the
    head rows never is one)."""
    ratio, coff, fmt, dtype, weight, d, rope, rotate = config
    key = plan.configure(str(dtype)[6:], str(weight)[6:], d, rope, rotate, fmt, 1e-6, "sm_90a")
    _, rows = host.prefill_store_keys(key, ratio, coff, size)
    from csa_ops.config import Part, with_knobs

    forward = with_knobs(rows.rows, part=Part.WHOLE, lane_requests=False, min_ctas=0)
    ptx = {name: compile_cache.ptx(direction, k) for name, direction, k in (
        ("rows", Direction.ROWS_STORE, rows), ("forward", Direction.FORWARD, forward),
        ("store", Direction.STORE, key))}
    for op in ("ex2.approx", "fma.rn.f32", "fma.rm.f32", "max.NaN.f32", r"\tmul.f32",
               r"\tadd.f32", "selp.f32", "setp.ge.f32", "mul.rn.f32", "div.rn.f32"):
        count = {name: len(re.findall(op, text)) for name, text in ptx.items()}
        pooling = 0 if op == "selp.f32" else count["forward"]
        assert count["rows"] == pooling + count["store"], (op, count)


def test_precompile_store_compiles_the_prefill_kernels_where_calls_take_them(monkeypatch):
    """With a configuration, precompile_store compiles the split calls' fused kernels only
    within fused_prefill(), where calls take them (recorded here, not compiled)."""
    from csa_ops import row_epilogue

    asked = []
    monkeypatch.setattr(host.KERNELS, "get", lambda direction, key: asked.append(
        (Direction(direction), key)))
    key = csa_ops.precompile_store(512, "fp8_ds_mla", 64, False, 1e-6, torch.bfloat16,
                                   torch.float32, arch="sm_90a", ratio=4, coff=2)
    split = {part for size in (SizeClass.FEW_LARGE, SizeClass.LARGE)
             for part in zip(window_plan.SPLIT_STORE,
                             host.prefill_store_keys(key, 4, 2, size))}
    assert len(split) == 3  # the head rows' kernel is both sizes'
    assert [d for d, _ in asked] == [Direction.STORE, Direction.EXTEND_STORE]
    asked.clear()
    with row_epilogue.fused_prefill():
        csa_ops.precompile_store(512, "fp8_ds_mla", 64, False, 1e-6, torch.bfloat16,
                                 torch.float32, arch="sm_90a", ratio=4, coff=2)
    assert set(asked[2:]) == split and len(asked) == 6


def test_the_prefill_keys_hold_their_two_keys_together():
    from csa_ops.config import Part, with_knobs
    from csa_ops.kernels import extend_plan
    from csa_ops.kernels.window.plan import ExtendStoreKey, RowsStoreKey

    epilogue = plan.configure("bfloat16", "float32", 512, 64, False, "fp8_ds_mla", 1e-6,
                              "sm_90a")
    heads, rows = host.prefill_store_keys(epilogue, 4, 2)
    with pytest.raises(ValueError, match="split call's row items"):
        RowsStoreKey(with_knobs(rows.rows, part=Part.REQUESTS), epilogue)
    with pytest.raises(ValueError, match="in the epilogue's CTA"):
        RowsStoreKey(with_knobs(rows.rows, vec=2, threads=256), epilogue)
    with pytest.raises(ValueError, match="head rows"):  # a split call's first part only
        ExtendStoreKey(with_knobs(heads.extend, request_rows=True), epilogue)
    # Only a split call has them: not a step, not a decode-sized call (one launch).
    forward = host.select_key(4, 2, 512, "bfloat16", "sm_90a", Direction.FORWARD)
    for size in (extend_plan.SizeClass.STEP, extend_plan.SizeClass.DECODE_SIZED):
        assert window_plan.split_store_keys(extend_plan.for_size(forward, size),
                                            epilogue) is None
    assert host.prefill_store_keys(epilogue, None, None) == ()
    # What one CTA cannot hold: ape's window-32 rows past the fused shared memory.
    assert host.prefill_store_keys(epilogue, 16, 2) == ()


@pytest.mark.parametrize("rows, sms", [(2051, 132), (2051, 78), (7, 132), (100000, 132)])
def test_the_rows_launch_covers_every_row_once(rows, sms):
    """The kernel takes ceil(rows / grid) consecutive rows a CTA: together every row, none
    twice, at most one a thread, and one wave of the CTAs an SM its bound keeps where a
    thread's row each fills it."""
    epilogue = plan.configure("bfloat16", "float32", 512, 64, False, "fp8_ds_mla", 1e-6,
                              "sm_90a")
    _, key = host.prefill_store_keys(epilogue, 4, 2)
    grid = window_plan.plan_row_share(key, rows, sms)[0].grid
    share = -(-rows // grid)
    assert share <= epilogue.threads
    assert grid <= max(sms * key.rows.knobs.min_ctas, -(-rows // epilogue.threads))
    covered = [n for cta in range(grid) for n in range(cta * share, min((cta + 1) * share, rows))]
    assert covered == list(range(rows))


# csa::compressor_epilogue's forward and backward in one kernel each
# (kernels/window/forward_epilogue.py, backward_epilogue.py): (ratio, coff, dtype, weight
# dtype, head_dim, rope_dim, rotate, position_offset), rows of two to four warps, both
# coffs, every row dtype.
FUSED_CONFIGS = (
    (4, 2, torch.bfloat16, torch.float32, 512, 64, False, True),
    (4, 2, torch.bfloat16, torch.bfloat16, 128, 64, True, False),
    (4, 1, torch.float16, torch.float32, 256, 0, False, False),
    (2, 2, torch.float32, torch.float32, 512, 64, True, True),
)


FUSED_TRAINING = {Direction.FORWARD_EPILOGUE: host.training_forward_key,
                  Direction.BACKWARD_EPILOGUE: host.training_backward_key}


def _an_sm_holds(ctas: int, threads: int, registers: int) -> bool:
    """Whether an SM holds ``ctas`` CTAs of ``threads`` threads at ``registers`` a thread:
    its threads, its CTAs, and each register sub-partition's share of the warps."""
    warps_a_partition = -(-ctas * threads // 32 // sm.SUB_PARTITIONS)
    return (ctas * threads <= sm.MAX_THREADS
            and ctas <= sm.MAX_CTAS
            and warps_a_partition * 32 * registers
            <= sm.REGISTER_FILE // sm.SUB_PARTITIONS)


@pytest.mark.parametrize("direction", list(FUSED_TRAINING))
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("config", FUSED_CONFIGS,
                         ids=["-".join(map(str, (r, c, str(t)[6:], d))) for r, c, t, _, d, _, _, _
                              in FUSED_CONFIGS])
def test_the_fused_training_kernels_compile_for_their_configuration(config, arch, direction):
    ratio, coff, dtype, weight, d, rope, rotate, offsets = config
    key = plan.configure(str(dtype)[6:], str(weight)[6:], d, rope, rotate, "none", 1e-6, arch,
                         offsets)
    fused = FUSED_TRAINING[direction](key, ratio, coff)
    assert fused is not None and fused.epilogue == key and fused.arch == arch
    assert (fused.pooling.knobs.vec, fused.pooling.knobs.threads) == (key.vec, key.threads)
    # The pooling's knob that fixes a row's bits is the forward key's (the backward pools
    # each row again).
    forward = host.select_key(ratio, coff, d, str(dtype)[6:], arch, Direction.FORWARD)
    assert fused.pooling.knobs.fast_exp == forward.knobs.fast_exp
    ptx = compile_cache.ptx(direction, fused)
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
    # The epilogue's correctly rounded square root, once; no approximate one.
    assert ptx.count("sqrt.rn.f32") == 1
    assert "sqrt.approx" not in ptx and "rsqrt" not in ptx
    main = ptx[ptx.index(".entry"):]
    main = main[:main.index("\n}\n")]
    if direction is Direction.FORWARD_EPILOGUE:
        # No pooled row goes to global memory: the one row store is the epilogue's output.
        assert len(re.findall(r"\bst\.global", main)) == key.vec
    else:
        # The kernel and the fixed-order sum of grad_ape's and grad_weight's partials.
        assert len(re.findall(r"\.entry", ptx)) == 2
    if shutil.which("ptxas"):
        # No spills, and the forward within the registers of the CTAs an SM its plan fills
        # (its launch bound).
        (_, registers, _, spill_stores, spill_loads), *_ = bench_module(
            "kernel_resources").ptxas_resources(ptx, arch)
        assert spill_stores == spill_loads == 0
        if direction is Direction.FORWARD_EPILOGUE:
            assert _an_sm_holds(fused.pooling.knobs.min_ctas, key.threads, registers)
    if direction is Direction.FORWARD_EPILOGUE:  # the bound the plan counts on
        assert f".minnctapersm {fused.pooling.knobs.min_ctas}" in ptx


@pytest.mark.parametrize("ratio, coff, d, dtype", [
    (4, 2, 512, "bfloat16"), (4, 2, 128, "bfloat16"), (4, 1, 512, "bfloat16"),
    (8, 2, 512, "bfloat16"), (4, 2, 1024, "bfloat16"), (4, 2, 256, "float32"),
    (8, 2, 512, "float32"), (2, 1, 1024, "float16")])
def test_the_fused_forward_plans_one_wave_of_what_an_sm_holds(ratio, coff, d, dtype):
    """Its CTAs an SM (its launch bound) fit the registers it is estimated at (whole warps
    of them in each of an SM's four register sub-partitions), the shared memory and the
    threads of an SM, and one more would not fit the registers, threads or CTAs of an SM;
    its plan gives each row to one CTA, consecutively, and puts at most one wave of CTAs on
    the SMs until every thread of that wave holds a row."""
    from csa_ops.kernels.window.forward_epilogue import WindowForwardEpilogue

    epilogue = plan.configure(dtype, "float32", d, 64, False, "none", 1e-6, "sm_90a")
    key = host.training_forward_key(epilogue, ratio, coff)
    resident, threads = key.forward.knobs.min_ctas, epilogue.threads
    registers = min(window_plan.forward_epilogue_registers(key.forward), sm.MAX_REGISTERS)
    registers = -(-registers // sm.REGISTER_GRANULE) * sm.REGISTER_GRANULE  # as allocated
    assert _an_sm_holds(resident, threads, registers)
    assert not _an_sm_holds(resident + 1, threads, registers)
    assert resident * WindowForwardEpilogue(key).smem_bytes() <= sm.SMEM_FOR_CTAS
    sms = 132
    for rows in (1, 5, 1000, 6144, 16384, sms * resident * threads, 10**6):
        launch, rows_per_cta = window_plan.plan_row_share(key, rows, sms)
        assert 1 <= rows_per_cta <= threads
        assert (launch.grid - 1) * rows_per_cta < rows <= launch.grid * rows_per_cta
        if rows <= sms * resident * threads:
            assert launch.grid <= sms * resident
        else:
            assert rows_per_cta == threads


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas (the CUDA toolkit)")
@pytest.mark.parametrize("ratio, coff, d, dtype", [
    (4, 2, 512, "bfloat16"), (4, 2, 128, "bfloat16"), (8, 2, 512, "bfloat16"),
    (4, 2, 512, "float32")])
def test_the_fused_forward_register_estimate_covers_the_unbounded_kernel(ratio, coff, d, dtype):
    """forward_epilogue_registers is at or above what ptxas gives the kernel without a launch
    bound, so the bound the plan counts on costs no spills."""
    from csa_ops.config import with_knobs

    epilogue = plan.configure(dtype, "float32", d, 64, False, "none", 1e-6, "sm_90a")
    key = host.training_forward_key(epilogue, ratio, coff)
    unbounded = type(key)(with_knobs(key.forward, min_ctas=0), key.epilogue)
    ptx = compile_cache.ptx(Direction.FORWARD_EPILOGUE, unbounded)
    (_, registers, *_), = bench_module("kernel_resources").ptxas_resources(ptx, "sm_90a")
    assert registers <= window_plan.forward_epilogue_registers(key.forward)


def test_precompile_epilogue_with_a_configuration_compiles_the_fused_kernels():
    ratio, coff, dtype, weight, d, rope, rotate, offsets = FUSED_CONFIGS[0]
    key = csa_ops.precompile_epilogue(d, rope, rotate, 1e-6, dtype, weight, offsets, "sm_90a",
                                      ratio=ratio, coff=coff)
    hits = host.KERNELS.hits
    for direction, key_of in FUSED_TRAINING.items():
        host.KERNELS.get(direction, key_of(key, ratio, coff))
    assert host.KERNELS.hits == hits + 2  # the precompile call held both in memory


@pytest.mark.parametrize("ratio, coff, d, dtype, why", [
    (128, 1, 512, "bfloat16", "the streaming family pools it"),
    (16, 2, 512, "bfloat16", "ape's window-32 rows past the shared memory it takes"),
    (16, 2, 256, "bfloat16", "a window of 32 at 4 columns a thread: past the registers"),
    (4, 2, 64, "bfloat16", "half a warp per row"),
    (4, 2, 1024, "float32", "32-byte vectors"),
])
def test_the_fused_training_kernels_decline_what_one_cta_cannot_hold(ratio, coff, d, dtype,
                                                                       why):
    epilogue = plan.configure(dtype, "float32", d, 0, False, "none", 1e-6, "sm_90a")
    assert plan.supports(epilogue)
    for key_of in FUSED_TRAINING.values():
        assert key_of(epilogue, ratio, coff) is None, why
        assert key_of(epilogue, None, None) is None


def test_the_fused_backward_holds_a_window_and_its_partials_in_shared_memory():
    """ape's rows and the grad_ape partials (as many), then the row: a window of 16 at d512
    fits the forward's shared memory but not the backward's."""
    epilogue = plan.configure("bfloat16", "float32", 512, 0, False, "none", 1e-6, "sm_90a")
    assert host.training_forward_key(epilogue, 8, 2) is not None
    assert host.training_backward_key(epilogue, 8, 2) is None
    assert host.training_backward_key(epilogue, 4, 2) is not None


@pytest.mark.parametrize("d, dtype, threads", [(64, "bfloat16", 16), (128, "bfloat16", 64),
                                               (128, "float32", 64), (256, "bfloat16", 64),
                                               (512, "bfloat16", 128)])
def test_unencoded_rows_take_two_warps_where_they_can(d, dtype, threads):
    """Rows in their dtype (format "none": the training op's) that 4 columns a thread leave
    to one warp take two at 2 columns a thread, so both fused training kernels take a row of
    128 columns; encoded rows keep 4 columns a thread (a 4-byte store of e4m3 codes)."""
    epilogue = plan.configure(dtype, "float32", d, 0, False, "none", 1e-6, "sm_90a")
    assert (epilogue.threads, epilogue.vec) == (threads, d // threads)
    if d == 128:
        encoded = plan.configure(dtype, "float32", d, 0, False, "fp8_block128", 1e-6, "sm_90a")
        assert (encoded.threads, encoded.vec) == (32, 4)
    if threads % 32 == 0:
        for key_of in FUSED_TRAINING.values():
            assert key_of(epilogue, 4, 2).pooling.knobs.threads == threads


@pytest.mark.parametrize("direction", list(FUSED_TRAINING))
def test_the_fused_training_keys_hold_their_two_keys_together(direction):
    from csa_ops.config import with_knobs

    epilogue = plan.configure("bfloat16", "float32", 512, 64, False, "none", 1e-6, "sm_90a")
    fused = FUSED_TRAINING[direction](epilogue, 4, 2)
    kind, pooling = type(fused), fused.pooling
    assert fused.family == "window" and (fused.dtype, fused.arch) == ("bfloat16", "sm_90a")
    assert fused.weight_dtype == "float32" and fused.align_bytes == 8
    with pytest.raises(ValueError, match="agree on dtype, arch and head_dim"):
        kind(pooling, plan.configure("bfloat16", "float32", 256, 64, False, "none", 1e-6,
                                     "sm_90a"))
    with pytest.raises(ValueError, match="in the epilogue's CTA"):
        kind(with_knobs(pooling, vec=2, threads=256), epilogue)
    with pytest.raises(ValueError, match="writes rows"):
        kind(pooling, plan.configure("bfloat16", "float32", 512, 64, False, "fp8_ds_mla",
                                     1e-6, "sm_90a"))


@pytest.mark.parametrize("cache_format", sorted(cache_formats.SCALE_TOP))
def test_the_scale_exponent_from_bits_is_the_reference_quotients(cache_format):
    """The kernels take a power-of-two scale's exponent from the bits of max(amax, floor)
    and the top's two parts (cache_formats.top_parts), with no division: for every fp32
    exponent, at the mantissas around the rule's threshold and at random ones, it is the
    reference's ceil(log2(divide(x, top))) of the quotient rounded to fp32."""
    top, floor = cache_formats.SCALE_TOP[cache_format], cache_formats.SCALE_FLOOR[cache_format]
    t, g = cache_formats.top_parts(top)
    assert math.ldexp(1 + g / 2**23, t) == top
    gen = torch.Generator().manual_seed(0)
    edges = torch.tensor([0, 1, g - 1, g, g + 1, 2**23 - 1], dtype=torch.int64)
    mantissas = torch.cat([edges, torch.randint(0, 2**23, (2048,), generator=gen)])
    exponents = torch.arange(0, 255, dtype=torch.int64)  # +0, subnormals and every normal
    bits = ((exponents[:, None] << 23) | mantissas[None, :]).flatten().to(torch.int32)
    x = bits.view(torch.float32).clamp(min=floor)
    want = reference_epilogue.ceil_log2(reference_epilogue.divide(x, top))
    b = x.view(torch.int32)
    got = (b >> 23) - 127 - t + ((b & 0x7FFFFF) > g).to(torch.int32)
    assert torch.equal(got, want)
