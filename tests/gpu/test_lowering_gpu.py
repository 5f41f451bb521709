"""csa_ops.lowering on CUDA: generated Triton against the reference, the code Inductor emits in
each mode, data-dependent and dynamic shapes, and the auto policy's choices."""

from __future__ import annotations

import re

import pytest
import torch
import torch._dynamo.testing
from helpers import (
    PackSpec,
    assert_bitwise_equal,
    assert_rounded_once,
    assert_within_one_step,
    cast_op_upcast,
    consumed_step,
    make_pack,
    sum_tolerance,
    use_lowering_mode,
    window,
)
from torch._inductor.utils import run_and_get_code

import csa_ops
from csa_ops import lowering, offsets_for, reference

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not lowering.available, reason="csa_ops.lowering not registered"),
]


def _kernels(code: str):
    return re.findall(r"^(triton_\w+) = async_compile", code, flags=re.MULTILINE)


def _extern_ops(code: str):
    """Calls of the opaque ops (not the asserts and comments that name them)."""
    return re.findall(r"= torch\.ops\.csa\.(\w+)\.default\(", code)


def _buffers(code: str):
    shapes = re.findall(r"empty_strided_cuda\(\(([^)]*)\)", code)
    return [tuple(int(x) for x in s.replace(" ", "").split(",") if x) for s in shapes]


def _assert_no_window_buffer(code: str, rows: int, window: int, head_dim: int, grads):
    """No buffer but the (T, coff*d) gradient outputs reaches rows * window * d elements."""
    for shape in _buffers(code):
        numel = 1
        for x in shape:
            numel *= x
        assert len(shape) <= 2 and (shape == grads or numel < rows * window * head_dim), shape


