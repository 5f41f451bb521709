"""CUDA graphs with a static row capacity, streams, and capture safety (H200)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from helpers import train_block

import csa_ops
from csa_ops import offsets_for, reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DTYPE = torch.bfloat16
HEAD_DIM, RATIO, COFF = 128, 4, 2
TOKEN_CAPACITY, ROW_CAPACITY = 4096, 1100


def _pack(lengths, seed):
    """Inputs sized to the static capacities; only the offsets' contents say what is real."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    width = COFF * HEAD_DIM
    kv = torch.randn(TOKEN_CAPACITY, width, device="cuda", dtype=DTYPE, generator=generator)
    score = torch.randn(TOKEN_CAPACITY, width, device="cuda", dtype=DTYPE, generator=generator)
    grad_out = torch.randn(ROW_CAPACITY, HEAD_DIM, device="cuda", dtype=DTYPE,
                           generator=generator)
    cu, cuc = offsets_for(lengths, RATIO, "cuda")
    return kv, score, grad_out, cu, cuc


def _step(kv, score, ape, cu, cuc, grad_out):
    out = torch.ops.csa.compressor(kv, score, ape, cu, cuc, RATIO, COFF, ROW_CAPACITY)
    grads = torch.ops.csa.compressor_backward(grad_out, kv, score, ape, cu, cuc, RATIO, COFF)
    return (out, *grads)


def _assert_padding_conventions(out, grad_kv, grad_score, cu, cuc):
    true_rows, true_tokens = int(cuc[-1]), int(cu[-1])
    assert torch.count_nonzero(out[true_rows:]) == 0
    assert torch.count_nonzero(grad_kv[true_tokens:]) == 0
    assert torch.count_nonzero(grad_score[true_tokens:]) == 0


PACKS = [[1000, 3, 2047, 517], [4000], [17, 0, 1, 2500, 64], [0]]


def test_manual_graph_replays_match_eager_bitwise():
    ape = torch.randn(RATIO, COFF * HEAD_DIM, device="cuda")
    static = list(_pack(PACKS[0], seed=0))
    # Offsets of different lengths cannot share one static buffer: pad B with empty segments.
    max_segments = max(len(p) for p in PACKS)

    def padded_offsets(lengths):
        return offsets_for(list(lengths) + [0] * (max_segments - len(lengths)), RATIO, "cuda")

    static[3], static[4] = padded_offsets(PACKS[0])
    kv, score, grad_out, cu, cuc = static
    _step(kv, score, ape, cu, cuc, grad_out)  # warm-up compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _step(kv, score, ape, cu, cuc, grad_out)
    for seed, lengths in enumerate(PACKS * 2):
        fresh_kv, fresh_score, fresh_grad, _, _ = _pack(lengths, seed=seed + 1)
        fresh_cu, fresh_cuc = padded_offsets(lengths)
        for buffer, value in zip(static, (fresh_kv, fresh_score, fresh_grad, fresh_cu, fresh_cuc)):
            buffer.copy_(value)
        graph.replay()
        expected = _step(kv, score, ape, cu, cuc, grad_out)
        for got, want in zip(captured, expected):
            assert torch.equal(got, want)
        _assert_padding_conventions(captured[0], captured[1], captured[2], cu, cuc)
        ref_out = reference.compressor_reference(kv, score, ape, cu, cuc, RATIO, COFF,
                                                 ROW_CAPACITY)
        torch.testing.assert_close(captured[0], ref_out, atol=1e-2, rtol=1e-2)


