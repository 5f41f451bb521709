"""csa_ops.lowering on CPU: the policy, generated C++ against the reference, the code Inductor
emits in each mode, data-dependent and dynamic shapes, cache invalidation, and pins of the
graphs and of a digest of the generated code."""

from __future__ import annotations

import copy
import importlib.metadata
import os
import re
import subprocess
import sys

import expecttest
import pytest
import torch
import torch._dynamo.testing
from helpers import (
    EPS,
    PackSpec,
    assert_bitwise_equal,
    assert_rounded_once,
    cast_op_upcast,
    consumed_step,
    make_pack,
    offsets,
    spec_params,
    sum_tolerance,
    train_block,
    ulp,
    use_lowering_mode,
    window,
)
from torch._inductor.utils import fresh_cache, run_and_get_code

import csa_ops
from csa_ops import lowering, reference
from csa_ops.config import CAPACITY_MESSAGE

pytestmark = pytest.mark.skipif(not lowering.available, reason="csa_ops.lowering not registered")


# ---------------------------------------------------------------------------------------
# Code inspection


def _buffers(code: str):
    """Shapes of every buffer the wrapper allocates."""
    shapes = re.findall(r"empty_strided_cpu\(\(([^)]*)\)", code)
    return [tuple(int(x) for x in s.replace(" ", "").split(",") if x) for s in shapes]


def _numel(shape):
    n = 1
    for x in shape:
        n *= x
    return n


def _kernels(code: str):
    return re.findall(r"^(cpp_fused_\w+) = ", code, flags=re.MULTILINE)


def _capacity_checks(code: str):
    """The kernels that compute only the row-capacity assertion's condition (an int32 offset
    in, a bool out, handed to aten._assert_async)."""
    return re.findall(r"^(cpp_fused_\w+) = async_compile\.cpp_pybinding\("
                      r"\['const int32_t\*', 'bool\*'\]", code, flags=re.MULTILINE)


def _extern_ops(code: str):
    """Calls of the opaque ops (not the asserts and comments that name them)."""
    return re.findall(r"= torch\.ops\.csa\.(\w+)\.default\(", code)


def digest(code: str) -> str:
    """Normalized, order-stable summary of one generated module: kernels, extern calls and
    the buffers the wrapper allocates (names and AOT ids, which count up, are left out)."""
    lines = [f"kernel {name}" for name in _kernels(code)]
    lines += [f"extern csa.{name}" for name in _extern_ops(code)]
    allocs = re.findall(r"empty_strided_cpu\((\([^)]*\)), \([^)]*\), torch\.(\w+)\)", code)
    lines += [f"buffer {shape} {dtype}" for shape, dtype in allocs]
    return "\n".join(lines)


def _assert_no_window_buffer(code: str, rows: int, spec: PackSpec):
    window_sized = rows * window(spec) * spec.head_dim
    if window(spec) == 1:
        return  # the output itself has window size
    grads = (spec.num_tokens, spec.coff * spec.head_dim)  # grad_kv/grad_score are outputs
    for shape in _buffers(code):
        assert len(shape) <= 2, f"a buffer of rank {len(shape)}: {shape}"
        assert shape == grads or _numel(shape) < window_sized, f"window-sized buffer {shape}"


# ---------------------------------------------------------------------------------------
# Policy


def test_mode_validates_and_retags_caches():
    with use_lowering_mode("auto"):
        tag = torch.compiler.config.cache_key_tag
        # Package version and a digest of the lowering sources key every cached artifact.
        assert f"csa_ops-{importlib.metadata.version('csa-ops')}-" in tag
        assert lowering.policy._source_digest() in tag and tag.endswith("-auto")
        lowering.mode = "extern"
        assert lowering.mode == "extern" == lowering.get_mode()
        assert torch.compiler.config.cache_key_tag.endswith("-extern")
        assert torch.compiler.config.cache_key_tag != tag
        with pytest.raises(ValueError, match="must be one of"):
            lowering.mode = "fast"
        assert lowering.mode == "extern"


@pytest.mark.parametrize(("ratio", "coff", "head_dim", "tokens"), [
    (4, 2, 128, 8192), (4, 1, 128, 8192), (8, 2, 64, 100), (4, 2, 128, None),
    (128, 1, 128, 8192)])
