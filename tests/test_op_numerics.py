"""csa::compressor forward and backward on CPU against the independent eager model.

fp64 must agree to a few ulps; fp32 within a summation-order bound that grows with the
window; bf16 reference within one bf16 rounding of an fp64 oracle.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time

import hypothesis
import hypothesis.strategies as st
import pytest
import torch
from helpers import (
    EPS,
    MATRIX,
    PackSpec,
    assert_bitwise_equal,
    eager_forward_backward,
    eager_region,
    make_pack,
    offsets,
    op_forward_backward,
    spec_params,
    sum_tolerance,
    tokens_beyond_cu,
    ulp,
    unconsumed_mask,
    window,
)

import csa_ops
from csa_ops import reference

NAMES = ("out", "grad_kv", "grad_score", "grad_ape")


def _scales(pack, grad_out):
    """Magnitude each output is built from: values for out, values*grad for the grads."""
    value = float(pack.kv.abs().max()) if pack.kv.numel() else 1.0
    grad = float(grad_out.abs().max()) if grad_out.numel() else 1.0
    return value, grad * max(value, 1.0), grad * max(value, 1.0), grad * max(value, 1.0)


def _assert_close_to_eager(pack, total_comp, dtype):
    grad_out = pack.grad_out(total_comp)
    actual = op_forward_backward(pack, grad_out, total_comp)
    expected = eager_forward_backward(pack, grad_out, total_comp)
    rows = max(pack.rows(total_comp), 1)
    terms = (window(pack), window(pack), window(pack), window(pack) * (rows + 1))
    for name, a, e, scale, n in zip(NAMES, actual, expected, _scales(pack, grad_out), terms):
        assert a.shape == e.shape and a.dtype == e.dtype, name
        tol = sum_tolerance(dtype, n, scale)
        torch.testing.assert_close(a, e, rtol=0, atol=tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("spec", spec_params(MATRIX))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_matches_eager_static_capacity(spec, dtype):
    _assert_close_to_eager(make_pack(spec, dtype), "capacity", dtype)


@pytest.mark.parametrize("spec", spec_params(MATRIX[::3]))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_matches_eager_true_count(spec, dtype):
    _assert_close_to_eager(make_pack(spec, dtype), None, dtype)


def test_fp64_bound_is_tight():
    # Guards the tolerance helper itself: fp64 at window 8 must be judged at ~1e-14.
    assert sum_tolerance(torch.float64, 8, 1.0) < 1e-13


@pytest.mark.parametrize("spec", spec_params(MATRIX[2::2]))
def test_bf16_reference_within_one_rounding_of_fp64_oracle(spec):
    pack = make_pack(spec, torch.bfloat16)
    grad_out = pack.grad_out()
    actual = op_forward_backward(pack, grad_out)
    oracle = eager_forward_backward(pack, grad_out, dtype=torch.float64)
    scales = _scales(pack, grad_out)
    for name, a, o, scale in zip(NAMES[:3], actual, oracle, scales):
        assert a.dtype == torch.bfloat16, name
        # One bf16 rounding of a value that carries fp32 error (window-length sums).
        bound = ulp(o, torch.bfloat16) + sum_tolerance(torch.float32, window(pack), scale)
        err = (a.double() - o).abs()
        assert bool((err <= bound).all()), f"{name}: max excess {float((err - bound).max())}"
    rows = pack.spec.capacity
    ape_tol = sum_tolerance(torch.float32, window(pack) * (rows + 1), scales[3])
    torch.testing.assert_close(actual[3].double(), oracle[3], rtol=0, atol=ape_tol)


@pytest.mark.parametrize("spec", spec_params(MATRIX[4:8]))
def test_library_oracle_agrees_with_independent_fp64(spec):
    pack = make_pack(spec, torch.bfloat16)
    oracle = reference.compressor_oracle(*pack.args())
    independent = eager_region(*(t.double() for t in pack.tensors()[:3]), *pack.args()[3:])
    torch.testing.assert_close(oracle, independent, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64],
                         ids=["fp16", "bf16", "fp32", "fp64"])
def test_every_dtype_runs_and_matches_eager(dtype):
    pack = make_pack(MATRIX[6], dtype)
    grad_out = pack.grad_out()
    actual = op_forward_backward(pack, grad_out)
    expected = eager_forward_backward(pack, grad_out)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    rows = pack.spec.capacity
    terms = (window(pack), window(pack), window(pack), window(pack) * (rows + 1))
    for name, a, e, scale, n in zip(NAMES, actual, expected, _scales(pack, grad_out), terms):
        assert a.dtype == e.dtype, name
        # Same fp32 (fp64) intermediates up to order: one output rounding plus order error.
        tol = 2 * EPS[a.dtype] * float(e.abs().max()) + sum_tolerance(acc, n, scale)
        torch.testing.assert_close(a, e, rtol=0, atol=tol, msg=lambda m, name=name: f"{name}: {m}")
    assert actual[3].dtype == torch.float32


def test_fp64_inputs_accept_fp64_ape():
    pack = make_pack(MATRIX[9], torch.float64, ape_dtype=torch.float64)
    grad_out = pack.grad_out()
    actual = op_forward_backward(pack, grad_out)
    expected = eager_forward_backward(pack, grad_out)
    assert actual[3].dtype == torch.float64
    for name, a, e in zip(NAMES, actual, expected):
        torch.testing.assert_close(a, e, rtol=0, atol=1e-13, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("ape_dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["ape_bf16", "ape_fp16", "ape_fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64],
                         ids=["bf16", "fp32", "fp64"])
@pytest.mark.parametrize("spec", spec_params(MATRIX[2::4]))
def test_ape_in_any_float_dtype(spec, dtype, ape_dtype):
    """ape is added in fp32 (fp64 for fp64 kv): the same results as its exact upcast, with
    grad_ape reduced in the accumulation dtype and rounded once to ape's dtype."""
    pack = make_pack(spec, dtype, ape_dtype=ape_dtype)
    grad_out = pack.grad_out()
    actual = op_forward_backward(pack, grad_out)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    upcast = op_forward_backward(dataclasses.replace(pack, ape=pack.ape.to(acc)), grad_out)
    assert actual[3].dtype == ape_dtype
    for name, a, e in zip(NAMES[:3], actual, upcast):
        assert_bitwise_equal(a, e, name)
    assert_bitwise_equal(actual[3], upcast[3].to(ape_dtype), "grad_ape")
    oracle = eager_forward_backward(pack, grad_out, dtype=torch.float64)[3]
    rows = pack.spec.capacity
    scale = _scales(pack, grad_out)[3]
    bound = ulp(oracle, ape_dtype) + sum_tolerance(acc, window(pack) * (rows + 1), scale)
    err = (actual[3].double() - oracle).abs()
    assert bool((err <= bound).all()), f"grad_ape: max excess {float((err - bound).max())}"


