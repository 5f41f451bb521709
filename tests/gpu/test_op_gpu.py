"""csa::compressor on CUDA against the eager region (helpers.eager_region) on the
production shapes and ragged packs, and against the fp32-intermediate reference run on the
same GPU: forward within one rounding step, grad_kv/grad_score bitwise at small windows,
grad_ape within 1e-3, bitwise determinism, full output coverage (NaN-prefilled memory),
torch.compile."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    PackSpec,
    assert_bitwise_equal,
    assert_within_one_step,
    eager_forward_backward,
    eager_region,
    make_pack,
    op_forward_backward,
    sum_tolerance,
    ulp,
    unconsumed_mask,
    window,
)

from csa_ops import reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Below this ratio the cases run the register-window kernels, whose gradients reproduce
# torch's CUDA eager autograd bit for bit.
BITWISE_RATIO_LIMIT = 64

CASES = [
    (PackSpec((1000, 0, 3, 517, 2049), 4, 2, 128, extra_tokens=9, extra_rows=5), torch.bfloat16),
    (PackSpec((8192,), 4, 2, 512), torch.bfloat16),
    (PackSpec((4096, 130, 0, 2000), 128, 1, 512, extra_tokens=7, extra_rows=3), torch.bfloat16),
    (PackSpec((2048, 0, 513), 128, 2, 512, extra_tokens=3, extra_rows=1), torch.bfloat16),
    (PackSpec((777, 1, 0, 1500), 2, 2, 128, extra_rows=4), torch.bfloat16),
    (PackSpec((1000, 63, 200), 64, 2, 128, extra_rows=2), torch.bfloat16),
    (PackSpec((300, 5, 0, 64), 1, 1, 64, extra_tokens=1), torch.float16),
    (PackSpec((301, 0, 2, 90), 3, 2, 65, extra_tokens=2, extra_rows=1), torch.bfloat16),
    (PackSpec((600, 31, 16), 16, 2, 7), torch.float32),
    (PackSpec((513, 4, 0), 4, 1, 256, extra_rows=7), torch.float16),
]
PARAMS = [pytest.param(spec, dtype, id=f"r{spec.ratio}_c{spec.coff}_d{spec.head_dim}_"
                       f"T{spec.num_tokens}_{str(dtype).removeprefix('torch.')}")
          for spec, dtype in CASES]


def _cuda_pack(spec, dtype, seed=0):
    return make_pack(spec, dtype, device="cuda", seed=seed)


def _op(pack, grad_out):
    out = torch.ops.csa.compressor(*pack.args())
    grads = torch.ops.csa.compressor_backward(grad_out, *pack.args()[:-1])
    return (out, *grads)


def _reference(pack, grad_out):
    out = reference.compressor_reference(*pack.args())
    grads = reference.compressor_backward_reference(grad_out, *pack.args()[:-1])
    return (out, *grads)


def _mean_error(x, oracle):
    return float((x.double() - oracle).abs().mean())


# The numerics contract against the eager region: bitwise gradients up to this window
# (coff * ratio).
BITWISE_WINDOW_MAX = 8
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# (pack, dtype, ape dtype). Ragged packs hold empty segments, segments of 1 and ratio - 1
# tokens, tails, spare rows and tokens, odd head dims.
REGION_CASES = [
    pytest.param(PackSpec((8192,), 4, 2, 128), BF16, FP32, id="1x8192_d128_r4c2"),
    pytest.param(PackSpec((8192,), 4, 2, 128), BF16, BF16, id="1x8192_d128_r4c2_ape_bf16"),
    pytest.param(PackSpec((8192,), 4, 2, 512), BF16, FP32, id="1x8192_d512_r4c2"),
    pytest.param(PackSpec((8192,) * 3, 4, 2, 512), BF16, FP32, id="3x8192_d512_r4c2"),
    pytest.param(PackSpec((8192,), 2, 2, 512), BF16, FP32, id="1x8192_d512_r2c2"),
    pytest.param(PackSpec((8192,), 4, 1, 128), BF16, FP32, id="1x8192_d128_r4c1"),
    pytest.param(PackSpec((65536,), 128, 1, 512), BF16, FP32, id="1x65536_d512_r128c1"),
    pytest.param(PackSpec((65536,), 128, 2, 512), BF16, FP32, id="1x65536_d512_r128c2"),
    pytest.param(PackSpec((65536,), 128, 2, 512), BF16, BF16, id="1x65536_d512_r128c2_ape_bf16"),
    pytest.param(PackSpec((1000, 0, 1, 3, 517, 2049), 4, 2, 128, extra_tokens=9, extra_rows=5),
                 BF16, FP32, id="ragged_r4c2_d128"),
    pytest.param(PackSpec((777, 1, 0, 1500, 1), 2, 2, 65, extra_rows=4), BF16, BF16,
                 id="ragged_r2c2_d65_ape_bf16"),
    pytest.param(PackSpec((513, 3, 0, 1, 64), 4, 1, 65, extra_tokens=2, extra_rows=7), FP16, FP16,
                 id="ragged_r4c1_d65_fp16"),
    pytest.param(PackSpec((301, 0, 15, 1, 90), 16, 2, 65, extra_rows=2), BF16, FP32,
                 id="ragged_r16c2_d65"),
    pytest.param(PackSpec((4096, 127, 0, 1, 2000), 128, 1, 512, extra_tokens=7, extra_rows=3),
                 BF16, FP32, id="ragged_r128c1_d512"),
    pytest.param(PackSpec((2048, 0, 255, 1, 513), 128, 2, 512, extra_tokens=3, extra_rows=1),
                 BF16, BF16, id="ragged_r128c2_d512_ape_bf16"),
]


def _assert_no_further_from_oracle(actual, region, oracle, name):
    """Larger windows: at least as close to fp64 as the eager region (mean error,
    with 1% for the noise of two roundings of one value)."""
    assert _mean_error(actual, oracle) <= 1.01 * _mean_error(region, oracle) + 1e-12, name


def _assert_grad_ape_close(actual, region):
    """Within 1e-3 of the region's largest element; a low-precision ape may round the fp32
    sums of two orders to neighbouring values."""
    assert actual.dtype == region.dtype
    bound = 1e-3 * float(region.abs().max())
    if region.dtype != torch.float32:
        bound = bound + ulp(region, region.dtype)
    err = (actual.double() - region.double()).abs()
    assert bool((err <= bound).all()), f"grad_ape: max error {float(err.max())}"


@pytest.mark.parametrize("spec, dtype, ape_dtype", REGION_CASES)
def test_matches_the_eager_region(spec, dtype, ape_dtype):
    pack = make_pack(spec, dtype, device="cuda", ape_dtype=ape_dtype)
    grad_out = pack.grad_out()
    actual = op_forward_backward(pack, grad_out)
    region = eager_forward_backward(pack, grad_out)
    (out, grad_kv, grad_score, grad_ape), (r_out, r_kv, r_score, r_ape) = actual, region
    assert grad_ape.dtype == ape_dtype
    assert torch.count_nonzero(out[spec.true_rows:]) == 0
    if window(spec) <= BITWISE_WINDOW_MAX:
        assert_within_one_step(out, r_out, "out", max_fraction=1e-4)
        assert_bitwise_equal(grad_kv, r_kv, "grad_kv")
        assert_bitwise_equal(grad_score, r_score, "grad_score")
    else:
        assert_within_one_step(out, r_out, "out", max_fraction=1e-2)
        # grad_score cancels terms of size g * v: allow fp32 summation error there.
        scale = float(grad_out.abs().max()) * float(pack.kv.abs().max())
        for name, a, r in (("grad_kv", grad_kv, r_kv), ("grad_score", grad_score, r_score)):
            assert_within_one_step(a, r, name, atol=sum_tolerance(FP32, window(spec), scale))
        oracle = eager_forward_backward(pack, grad_out, dtype=torch.float64)
        for name, a, r, o in zip(("out", "grad_kv", "grad_score"), actual, region, oracle):
            _assert_no_further_from_oracle(a, r, o, name)
    _assert_grad_ape_close(grad_ape, r_ape)


@pytest.mark.parametrize("spec, dtype", PARAMS)
def test_forward_matches_the_eager_region_on_ragged_packs(spec, dtype):
    pack = _cuda_pack(spec, dtype)
    out = torch.ops.csa.compressor(*pack.args())
    expected = eager_region(*pack.args())
    assert_within_one_step(out, expected, "out", max_fraction=1e-3)
    assert torch.count_nonzero(out[spec.true_rows:]) == 0


@pytest.mark.parametrize("spec, dtype", PARAMS)
def test_backward_matches_reference(spec, dtype):
    pack = _cuda_pack(spec, dtype)
    grad_out = pack.grad_out()
    _, grad_kv, grad_score, grad_ape = _op(pack, grad_out)
    _, ref_kv, ref_score, ref_ape = _reference(pack, grad_out)
    if spec.ratio < BITWISE_RATIO_LIMIT:
        # Bit for bit torch's CUDA autograd (the numerics contract), whose softmax backward
        # orders its operations differently from the reference's CPU order.
        _, eager_kv, eager_score, _ = eager_forward_backward(pack, grad_out)
        assert_bitwise_equal(grad_kv, eager_kv, "grad_kv")
        assert_bitwise_equal(grad_score, eager_score, "grad_score")
    else:
        # Streaming kernels: final-rounding tolerance, and no further from the fp64 oracle
        # than the fp32 reference is.
        scale = float(grad_out.abs().max()) * float(pack.kv.abs().max())
        tol = sum_tolerance(torch.float32, window(pack), scale)
        for name, a, r in (("grad_kv", grad_kv, ref_kv), ("grad_score", grad_score, ref_score)):
            err = (a.double() - r.double()).abs()
            bound = ulp(torch.maximum(a.abs(), r.abs()), a.dtype) + tol
            assert bool((err <= bound).all()), f"{name}: max excess {float((err - bound).max())}"
        _, oracle_kv, oracle_score, _ = eager_forward_backward(pack, grad_out,
                                                               dtype=torch.float64)
        for name, a, r, o in (("grad_kv", grad_kv, ref_kv, oracle_kv),
                              ("grad_score", grad_score, ref_score, oracle_score)):
            assert _mean_error(a, o) <= 1.05 * _mean_error(r, o) + 1e-12, name
    torch.testing.assert_close(grad_ape, ref_ape, rtol=1e-3, atol=1e-3)
    beyond = slice(int(pack.cu_seqlens[-1]), spec.num_tokens)
    assert torch.count_nonzero(grad_kv[beyond]) == 0 and torch.count_nonzero(grad_score[beyond]) == 0


@pytest.mark.parametrize("spec, dtype", PARAMS[:1] + PARAMS[2:3])
def test_autograd_path_equals_backward_op(spec, dtype):
    pack = _cuda_pack(spec, dtype)
    grad_out = pack.grad_out()
    leaves = pack.leaves()
    out = torch.ops.csa.compressor(*leaves, *pack.args()[3:])
    grads = torch.autograd.grad(out, leaves, grad_out)
    direct = _op(pack, grad_out)
    for name, a, b in zip(("out", "grad_kv", "grad_score", "grad_ape"), (out, *grads), direct):
        assert_bitwise_equal(a.detach(), b, name)


@pytest.mark.parametrize("spec, dtype", PARAMS[:3] + PARAMS[5:6])
def test_bitwise_deterministic_under_deterministic_algorithms(spec, dtype, deterministic):
    pack = _cuda_pack(spec, dtype)
    grad_out = pack.grad_out()
    first = _op(pack, grad_out)
    for _ in range(3):
        again = _op(pack, grad_out)
        for name, a, b in zip(("out", "grad_kv", "grad_score", "grad_ape"), first, again):
            assert_bitwise_equal(b, a, name)


def _poison_allocator(shapes_and_dtypes, copies=8):
    """Leave NaN-filled blocks of the outputs' sizes in the caching allocator, so outputs
    from torch.empty start as NaN: any element a kernel forgets to write shows up."""
    blocks = [torch.full(shape, float("nan"), dtype=dtype, device="cuda")
              for shape, dtype in shapes_and_dtypes for _ in range(copies)]
    torch.cuda.synchronize()
    del blocks


@pytest.mark.parametrize("spec, dtype", PARAMS[:1] + PARAMS[2:4] + PARAMS[7:8])
def test_nan_prefilled_outputs_are_fully_written(spec, dtype):
    pack = _cuda_pack(spec, dtype)
    grad_out = pack.grad_out()
    clean = _op(pack, grad_out)
    _poison_allocator([(t.shape, t.dtype) for t in clean]
                      + [((8 << 20,), torch.float32)])  # workspace-sized blocks too
    poisoned = _op(pack, grad_out)
    for name, a, b in zip(("out", "grad_kv", "grad_score", "grad_ape"), clean, poisoned):
        assert not bool(torch.isnan(b).any()), name
        assert_bitwise_equal(b, a, name)


@pytest.mark.parametrize("spec, dtype", PARAMS)
def test_unread_inputs_and_padding_grads_cannot_poison(spec, dtype):
    """NaN/Inf in elements no window consumes (tails, short segments, last blocks' first
    halves, tokens past cu[-1]) and NaN grad_out on padding rows change nothing."""
    pack = _cuda_pack(spec, dtype)
    grad_out = pack.grad_out()
    clean = _op(pack, grad_out)
    unused = unconsumed_mask(spec).cuda()
    assert torch.count_nonzero(clean[1][unused]) == 0
    assert torch.count_nonzero(clean[2][unused]) == 0
    pack.kv[unused] = float("nan")
    pack.score[unused] = float("inf")
    grad_out[spec.true_rows:] = float("nan")
    poisoned = _op(pack, grad_out)
    for name, a, b in zip(("out", "grad_kv", "grad_score", "grad_ape"), clean, poisoned):
        if name in ("grad_kv", "grad_score"):
            a, b = a[~unused], b[~unused]
        assert_bitwise_equal(b, a, name)


@pytest.mark.parametrize("spec", [
    pytest.param(PackSpec((), 4, 2, 128, extra_tokens=5, extra_rows=3), id="B0"),
    pytest.param(PackSpec((0,), 4, 2, 128, extra_rows=2), id="zero_tokens"),
    pytest.param(PackSpec((3, 1), 4, 2, 128, extra_tokens=1), id="zero_rows"),
])
def test_degenerate_packs(spec):
    pack = _cuda_pack(spec, torch.bfloat16)
    grad_out = pack.grad_out()
    for name, a, r in zip(("out", "grad_kv", "grad_score", "grad_ape"), _op(pack, grad_out),
                          _reference(pack, grad_out)):
        assert_bitwise_equal(a, r, name)
        assert torch.count_nonzero(a) == 0, name


def test_non_contiguous_inputs_match_contiguous():
    spec, dtype = CASES[0]
    pack = _cuda_pack(spec, dtype)
    grad_out = pack.grad_out()
    expected = _op(pack, grad_out)
    wide = torch.cat([pack.kv, pack.score], dim=1)
    kv, score = wide[:, : pack.kv.shape[1]], wide[:, pack.kv.shape[1]:]
    assert not kv.is_contiguous()
    # Offset by one element: a contiguous view that is not 16-byte aligned.
    flat = torch.empty(pack.kv.numel() + 1, dtype=dtype, device="cuda")
    flat[1:] = pack.kv.reshape(-1)
    misaligned = flat[1:].view_as(pack.kv)
    for kv_in in (kv, misaligned):
        args = (kv_in, score, *pack.args()[2:])
        out = torch.ops.csa.compressor(*args)
        grads = torch.ops.csa.compressor_backward(grad_out.t().contiguous().t(), *args[:-1])
        for name, a, b in zip(("out", "grad_kv", "grad_score", "grad_ape"), (out, *grads),
                              expected):
            assert_bitwise_equal(a, b, name)


@pytest.mark.parametrize("ratio, coff, head_dim", [(4, 2, 128), (4, 2, 512), (2, 2, 128),
                                                   (128, 1, 512), (128, 2, 512)])
def test_production_configs_run_the_cuda_kernels(ratio, coff, head_dim):
    from csa_ops import host

    if host.device_arch(torch.cuda.current_device()) is None:
        pytest.skip("no CuTe-DSL kernel targets this GPU")
    pack = _cuda_pack(PackSpec((4 * ratio,), ratio, coff, head_dim), torch.bfloat16)
    assert host.supports(*pack.tensors(), ratio, coff)


@pytest.mark.parametrize("total_comp", ["capacity", None], ids=["capacity", "true_count"])
@pytest.mark.parametrize("spec, dtype", PARAMS[:1] + PARAMS[2:3])
def test_compile_fullgraph_matches_eager(spec, dtype, total_comp, compile_env):
    import torch._dynamo.testing

    pack = _cuda_pack(spec, dtype)
    grad_out = pack.grad_out(total_comp)
    tc = spec.capacity if total_comp == "capacity" else None

    def forward(kv, score, ape, cu_seqlens, cu_seqlens_comp):
        return torch.ops.csa.compressor(kv, score, ape, cu_seqlens, cu_seqlens_comp, spec.ratio,
                                        spec.coff, tc)

    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(forward, backend=counter, fullgraph=True)
    results = []
    for fn in (compiled, forward):
        leaves = pack.leaves()
        out = fn(*leaves, pack.cu_seqlens, pack.cu_seqlens_comp)
        results.append((out.detach(), *torch.autograd.grad(out, leaves, grad_out)))
    assert counter.frame_count == 1
    (out, *grads), (eager_out, *eager_grads) = results
    # Inductor may pick generated code over the extern kernel: the forward contract holds
    # against eager as it does against the reference.
    assert_within_one_step(out, eager_out, "out", max_fraction=1e-3)
    # Near-zero grad_score values come from cancellation: allow fp32 summation error there.
    scale = float(grad_out.abs().max()) * float(pack.kv.abs().max())
    for name, a, e in zip(("grad_kv", "grad_score"), grads[:2], eager_grads[:2]):
        assert_within_one_step(a, e, name, atol=sum_tolerance(torch.float32, window(pack), scale))
    torch.testing.assert_close(grads[2], eager_grads[2], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("total_comp", ["capacity", None], ids=["capacity", "true_count"])
@pytest.mark.parametrize("spec, dtype", PARAMS[4:5] + PARAMS[7:8])
def test_opcheck_on_cuda(spec, dtype, total_comp):
    pack = _cuda_pack(spec, dtype)
    leaves = pack.leaves()
    torch.library.opcheck(torch.ops.csa.compressor.default,
                          (*leaves, *pack.args(total_comp)[3:]))
    torch.library.opcheck(torch.ops.csa.compressor_backward.default,
                          (pack.grad_out(), *pack.args()[:-1]))


def test_plain_cuda_calls_skip_the_second_dispatch(monkeypatch):
    """Eager calls on plain CUDA tensors reach the kernels from the Autograd-key kernel
    directly (csa_ops.dispatch, or the C++ one of csa_ops.native), with and without autograd
    recording, and give the same bits as the dispatcher's own route."""
    spec = PackSpec((512, 37), 4, 2, 128, extra_rows=2)
    pack = make_pack(spec, dtype=torch.bfloat16, device="cuda")
    leaves = [t.detach().clone().requires_grad_(True) for t in pack.tensors()[:3]]
    args = (*leaves, *pack.tensors()[3:], spec.ratio, spec.coff, spec.capacity)
    grad_out = torch.randn(spec.capacity, spec.head_dim, device="cuda").to(torch.bfloat16)

    def run():
        out = torch.ops.csa.compressor(*args)
        grads = torch.autograd.grad(out, leaves, grad_out)
        with torch.no_grad():
            again = torch.ops.csa.compressor(*args)
        return out, again, *grads

    direct = run()
    redispatched = []
    original = torch._ops.OpOverload.redispatch
    monkeypatch.setattr(torch._ops.OpOverload, "redispatch",
                        lambda self, *a, **k: redispatched.append(self) or original(self, *a, **k))
    again = run()
    assert redispatched == []
    from csa_ops import dispatch, host

    monkeypatch.setattr(dispatch, "_PLAIN_CUDA", frozenset())  # force the dispatcher's route
    with host.python_launch_path():  # the C++ Autograd kernels (csa_ops.native) then defer
        via_dispatcher = run()
    assert len(redispatched) >= 3
    for a, b, c in zip(direct, again, via_dispatcher):
        assert_bitwise_equal(a, b)
        assert_bitwise_equal(a, c)