def test_auto_calls_the_kernel_wherever_it_runs(monkeypatch, ratio, coff, head_dim, tokens):
    # Eager runs the CuTe kernel there, and compiling must not change the op's numerics:
    # compiled code gives eager's bits by calling the same kernel.
    gpu = torch.device("cuda", 0)
    for supported, expected in ((True, "extern"), (False, "generate")):
        monkeypatch.setattr(lowering.policy, "extern_kernel_supports",
                            lambda *args, s=supported: s)
        with use_lowering_mode("auto"):
            for direction in ("fwd", "bwd"):
                path = lowering.policy.choose(direction, gpu, torch.bfloat16, ratio, coff,
                                              head_dim, tokens)
                assert path == expected


def test_auto_generates_on_cpu_and_explicit_modes_win():
    cpu = torch.device("cpu")
    with use_lowering_mode("auto"):
        assert lowering.policy.choose("fwd", cpu, torch.bfloat16, 4, 2, 128) == "generate"
        assert not lowering.policy.extern_kernel_supports(cpu, torch.bfloat16, 4, 2, 128)
    for mode in ("extern", "generate"):
        with use_lowering_mode(mode):
            assert lowering.policy.choose("bwd", cpu, torch.float32, 4, 2, 128) == mode


def _import_in_subprocess(env_updates, statement):
    # A warning at import (the range check's) fails the import: none is expected here.
    env = {**os.environ, **env_updates}
    return subprocess.run([sys.executable, "-W", "error::UserWarning", "-c",
                           f"import csa_ops.lowering as L; {statement}"],
                          check=False, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("version", "supported"), [
    ("2.10.1", False), ("2.11.0", True), ("2.13.0+cpu", True), ("2.14.1+cu130", True),
    ("2.15.0+cu132", True), ("2.16.0a0+git1234", False), ("3.0.0", False)])
def test_tested_range(version, supported):
    assert lowering.torch_supported(version) is supported


def test_outside_the_tested_range_keeps_the_opaque_op(monkeypatch):
    monkeypatch.delenv(lowering.DISABLE_ENV, raising=False)
    monkeypatch.setattr(torch, "__version__", "2.16.0")
    with pytest.warns(UserWarning, match=r"torch 2\.16\.0 is outside the tested range "
                                         r"2\.11-2\.15; .* opaque op"):
        assert lowering._register() is False


def test_environment_variables():
    run = _import_in_subprocess({"CSA_OPS_LOWERING": "Extern"}, "print(L.mode, L.available)")
    assert run.stdout.split() == ["extern", "True"], run.stderr
    run = _import_in_subprocess({"CSA_OPS_LOWERING": "nope"}, "pass")
    assert "CSA_OPS_LOWERING" in run.stderr and "must be one of" in run.stderr
    run = _import_in_subprocess({"CSA_OPS_LOWERING_DISABLE": "1"}, "print(L.available)")
    assert run.stdout.split() == ["False"], run.stderr
    run = _import_in_subprocess(
        {"CSA_OPS_FUSE_RMSNORM": "1"},
        "import torch; print(L.fuse_rms_norm, "
        "type(torch._inductor.config.pre_grad_custom_pass).__name__)")
    assert run.stdout.split() == ["True", "FuseRmsNorm"], run.stderr
    run = _import_in_subprocess({"CSA_OPS_FUSE_RMSNORM": "yes"}, "pass")
    assert "CSA_OPS_FUSE_RMSNORM" in run.stderr and "must be 0 or 1" in run.stderr


# ---------------------------------------------------------------------------------------
# Generated code against the reference


def _fwd_bwd(grad_out, kv, score, ape, cu, cuc, ratio, coff, total_comp):
    out = torch.ops.csa.compressor(kv, score, ape, cu, cuc, ratio, coff, total_comp)
    grads = torch.ops.csa.compressor_backward(grad_out, kv, score, ape, cu, cuc, ratio, coff)
    return (out, *grads)


def _assert_close_to_reference(actual, expected, pack, rows):
    """Output and grad_kv/grad_score: one rounding step of their dtype beyond the fp32 terms'
    own error (Inductor's vectorized exp differs from ATen's by an ulp); grad_ape: summation
    order over rows."""
    dtype = pack.kv.dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    scale = float(pack.kv.abs().max()) * max(float(actual[0].abs().max()), 1.0) + 1.0
    for name, a, e in zip(("out", "grad_kv", "grad_score", "grad_ape"), actual, expected):
        assert a.shape == e.shape and a.dtype == e.dtype, name
        terms = window(pack) * (rows + 1) if name == "grad_ape" else window(pack)
        atol = sum_tolerance(acc, terms, scale * 4)
        bound = (ulp(e, a.dtype) if a.dtype != acc else 0) + atol
        err = (a.double() - e.double()).abs()
        assert bool((err <= bound).all()), f"{name}: max error {float(err.max())}"


