"""torch.library contracts of csa::compressor and csa::compressor_backward: opcheck over
the pack matrix, pinned schemas and tags, torch.export of a module that calls the op."""

from __future__ import annotations

import expecttest
import pytest
import torch
from helpers import MATRIX, PackSpec, eager_region, make_pack, spec_params
from torch.library import opcheck

import csa_ops

FORWARD = torch.ops.csa.compressor.default
BACKWARD = torch.ops.csa.compressor_backward.default

# Degenerate packs: B=0, zero tokens, tokens but no complete block, all-empty segments.
EDGES = (
    PackSpec((), ratio=4, coff=2, head_dim=3, extra_rows=2),
    PackSpec((0, 0), ratio=2, coff=1, head_dim=5, extra_rows=1),
    PackSpec((3, 1), ratio=4, coff=2, head_dim=2, extra_tokens=2),
)


@pytest.mark.parametrize("spec", spec_params(MATRIX + EDGES))
@pytest.mark.parametrize("total_comp", ["capacity", None], ids=["static", "true_count"])
def test_opcheck_forward_with_grad(spec, total_comp):
    pack = make_pack(spec)
    kv, score, ape = pack.leaves()
    args = (kv, score, ape, *pack.args(total_comp)[3:])
    opcheck(FORWARD, args)


@pytest.mark.parametrize("spec", spec_params(MATRIX[1::3] + EDGES[:1]))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=["bf16", "fp64"])
def test_opcheck_forward_without_grad(spec, dtype):
    opcheck(FORWARD, make_pack(spec, dtype).args())


@pytest.mark.parametrize("spec", spec_params(MATRIX + EDGES))
def test_opcheck_backward(spec):
    pack = make_pack(spec, torch.bfloat16 if spec.coff == 2 else torch.float32)
    opcheck(BACKWARD, (pack.grad_out(), *pack.args()[:-1]))


@pytest.mark.parametrize("dtype, ape_dtype", [
    pytest.param(torch.bfloat16, torch.bfloat16, id="bf16_ape_bf16"),
    pytest.param(torch.float32, torch.float16, id="fp32_ape_fp16"),
    pytest.param(torch.float64, torch.bfloat16, id="fp64_ape_bf16"),
])
@pytest.mark.parametrize("total_comp", ["capacity", None], ids=["static", "true_count"])
def test_opcheck_low_precision_ape(dtype, ape_dtype, total_comp):
    """A model cast with .to(torch.bfloat16) hands the op a bf16 ape: the fakes, autograd
    and both ops agree on grad_ape in ape's dtype."""
    pack = make_pack(MATRIX[6], dtype, ape_dtype=ape_dtype)
    opcheck(FORWARD, (*pack.leaves(), *pack.args(total_comp)[3:]))
    opcheck(BACKWARD, (pack.grad_out(), *pack.args()[:-1]))


def test_opcheck_forward_with_non_contiguous_inputs():
    pack = make_pack(MATRIX[2])
    kv = pack.kv.t().contiguous().t().requires_grad_(True)
    score = torch.cat([pack.score, pack.score], dim=1)[:, ::2].requires_grad_(True)
    opcheck(FORWARD, (kv, score, pack.ape, *pack.args()[3:]))


class CompressorModel(torch.nn.Module):
    """Linear projections, the op at a static capacity, a residual-style scale."""

    def __init__(self, dim, head_dim, ratio, coff, capacity):
        super().__init__()
        self.ratio, self.coff, self.capacity = ratio, coff, capacity
        self.wkv = torch.nn.Linear(dim, coff * head_dim, bias=False)
        self.wgate = torch.nn.Linear(dim, coff * head_dim, bias=False)
        self.ape = torch.nn.Parameter(torch.randn(ratio, coff * head_dim))

    def forward(self, x, cu_seqlens, cu_seqlens_comp):
        pooled = csa_ops.compressor(self.wkv(x), self.wgate(x), self.ape, cu_seqlens,
                                    cu_seqlens_comp, ratio=self.ratio, coff=self.coff,
                                    total_comp=self.capacity)
        return pooled * 2.0


