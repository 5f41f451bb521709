"""csa::compressor_epilogue and its backward on the CPU: the composition as models write it,
the fp64 oracle, gradients (torch autograd, gradcheck), opcheck, fakes, compile, errors.

`model_epilogue` writes the epilogue the way model code does (a mean, complex RoPE, a
Hadamard matrix) and shares no code with csa_ops.reference_epilogue: agreement is evidence.
"""

from __future__ import annotations

import dataclasses

import csa_ops.meta.epilogue  # noqa: F401  (registers the fakes)
import numpy as np
import pytest
import torch
import torch._dynamo.testing
from helpers import PackSpec, assert_bitwise_equal, assert_within_one_step, make_pack, ulp
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import csa_ops
from csa_ops import epilogue, reference_epilogue

FORWARD = torch.ops.csa.compressor_epilogue.default
BACKWARD = torch.ops.csa.compressor_epilogue_backward.default


@dataclasses.dataclass(frozen=True)
class Case:
    lengths: tuple
    ratio: int
    coff: int
    head_dim: int
    dtype: torch.dtype
    rope_dim: int
    rotate: bool
    offsets: bool = True
    extra_rows: int | None = 2  # None: total_comp=None (the true row count)
    weight_dtype: torch.dtype = torch.float32

    @property
    def spec(self) -> PackSpec:
        return PackSpec(self.lengths, self.ratio, self.coff, self.head_dim,
                        extra_tokens=1, extra_rows=self.extra_rows or 0)

    @property
    def total_comp(self):
        return None if self.extra_rows is None else self.spec.capacity


def _id(case: Case) -> str:
    return (f"r{case.ratio}c{case.coff}_d{case.head_dim}_{str(case.dtype)[6:]}_rope"
            f"{case.rope_dim}{'_rot' if case.rotate else ''}{'_off' if case.offsets else ''}"
            f"{'_none' if case.extra_rows is None else ''}_w{str(case.weight_dtype)[6:]}")


CASES = [
    Case((13, 0, 9, 4), 4, 2, 128, torch.bfloat16, 64, True),
    Case((9, 3, 8), 4, 1, 64, torch.bfloat16, 0, False, offsets=False, extra_rows=None),
    Case((7, 5), 2, 2, 64, torch.bfloat16, 64, False, weight_dtype=torch.bfloat16),
    Case((10, 6, 1), 3, 1, 128, torch.float16, 32, True, offsets=False),
    Case((12, 9), 4, 2, 64, torch.float32, 16, True, extra_rows=None),
]
LOW_PRECISION = [c for c in CASES if c.dtype != torch.float32]


def rope_tables(rope_dim: int, max_position: int = 96, theta: float = 10000.0):
    """(cos, sin) fp32 (max_position, rope_dim // 2): angle p * theta**(-2i / rope_dim)."""
    inv_freq = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq
    return torch.cos(angles).float(), torch.sin(angles).float()


def make_inputs(case: Case, seed: int = 0, requires_grad: bool = False) -> dict:
    """The op's arguments by name (kv, score, ape from helpers.make_pack)."""
    ape_dtype = torch.float64 if case.dtype == torch.float64 else torch.float32
    pack = make_pack(case.spec, case.dtype, seed=seed, ape_dtype=ape_dtype)
    gen = torch.Generator().manual_seed(seed + 100)
    weight = (1 + 0.25 * torch.randn(case.head_dim, generator=gen)).to(case.weight_dtype)
    offsets = torch.randint(0, 8, (len(case.lengths),), generator=gen, dtype=torch.int32)
    cos, sin = rope_tables(case.rope_dim) if case.rope_dim else (None, None)
    leaves = [pack.kv, pack.score, pack.ape, weight]
    if requires_grad:
        leaves = [t.clone().requires_grad_(True) for t in leaves]
    kv, score, ape, weight = leaves
    return {"kv": kv, "score": score, "ape": ape, "cu_seqlens": pack.cu_seqlens,
            "cu_seqlens_comp": pack.cu_seqlens_comp, "ratio": case.ratio, "coff": case.coff,
            "norm_weight": weight, "eps": 1e-6, "cos": cos, "sin": sin,
            "rope_dim": case.rope_dim, "position_offset": offsets if case.offsets else None,
            "rotate": case.rotate, "total_comp": case.total_comp}


def positional(inputs: dict) -> tuple:
    return tuple(inputs[name] for name in epilogue.FORWARD_ARGS)