@pytest.mark.parametrize("spec", spec_params(MATRIX[::2]))
def test_padding_rows_are_zero_and_ignore_their_grads(spec):
    pack = make_pack(spec)
    true_rows = spec.true_rows
    grad_out = pack.grad_out()
    out, *grads = op_forward_backward(pack, grad_out)
    assert bool((out[true_rows:] == 0).all()) and not torch.signbit(out[true_rows:]).any()
    # Huge and NaN gradients on padding rows must not leak anywhere.
    poisoned = grad_out.clone()
    poisoned[true_rows:] = float("nan")
    if spec.extra_rows > 1:
        poisoned[true_rows] = 1e30
    _, *poisoned_grads = op_forward_backward(pack, poisoned)
    for name, a, b in zip(NAMES[1:], grads, poisoned_grads):
        assert_bitwise_equal(b, a, name)


@pytest.mark.parametrize("spec", spec_params(MATRIX))
def test_unconsumed_inputs_get_zero_grads_and_cannot_poison(spec):
    pack = make_pack(spec)
    grad_out = pack.grad_out()
    clean = op_forward_backward(pack, grad_out)
    unused = unconsumed_mask(spec)
    for grad in clean[1:3]:
        assert bool((grad[unused] == 0).all())
    pack.kv.data[unused] = float("nan")
    pack.score.data[unused] = float("inf")
    poisoned = op_forward_backward(pack, grad_out)
    for name, a, b in zip(NAMES, clean, poisoned):
        if name in ("grad_kv", "grad_score"):
            a, b = a[~unused], b[~unused]
        assert_bitwise_equal(b, a, name)