def test_static_capacity_never_synchronizes():
    kv, score, grad_out, cu, cuc = _pack(PACKS[0], seed=3)
    ape = torch.randn(RATIO, COFF * HEAD_DIM, device="cuda")
    _step(kv, score, ape, cu, cuc, grad_out)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(kv, score, ape, cu, cuc, grad_out)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_first_call_under_capture_asks_for_precompile():
    # A configuration nothing has compiled yet in this process.
    ratio, coff, head_dim = 3, 1, 40
    kv = torch.randn(64, coff * head_dim, device="cuda", dtype=torch.float16)
    ape = torch.randn(ratio, coff * head_dim, device="cuda")
    cu, cuc = offsets_for([64], ratio, "cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="precompile"), torch.cuda.graph(graph):
        torch.ops.csa.compressor(kv, kv, ape, cu, cuc, ratio, coff, 21)
    csa_ops.precompile(ratio, head_dim, coff, dtype=torch.float16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.csa.compressor(kv, kv, ape, cu, cuc, ratio, coff, 21)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.ops.csa.compressor(kv, kv, ape, cu, cuc, ratio, coff, 21))


def test_side_stream_runs_on_the_callers_stream():
    kv, score, grad_out, cu, cuc = _pack(PACKS[2], seed=4)
    ape = torch.randn(RATIO, COFF * HEAD_DIM, device="cuda")
    expected = _step(kv, score, ape, cu, cuc, grad_out)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = _step(kv, score, ape, cu, cuc, grad_out)
    torch.cuda.current_stream().wait_stream(side)
    for tensor in got:
        tensor.record_stream(torch.cuda.current_stream())
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def _relative_error(got, want):
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def _reduce_overhead_steps(train: bool):
    """Several steps of the Compressor block under reduce-overhead with changing packs,
    each checked against an eager copy of the block (outputs and, in training, every
    parameter gradient)."""
    torch._dynamo.reset()
    block = csa_ops.Compressor(256, HEAD_DIM, RATIO, COFF, device="cuda", dtype=DTYPE)
    eager = copy.deepcopy(block)
    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    from torch._dynamo.utils import counters

    counters.clear()
    # A fixed random projection as the loss: mean(out**2) would be degenerate, since the
    # RMSNorm rows have (nearly) constant norm and its true gradient is rounding noise.
    probe = torch.randn(ROW_CAPACITY, HEAD_DIM, device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(7))
    max_segments = 5
    for lengths in PACKS * 2:
        padded = list(lengths) + [0] * (max_segments - len(lengths))
        cu, cuc = offsets_for(padded, RATIO, "cuda")
        x = torch.randn(TOKEN_CAPACITY, 256, device="cuda", dtype=DTYPE)
        with torch.set_grad_enabled(train):
            torch.compiler.cudagraph_mark_step_begin()
            out = compiled(x, cu, cuc, ROW_CAPACITY)
            if train:
                # Gradients are outputs of the backward graph, whose memory the next replay
                # reuses: a training loop drops them (set_to_none) before each backward,
                # never accumulates into them, and copies what it keeps.
                block.zero_grad(set_to_none=True)
                (out.float() * probe).sum().backward()
                grads = [p.grad.clone() for p in block.parameters()]
            out = out.detach().clone()
            expected = eager(x, cu, cuc, ROW_CAPACITY)
            if train:
                eager.zero_grad(set_to_none=True)
                (expected.float() * probe).sum().backward()
        torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
        assert torch.count_nonzero(out[int(cuc[-1]):]) == 0
        if train:
            for got, param in zip(grads, eager.parameters()):
                assert _relative_error(got, param.grad) < 2e-2
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert counters["stats"]["unique_graphs"] <= 1


def test_reduce_overhead_inference_replays_without_recompiles():
    _reduce_overhead_steps(train=False)


def test_reduce_overhead_training_replays_without_recompiles():
    _reduce_overhead_steps(train=True)


def test_bf16_converted_block_trains_under_reduce_overhead():
    """After model.to(torch.bfloat16) (ape bf16 too), training steps under reduce-overhead
    replay without skips and follow an eager copy of the block."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    torch.manual_seed(0)
    block = csa_ops.Compressor(256, HEAD_DIM, RATIO, COFF, device="cuda").to(torch.bfloat16)
    assert block.ape.dtype == torch.bfloat16
    eager = copy.deepcopy(block)
    cu, cuc = offsets_for(PACKS[0], RATIO, "cuda")
    x = torch.randn(TOKEN_CAPACITY, 256, device="cuda", dtype=torch.bfloat16)
    counters.clear()
    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    losses, params = train_block(block, compiled, x, cu, cuc, ROW_CAPACITY, steps=4)
    assert block.ape.grad.dtype == torch.bfloat16
    assert counters["inductor"]["cudagraph_skips"] == 0
    eager_losses, eager_params = train_block(eager, eager, x, cu, cuc, ROW_CAPACITY, steps=4)
    torch.testing.assert_close(losses, eager_losses, rtol=2e-2, atol=2e-2)
    # Compiled RMSNorm and linears round differently from eager's in bf16, and SGD carries
    # those last bits through four steps: compare each parameter as a whole.
    for name, value in params.items():
        assert _relative_error(value, eager_params[name]) < 2e-2, name


def test_concurrent_first_calls_compile_once():
    ratio, coff, head_dim = 5, 2, 24
    kv = torch.randn(200, coff * head_dim, device="cuda", dtype=torch.float16)
    ape = torch.randn(ratio, coff * head_dim, device="cuda")
    cu, cuc = offsets_for([120, 80], ratio, "cuda")
    expected = reference.compressor_reference(kv, kv, ape, cu, cuc, ratio, coff, 40)
    from csa_ops import host

    misses_before = host.cache_info()["misses"]
    results, errors = [], []

    def worker():
        try:
            results.append(torch.ops.csa.compressor(kv, kv, ape, cu, cuc, ratio, coff, 40))
        except Exception as error:  # noqa: BLE001  (surfaced below)
            errors.append(error)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert host.cache_info()["misses"] - misses_before == 1  # one forward compile for 6 threads
    for out in results:
        torch.testing.assert_close(out, expected, atol=1e-3, rtol=1e-3)
        assert torch.equal(out, results[0])


def test_launch_stream_is_the_callers_current_stream():
    from csa_ops.launch_description import current_stream_handle

    index = torch.cuda.current_device()
    assert current_stream_handle(index) == torch.cuda.current_stream().cuda_stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert current_stream_handle(index) == side.cuda_stream != 0