def row_positions(inputs: dict, rows: int) -> list:
    """Position of every output row, from the lengths in plain Python: block b of sequence
    s at b * ratio + position_offset[s]; padding rows at 0 (never read)."""
    cu = inputs["cu_seqlens"].tolist()
    offsets = inputs["position_offset"]
    positions = []
    for s in range(len(cu) - 1):
        offset = 0 if offsets is None else int(offsets[s])
        positions += [b * inputs["ratio"] + offset
                      for b in range((cu[s + 1] - cu[s]) // inputs["ratio"])]
    return positions + [0] * (rows - len(positions))


def sylvester(d: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def model_epilogue(pooled, inputs: dict):
    """The epilogue as model code writes it: fp32 from the rounded row, rounded per step."""
    dtype, rows = pooled.dtype, pooled.shape[0]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    x = pooled.to(acc)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + inputs["eps"])
    x = (x * inputs["norm_weight"].to(acc)).to(dtype)
    rope_dim = inputs["rope_dim"]
    if rope_dim:
        index = torch.tensor(row_positions(inputs, rows))
        freqs = torch.complex(inputs["cos"][index].to(acc), inputs["sin"][index].to(acc))
        tail = x[:, -rope_dim:].to(acc).reshape(rows, -1, 2).contiguous()
        turned = torch.view_as_real(torch.view_as_complex(tail) * freqs).reshape(rows, -1)
        x = torch.cat([x[:, :-rope_dim], turned.to(dtype)], 1)
    if inputs["rotate"]:
        d = x.shape[1]
        x = (x.to(acc) @ sylvester(d).to(acc) * d**-0.5).to(dtype)
    true_rows = int(inputs["cu_seqlens_comp"][-1])
    return torch.cat([x[:true_rows], torch.zeros_like(x[true_rows:])])


def model_forward(inputs: dict):
    pooled = torch.ops.csa.compressor(*(inputs[n] for n in ("kv", "score", "ape", "cu_seqlens",
                                                             "cu_seqlens_comp", "ratio",
                                                             "coff", "total_comp")))
    return model_epilogue(pooled, inputs)


def params_of(inputs: dict) -> reference_epilogue.EpilogueParams:
    return reference_epilogue.EpilogueParams(inputs["norm_weight"], inputs["eps"],
                                             inputs["cos"], inputs["sin"],
                                             inputs["rope_dim"], inputs["rotate"])


def oracle(inputs: dict):
    names = ("kv", "score", "ape", "cu_seqlens", "cu_seqlens_comp", "ratio", "coff")
    return reference_epilogue.compressor_epilogue_oracle(
        *(inputs[n] for n in names), params_of(inputs), inputs["position_offset"],
        inputs["total_comp"])


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_matches_model_composition(case):
    inputs = make_inputs(case)
    out = epilogue.compressor_epilogue(**{k: v for k, v in inputs.items()})
    want = model_forward(inputs)
    if case.dtype == torch.float32:
        # No coarse final rounding hides the summation orders (mean, Hadamard matmul).
        torch.testing.assert_close(out, want, rtol=2e-6, atol=2e-6)
    else:
        assert_within_one_step(out, want, "epilogue rows", max_fraction=1e-3)
    rows = case.spec.capacity if case.extra_rows is not None else case.spec.true_rows
    assert out.shape == (rows, case.head_dim) and out.dtype == case.dtype


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_close_to_fp64_oracle(case):
    """Each of the four roundings to the row dtype costs at most half a step of the row's
    largest value (RMSNorm and the orthonormal rotation keep errors at the row's scale)."""
    inputs = make_inputs(case)
    out = FORWARD(*positional(inputs)).double()
    truth = oracle(inputs)
    row_max = truth.abs().amax(1, keepdim=True)
    bound = 4 * ulp(row_max, case.dtype) + 1e-12
    assert bool(((out - truth).abs() <= bound).all())


def test_padding_rows_are_exact_zeros_even_where_the_norm_is_nan():
    """eps = 0 makes the norm of a zero row 0 * inf = NaN; padding rows carry no data."""
    case = CASES[0]
    inputs = make_inputs(case, requires_grad=True)
    inputs["eps"] = 0.0
    out = FORWARD(*positional(inputs))
    true_rows = case.spec.true_rows
    assert_bitwise_equal(out[true_rows:], torch.zeros_like(out[true_rows:]), "padding")
    grad_out = torch.randn(out.shape).to(out.dtype)
    grads = torch.autograd.grad(out, [inputs[n] for n in ("kv", "score", "ape", "norm_weight")],
                                grad_out)
    assert all(bool(torch.isfinite(g).all()) for g in grads)


def _op_grads(inputs, grad_out):
    out = FORWARD(*positional(inputs))
    leaves = [inputs[n] for n in ("kv", "score", "ape", "norm_weight")]
    return (out.detach(), *torch.autograd.grad(out, leaves, grad_out))


@pytest.mark.parametrize("case", [c for c in CASES if c.dtype == torch.float32] + [
    Case((9, 8), 4, 1, 64, torch.float32, 64, False, weight_dtype=torch.bfloat16),
], ids=_id)
def test_gradients_match_torch_autograd_of_the_composition(case):
    inputs = make_inputs(case, requires_grad=True)
    out = FORWARD(*positional(inputs))
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    got = _op_grads(inputs, grad_out)[1:]
    want = torch.autograd.grad(model_forward(inputs),
                               [inputs[n] for n in ("kv", "score", "ape", "norm_weight")],
                               grad_out)
    for name, a, e in zip(("grad_kv", "grad_score", "grad_ape", "grad_weight"), got, want):
        assert a.dtype == e.dtype and a.shape == e.shape, name
        scale = float(e.abs().max()) + 1e-30
        torch.testing.assert_close(a, e, rtol=0, atol=2e-5 * scale, msg=name)


@pytest.mark.parametrize("coff", [1, 2])
def test_gradcheck_fp64(coff):
    case = Case((6, 4), 2, coff, 8, torch.float64, 4, True, extra_rows=1,
                weight_dtype=torch.float64)
    inputs = make_inputs(case)
    names = ("kv", "score", "ape", "norm_weight")

    def fn(*leaves):
        return FORWARD(*positional({**inputs, **dict(zip(names, leaves))}))

    leaves = [inputs[n].clone().requires_grad_(True) for n in names]
    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-7)


def test_bitwise_run_to_run_and_deterministic_mode(deterministic):
    inputs = make_inputs(CASES[0], requires_grad=True)
    grad_out = torch.randn(CASES[0].spec.capacity, 128).bfloat16()
    first, second = _op_grads(inputs, grad_out), _op_grads(inputs, grad_out)
    for name, a, b in zip(("out", "grad_kv", "grad_score", "grad_ape", "grad_weight"), first,
                          second):
        assert_bitwise_equal(a, b, name)


def test_without_grad_matches_with_grad():
    inputs = make_inputs(CASES[0], requires_grad=True)
    with torch.no_grad():
        plain = FORWARD(*positional(inputs))
    assert_bitwise_equal(plain, FORWARD(*positional(inputs)).detach(), "out")


def test_rope_and_norm_only_use_their_arguments():
    """rope_dim 0 reads no tables (None accepted); weight 1, no rotation: plain RMSNorm."""
    case = Case((9, 8), 4, 1, 64, torch.float32, 0, False)
    inputs = make_inputs(case)
    inputs["norm_weight"] = torch.ones(64)
    out = epilogue.compressor_epilogue(**inputs)
    pooled = torch.ops.csa.compressor(*(inputs[n] for n in ("kv", "score", "ape", "cu_seqlens",
                                                             "cu_seqlens_comp", "ratio",
                                                             "coff", "total_comp")))
    normed = torch.nn.functional.rms_norm(pooled, (64,), eps=1e-6)
    torch.testing.assert_close(out, normed, rtol=1e-6, atol=1e-6)


OPCHECK_CASES = [CASES[0], CASES[1], CASES[2], CASES[4]]


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=_id)
def test_opcheck_forward(case):
    torch.library.opcheck(FORWARD, positional(make_inputs(case, requires_grad=True)))


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=_id)
def test_opcheck_backward(case):
    inputs = make_inputs(case)
    rows = case.spec.capacity
    grad_out = torch.randn(rows, case.head_dim).to(case.dtype)
    torch.library.opcheck(BACKWARD, (grad_out, *positional(inputs)[:-1]))