@pytest.mark.parametrize("spec", spec_params([s for s in MATRIX if s.extra_tokens]))
def test_tokens_beyond_cu_get_exact_zero_grads_and_are_never_read(spec):
    pack = make_pack(spec)
    grad_out = pack.grad_out()
    out, grad_kv, grad_score, _ = op_forward_backward(pack, grad_out)
    beyond = tokens_beyond_cu(pack)
    assert bool((grad_kv[beyond] == 0).all()) and bool((grad_score[beyond] == 0).all())
    pack.kv.data[beyond] = float("nan")
    pack.score.data[beyond] = float("inf")
    poisoned = op_forward_backward(pack, grad_out)
    for name, a, b in zip(NAMES, (out, grad_kv, grad_score), poisoned):
        if name == "out":
            assert_bitwise_equal(b, a, name)
        else:
            assert_bitwise_equal(b[: beyond.start], a[: beyond.start], name)


def test_tails_short_and_empty_segments_get_zero_grads():
    spec = PackSpec((6, 0, 3, 9), ratio=4, coff=2, head_dim=5)
    pack = make_pack(spec)
    _, grad_kv, grad_score, _ = op_forward_backward(pack, pack.grad_out())
    # A block's first half feeds the next block, its second half its own. Never consumed:
    # tails (4, 5, 17), the short segment (6..8), and the first half of each segment's
    # last block (0..3, 13..16).
    unused_all = [4, 5, 6, 7, 8, 17]
    unused_first_half = [0, 1, 2, 3, 13, 14, 15, 16]
    for grad in (grad_kv, grad_score):
        assert bool((grad[unused_all] == 0).all())
        assert bool((grad[unused_first_half, :5] == 0).all())
        assert bool((grad[[0, 1, 2, 3], 5:] != 0).all())
    # Block 0 of segment 3 (tokens 9..12) feeds block 1's window with its first half.
    assert bool((grad_kv[9:13, :5] != 0).all())


def _relayout(t, layout):
    """The same values in a non-contiguous view; the gaps hold NaN so a stride bug shows."""
    if layout == "column_slice":
        wide = torch.full((t.shape[0], 2 * t.shape[1]), float("nan"), dtype=t.dtype)
        wide[:, ::2] = t
        return wide[:, ::2]
    if layout == "row_stride":
        tall = torch.full((2 * t.shape[0], t.shape[1]), float("nan"), dtype=t.dtype)
        tall[::2] = t
        return tall[::2]
    return t.t().contiguous().t()


@pytest.mark.parametrize("layout", ["column_slice", "row_stride", "transposed"])
def test_non_contiguous_inputs_give_the_contiguous_result(layout):
    pack = make_pack(MATRIX[6])
    grad_out = pack.grad_out()
    expected = op_forward_backward(pack, grad_out)
    # Views of tensors without grad are leaves, so they can require grad as they are.
    kv, score, ape = (_relayout(t, layout).requires_grad_(True)
                      for t in (pack.kv, pack.score, pack.ape))
    cu = torch.stack([pack.cu_seqlens, pack.cu_seqlens], dim=1)[:, 0]
    cuc = torch.stack([pack.cu_seqlens_comp, pack.cu_seqlens_comp], dim=1)[:, 0]
    assert not any(t.is_contiguous() for t in (kv, score, ape, cu, cuc))
    out = torch.ops.csa.compressor(kv, score, ape, cu, cuc, pack.ratio, pack.coff,
                                   pack.spec.capacity)
    grads = torch.autograd.grad(out, (kv, score, ape), _relayout(grad_out, layout))
    for name, a, e in zip(NAMES, (out, *grads), expected):
        assert_bitwise_equal(a.detach().contiguous(), e, name)