def _count_op(graph_module, op) -> int:
    return sum(1 for node in graph_module.graph.nodes if node.target is op)


@pytest.mark.parametrize("coff", [1, 2])
def test_export_module_with_static_capacity(coff):
    torch.manual_seed(0)
    lengths, ratio = (13, 0, 6), 4
    cu, cuc = csa_ops.offsets_for(lengths, ratio)
    model = CompressorModel(dim=16, head_dim=8, ratio=ratio, coff=coff, capacity=6).eval()
    x = torch.randn(21, 16)
    exported = torch.export.export(model, (x, cu, cuc))
    assert _count_op(exported.graph_module, FORWARD) == 1
    with torch.no_grad():
        expected = model(x, cu, cuc)
        assert torch.equal(exported.module()(x, cu, cuc), expected)
        # The exported program is not tied to the example's offsets.
        cu2, cuc2 = csa_ops.offsets_for((4, 9, 8), ratio)
        assert torch.equal(exported.module()(x, cu2, cuc2), model(x, cu2, cuc2))
    independent = eager_region(model.wkv(x), model.wgate(x), model.ape, cu, cuc, ratio, coff,
                               6) * 2.0
    torch.testing.assert_close(expected, independent.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokens", [
    pytest.param(torch.export.Dim.DYNAMIC, id="dim_dynamic"),
    pytest.param(torch.export.Dim("tokens", min=2, max=2**20), id="dim_bounded"),
    # Unbounded: the int32-offset checks must not guard on a symbolic token count.
    pytest.param(torch.export.Dim("tokens"), id="dim_unbounded"),
])
def test_export_with_dynamic_token_count(tokens):
    torch.manual_seed(0)
    ratio, coff = 2, 2
    model = CompressorModel(dim=8, head_dim=4, ratio=ratio, coff=coff, capacity=16).eval()
    cu, cuc = csa_ops.offsets_for((7, 5), ratio)
    exported = torch.export.export(model, (torch.randn(12, 8), cu, cuc),
                                   dynamic_shapes=({0: tokens}, None, None))
    cu2, cuc2 = csa_ops.offsets_for((20, 11), ratio)  # B is static: same segment count
    x2 = torch.randn(35, 8)
    with torch.no_grad():
        assert torch.equal(exported.module()(x2, cu2, cuc2), model(x2, cu2, cuc2))


@pytest.mark.parametrize("total_comp", [6, None], ids=["capacity", "true_count"])
def test_export_compressor_module(total_comp):
    torch.manual_seed(0)
    model = csa_ops.Compressor(dim=16, head_dim=8, ratio=4, coff=2).eval()
    cu, cuc = csa_ops.offsets_for((13, 0, 6), 4)
    x = torch.randn(21, 16)
    args = (x, cu, cuc) if total_comp is None else (x, cu, cuc, total_comp)
    exported = torch.export.export(model, args)
    assert _count_op(exported.graph_module, FORWARD) == 1
    # Same shapes, different offsets: with None the row count follows the data (4 -> 5).
    cu2, cuc2 = csa_ops.offsets_for((8, 4, 9), 4)
    with torch.no_grad():
        for offsets in ((cu, cuc), (cu2, cuc2)):
            call = (x, *offsets) + args[3:]
            assert torch.equal(exported.module()(*call), model(*call))


class TestSchemas(expecttest.TestCase):
    def test_forward_schema(self):
        self.assertExpectedInline(str(FORWARD._schema), """\
csa::compressor(Tensor kv, Tensor score, Tensor ape, Tensor cu_seqlens, Tensor cu_seqlens_comp, int ratio, int coff, SymInt? total_comp=None) -> Tensor""")

    def test_backward_schema(self):
        self.assertExpectedInline(str(BACKWARD._schema), """\
csa::compressor_backward(Tensor grad_out, Tensor kv, Tensor score, Tensor ape, Tensor cu_seqlens, Tensor cu_seqlens_comp, int ratio, int coff) -> (Tensor, Tensor, Tensor)""")

    def test_tags(self):
        lines = [f"{op}: {', '.join(sorted(str(tag) for tag in op.tags))}"
                 for op in (FORWARD, BACKWARD)]
        self.assertExpectedInline("\n".join(lines), """\
csa.compressor.default: Tag.needs_contiguous_strides, Tag.pt2_compliant_tag
csa.compressor_backward.default: Tag.needs_contiguous_strides, Tag.pt2_compliant_tag""")