def _metadata(t: torch.Tensor):
    return t.shape, t.dtype, t.stride(), t.device


def test_fakes_have_exact_metadata():
    inputs = make_inputs(CASES[0])
    grad_out = torch.randn(CASES[0].spec.capacity, 128).bfloat16()
    args = positional(inputs)
    real = (FORWARD(*args), *BACKWARD(grad_out, *args[:-1]))
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                          for a in (grad_out, *args))
        fake = (FORWARD(*fake_args[1:]), *BACKWARD(*fake_args[:-1]))
    for r, f in zip(real, fake):
        assert _metadata(r)[:3] == _metadata(f)[:3]


class EpilogueBlock(torch.nn.Module):
    """Projections and the op at a static capacity: a graph without generated kernels (on
    the CPU each one is a C++ compile of seconds), so the test costs the trace alone."""

    def __init__(self, dim: int, case: Case):
        super().__init__()
        width = case.coff * case.head_dim
        self.case = case
        self.wkv = torch.nn.Linear(dim, width, bias=False)
        self.wgate = torch.nn.Linear(dim, width, bias=False)
        self.ape = torch.nn.Parameter(0.5 * torch.randn(case.ratio, width))
        self.norm = torch.nn.Parameter(1 + 0.25 * torch.randn(case.head_dim))
        cos, sin = rope_tables(case.rope_dim)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, x, cu_seqlens, cu_seqlens_comp, position_offset):
        c = self.case
        return epilogue.compressor_epilogue(
            self.wkv(x), self.wgate(x), self.ape, cu_seqlens, cu_seqlens_comp, ratio=c.ratio,
            coff=c.coff, norm_weight=self.norm, cos=self.cos, sin=self.sin,
            rope_dim=c.rope_dim, position_offset=position_offset, rotate=c.rotate,
            total_comp=c.total_comp)