@pytest.mark.parametrize("spec", spec_params([MATRIX[6], MATRIX[10]]))
def test_bitwise_deterministic_under_deterministic_algorithms(spec, deterministic):
    pack = make_pack(spec, torch.bfloat16)
    grad_out = pack.grad_out()
    first = op_forward_backward(pack, grad_out)
    second = op_forward_backward(pack, grad_out)
    for name, a, b in zip(NAMES, first, second):
        assert_bitwise_equal(a, b, name)


def test_overflowing_logits_give_nan_not_clean_values():
    pack = make_pack(PackSpec((8,), ratio=4, coff=1, head_dim=3))
    pack.score.data[1, 0] = float("inf")
    pack.score.data[5, 1] = float("nan")
    out = torch.ops.csa.compressor(*pack.args())
    expected = eager_region(*pack.args())
    assert bool(torch.isnan(out[0, 0])) and bool(torch.isnan(out[1, 1]))
    assert_bitwise_equal(torch.isnan(out), torch.isnan(expected), "nan pattern")


@pytest.mark.parametrize("spec", [
    pytest.param(PackSpec((3, 0, 5), 1, 1, 2, extra_tokens=1, extra_rows=1), id="r1_c1"),
    pytest.param(PackSpec((5, 0, 1, 6), 2, 2, 3, extra_tokens=2, extra_rows=2), id="r2_c2"),
    pytest.param(PackSpec((7, 2, 6), 3, 2, 1, extra_rows=1), id="r3_c2_d1"),
    pytest.param(PackSpec((9, 3, 0, 8), 4, 1, 2, extra_tokens=1), id="r4_c1"),
    pytest.param(PackSpec((33, 5), 16, 2, 1, extra_rows=1), id="r16_c2"),
    pytest.param(PackSpec((257, 0), 128, 1, 1, extra_tokens=1), id="r128_c1"),
])
@pytest.mark.parametrize("total_comp", ["capacity", None])
def test_gradcheck_fp64(spec, total_comp):
    pack = make_pack(spec, torch.float64, ape_dtype=torch.float64)
    tc = spec.capacity if total_comp == "capacity" else None

    def fn(kv, score, ape):
        return torch.ops.csa.compressor(kv, score, ape, pack.cu_seqlens, pack.cu_seqlens_comp,
                                        spec.ratio, spec.coff, tc)

    assert torch.autograd.gradcheck(fn, pack.leaves())


def test_reference_speed_3x8192_d512_r4_c2():
    spec = PackSpec((8192, 8192, 8192), ratio=4, coff=2, head_dim=512)
    pack = make_pack(spec, torch.bfloat16)
    grad_out = pack.grad_out()
    start = time.perf_counter()
    out, *_ = op_forward_backward(pack, grad_out)
    elapsed = time.perf_counter() - start
    assert out.shape == (spec.capacity, 512)
    assert elapsed < 30.0, f"CPU reference fwd+bwd took {elapsed:.1f} s"


@st.composite
def _random_specs(draw):
    ratio = draw(st.sampled_from([1, 2, 3, 4, 5, 16]))
    lengths = tuple(draw(st.lists(st.integers(0, 4 * ratio + 3), max_size=5)))
    return PackSpec(lengths, ratio, coff=draw(st.sampled_from([1, 2])),
                    head_dim=draw(st.integers(1, 9)), extra_tokens=draw(st.integers(0, 3)),
                    extra_rows=draw(st.integers(0, 3)))