class _Recorder:
    """Stands in for an op and its CUDA kernel: records which route a call took."""

    def __init__(self):
        self.routes = []

    def kernel(self, *args):
        self.routes.append("kernel")
        return args

    def redispatch(self, keyset, *args):
        self.routes.append(("dispatcher", keyset))
        return args


_KEY = torch._C.DispatchKey


@pytest.mark.parametrize("keys, route", [
    ((_KEY.CUDA,), "kernel"),
    ((_KEY.CUDA, _KEY.ADInplaceOrView), "kernel"),
    ((_KEY.CPU,), "dispatcher"),
    ((_KEY.CUDA, _KEY.Python), "dispatcher"),       # fake tensors, __torch_dispatch__ modes
    ((_KEY.CUDA, _KEY.Functionalize), "dispatcher"),  # torch.compile's functional tracing
    ((_KEY.Meta,), "dispatcher"),
])
def test_below_autograd_takes_the_short_route_only_for_plain_cuda(keys, route):
    from csa_ops import dispatch

    keyset = torch._C.DispatchKeySet(keys[0])
    for key in keys[1:]:
        keyset = keyset.add(key)
    keyset = keyset.add(_KEY.AutogradCUDA)  # the key this kernel sits at: masked off
    recorder = _Recorder()
    assert dispatch.below_autograd(recorder, recorder.kernel, keyset, (1, 2)) == (1, 2)
    taken = recorder.routes[0] if recorder.routes[0] == "kernel" else recorder.routes[0][0]
    assert taken == route
    if route == "dispatcher":  # the dispatcher gets the keys below autograd, unchanged
        below = recorder.routes[0][1]
        assert not below.has(_KEY.AutogradCUDA)
        assert all(below.has(key) for key in keys)


def test_autograd_kernel_gets_the_key_set_the_short_route_expects():
    """torch hands the Autograd kernel of plain CPU tensors {CPU} (no fallthrough keys): the
    CUDA analogue is what dispatch.below_autograd recognizes as plain."""
    from csa_ops import dispatch

    seen = []
    original = dispatch.below_autograd

    def spy(op, kernel, keyset, args):
        seen.append(keyset)
        return original(op, kernel, keyset, args)

    spec = PackSpec(lengths=(8,), ratio=4, coff=2, head_dim=4)
    pack = make_pack(spec, dtype=torch.float32, device="cpu")
    dispatch.below_autograd = spy
    try:
        torch.ops.csa.compressor(*pack.tensors(), spec.ratio, spec.coff, None)
    finally:
        dispatch.below_autograd = original
    below = seen[0] & torch._C._after_autograd_keyset
    cpu = torch._C.DispatchKeySet(_KEY.CPU)
    assert below.raw_repr() in (cpu.raw_repr(), cpu.add(_KEY.ADInplaceOrView).raw_repr())


def test_prepared_calls_are_bounded_and_keyed_by_metadata():
    from csa_ops import dispatch

    a, b = torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float64)
    assert dispatch.signature((a, a), 4, 2) == dispatch.signature((a.clone(), a + 1), 4, 2)
    assert dispatch.signature((a, a), 4, 2) != dispatch.signature((a, b), 4, 2)
    assert dispatch.signature((a, a), 4, 2) != dispatch.signature((a, a), 4, 1)
    assert dispatch.signature((a, [a]), 4) is None  # not a tensor: no memo, full checks
    memo = dispatch.PreparedCalls(limit=2)
    calls = [memo.remember(("sig", i), lambda i=i: i) for i in range(3)]
    assert [call() for call in calls] == [0, 1, 2]
    assert list(memo) == [("sig", 2)]  # cleared on reaching the limit, then remembered
    assert memo.remember(None, calls[0]) is calls[0] and len(memo) == 1