@pytest.mark.parametrize("rotate", (False, True), ids=("rope", "rope_rot"))
def test_compressor_block_with_rope_tables_runs_the_fused_op(rotate):
    """csa_ops.Compressor built with rope_dim: its forward is the fused op on its projections
    and norm (bitwise the direct call, gradients to every parameter, the norm's weight
    included); built without, RoPE arguments are an error naming them."""
    from csa_ops.module import offsets_for

    torch.manual_seed(0)
    block = csa_ops.Compressor(24, 64, 4, 2, rope_dim=16, rotate=rotate)
    cu, cuc = offsets_for([13, 0, 9], 4)
    x = torch.randn(22, 24)
    cos, sin = rope_tables(16)
    offsets = torch.tensor([3, 0, 5], dtype=torch.int32)
    out = block(x, cu, cuc, 7, cos=cos, sin=sin, position_offset=offsets)
    want = epilogue.compressor_epilogue(
        block.wkv(x), block.wgate(x), block.ape, cu, cuc, ratio=4, coff=2,
        norm_weight=block.norm.weight, eps=1e-6, cos=cos, sin=sin, rope_dim=16,
        position_offset=offsets, rotate=rotate, total_comp=7)
    assert_bitwise_equal(out, want, "block rows")
    out.square().sum().backward()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in block.parameters())
    plain = csa_ops.Compressor(24, 64, 4, 2)
    with pytest.raises(ValueError, match="`cos`, `sin` and `position_offset`"):
        plain(x, cu, cuc, 7, cos=cos, sin=sin)


def test_compile_fullgraph_block_equals_eager_bitwise(compile_env):
    torch.manual_seed(0)
    case = Case((13, 0, 9, 4), 4, 2, 64, torch.float32, 64, True)
    block = EpilogueBlock(32, case)
    inputs = make_inputs(case)
    x = torch.randn(case.spec.num_tokens, 32)
    extra = (inputs["cu_seqlens"], inputs["cu_seqlens_comp"], inputs["position_offset"])
    probe = torch.randn(case.spec.capacity, case.head_dim)

    def step(fn):
        block.zero_grad()
        y = fn(x, *extra)
        (y * probe).sum().backward()
        return [y.detach(), *(p.grad.clone() for p in block.parameters())]

    eager = step(block)
    compiled = step(torch.compile(block, fullgraph=True))
    for i, (a, b) in enumerate(zip(compiled, eager)):
        assert_bitwise_equal(a, b, f"output {i}")


@pytest.mark.parametrize("emulate", (False, True), ids=("", "emulated_casts"))
@pytest.mark.parametrize("case", [CASES[0], CASES[4]], ids=_id)
def test_generate_mode_compiles_the_composition_and_other_modes_keep_the_op(case, emulate,
                                                                           compile_env):
    """Under csa_ops.lowering "generate" the epilogue ops decompose into their composition,
    so Inductor generates the pooling and fuses the norm, RoPE and rotation into its code
    (no opaque csa call left): fp32 rows within fp32 summation error of eager (Inductor's
    reduction order), bf16 rows (only under emulate_precision_casts, which keeps the
    roundings between the steps) within one rounding step, grad_ape and grad_weight within
    the fp32 sums' error. Otherwise, and under "extern" and "auto", they stay opaque calls
    and give eager's bits."""
    import re

    from torch._inductor.utils import run_and_get_code

    from csa_ops import lowering

    generates = case.dtype == torch.float32 or emulate

    inputs = make_inputs(case, requires_grad=True)
    leaves = [inputs[n] for n in ("kv", "score", "ape", "norm_weight")]
    probe = torch.randn(case.spec.capacity, case.head_dim,
                        generator=torch.Generator().manual_seed(5)).to(case.dtype)

    def step(fn):
        out = fn(*leaves)
        return (out.detach(), *torch.autograd.grad(out, leaves, probe))

    def op(kv, score, ape, norm_weight):
        return FORWARD(*positional({**inputs, "kv": kv, "score": score, "ape": ape,
                                    "norm_weight": norm_weight}))

    eager = step(op)
    previous = lowering.get_mode()
    try:
        for mode in ("generate", "extern", "auto"):
            lowering.mode = mode
            with torch._inductor.config.patch(emulate_precision_casts=emulate):
                compiled, codes = run_and_get_code(step, torch.compile(op, fullgraph=True))
            opaque = [re.findall(r"torch\.ops\.csa\.(\w+)\.default\(", code) for code in codes]
            if mode == "generate" and generates:
                assert opaque == [[], []], opaque
                names = ("out", "grad_kv", "grad_score", "grad_ape", "grad_weight")
                for name, got, want in zip(names, compiled, eager):
                    if got.dtype == torch.float32:
                        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,
                                                   msg=lambda m, n=name: f"{n}: {m}")
                    else:
                        assert_within_one_step(got, want, f"{mode} {name}")
            else:
                assert opaque == [["compressor_epilogue"], ["compressor_epilogue_backward"]]
                for i, (got, want) in enumerate(zip(compiled, eager)):
                    assert_bitwise_equal(got, want, f"{mode} output {i}")
    finally:
        lowering.mode = previous