GENERATE_CASES = [
    (PackSpec((3, 0, 5), ratio=1, coff=1, head_dim=7, extra_tokens=2, extra_rows=2),
     torch.float32),
    (PackSpec((5, 0, 1, 8), ratio=2, coff=2, head_dim=65, extra_tokens=3, extra_rows=1),
     torch.bfloat16),
    (PackSpec((11, 2, 6), ratio=3, coff=2, head_dim=7, extra_tokens=1), torch.float64),
    (PackSpec((9, 3, 0, 16), ratio=4, coff=2, head_dim=128, extra_tokens=4, extra_rows=2),
     torch.float16),
    (PackSpec((50, 0, 16, 9), ratio=16, coff=2, head_dim=7, extra_tokens=5, extra_rows=2),
     torch.float32),
    (PackSpec((300, 127, 0, 128), ratio=128, coff=1, head_dim=7, extra_tokens=3, extra_rows=2),
     torch.bfloat16),
    (PackSpec((600, 0, 255, 300), ratio=256, coff=2, head_dim=3, extra_rows=1), torch.float32),
]


@pytest.mark.parametrize(("spec", "dtype"), [
    pytest.param(spec, dtype, id=f"{spec_params([spec])[0].id}_{str(dtype)[6:]}")
    for spec, dtype in GENERATE_CASES])
def test_generated_forward_backward_match_reference(spec, dtype, compile_env):
    pack = make_pack(spec, dtype=dtype)
    rows = spec.capacity
    grad_out = pack.grad_out()
    with use_lowering_mode("generate"):
        actual, code = run_and_get_code(torch.compile(_fwd_bwd, fullgraph=True), grad_out,
                                        *pack.args())
    (code,) = code
    assert _extern_ops(code) == []
    _assert_no_window_buffer(code, rows, spec)
    expected = (reference.compressor_reference(*pack.args()),
                *reference.compressor_backward_reference(grad_out, *pack.tensors(), spec.ratio,
                                                         spec.coff))
    _assert_close_to_reference(actual, expected, pack, rows)
    true_rows, true_tokens = spec.true_rows, int(pack.cu_seqlens[-1])
    assert torch.count_nonzero(actual[0][true_rows:]) == 0
    assert torch.count_nonzero(actual[1][true_tokens:]) == 0


@pytest.mark.parametrize("mode", ["generate", "extern"])
def test_strided_inputs(mode, compile_env):
    """kv and score as column slices of one fused projection (row stride 2*width)."""
    spec = PackSpec((9, 3, 0, 16), ratio=4, coff=2, head_dim=6, extra_tokens=1, extra_rows=1)
    pack = make_pack(spec)
    fused = torch.cat([pack.kv, pack.score], dim=1)
    grad_out = pack.grad_out()

    def fn(fused, ape, cu, cuc):
        kv, score = fused.split(spec.coff * spec.head_dim, dim=1)
        return _fwd_bwd(grad_out, kv, score, ape, cu, cuc, spec.ratio, spec.coff, spec.capacity)

    with use_lowering_mode(mode):
        actual = torch.compile(fn, fullgraph=True)(fused, *pack.tensors()[2:])
    expected = (reference.compressor_reference(*pack.args()),
                *reference.compressor_backward_reference(grad_out, *pack.tensors(), spec.ratio,
                                                         spec.coff))
    _assert_close_to_reference(actual, expected, pack, spec.capacity)


# ---------------------------------------------------------------------------------------
# Compiling keeps the op's rounding: one rounding to the output dtype, fused or not


ROUNDING_CASES = [
    pytest.param(PackSpec((13, 0, 9, 2, 20), 4, 2, 32, extra_tokens=2, extra_rows=3),
                 torch.bfloat16, id="r4_c2_d32_bf16"),
    pytest.param(PackSpec((21, 3, 0, 8), 2, 2, 65, extra_rows=1), torch.float16,
                 id="r2_c2_d65_fp16"),
    pytest.param(PackSpec((70, 0, 33), 16, 2, 16, extra_tokens=1, extra_rows=2), torch.bfloat16,
                 id="r16_c2_d16_bf16_reduction"),
]


