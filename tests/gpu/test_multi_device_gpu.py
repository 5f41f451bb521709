"""Launches on any device: tensors on one GPU while another is current. Both ops and
csa::compressor_extend run on the tensors' device and its current stream, bitwise equal to
the same call on the first GPU; the kernel cache and the native launch path serve both
devices in turn; tensors on two devices are an error naming the argument. Needs two GPUs
(skipped otherwise)."""

from __future__ import annotations

import pytest
import torch
from helpers import PackSpec, assert_bitwise_equal, make_pack

from csa_ops import CompressorState

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                reason="needs two CUDA devices or more")

# (ratio, coff, head_dim): both kernel families.
CONFIGS = [(4, 2, 128), (128, 1, 128)]


def _pack(ratio, coff, head_dim, device):
    spec = PackSpec((3 * ratio + 1, 0, 5 * ratio), ratio, coff, head_dim, extra_rows=2)
    return make_pack(spec, torch.bfloat16, device=device, seed=1), spec


def _forward_backward(pack, spec, ratio, coff):
    """The op's rows and gradients, launched on the pack's device's current stream."""
    out = torch.ops.csa.compressor(*pack.tensors(), ratio, coff, spec.capacity)
    grad_out = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out).to(out.dtype)
    grads = torch.ops.csa.compressor_backward(grad_out, *pack.tensors(), ratio, coff)
    return out, *grads


@pytest.mark.parametrize("ratio,coff,head_dim", CONFIGS)
@pytest.mark.parametrize("current", [0, 1])
def test_ops_run_on_the_tensors_device(ratio, coff, head_dim, current):
    """With the other GPU current, and on a side stream of the tensors' GPU: the outputs
    live there and equal the call on the first GPU bitwise, twice in a row (the second
    through the prepared, native call)."""
    reference, spec = _pack(ratio, coff, head_dim, "cuda:0")
    want = _forward_backward(reference, spec, ratio, coff)
    pack, _ = _pack(ratio, coff, head_dim, "cuda:1")
    side = torch.cuda.Stream(device="cuda:1")
    with torch.cuda.device(current):
        for _ in range(2):
            side.wait_stream(torch.cuda.current_stream("cuda:1"))
            with torch.cuda.stream(side):
                got = _forward_backward(pack, spec, ratio, coff)
            torch.cuda.current_stream("cuda:1").wait_stream(side)
            for name, a, e in zip(("out", "grad_kv", "grad_score", "grad_ape"), got, want):
                assert a.device == torch.device("cuda:1"), name
                assert_bitwise_equal(a.cpu(), e.cpu(), name)


@pytest.mark.parametrize("ratio,coff,head_dim", CONFIGS)
def test_the_kernel_cache_serves_both_devices_in_turn(ratio, coff, head_dim):
    """One signature, devices alternating: each call right on its own device (a kernel
    loaded for one context, or a prepared call remembering one device, would fail)."""
    packs = [_pack(ratio, coff, head_dim, f"cuda:{i}") for i in (0, 1)]
    first = [t.cpu() for t in _forward_backward(*packs[0], ratio, coff)]
    for i in (1, 0, 1, 0):
        got = _forward_backward(*packs[i], ratio, coff)
        for a, e in zip(got, first):
            assert a.device == torch.device(f"cuda:{i}")
            assert_bitwise_equal(a.cpu(), e, f"device {i}")


@pytest.mark.parametrize("ratio,coff", [(4, 2), (128, 1)])
def test_extend_runs_on_the_state_device(ratio, coff):
    """A serving step on the second GPU while the first is current: rows, offsets and state
    equal the same step on the first GPU bitwise."""
    head_dim, batch = 128, 3
    results = []
    for device in ("cuda:0", "cuda:1"):
        gen = torch.Generator().manual_seed(5)
        state = CompressorState(4, ratio, coff, head_dim, torch.bfloat16, device)
        tokens = 2 * ratio + 3
        kv, score = (torch.randn(tokens, coff * head_dim, generator=gen).bfloat16().to(device)
                     for _ in range(2))
        ape = torch.randn(ratio, coff * head_dim, generator=gen).to(device)
        cu = torch.tensor([0, ratio, ratio + 3, tokens], dtype=torch.int32, device=device)
        start = torch.tensor([0, ratio - 1, 5], dtype=torch.int32, device=device)
        slots = torch.tensor([2, 0, 3], dtype=torch.int32, device=device)
        with torch.cuda.device(0):
            out, cuc = state.extend(kv, score, ape, cu, start, slots, total_comp=batch + 4)
        results.append([t.cpu() for t in (out, cuc, state.kv, state.score)])
        assert out.device == torch.device(device)
    for name, a, e in zip(("rows", "cu_seqlens_comp", "kv_state", "score_state"), *results):
        assert_bitwise_equal(a, e, name)


def test_tensors_on_two_devices_are_an_error():
    pack, spec = _pack(4, 2, 128, "cuda:0")
    score = pack.score.to("cuda:1")
    with pytest.raises(ValueError, match="`score` must be on the device of `kv`"):
        torch.ops.csa.compressor(pack.kv, score, *pack.tensors()[2:], 4, 2, spec.capacity)