def test_export_of_the_rope_block_keeps_the_fused_op():
    """torch.export of csa_ops.Compressor with RoPE tables: one csa::compressor_epilogue
    node, the program equal to the module bitwise on the example and on other offsets, the
    token count dynamic."""
    from csa_ops.module import offsets_for

    torch.manual_seed(0)
    block = csa_ops.Compressor(24, 64, 4, 2, rope_dim=16, rotate=True).eval()
    cos, sin = rope_tables(16)
    x = torch.randn(22, 24)
    cu, cuc = offsets_for([13, 0, 9], 4)
    tokens = torch.export.Dim("tokens", min=2, max=4096)
    exported = torch.export.export(
        block, (x, cu, cuc, 12), {"cos": cos, "sin": sin},
        dynamic_shapes={"x": {0: tokens}, "cu_seqlens": None, "cu_seqlens_comp": None,
                        "total_comp": None, "cos": None, "sin": None})
    fused = [n for n in exported.graph_module.graph.nodes if n.target is FORWARD]
    assert len(fused) == 1
    with torch.no_grad():
        for lengths in ([13, 0, 9], [4, 30, 7]):
            x = torch.randn(sum(lengths), 24)
            cu, cuc = offsets_for(lengths, 4)
            assert_bitwise_equal(exported.module()(x, cu, cuc, 12, cos=cos, sin=sin),
                                 block(x, cu, cuc, 12, cos=cos, sin=sin), f"lengths {lengths}")


def test_compile_dynamic_shapes_one_graph(compile_env):
    """torch.compile(dynamic=True) of the fused op, forward and backward: packs of other
    token counts and capacities (and the true count) run in the frames compiled once, each
    equal to eager bitwise (the op is opaque under the default lowering mode)."""
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")

    def forward(inputs):
        return FORWARD(*positional(inputs))

    # fullgraph: total_comp=None is a data-dependent size, which breaks a partial graph.
    compiled = torch.compile(forward, backend=counter, dynamic=True, fullgraph=True)
    leaves = ("kv", "score", "ape", "norm_weight")
    frames = []
    for lengths, extra in (((13, 0, 9, 4), 2), ((40, 3, 17, 8), 5), ((9, 8, 1, 30), None)):
        case = Case(lengths, 4, 2, 64, torch.float32, 16, True, extra_rows=extra)
        inputs = make_inputs(case, requires_grad=True)
        results = []
        for fn in (compiled, forward):
            out = fn(inputs)
            grads = torch.autograd.grad(out, [inputs[n] for n in leaves], torch.ones_like(out))
            results.append((out.detach(), *grads))
        for i, (a, b) in enumerate(zip(*results)):
            assert_bitwise_equal(a, b, f"{lengths} output {i}")
        frames.append(counter.frame_count)
    assert frames[1] == frames[0]  # another token count and capacity: no new frame
    assert frames[2] <= frames[1] + 1  # total_comp=None: one frame of its own at most


# ---------------------------------------------------------------------------------------
# Device independence, on the CPU: what CUDA does differently is made to happen here.

aten = torch.ops.aten
# Ops that read tensor contents on the host (a sync on CUDA): .item(), int(), float() and
# bool() of a tensor and indexing with a 0-dim tensor all reach aten._local_scalar_dense;
# the others size their output by the data.
HOST_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default,
              aten.nonzero.default, aten.masked_select.default, aten._unique2.default,
              aten.unique_dim.default, aten.unique_consecutive.default,
              aten.repeat_interleave.Tensor}
# Ops that take a list of index tensors, where a bool mask means a nonzero() (a sync).
INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
            aten._index_put_impl_.default}


class HostReadsAreErrors(TorchDispatchMode):
    """Inside, an aten op that reads tensor contents on the host raises, as
    torch.cuda.set_sync_debug_mode("error") raises on CUDA. Ops of other namespaces (the
    pooling ops) run whole: their CUDA kernels read nothing on the host (tests/gpu)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        masks = func in INDEXING and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        if func in HOST_READS or masks:
            raise AssertionError(f"{func} reads tensor contents on the host (a sync on CUDA)")
        return func(*args, **(kwargs or {}))


# Functions whose CUDA results are approximations with unspecified last bits (CUDA's rsqrt
# is within 2 ulp; pow, exp and log come from a device math library).
APPROXIMATE = {aten.rsqrt.default, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor,
               aten.pow.Scalar, aten.exp.default, aten.exp2.default, aten.log.default,
               aten.log2.default}
DIVISIONS = {aten.div.Tensor, aten.div.Scalar}


class CudaArithmetic(TorchDispatchMode):
    """Inside, arithmetic goes CUDA's way where that differs from the CPU's: a floating
    division by a host scalar (a Python number, or a 0-dim CPU tensor, which CUDA's kernels
    take as one) multiplies by the divisor's reciprocal rounded to the compute dtype, as
    CUDA's true-division kernel does; and an APPROXIMATE op raises. Code whose bits this
    does not change computes the same bits on both devices."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        squares = func == aten.pow.Tensor_Scalar and args[1] == 2  # x * x on both devices
        if func in APPROXIMATE and not squares:
            raise AssertionError(f"{func}: its CUDA result differs from the CPU's")
        if func in DIVISIONS and not kwargs and _host_scalar(args[1]):
            x, divisor = args
            dtype = torch.result_type(x, divisor)
            if dtype.is_floating_point:
                opmath = torch.float64 if dtype == torch.float64 else torch.float32
                value = divisor.item() if isinstance(divisor, torch.Tensor) else divisor
                reciprocal = torch.tensor(1.0, dtype=opmath) / torch.tensor(value, dtype=opmath)
                return (x.to(opmath) * reciprocal).to(dtype)
        return func(*args, **(kwargs or {}))