# On the CPU "auto" generates (test_auto_generates_on_cpu_and_explicit_modes_win), so an
# "auto" run here would compile and check generate's code again. On CUDA, where it calls
# the kernel, tests/gpu/test_lowering_gpu.py runs it.
CPU_MODES = ["extern", "generate"]


@pytest.mark.parametrize("mode", CPU_MODES)
@pytest.mark.parametrize(("spec", "dtype"), ROUNDING_CASES)
def test_compiled_consumers_see_the_rounded_output(spec, dtype, mode, compile_env):
    """Fused or not, the op's output and gradients are rounded to their dtype exactly once:
    compiled equals eager bitwise, forward and gradients, in every mode."""
    pack = make_pack(spec, dtype, ape_dtype=dtype)
    expected = consumed_step(cast_op_upcast, pack, dtype)
    with use_lowering_mode(mode):
        actual = consumed_step(torch.compile(cast_op_upcast, fullgraph=True), pack, dtype)
    assert_rounded_once(actual[0], actual[1:], dtype)
    for name, a, e in zip(("consumer", "grad_kv", "grad_score", "grad_ape"), actual, expected):
        assert_bitwise_equal(a, e, name)


# ---------------------------------------------------------------------------------------
# The Compressor block (linears, op, RMSNorm) through autograd in each mode


BLOCK_PACK = PackSpec((13, 0, 9, 2, 20), ratio=4, coff=2, head_dim=32, extra_tokens=2,
                       extra_rows=3)


def _module_and_inputs(spec=BLOCK_PACK, dtype=torch.float32, dim=16):
    torch.manual_seed(0)
    module = csa_ops.Compressor(dim, spec.head_dim, spec.ratio, spec.coff, dtype=dtype)
    cu, cuc = offsets(spec.lengths, spec.ratio)
    x = torch.randn(spec.num_tokens, dim, dtype=dtype)
    return module, x, cu, cuc


def _module_step(module, x, cu, cuc, total_comp):
    """Output and grads of (x, ape, norm weight) for the loss sum(y * probe) (compiled or
    not). Not sum(y^2): RMSNorm rows have nearly constant norm, so that loss's gradient
    through the op is rounding noise and would hide a wrong backward."""
    x = x.detach().requires_grad_(True)
    y = module(x, cu, cuc, total_comp)
    probe = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(7))
    grads = torch.autograd.grad((y * probe).sum(), (x, module.ape, module.norm.weight))
    return (y.detach(), *grads)


@pytest.mark.parametrize("mode", CPU_MODES)
def test_compressor_block_modes(mode, compile_env):
    module, x, cu, cuc = _module_and_inputs()
    rows = BLOCK_PACK.capacity
    expected = _module_step(module, x, cu, cuc, rows)
    compiled = torch.compile(module, fullgraph=True)
    with use_lowering_mode(mode):
        actual, codes = run_and_get_code(_module_step, compiled, x, cu, cuc, rows)
    fwd_code, bwd_code = codes
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=2e-5, atol=2e-5)
    if mode == "extern":
        assert _extern_ops(fwd_code) == ["compressor"]
        assert _extern_ops(bwd_code) == ["compressor_backward"]
        return
    # Generated: the op and the RMSNorm in one C++ kernel, nothing window-sized; beside it
    # the row-capacity assertion (its condition in a kernel of its own in the forward, in
    # the backward's one kernel).
    assert _extern_ops(fwd_code) == [] and _extern_ops(bwd_code) == []
    for code in (fwd_code, bwd_code):
        assert code.count("aten._assert_async.msg(") == 1
    (check,) = _capacity_checks(fwd_code)
    (kernel,) = set(_kernels(fwd_code)) - {check}
    assert "compressor" in kernel and "rsqrt" in kernel
    assert len(_kernels(bwd_code)) == 1
    _assert_no_window_buffer(fwd_code, rows, BLOCK_PACK)
    _assert_no_window_buffer(bwd_code, rows, BLOCK_PACK)


