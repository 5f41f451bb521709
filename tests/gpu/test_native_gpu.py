"""The native launch path (csa_ops.native) on CUDA: the ops' prepared calls are C++ objects,
their results are bitwise those of the Python path (same kernels, arguments and
allocations) in both directions and both kernel families, with any ape dtype and with
misaligned views, and they capture in CUDA graphs. The session's conftest provides the
library (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import PackSpec, assert_bitwise_equal, make_pack

from csa_ops import host, native, ops
from csa_ops.state import STATE

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CASES = [
    pytest.param(PackSpec((1000, 0, 3, 517, 2049), 4, 2, 128, extra_tokens=9, extra_rows=5),
                 torch.bfloat16, torch.float32, id="window_r4c2_d128"),
    pytest.param(PackSpec((1000, 0, 3, 517, 2049), 4, 2, 128, extra_rows=5),
                 torch.bfloat16, torch.bfloat16, id="window_r4c2_d128_ape_bf16"),
    pytest.param(PackSpec((513, 4, 0), 4, 1, 256, extra_rows=7), torch.float16, torch.float16,
                 id="window_r4c1_d256_fp16"),
    pytest.param(PackSpec((4096, 130, 0, 2000), 128, 1, 512, extra_tokens=7, extra_rows=3),
                 torch.bfloat16, torch.float32, id="streaming_r128c1_d512"),
]


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """The same values in a view that starts one element into its allocation."""
    flat = torch.cat([t.new_zeros(1), t.flatten()])
    return flat[1:].view(t.shape)


def _op_calls(pack, grad_out):
    out = torch.ops.csa.compressor(*pack.args())
    grads = torch.ops.csa.compressor_backward(grad_out, *pack.args()[:-1])
    return (out, *grads)


@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("spec, dtype, ape_dtype", CASES)
def test_native_calls_match_the_python_path_bitwise(spec, dtype, ape_dtype, misaligned):
    assert native.module() is not None, "the session has no native library"
    pack = make_pack(spec, dtype, device="cuda", ape_dtype=ape_dtype)
    if misaligned:
        pack.kv, pack.score = _misaligned(pack.kv), _misaligned(pack.score)
    grad_out = pack.grad_out()
    STATE.forget_calls()
    for direction, tensors, scalars in (
            ("fwd", pack.tensors(), (spec.ratio, spec.coff, spec.capacity)),
            ("bwd", (grad_out, *pack.tensors()), (spec.ratio, spec.coff, None))):
        call = host.prepare(direction, tensors, *scalars)
        assert type(call).__name__ == "PreparedCall", direction
    fast = _op_calls(pack, grad_out)
    assert len(ops._PREPARED.table) >= 2  # the second call of each signature is a table hit
    for op in ("compressor", "compressor_backward"):  # served by the C++ Autograd kernels
        assert "AutogradCUDA: registered at" in torch._C._dispatch_dump(f"csa::{op}")
    assert all(torch.equal(a, b) for a, b in zip(_op_calls(pack, grad_out), fast))
    with host.python_launch_path():
        assert type(host.prepare("fwd", pack.tensors(), spec.ratio, spec.coff,
                                 spec.capacity)).__name__ == "function"
        slow = _op_calls(pack, grad_out)
    for name, a, b in zip(("out", "grad_kv", "grad_score", "grad_ape"), fast, slow):
        assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous(), name
        assert_bitwise_equal(a, b, name)
    assert fast[3].dtype == ape_dtype


def test_native_calls_capture_in_a_cuda_graph():
    spec = PackSpec((1000, 3, 517), 4, 2, 128, extra_rows=5)
    pack = make_pack(spec, torch.bfloat16, device="cuda")
    grad_out = pack.grad_out()
    STATE.forget_calls()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _op_calls(pack, grad_out)  # prepares the calls outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    assert len(ops._PREPARED.table) >= 2  # the captured calls are native ones
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _op_calls(pack, grad_out)
    fresh = make_pack(spec, torch.bfloat16, device="cuda", seed=5)
    for static, new in zip(pack.tensors()[:3], fresh.tensors()[:3]):
        static.copy_(new)
    graph.replay()
    expected = _op_calls(fresh, grad_out)
    for name, a, b in zip(("out", "grad_kv", "grad_score", "grad_ape"), captured, expected):
        assert_bitwise_equal(a, b, name)