def _host_scalar(value) -> bool:
    return not isinstance(value, torch.Tensor) or value.dim() == 0


def _reciprocal_differs(x: np.ndarray, divisor: float) -> np.ndarray:
    """Where fp32 x * (1 / divisor) is not the correctly rounded x / divisor."""
    d = np.float32(divisor)
    return x * (np.float32(1) / d) != x / d


def _composition_inputs(dtype, head_dim: int, rope_dim: int, rotate: bool, rows: int = 64):
    gen = torch.Generator().manual_seed(head_dim + rope_dim)
    pooled = (torch.randn(rows, head_dim, generator=gen)
              * 2.0 ** torch.randint(-8, 8, (rows, 1), generator=gen)).to(dtype)
    cos, sin = rope_tables(rope_dim) if rope_dim else (None, None)
    params = reference_epilogue.EpilogueParams(
        1 + 0.25 * torch.randn(head_dim, generator=gen), 1e-6, cos, sin, rope_dim, rotate)
    positions = torch.randint(0, 96, (rows,), generator=gen)
    valid = torch.arange(rows) < rows - 3
    grad_out = torch.randn(rows, head_dim, generator=gen).to(dtype)
    return pooled, positions, valid, params, grad_out


def _composition(pooled, positions, valid, params, grad_out) -> list:
    """The rows, both gradients, and each format's encoding the rows' shape allows."""
    rows = reference_epilogue.epilogue_rows(pooled, positions, valid, params)
    out = [rows, *reference_epilogue.epilogue_rows_backward(grad_out, pooled, positions,
                                                            valid, params)]
    d = pooled.shape[1]
    for fmt, fits in (("fp8_block128", d % 128 == 0), ("mxfp4", d % 32 == 0),
                      ("fp8_ds_mla", d == 512)):
        if fits:
            out += reference_epilogue.encode_rows(rows, fmt)
    return out


@pytest.mark.parametrize("dtype, head_dim, rope_dim, rotate", [
    pytest.param(torch.bfloat16, 128, 64, True, id="bf16_d128_rot"),
    pytest.param(torch.float32, 96, 32, False, id="fp32_d96"),
    pytest.param(torch.float16, 512, 64, False, id="fp16_d512"),
])
def test_composition_computes_the_same_bits_with_cuda_arithmetic(dtype, head_dim, rope_dim,
                                                                  rotate):
    """Forward, backward and encodings bitwise unchanged when divisions by a host scalar
    multiply by the reciprocal and approximate functions are refused, as on CUDA (d96: a
    mean whose divisor is no power of two)."""
    inputs = _composition_inputs(dtype, head_dim, rope_dim, rotate)
    plain = _composition(*inputs)
    with CudaArithmetic():
        cuda_way = _composition(*inputs)
    for i, (a, b) in enumerate(zip(cuda_way, plain)):
        assert_bitwise_equal(a, b, f"output {i}")


def test_row_mean_and_inverse_rms_are_ieee_division_and_sqrt():
    """Integer rows of width 96 (exact sums in any order): the mean is the fp32 quotient by
    96 and the inverse RMS fp32 1 / sqrt of its argument, computed by numpy, also where the
    reciprocal's product differs from the quotient (checked present)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randint(-1000, 1000, (512, 96), generator=gen).float()
    sums = x.double().sum(1).numpy().astype(np.float32)  # exact: |sum| < 2**24
    assert _reciprocal_differs(sums, 96).sum() > 10
    with CudaArithmetic():
        mean = reference_epilogue.row_mean(x)
        inv = reference_epilogue.inverse_rms(x, 1e-6)
    assert_bitwise_equal(mean[:, 0], torch.from_numpy(sums / np.float32(96)), "mean")
    v = reference_epilogue.row_mean(x * x).numpy() + np.float32(1e-6)
    want = np.float32(1) / np.sqrt(v)
    assert_bitwise_equal(inv, torch.from_numpy(want), "inverse rms")


def test_fp8_block128_scales_are_ieee_quotients():
    """The fp32 scale amax / 448 of many blocks, with CUDA's arithmetic, equals numpy's
    fp32 division, where x * (1 / 448) rounds otherwise too (checked present); the codes
    are those of each value divided by its block's scale."""
    gen = torch.Generator().manual_seed(6)
    amax = torch.rand(4096, generator=gen) * 2.0 ** torch.randint(-100, 100, (4096,),
                                                                  generator=gen)
    assert _reciprocal_differs(amax.numpy(), 448.0).sum() > 1000
    blocks = torch.rand(4096, 128, generator=gen) * 2 - 1
    blocks = blocks * amax[:, None]
    blocks[torch.arange(4096), torch.randint(0, 128, (4096,), generator=gen)] = amax
    with CudaArithmetic():
        encoded = reference_epilogue.encode_fp8_block128(blocks)
    scale = np.abs(blocks.numpy()).max(1) / np.float32(448)
    got = reference_epilogue.bitcast(encoded[:, 128:], torch.float32)[:, 0]
    assert_bitwise_equal(got, torch.from_numpy(scale), "scales")
    quotient = torch.from_numpy(blocks.numpy() / scale[:, None])
    assert_bitwise_equal(encoded[:, :128], reference_epilogue.encode_e4m3(quotient), "codes")