@pytest.mark.parametrize("mode", CPU_MODES)
def test_bf16_converted_block_trains_like_eager(mode, compile_env):
    """model.to(torch.bfloat16) makes ape bf16 too. Compiled training steps equal eager's
    bitwise through the extern op; generated C++ takes Sleef's exp where ATen takes MKL's
    (an fp32 last bit, rarely a bf16 one), so there within bf16 tolerance."""
    module, x, cu, cuc = _module_and_inputs()
    module, x = module.to(torch.bfloat16), x.to(torch.bfloat16)
    assert module.ape.dtype == torch.bfloat16
    eager_model, compiled_model = copy.deepcopy(module), copy.deepcopy(module)
    expected = train_block(eager_model, eager_model, x, cu, cuc, BLOCK_PACK.capacity)
    with use_lowering_mode(mode):
        actual = train_block(compiled_model, torch.compile(compiled_model, fullgraph=True), x,
                             cu, cuc, BLOCK_PACK.capacity)
    assert compiled_model.ape.grad.dtype == torch.bfloat16
    (losses, params), (eager_losses, eager_params) = actual, expected
    for name, value in [("loss", losses), *params.items()]:
        want = eager_losses if name == "loss" else eager_params[name]
        if mode == "extern":
            assert_bitwise_equal(value, want, name)
        else:
            torch.testing.assert_close(value, want, msg=lambda m, n=name: f"{n}: {m}")


def test_data_dependent_rows_and_dynamic_shapes(compile_env):
    """total_comp=None under dynamic=True: one graph serves packs of other sizes."""
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(_fwd_bwd, backend=counter, fullgraph=True, dynamic=True)
    with use_lowering_mode("generate"):
        for lengths in [(13, 0, 9, 2, 20), (40, 3, 0, 17, 8)]:
            spec = PackSpec(lengths, ratio=4, coff=2, head_dim=6, extra_tokens=3)
            pack = make_pack(spec)
            grad_out = pack.grad_out(total_comp=None)
            actual = compiled(grad_out, *pack.args(total_comp=None))
            expected = (reference.compressor_reference(*pack.args(total_comp=None)),
                        *reference.compressor_backward_reference(grad_out, *pack.tensors(), 4, 2))
            _assert_close_to_reference(actual, expected, pack, spec.true_rows)
    assert counter.frame_count == 1


def test_all_segments_short_data_dependent(compile_env):
    """total_comp=None with no full block anywhere: zero rows at run time, and the backward's
    row-indexed reads (masked) never touch the empty grad_out."""
    pack = make_pack(PackSpec((3, 0, 2), ratio=4, coff=2, head_dim=5, extra_tokens=2))
    grad_out = pack.grad_out(total_comp=None)
    with use_lowering_mode("generate"):
        out, grad_kv, grad_score, grad_ape = torch.compile(_fwd_bwd, fullgraph=True)(
            grad_out, *pack.args(total_comp=None))
    assert out.shape == (0, 5)
    for grad in (grad_kv, grad_score, grad_ape):
        assert torch.count_nonzero(grad) == 0


@pytest.mark.parametrize("dynamic", (False, True), ids=("static", "dynamic"))
def test_generated_code_asserts_the_row_capacity(dynamic, compile_env):
    """A capacity below the true count stops the compiled forward and backward with the
    kernels' assertion (aten._assert_async: torch's device-side assert on CUDA), as eager
    refuses it; the true count and larger capacities run."""
    spec = PackSpec((17, 9, 12), ratio=4, coff=2, head_dim=6)
    pack = make_pack(spec)
    rows = spec.true_rows
    forward = torch.compile(torch.ops.csa.compressor, fullgraph=True, dynamic=dynamic)
    backward = torch.compile(torch.ops.csa.compressor_backward, fullgraph=True,
                             dynamic=dynamic)
    with use_lowering_mode("generate"):
        for capacity in (rows, rows + 3):
            assert forward(*pack.args(total_comp=capacity)).shape == (capacity, 6)
            backward(pack.grad_out(total_comp=capacity), *pack.tensors(), 4, 2)
        message = re.escape(CAPACITY_MESSAGE)
        with pytest.raises(RuntimeError, match=message):
            forward(*pack.args(total_comp=rows - 1))
        with pytest.raises(RuntimeError, match=message):
            backward(pack.grad_out(total_comp=rows - 1), *pack.tensors(), 4, 2)


