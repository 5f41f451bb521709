"""torch.compile(fullgraph=True) of csa::compressor forward and backward on CPU: no graph
breaks, static/dynamic shapes, total_comp=None, and the Compressor module."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo.testing
from helpers import (
    EPS,
    PackSpec,
    eager_region,
    make_pack,
    op_forward_backward,
    sum_tolerance,
    window,
)

import csa_ops
from csa_ops import reference

NAMES = ("out", "grad_kv", "grad_score", "grad_ape")


def _forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp):
    return torch.ops.csa.compressor(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff,
                                    total_comp)


def _run(fn, pack, grad_out, total_comp):
    """fn's output and the gradients of <out, grad_out> (AOTAutograd's compiled backward)."""
    kv, score, ape = pack.leaves()
    tc = pack.spec.capacity if total_comp == "capacity" else total_comp
    out = fn(kv, score, ape, pack.cu_seqlens, pack.cu_seqlens_comp, pack.ratio, pack.coff, tc)
    grads = torch.autograd.grad(out, (kv, score, ape), grad_out)
    return [out.detach(), *grads]


def _max_abs(t) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


def _assert_matches_eager(actual, pack, grad_out, total_comp):
    expected = op_forward_backward(pack, grad_out, total_comp)
    # Inductor may generate its own kernel for the op (lowering/): same math, and up to
    # summation order the same roundings.
    scale = max(_max_abs(pack.kv), 1.0) * max(_max_abs(grad_out), 1.0)
    rows = max(pack.rows(total_comp), 1)
    # Per-row outputs sum one window; grad_ape sums a window per row.
    terms = (window(pack),) * 3 + (window(pack) * (rows + 1),)
    for name, a, e, n in zip(NAMES, actual, expected, terms):
        assert a.shape == e.shape and a.dtype == e.dtype, name
        tol = sum_tolerance(torch.float32, n, scale)
        torch.testing.assert_close(a, e, rtol=0, atol=tol, msg=lambda m, name=name: f"{name}: {m}")


R4C2 = PackSpec((9, 3, 0, 16), 4, 2, 8, extra_tokens=3, extra_rows=2)
# head_dim 6 keeps kv's width apart from len(cu_seqlens): duck sizing would tie them.
R16C1 = PackSpec((35, 0, 16, 7), 16, 1, 6, extra_rows=1)


def _case(spec, dynamic, total_comp, mode):
    name = (f"r{spec.ratio}_c{spec.coff}-{'dynamic' if dynamic else 'static'}-"
            f"{'capacity' if total_comp else 'true_count'}-{mode}")
    return pytest.param(spec, dynamic, total_comp, mode, id=name)


# "extern" keeps the op an opaque node (the op-surface contract, cheap to compile); "auto" is
# what users get: on CPU Inductor generates C++ for the op, which costs seconds per graph.
COMPILE_CASES = [
    *(_case(spec, dynamic, tc, "extern") for spec in (R4C2, R16C1) for dynamic in (False, True)
      for tc in ("capacity", None)),
    _case(R4C2, False, "capacity", "auto"),
    _case(R16C1, False, None, "auto"),
    # Dynamic shapes with generated code: test_dynamic_graph_fed_degenerate_packs_generated.
]


@pytest.mark.parametrize("spec, dynamic, total_comp, lowering_mode", COMPILE_CASES,
                         indirect=["lowering_mode"])
def test_compile_forward_backward_fullgraph(spec, dynamic, total_comp, lowering_mode,
                                            compile_env):
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(_forward, backend=counter, fullgraph=True, dynamic=dynamic)
    pack = make_pack(spec)
    grad_out = pack.grad_out(total_comp)
    _assert_matches_eager(_run(compiled, pack, grad_out, total_comp), pack, grad_out, total_comp)
    assert counter.frame_count == 1
    if dynamic:
        # A different pack (tokens, segments, rows) reuses the dynamic graph.
        lengths = spec.lengths[::-1] + (2 * spec.ratio + 1,)
        other = make_pack(PackSpec(lengths, spec.ratio, spec.coff, spec.head_dim,
                                   extra_tokens=1, extra_rows=spec.extra_rows + 1), seed=3)
        other_grad = other.grad_out(total_comp)
        _assert_matches_eager(_run(compiled, other, other_grad, total_comp), other, other_grad,
                              total_comp)
        assert counter.frame_count == 1


@pytest.mark.parametrize("lowering_mode", ["extern"], indirect=True)
def test_new_static_capacity_recompiles_once_then_stays_symbolic(lowering_mode, compile_env):
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(_forward, backend=counter, fullgraph=True)
    pack = make_pack(R4C2)
    with torch.no_grad():
        for capacity in (pack.spec.true_rows, pack.spec.true_rows + 3, pack.spec.true_rows + 9,
                         pack.spec.true_rows + 20):
            out = compiled(*pack.args(capacity))
            assert torch.equal(out, torch.ops.csa.compressor(*pack.args(capacity)))
    assert counter.frame_count == 2


@pytest.mark.parametrize("total_comp", ["capacity", None], ids=["capacity", "true_count"])
def test_no_graph_breaks_without_fullgraph(total_comp, compile_env):
    """Without fullgraph a break would be tolerated silently: count them instead. The None
    form has a data-dependent output size, which dynamo captures only when
    capture_dynamic_output_shape_ops is on (fullgraph=True turns it on by itself)."""
    torch._dynamo.utils.counters.clear()
    counter = torch._dynamo.testing.CompileCounter()
    pack = make_pack(R4C2)
    grad_out = pack.grad_out(total_comp)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=total_comp is None):
        _run(torch.compile(_forward, backend=counter), pack, grad_out, total_comp)
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}
    assert counter.frame_count == 1
    assert counter.op_count >= 1


@pytest.mark.parametrize("lowering_mode", ["extern", "auto"], indirect=True)
def test_compile_with_following_ops_and_bf16(lowering_mode, compile_env):
    """The op inside a larger graph (scale, RMSNorm, loss) with a backward through all of it."""
    pack = make_pack(PackSpec((17, 2, 12), 4, 2, 16, extra_rows=2), torch.bfloat16)
    weight = torch.ones(16)

    def loss_fn(kv, score, ape):
        out = torch.ops.csa.compressor(kv, score, ape, pack.cu_seqlens, pack.cu_seqlens_comp,
                                       pack.ratio, pack.coff, pack.spec.capacity)
        normed = torch.nn.functional.rms_norm(out.float(), (16,), weight, 1e-6)
        return (normed * torch.arange(16.0)).sum()

    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(loss_fn, backend=counter, fullgraph=True)
    leaves = pack.leaves()
    # Inductor computes a fused bf16 chain in fp32 and may skip a rounding between ops
    # unless told to emulate eager's casts; with emulation, eager and compiled round alike.
    with torch._inductor.config.patch(emulate_precision_casts=True):
        loss = compiled(*leaves)
        grads = torch.autograd.grad(loss, leaves)
    eager_leaves = pack.leaves()
    eager_loss = loss_fn(*eager_leaves)
    eager_grads = torch.autograd.grad(eager_loss, eager_leaves)
    assert counter.frame_count == 1
    torch.testing.assert_close(loss, eager_loss, rtol=1e-4, atol=1e-3)
    for name, a, e in zip(NAMES[1:], grads, eager_grads):
        # bf16 gradients: one rounding step apart at most where Inductor reorders fp32 math.
        torch.testing.assert_close(a, e, rtol=2**-7, atol=1e-3, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("dtype, ape_dtype", [
    pytest.param(torch.float16, torch.float32, id="fp16"),
    pytest.param(torch.float64, torch.float64, id="fp64_ape_fp64"),
    pytest.param(torch.float64, torch.float32, id="fp64_ape_fp32"),
    pytest.param(torch.bfloat16, torch.bfloat16, id="bf16_ape_bf16"),
    pytest.param(torch.float32, torch.float16, id="fp32_ape_fp16"),
])
@pytest.mark.parametrize("lowering_mode", ["generate"], indirect=True)
def test_generated_code_for_every_accepted_dtype(dtype, ape_dtype, lowering_mode, compile_env):
    """Every dtype combination the op accepts must compile to generated code too (auto mode
    silently falls back to the extern op when generation fails, so force it here)."""
    pack = make_pack(PackSpec((9, 3, 0, 17), 4, 2, 5, extra_tokens=2, extra_rows=2), dtype,
                     ape_dtype=ape_dtype)
    grad_out = pack.grad_out()
    actual = _run(torch.compile(_forward, fullgraph=True), pack, grad_out, "capacity")
    expected = op_forward_backward(pack, grad_out)
    for name, a, e in zip(NAMES, actual, expected):
        assert a.dtype == e.dtype, name
        step = EPS[a.dtype] * max(float(e.abs().max()), 1.0)
        torch.testing.assert_close(a, e, rtol=0, atol=2 * step + 1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _module_reference(module, x, cu_seqlens, cu_seqlens_comp, total_comp):
    """The Compressor block composed from csa_ops.reference and plain torch."""
    pooled = reference.compressor_reference(module.wkv(x), module.wgate(x), module.ape, cu_seqlens,
                                            cu_seqlens_comp, module.ratio, module.coff, total_comp)
    return torch.nn.functional.rms_norm(pooled, (module.head_dim,), module.norm.weight,
                                        module.norm.eps)


@pytest.mark.parametrize("ratio, coff, total_comp, lowering_mode", [
    pytest.param(4, 2, 12, "auto", id="r4_c2-capacity-auto"),
    pytest.param(4, 2, None, "extern", id="r4_c2-true_count-extern"),
    pytest.param(3, 1, 12, "extern", id="r3_c1-capacity-extern"),
    pytest.param(3, 1, None, "auto", id="r3_c1-true_count-auto"),
], indirect=["lowering_mode"])
def test_compressor_module_eager_compiled_reference(ratio, coff, total_comp, lowering_mode,
                                                   compile_env):
    torch.manual_seed(0)
    module = csa_ops.Compressor(dim=24, head_dim=16, ratio=ratio, coff=coff)
    with torch.no_grad():
        module.norm.weight.uniform_(0.5, 1.5)
    cu_seqlens, cu_seqlens_comp = csa_ops.offsets_for((13, 0, 2, 21), ratio)
    x = torch.randn(38, 24)
    rows = int(cu_seqlens_comp[-1])
    grad = torch.randn(rows if total_comp is None else total_comp, 16)

    def step(fn):
        module.zero_grad()
        out = fn(x, cu_seqlens, cu_seqlens_comp, total_comp)
        out.backward(grad)
        return out.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}

    eager_out, eager_grads = step(module)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled_out, compiled_grads = step(torch.compile(module, backend=counter, fullgraph=True))
    assert counter.frame_count == 1
    with torch.no_grad():
        ref_out = _module_reference(module, x, cu_seqlens, cu_seqlens_comp, total_comp)
    assert torch.equal(eager_out, ref_out)
    assert bool((eager_out[rows:] == 0).all())
    torch.testing.assert_close(compiled_out, eager_out, rtol=1e-5, atol=1e-5)
    for name, grad_value in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad_value, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")
    # And the independent model agrees with the module's pooled rows.
    with torch.no_grad():
        pooled = eager_region(module.wkv(x), module.wgate(x), module.ape, cu_seqlens,
                              cu_seqlens_comp, ratio, coff, total_comp)
        independent = torch.nn.functional.rms_norm(pooled, (16,), module.norm.weight,
                                                   module.norm.eps)
    torch.testing.assert_close(eager_out, independent, rtol=1e-5, atol=1e-5)


DEGENERATE = {
    "B0": PackSpec((), 4, 2, 3, extra_tokens=2, extra_rows=2),
    "zero_tokens": PackSpec((0,), 2, 1, 4, extra_rows=1),
    "tokens_but_zero_rows": PackSpec((3, 1), 4, 2, 2, extra_tokens=1),
}
DEGENERATE_RUNS = [(case, tc) for case in DEGENERATE for tc in ("capacity", None)]
# One dynamic graph, first traced on a normal pack, then fed degenerate ones: sizes that are
# zero at run time but not at trace time.
DYNAMIC_SEQUENCE = (
    PackSpec((9, 3, 5), 4, 2, 2, extra_tokens=2, extra_rows=1),
    PackSpec((0, 0, 0), 4, 2, 2, extra_rows=3),
    PackSpec((3, 1, 2), 4, 2, 2, extra_tokens=1, extra_rows=2),
    PackSpec((0, 0, 0), 4, 2, 2, extra_tokens=7),
)


def _compile_and_compare(spec, total_comp, compiled=None):
    pack = make_pack(spec)
    grad_out = pack.grad_out(total_comp)
    compiled = compiled or torch.compile(_forward, fullgraph=True)
    actual = _run(compiled, pack, grad_out, total_comp)
    _assert_matches_eager(actual, pack, grad_out, total_comp)


@pytest.mark.parametrize("case, total_comp", DEGENERATE_RUNS)
@pytest.mark.parametrize("lowering_mode", ["extern"], indirect=True)
def test_compile_degenerate_packs_extern(case, total_comp, lowering_mode, compile_env):
    _compile_and_compare(DEGENERATE[case], total_comp)


@pytest.mark.parametrize("total_comp", ["capacity", None], ids=["capacity", "true_count"])
@pytest.mark.parametrize("lowering_mode", ["extern"], indirect=True)
def test_dynamic_graph_fed_degenerate_packs_extern(total_comp, lowering_mode, compile_env):
    compiled = torch.compile(_forward, fullgraph=True, dynamic=True)
    for spec in DYNAMIC_SEQUENCE:
        _compile_and_compare(spec, total_comp, compiled)


# Generated C++ takes seconds per graph: the static cases most likely to go out of bounds.
GENERATED_RUNS = [("B0", "capacity"), ("zero_tokens", None), ("tokens_but_zero_rows", None)]


def _run_in_child(body: str, tmp_path):
    """Run test code in a child process, so a crash (an out-of-bounds read in generated
    code) fails the calling test instead of killing the whole run."""
    script = (
        "import sys, torch, csa_ops\n"
        f"sys.path[:0] = [{str(Path(__file__).parent)!r}]\n"
        "import test_op_compile as t\n"
        "torch._inductor.config.force_disable_caches = True\n"
        "csa_ops.lowering.set_mode('generate')\n" + body
    )
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=env, timeout=540, check=False)
    last = [line for line in result.stdout.splitlines() if line.startswith("start")][-1:]
    assert result.returncode == 0, (f"exit {result.returncode} during {last}: "
                                    f"{result.stderr[-2000:]}")


def test_compile_degenerate_packs_generated(tmp_path):
    _run_in_child(
        "for case, tc in t.GENERATED_RUNS:\n"
        "    print('start', case, tc, flush=True)\n"
        "    torch._dynamo.reset()\n"
        "    t._compile_and_compare(t.DEGENERATE[case], tc)\n", tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("total_comp", ["'capacity'", "None"], ids=["capacity", "true_count"])
def test_dynamic_graph_fed_degenerate_packs_generated(total_comp, tmp_path):
    _run_in_child(
        "compiled = torch.compile(t._forward, fullgraph=True, dynamic=True)\n"
        "for i, spec in enumerate(t.DYNAMIC_SEQUENCE):\n"
        f"    print('start', i, {total_comp}, flush=True)\n"
        f"    t._compile_and_compare(spec, {total_comp}, compiled)\n", tmp_path)