def test_sqrt_is_correctly_rounded_and_corrects_a_guess_one_step_off():
    """fp32 roots against numpy's (correctly rounded) over normal and subnormal values,
    zero, Inf, NaN and squares; and the exact check alone turns a guess one step above or
    below the root into the root."""
    gen = np.random.default_rng(7)
    v = np.concatenate([gen.random(1 << 16) * 4, gen.random(1 << 12) * 1e-38,
                        [0.0, 2.0**-149, 1.0, 4.0, 3.4e38, 9.0, np.inf, np.nan]])
    v = v.astype(np.float32)
    want = torch.from_numpy(np.sqrt(v))
    assert_bitwise_equal(reference_epilogue.sqrt(torch.from_numpy(v)), want, "sqrt")
    finite = torch.from_numpy(np.isfinite(v))
    wide, want = torch.from_numpy(v).double()[finite], want[finite]
    for toward in (float("inf"), 0.0):
        guess = torch.nextafter(want, torch.full_like(want, toward))
        assert_bitwise_equal(reference_epilogue._nearest_root(wide, guess), want, "corrected")


def test_sqrt_under_autograd_keeps_its_bits_and_has_sqrts_gradient():
    """nextafter has no derivative: a root that requires grad is the rounded root in value
    and torch.sqrt in its gradient."""
    v = (torch.rand(4096, generator=torch.Generator().manual_seed(3)) * 9 + 1e-3)
    leaf = v.clone().requires_grad_()
    root = reference_epilogue.sqrt(leaf)
    assert_bitwise_equal(root.detach(), reference_epilogue.sqrt(v), "sqrt")
    root.sum().backward()
    assert torch.allclose(leaf.grad, 0.5 / torch.sqrt(v), rtol=1e-6, atol=0)


def test_pow2_is_exact_over_its_range():
    exponent = torch.arange(-149, 129, dtype=torch.int32)
    want = torch.tensor([2.0**e for e in exponent.tolist()]).float()  # 2**128: Inf
    assert_bitwise_equal(reference_epilogue.pow2(exponent), want, "2**e")


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=_id)
def test_training_composition_reads_nothing_on_the_host(case):
    """What the op runs on CUDA (no content checks): pooling, positions, epilogue and its
    backward with no op that syncs; the rows are the op's."""
    inputs = make_inputs(case)
    names = ("kv", "score", "ape", "cu_seqlens", "cu_seqlens_comp", "ratio", "coff")
    params = params_of(inputs)
    rows = case.spec.capacity
    grad_out = torch.randn(rows, case.head_dim).to(case.dtype)
    with HostReadsAreErrors():
        out = reference_epilogue.compressor_epilogue_reference(
            *(inputs[n] for n in names), params, inputs["position_offset"], rows)
        positions, valid = reference_epilogue.training_positions(
            inputs["cu_seqlens_comp"], inputs["position_offset"], rows, case.ratio)
        reference_epilogue.epilogue_rows_backward(grad_out, out, positions, valid, params)
    assert_bitwise_equal(out, FORWARD(*positional(inputs)), "rows")


def test_host_read_detector_catches_a_zero_dim_index():
    flags = torch.tensor([False, True])
    with HostReadsAreErrors(), pytest.raises(AssertionError, match="_local_scalar_dense"):
        flags[flags.int().argmax()]
    with HostReadsAreErrors(), pytest.raises(AssertionError, match="reads tensor contents"):
        torch.arange(2)[flags]


# ---------------------------------------------------------------------------------------
# Bad inputs: every one names the argument.


def _bad(name, mutate, match, error=ValueError):
    return pytest.param(mutate, match, error, id=name)


def _set(**changes):
    return lambda d: d.update(changes)


def _poke(name, index, value):
    return lambda d: d[name].__setitem__(index, value)