@hypothesis.settings(max_examples=60, deadline=None, derandomize=True, database=None)
@hypothesis.given(spec=_random_specs(), total_comp=st.sampled_from(["capacity", None]))
def test_random_packs_match_eager_fp64(spec, total_comp):
    pack = make_pack(spec, torch.float64)
    grad_out = pack.grad_out(total_comp)
    actual = op_forward_backward(pack, grad_out, total_comp)
    expected = eager_forward_backward(pack, grad_out, total_comp)
    for name, a, e in zip(NAMES, actual, expected):
        torch.testing.assert_close(a, e, rtol=0, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("lengths", [(), (0,), (5, 0, 3, 9), (4096, 1, 127)])
def test_offsets_for_and_public_wrapper(lengths):
    ratio = 4
    cu, cuc = csa_ops.offsets_for(lengths, ratio)
    expected_cu, expected_cuc = offsets(lengths, ratio)
    assert_bitwise_equal(cu, expected_cu, "cu_seqlens")
    assert_bitwise_equal(cuc, expected_cuc, "cu_seqlens_comp")
    pack = make_pack(PackSpec(lengths, ratio, 2, 3, extra_rows=1))
    wrapped = csa_ops.compressor(*pack.tensors(), ratio=ratio, coff=2, total_comp=None)
    assert_bitwise_equal(wrapped, torch.ops.csa.compressor(*pack.args(None)), "out")


def test_autograd_saves_only_the_inputs():
    """The forward saves its inputs, never (rows, window, d) probabilities: the backward
    recomputes them."""
    pack = make_pack(MATRIX[6])
    kv, score, ape = pack.leaves()
    saved = []

    def pack_hook(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda tensor: tensor):
        out = torch.ops.csa.compressor(kv, score, ape, *pack.args()[3:])
    inputs = (kv, score, ape, pack.cu_seqlens, pack.cu_seqlens_comp)
    assert len(saved) == len(inputs)
    for tensor, expected in zip(saved, inputs):
        assert tensor.data_ptr() == expected.data_ptr() and tensor.shape == expected.shape
    out.sum().backward()


_FIRST_CALL = """
import hashlib, torch, csa_ops
gen = torch.Generator().manual_seed(0)
x = torch.randn(3567, 512, generator=gen)
kv, score = (x @ torch.randn(512, 256, generator=gen) / 40 for _ in range(2))  # as a block's
ape = torch.randn(4, 256, generator=gen) / 50
cu, cuc = csa_ops.offsets_for([1000, 3, 2047, 517], 4)
outs = [torch.ops.csa.compressor(kv, score, ape, cu, cuc, 4, 2, None) for _ in range(2)]
print(hashlib.sha256(outs[0].numpy().tobytes()).hexdigest(), torch.equal(*outs))
"""


def test_first_cpu_call_of_a_process_is_bitwise_the_steady_one():
    """The CPU op's first call in a fresh process (the first parallel exp of the process)
    computes the same bits as later calls and as every other process: MKL VML can run a
    low-accuracy exp kernel on one thread's chunk of a function's first concurrent call
    (pytorch/pytorch#188792). The race fires in a fraction of fresh processes (without the
    settling exp, two in five runs of this test fail on a 2-core machine), so twelve run,
    two at a time: oversubscribed processes rarely start their worker threads together."""
    results = []
    for _ in range(6):
        runs = [subprocess.Popen([sys.executable, "-c", _FIRST_CALL], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for _ in range(2)]
        for run in runs:
            out, err = run.communicate(timeout=300)
            results.append((run.returncode, out, err))
    assert all(code == 0 for code, _, _ in results), [err[-2000:] for _, _, err in results]
    lines = {out.strip() for _, out, _ in results}
    assert len(lines) == 1 and lines.pop().endswith("True"), lines