def _pack(lengths, ratio, coff, head_dim, dtype, extra_tokens=3, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cu, cuc = offsets_for(lengths, ratio, "cuda")
    tokens = sum(lengths) + extra_tokens
    width = coff * head_dim
    kv = torch.randn(tokens, width, device="cuda", generator=gen).to(dtype)
    score = (2 * torch.randn(tokens, width, device="cuda", generator=gen)).to(dtype)
    ape = 0.5 * torch.randn(ratio, width, device="cuda", generator=gen)
    return kv, score, ape, cu, cuc


def _fwd_bwd(grad_out, kv, score, ape, cu, cuc, ratio, coff, total_comp):
    out = torch.ops.csa.compressor(kv, score, ape, cu, cuc, ratio, coff, total_comp)
    grads = torch.ops.csa.compressor_backward(grad_out, kv, score, ape, cu, cuc, ratio, coff)
    return (out, *grads)


def _ulp(x, dtype):
    mantissa = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[dtype]
    mag = x.double().abs().clamp_min(2.0**-126)
    return torch.exp2(torch.floor(torch.log2(mag)) - mantissa)


def _exact_ops() -> bool:
    """Inductor rounds like eager CUDA: mul_rn/div_rn ops, and (with emulate_precision_casts)
    the CUDA toolkit's libdevice exp rather than Triton's bundled one."""
    numerics = getattr(torch._inductor.config, "eager_numerics", None)
    return lowering._generate.EXACT_ROUNDING and hasattr(numerics, "use_pytorch_libdevice")


CASES = [  # (lengths, ratio, coff, head_dim, dtype)
    pytest.param((3, 0, 5), 1, 1, 7, torch.float32, id="r1_c1_d7_fp32"),
    pytest.param((5, 0, 1, 8), 2, 2, 65, torch.bfloat16, id="r2_c2_d65_bf16"),
    pytest.param((900, 3, 0, 1601), 4, 2, 128, torch.bfloat16, id="r4_c2_d128_bf16"),
    pytest.param((9, 3, 0, 16), 4, 1, 33, torch.float16, id="r4_c1_d33_fp16"),
    pytest.param((50, 0, 16, 9), 16, 2, 7, torch.float32, id="r16_c2_d7_fp32"),
    pytest.param((3000, 127, 0, 1280), 128, 1, 512, torch.bfloat16, id="r128_c1_d512_bf16"),
    pytest.param((600, 0, 255, 300), 256, 2, 3, torch.float32, id="r256_c2_d3_fp32"),
]


@pytest.mark.parametrize(("lengths", "ratio", "coff", "head_dim", "dtype"), CASES)
def test_generated_matches_reference(lengths, ratio, coff, head_dim, dtype, compile_env):
    """Unrolled windows (coff*ratio <= UNROLL_MAX) with emulated precision casts reproduce the
    reference bit for bit where Inductor rounds like eager CUDA (_exact_ops);
    otherwise, and for Reduction windows, within one output rounding step plus fp32
    summation-order error."""
    kv, score, ape, cu, cuc = _pack(lengths, ratio, coff, head_dim, dtype)
    true_rows = int(cuc[-1])
    rows = true_rows + 2
    grad_out = torch.randn(rows, head_dim, device="cuda").to(dtype)
    args = (kv, score, ape, cu, cuc, ratio, coff, rows)
    bitwise = coff * ratio <= lowering._generate.UNROLL_MAX and _exact_ops()
    with use_lowering_mode("generate"), torch._inductor.config.patch(emulate_precision_casts=True):
        compiled = torch.compile(_fwd_bwd, fullgraph=True)
        actual, (code,) = run_and_get_code(compiled, grad_out, *args)
        again = compiled(grad_out, *args)
    # No atomics anywhere (grad_ape is a split reduction): bitwise run to run.
    assert all(torch.equal(a, b) for a, b in zip(actual, again))
    assert _extern_ops(code) == []
    if coff * ratio > 1:
        _assert_no_window_buffer(code, rows, coff * ratio, head_dim, tuple(kv.shape))
    expected = (reference.compressor_reference(*args),
                *reference.compressor_backward_reference(grad_out, *args[:-1]))
    scale = 8 * float(kv.abs().max()) * max(float(grad_out.abs().max()), 1.0)
    for name, a, e in zip(("out", "grad_kv", "grad_score", "grad_ape"), actual, expected):
        assert a.shape == e.shape and a.dtype == e.dtype, name
        if bitwise and name != "grad_ape":
            assert torch.equal(a, e), f"{name}: max error {float((a - e).abs().max())}"
            continue
        terms = coff * ratio * (rows + 1 if name == "grad_ape" else 1)
        atol = 4 * (terms + 4) * 2.0**-23 * scale
        bound = (_ulp(e, a.dtype) if a.dtype != torch.float32 else 0) + atol
        err = (a.double() - e.double()).abs()
        assert bool((err <= bound).all()), f"{name}: max error {float(err.max())}"
    assert torch.count_nonzero(actual[0][true_rows:]) == 0
    assert torch.count_nonzero(actual[1][int(cu[-1]):]) == 0


ROUNDING_CASES = [
    pytest.param(PackSpec((300, 0, 77, 2, 500), 4, 2, 128, extra_tokens=5, extra_rows=3),
                 torch.bfloat16, id="r4_c2_d128_bf16"),
    pytest.param(PackSpec((21, 3, 0, 8), 2, 2, 65, extra_rows=1), torch.float16,
                 id="r2_c2_d65_fp16"),
    pytest.param(PackSpec((700, 0, 300), 16, 2, 64, extra_rows=2), torch.bfloat16,
                 id="r16_c2_d64_bf16_reduction"),
]


@pytest.mark.parametrize("mode", ["extern", "generate", "auto"])
@pytest.mark.parametrize(("spec", "dtype"), ROUNDING_CASES)
def test_compiled_consumers_see_the_rounded_output(spec, dtype, mode, compile_env):
    """Fused or not, the op's output and gradients are rounded to their dtype exactly once
    (Triton would otherwise hand a fused consumer the fp32 value). Compiled equals eager
    bitwise where both run the CUDA kernels; generated Triton (csa_ops.reference's order, and
    eager CUDA's roundings only under emulate_precision_casts) is held to the bound between
    two implementations (within one rounding step of the output dtype), grad_ape to 1e-3."""
    pack = make_pack(spec, dtype, device="cuda", ape_dtype=dtype)
    expected = consumed_step(cast_op_upcast, pack, dtype)
    with use_lowering_mode(mode):
        actual = consumed_step(torch.compile(cast_op_upcast, fullgraph=True), pack, dtype)
        assert_rounded_once(actual[0], actual[1:], dtype)
        paths = {d: lowering.policy.choose(d, pack.kv.device, dtype, spec.ratio, spec.coff,
                                           spec.head_dim, spec.num_tokens) for d in ("fwd", "bwd")}
        if "generate" in paths.values() and _exact_ops():
            torch._dynamo.reset()
            with torch._inductor.config.patch(emulate_precision_casts=True):
                actual = consumed_step(torch.compile(cast_op_upcast, fullgraph=True), pack,
                                       dtype)
    # y = out^2 is exact in fp32: its root is |out|, a value of dtype.
    roots = [y.sqrt().to(dtype) for y in (actual[0], expected[0])]
    grads = [[g.to(dtype) for g in run[1:]] for run in (actual, expected)]
    if paths["fwd"] == "extern":
        assert_bitwise_equal(*roots, "consumer")
    else:  # forced "generate" where the kernel runs: two implementations, one step apart
        assert_within_one_step(*roots, "consumer", max_fraction=1e-3)
    # grad_kv = p * g bounds g; grad_score cancels terms of size g * v.
    scale = float(expected[1].abs().max()) * float(pack.kv.abs().max())
    for name, a, e in zip(("grad_kv", "grad_score", "grad_ape"), *grads):
        if paths["bwd"] == "extern":
            assert_bitwise_equal(a, e, name)
        elif name == "grad_ape":
            torch.testing.assert_close(a, e, rtol=1e-3, atol=1e-3)
        else:
            assert_within_one_step(a, e, name,
                                   atol=sum_tolerance(torch.float32, window(spec), scale))


def _block(dtype=torch.float32, head_dim=128, ratio=4, coff=2, lengths=(300, 0, 77, 2, 500)):
    torch.manual_seed(0)
    module = csa_ops.Compressor(64, head_dim, ratio, coff, device="cuda", dtype=dtype)
    cu, cuc = offsets_for(lengths, ratio, "cuda")
    x = torch.randn(sum(lengths) + 5, 64, device="cuda", dtype=dtype)
    return module, x, cu, cuc, int(cuc[-1]) + 3


def _block_step(module, x, cu, cuc, total_comp):
    x = x.detach().requires_grad_(True)
    y = module(x, cu, cuc, total_comp)
    # A fixed projection, not sum(y^2): RMSNorm rows have nearly constant norm, so that
    # loss's gradient through the op would be rounding noise.
    probe = torch.randn(y.shape, device=y.device,
                        generator=torch.Generator(device=y.device).manual_seed(7))
    grads = torch.autograd.grad((y.float() * probe).sum(), (x, module.ape, module.norm.weight))
    return (y.detach(), *grads)


@pytest.mark.parametrize("mode", ["generate", "extern", "auto"])
def test_block_modes(mode, compile_env):
    """fp32 block (bf16 would compare Inductor's fused RMSNorm numerics, not the op)."""
    module, x, cu, cuc, rows = _block()
    expected = _block_step(module, x, cu, cuc, rows)
    with use_lowering_mode(mode):
        actual, codes = run_and_get_code(_block_step, torch.compile(module, fullgraph=True), x,
                                         cu, cuc, rows)
        path = {d: lowering.policy.choose(d, x.device, x.dtype, 4, 2, 128, x.shape[0])
                for d in ("fwd", "bwd")}
    assert len(codes) == 2, f"{len(codes)} compiled modules"
    fwd_code, bwd_code = codes
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-3, atol=1e-3)
    fwd_extern = _extern_ops(fwd_code) == ["compressor"]
    bwd_extern = _extern_ops(bwd_code) == ["compressor_backward"]
    assert fwd_extern == (path["fwd"] == "extern"), (path, _extern_ops(fwd_code))
    assert bwd_extern == (path["bwd"] == "extern"), (path, _extern_ops(bwd_code))
    if not fwd_extern:
        assert _extern_ops(fwd_code) == []
        # The op and the RMSNorm share one Triton kernel.
        # Kernel names list the fused ops: rsqrt (2.13's RMSNorm decomposition) or
        # _fused_rms_norm (2.11, seen on the H200).
        assert any("compressor" in k and ("rsqrt" in k or "rms_norm" in k)
                   for k in _kernels(fwd_code)), fwd_code
        _assert_no_window_buffer(fwd_code, rows, 8, 128, None)
    if not bwd_extern:
        assert _extern_ops(bwd_code) == []
        _assert_no_window_buffer(bwd_code, rows, 8, 128, (x.shape[0], 256))