BAD_INPUTS = [
    _bad("weight_shape", lambda d: d.update(norm_weight=d["norm_weight"][:5]),
         r"`norm_weight` must have shape \(head_dim,\) = \(128,\)"),
    _bad("weight_dtype", lambda d: d.update(norm_weight=d["norm_weight"].double()),
         "`norm_weight` must be float32, bfloat16 or float16"),
    _bad("weight_device", lambda d: d.update(norm_weight=d["norm_weight"].to("meta")),
         "`norm_weight` must be on the device of `kv`"),
    _bad("eps_negative", _set(eps=-1e-6), "`eps` must be a finite float >= 0"),
    _bad("eps_nan", _set(eps=float("nan")), "`eps` must be a finite float >= 0"),
    _bad("rope_odd", _set(rope_dim=63), r"`rope_dim` must be even and in \[0, head_dim=128\]"),
    _bad("rope_wide", _set(rope_dim=130), "`rope_dim` must be even"),
    _bad("rope_negative", _set(rope_dim=-2), "`rope_dim` must be even"),
    _bad("cos_missing", _set(cos=None), "`cos` is required when rope_dim > 0"),
    _bad("sin_missing", _set(sin=None), "`sin` is required when rope_dim > 0"),
    _bad("cos_width", lambda d: d.update(cos=d["cos"][:, :16]),
         r"`cos` must have shape \(max_position >= 1, rope_dim // 2 = 32\)"),
    _bad("cos_1d", lambda d: d.update(cos=d["cos"][0]), "`cos` must have shape"),
    _bad("cos_dtype", lambda d: d.update(cos=d["cos"].double()), "`cos` must be float32"),
    _bad("sin_rows", lambda d: d.update(sin=d["sin"][:10]), "`sin` must have the shape of `cos`"),
    _bad("rotate_not_pow2", lambda d: d.update(
        kv=d["kv"][:, :192], score=d["score"][:, :192], ape=d["ape"][:, :192],
        norm_weight=d["norm_weight"][:96]), "`rotate` needs a power-of-two head_dim"),
    _bad("offset_int64", lambda d: d.update(position_offset=d["position_offset"].long()),
         r"`position_offset` must be an int32 tensor of shape \(B,\) = \(4,\)"),
    _bad("offset_length", lambda d: d.update(position_offset=d["position_offset"][:2]),
         "`position_offset` must be an int32 tensor"),
    _bad("offset_negative", _poke("position_offset", 2, -1),
         r"`position_offset\[2\]` = -1 puts row 0 of segment 2 at a negative position"),
    _bad("position_past_table", lambda d: d.update(cos=d["cos"][:9], sin=d["sin"][:9]),
         "`cos`/`sin` hold 9 positions, but row 2 of segment 0 sits at position"),
    _bad("ratio_zero", _set(ratio=0), "`ratio` must be an int >= 1"),
    _bad("kv_rank", lambda d: d.update(kv=d["kv"][0]), "`kv` must be 2-D"),
    _bad("ape_shape", lambda d: d.update(ape=d["ape"][:2]), r"`ape` must have shape"),
    _bad("cuc_rows", _poke("cu_seqlens_comp", 1, 2), "`cu_seqlens_comp` must count len"),
    _bad("total_comp_small", _set(total_comp=1), "`total_comp` = 1 is smaller than the true"),
]


@pytest.mark.parametrize("mutate,match,error", BAD_INPUTS)
def test_bad_input_raises(mutate, match, error):
    inputs = make_inputs(CASES[0])
    mutate(inputs)
    with pytest.raises(error, match=rf"csa\.compressor_epilogue: {match}"):
        FORWARD(*positional(inputs))


@pytest.mark.parametrize("mutate,match,error", [p for p in BAD_INPUTS if p.id in (
    "weight_shape", "rope_odd", "cos_width", "rotate_not_pow2", "offset_length")])
def test_fake_raises_like_the_kernel(mutate, match, error):
    inputs = make_inputs(CASES[0])
    mutate(inputs)
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                for a in positional(inputs)]
        with pytest.raises(error, match=match):
            FORWARD(*args)


def test_backward_errors_name_the_backward_op():
    inputs = make_inputs(CASES[0])
    args = positional(inputs)[:-1]
    with pytest.raises(ValueError, match=r"compressor_epilogue_backward: `grad_out` must be 2-D"):
        BACKWARD(torch.zeros(8, 64).bfloat16(), *args)
    few = CASES[0].spec.true_rows - 1
    with pytest.raises(ValueError, match="compressor_epilogue_backward: `grad_out` row count"):
        BACKWARD(torch.zeros(few, 128).bfloat16(), *args)


def test_double_backward_is_refused():
    inputs = make_inputs(CASES[1], requires_grad=True)
    out = FORWARD(*positional(inputs))
    grads = torch.autograd.grad(out, inputs["kv"], torch.ones_like(out), create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        grads[0].sum().backward()


def test_public_wrapper_is_the_op_with_the_model_eps():
    inputs = make_inputs(CASES[2])
    want = FORWARD(*positional(inputs))
    del inputs["eps"]  # the wrapper's default, the model's 1e-6
    assert_bitwise_equal(epilogue.compressor_epilogue(**inputs), want, "wrapper")