def test_no_stale_code_across_modes():
    """With caches on, code compiled under one mode is never served under another."""

    def fn(*args):
        return torch.ops.csa.compressor(*args).relu()

    pack = make_pack(BLOCK_PACK)
    seen = []
    with fresh_cache(), use_lowering_mode("generate"):
        for mode in ("generate", "extern", "generate"):
            lowering.mode = mode  # resets dynamo, so every pass compiles (or hits the cache)
            _, (code,) = run_and_get_code(torch.compile(fn, fullgraph=True), *pack.args())
            seen.append(_extern_ops(code))
    assert seen == [[], ["compressor"], []]


def test_auto_falls_back_to_the_op_when_generation_fails(monkeypatch, compile_env):
    def broken(*args, **kwargs):
        raise NotImplementedError("an Inductor internal moved")

    monkeypatch.setattr(lowering._generate, "forward", broken)
    pack = make_pack(BLOCK_PACK)
    expected = reference.compressor_reference(*pack.args())
    with use_lowering_mode("auto"):
        out, (code,) = run_and_get_code(torch.compile(torch.ops.csa.compressor, fullgraph=True),
                                        *pack.args())
    assert _extern_ops(code) == ["compressor"]
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    with use_lowering_mode("generate"), pytest.raises(Exception, match="an Inductor internal moved"):
        torch.compile(torch.ops.csa.compressor, fullgraph=True)(*pack.args())


# ---------------------------------------------------------------------------------------
# Pins (EXPECTTEST_ACCEPT=1 rewrites them): the graph Inductor lowers and what it emits


def _inductor_graphs(fn, *args):
    backend = torch._dynamo.testing.InductorAndRecordGraphs()
    _, codes = run_and_get_code(torch.compile(fn, backend=backend, fullgraph=True), *args)
    graphs = [torch._dynamo.testing.normalize_gm(g.print_readable(print_output=False))
              for g in backend.inductor_graphs]
    return graphs, codes


# Recorded on torch 2.13 and the same on every release of the tested range (2.11-2.15): a
# release that changes them (a decomposition, a kernel name, a buffer) changed what Inductor
# makes of the op, which is worth a look before the range is widened.
class TestPins(expecttest.TestCase):
    def setUp(self):
        torch._dynamo.reset()
        self._patch = torch._inductor.config.patch(force_disable_caches=True)
        self._patch.__enter__()

    def tearDown(self):
        self._patch.__exit__(None, None, None)
        torch._dynamo.reset()

    def test_pin_data_dependent_forward(self):
        pack = make_pack(PackSpec((13, 0, 9), ratio=4, coff=2, head_dim=4))
        with use_lowering_mode("generate"):
            (graph,), (code,) = _inductor_graphs(
                lambda *a: torch.ops.csa.compressor(*a).relu(), *pack.args(total_comp=None))
        self.assertExpectedInline(graph, """\
class <lambda>(torch.nn.Module):
    def forward(self, arg0_1: "f32[22, 8]", arg1_1: "f32[22, 8]", arg2_1: "f32[4, 8]", arg3_1: "i32[4]", arg4_1: "i32[4]"):
        select: "i32[]" = torch.ops.aten.select.int(arg4_1, 0, -1)
        _local_scalar_dense: "Sym(u0)" = torch.ops.aten._local_scalar_dense.default(select);  select = None
        ge_1: "Sym(u0 >= 0)" = _local_scalar_dense >= 0
        _assert_scalar = torch.ops.aten._assert_scalar.default(ge_1, "Runtime assertion failed for expression u0 >= 0 on node 'ge'");  ge_1 = _assert_scalar = None
        compressor: "f32[u0, 4]" = torch.ops.csa.compressor.default(arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, 4, 2, _local_scalar_dense);  arg0_1 = arg1_1 = arg2_1 = arg3_1 = arg4_1 = _local_scalar_dense = None
        relu: "f32[u0, 4]" = torch.ops.aten.relu.default(compressor);  compressor = None
        return (relu,)
""")
        self.assertExpectedInline(digest(code), """\
kernel cpp_fused_compressor_0
kernel cpp_fused_compressor_relu_1
buffer () bool
buffer (u0, 4) float32""")

    def test_pin_block_forward_backward(self):
        module, x, cu, cuc = _module_and_inputs()
        compiled = torch.compile(module, fullgraph=True)
        with use_lowering_mode("generate"):
            _, codes = run_and_get_code(_module_step, compiled, x, cu, cuc, BLOCK_PACK.capacity)
        self.assertExpectedInline("\n---\n".join(digest(c) for c in codes), """\
kernel cpp_fused_compressor_0
kernel cpp_fused_add_compressor_mean_mul_pow_rsqrt_1
buffer (46, 64) float32
buffer (46, 64) float32
buffer () bool
buffer (13, 32) float32
buffer (13, 1) float32
buffer (13, 32) float32
---
kernel cpp_fused_add_compressor_backward_div_expand_mul_pow_sum_0
buffer (1, 32) float32
buffer (13, 1) float32
buffer (13, 32) float32
buffer (13, 32) float32
buffer (13, 32) float32
buffer (4, 64) float32
buffer (46, 64) float32
buffer (46, 64) float32
buffer () bool
buffer (64, 16) float32
buffer (46, 16) float32
buffer (64, 16) float32
buffer (46, 16) float32""")