def test_auto_policy_on_this_gpu():
    """auto: extern wherever the CuTe kernels support the configuration (never fp64),
    generated elsewhere."""
    dev = torch.device("cuda")
    with use_lowering_mode("auto"):
        choose = lowering.policy.choose
        supports = lowering.policy.extern_kernel_supports
        for tokens in (8192, 3 * 8192, None):
            assert choose("fwd", dev, torch.bfloat16, 4, 2, 128, tokens) == "extern"
        assert choose("bwd", dev, torch.bfloat16, 4, 2, 128, 8192) == "extern"
        assert choose("bwd", dev, torch.float64, 4, 2, 128) == "generate"
        for direction, ratio, coff in (("bwd", 4, 2), ("fwd", 128, 1), ("bwd", 128, 1)):
            expected = "extern" if supports(dev, torch.bfloat16, ratio, coff, 512) else "generate"
            assert choose(direction, dev, torch.bfloat16, ratio, coff, 512) == expected


def test_data_dependent_rows_and_dynamic_shapes(compile_env):
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(_fwd_bwd, backend=counter, fullgraph=True, dynamic=True)
    with use_lowering_mode("generate"):
        for lengths in [(13, 0, 9, 2, 20), (400, 3, 0, 17, 8)]:
            kv, score, ape, cu, cuc = _pack(lengths, 4, 2, 6, torch.float32)
            grad_out = torch.randn(int(cuc[-1]), 6, device="cuda")
            args = (kv, score, ape, cu, cuc, 4, 2)
            actual = compiled(grad_out, *args, None)
            expected = (reference.compressor_reference(*args, None),
                        *reference.compressor_backward_reference(grad_out, *args))
            for a, e in zip(actual, expected):
                torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1


def test_reduce_overhead_static_capacity(compile_env):
    """CUDA graphs over the generated path (static capacity): replays match eager."""
    module, x, cu, cuc, rows = _block(dtype=torch.float32, head_dim=64)
    expected = module(x, cu, cuc, rows)
    with use_lowering_mode("generate"), torch.no_grad():
        compiled = torch.compile(module, mode="reduce-overhead", fullgraph=True)
        for _ in range(3):
            torch.compiler.cudagraph_mark_step_begin()
            out = compiled(x, cu, cuc, rows)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