def test_bf16_rmsnorm_fusion_matches_eager(compile_env):
    """Fused with the RMSNorm, the op's output still goes in rounded to bf16 (no
    emulate_precision_casts needed): the compiled block equals eager to one bf16 step (the
    RMSNorm's own reduction order)."""
    module, x, cu, cuc = _module_and_inputs(dtype=torch.bfloat16)
    eager = module(x, cu, cuc, BLOCK_PACK.capacity)
    with use_lowering_mode("generate"):
        compiled = torch.compile(module, fullgraph=True)(x, cu, cuc, BLOCK_PACK.capacity)
    err = (compiled.double() - eager.double()).abs()
    assert bool((err <= ulp(eager, torch.bfloat16) + 4 * EPS[torch.float32]).all())


def test_static_token_counts_never_guard():
    import sympy
    from csa_ops.lowering._wiring import _static_tokens

    assert _static_tokens(sympy.Integer(8192)) == 8192 and _static_tokens(77) == 77
    assert _static_tokens(sympy.Symbol("s0")) is None
    assert _static_tokens(sympy.Symbol("s0") * 4) is None


# ---------------------------------------------------------------------------------------
# fuse_rms_norm: the op followed by an RMSNorm, rewritten into csa::compressor_epilogue

FUSE_PACK = PackSpec((17, 9, 12), ratio=4, coff=2, head_dim=16, extra_rows=2)


def _norm_forms(weight, eps):
    """Name -> the RMSNorm of the pooled rows y as a model writes it."""
    module = torch.nn.RMSNorm(weight.shape[0], eps=eps, dtype=weight.dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
    return {
        "F.rms_norm": lambda y, w: torch.nn.functional.rms_norm(y, (y.shape[-1],), w, eps),
        "nn.RMSNorm": lambda y, w: module(y),
        "explicit": lambda y, w: y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * w,
        "explicit, swapped": lambda y, w: w * (torch.rsqrt(eps + (y * y).mean(dim=-1,
                                                                         keepdim=True)) * y),
    }, module


@pytest.fixture
def fuse_rms_norm():
    previous = lowering.fuse_rms_norm
    lowering.fuse_rms_norm = True
    try:
        yield
    finally:
        lowering.fuse_rms_norm = previous


def _rows_and_grads(fn, leaves):
    """(rows, gradients of ``leaves``) of ``fn(*leaves)`` against a fixed probe."""
    rows = fn(*leaves)
    probe = torch.randn(rows.shape, generator=torch.Generator().manual_seed(2)).to(rows.dtype)
    return (rows.detach(), *torch.autograd.grad(rows, leaves, probe))


@pytest.mark.parametrize("form", ["F.rms_norm", "nn.RMSNorm", "explicit", "explicit, swapped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=("fp32", "bf16"))
def test_fuse_rms_norm_rewrites_each_form(form, dtype, fuse_rms_norm, compile_env):
    """Under fuse_rms_norm the op and its norm compile to one csa::compressor_epilogue call
    and its backward op: the fused op's rows and gradients, bitwise (auto keeps the fused op
    opaque on the CPU); eager still computes the two steps."""
    pack = make_pack(FUSE_PACK, dtype=dtype)
    weight = (1 + 0.25 * torch.randn(16, generator=torch.Generator().manual_seed(1))).to(dtype)
    forms, module = _norm_forms(weight, 1e-6)
    norm = forms[form]
    leaves = [t.clone().requires_grad_(True) for t in (pack.kv, pack.score, pack.ape, weight)]
    if form == "nn.RMSNorm":  # the module's own weight is the leaf
        leaves[3] = module.weight
    def op_then_norm(kv, score, ape, w):
        return norm(torch.ops.csa.compressor(kv, score, ape, *pack.tensors()[3:], 4, 2,
                                             FUSE_PACK.capacity), w)

    got, codes = run_and_get_code(
        _rows_and_grads, torch.compile(op_then_norm, fullgraph=True), leaves)
    calls = [re.findall(r"torch\.ops\.csa\.(\w+)\.default\(", code) for code in codes]
    assert calls == [["compressor_epilogue"], ["compressor_epilogue_backward"]], calls

    def fused(y_kv, y_score, y_ape, w):
        return torch.ops.csa.compressor_epilogue(
            y_kv, y_score, y_ape, *pack.tensors()[3:], 4, 2, w, 1e-6, None, None, 0, None,
            False, FUSE_PACK.capacity)

    want = _rows_and_grads(fused, leaves)
    names = ("rows", "grad_kv", "grad_score", "grad_ape", "grad_weight")
    for name, a, e in zip(names, got, want):
        assert_bitwise_equal(a, e, f"{form} {name}")


def test_fuse_rms_norm_leaves_what_it_cannot_fuse(fuse_rms_norm, compile_env):
    """Rows used beside the norm, a weightless norm, a mean over the rows' other dimension,
    and the flag off: the op and the norm stay two steps."""
    pack = make_pack(FUSE_PACK)
    weight = torch.full((16,), 1.5)

    def pooled():
        return torch.ops.csa.compressor(*pack.tensors(), 4, 2, FUSE_PACK.capacity)

    def norm(y):
        return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    graphs = {
        "rows used twice": lambda: (lambda y: norm(y) + y)(pooled()),
        "weightless": lambda: torch.nn.functional.rms_norm(pooled(), (16,), None, 1e-6),
        "other dimension": lambda: (lambda y: y * torch.rsqrt(
            y.pow(2).mean(0, keepdim=True) + 1e-6) * weight)(pooled()),
    }
    for name, fn in graphs.items():
        _, (code,) = run_and_get_code(torch.compile(fn, fullgraph=True))
        assert "compressor_epilogue" not in code, name
    lowering.fuse_rms_norm = False
    _, (code,) = run_and_get_code(torch.compile(lambda: norm(pooled()), fullgraph=True))
    assert "compressor_epilogue" not in code


def test_fuse_rms_norm_runs_the_pass_it_replaces(compile_env):
    """A pre-grad custom pass of the user's runs after the rewrite and is put back when the
    flag goes off; the flag takes bools only."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class Counting(CustomGraphPass):
        calls = 0

        def __call__(self, graph):
            Counting.calls += 1

        def uuid(self):
            return "counting"

    user = Counting()
    with torch._inductor.config.patch(pre_grad_custom_pass=user):
        lowering.fuse_rms_norm = True
        try:
            assert torch._inductor.config.pre_grad_custom_pass.then is user
            pack = make_pack(FUSE_PACK)
            torch.compile(lambda: torch.ops.csa.compressor(*pack.args()).relu(),
                          fullgraph=True)()
            assert Counting.calls == 1
        finally:
            lowering.fuse_rms_norm = False
        assert torch._inductor.config.pre_grad_custom_pass is user
    with pytest.raises(ValueError, match="must be a bool"):
        lowering.fuse_rms_norm = 1


def test_fuse_rms_norm_under_generate_is_one_generated_kernel(fuse_rms_norm, compile_env):
    """With "generate" the rewritten fused op decomposes into its composition: Inductor
    pools and normalizes in one generated kernel (beside the capacity check's), no opaque
    call left, within fp32 summation error of the fused op."""
    pack = make_pack(FUSE_PACK)
    weight = torch.full((16,), 1.5)

    def op_then_norm(kv):
        y = torch.ops.csa.compressor(kv, *pack.tensors()[1:], 4, 2, FUSE_PACK.capacity)
        return torch.nn.functional.rms_norm(y, (16,), weight, 1e-6)

    with use_lowering_mode("generate"):
        got, (code,) = run_and_get_code(torch.compile(op_then_norm, fullgraph=True), pack.kv)
    assert _extern_ops(code) == []
    assert len(set(_kernels(code)) - set(_capacity_checks(code))) == 1, _kernels(code)
    want = torch.ops.csa.compressor_epilogue(*pack.tensors(), 4, 2, weight, 1e-6, None, None,
                                             0, None, False, FUSE_PACK.capacity)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
