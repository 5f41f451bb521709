"""Register-window CuTe-DSL kernels against torch's eager region on the same GPU.

grad_kv / grad_score must match torch's eager autograd of the formula bit for bit (the
reference mirrors torch's CPU operation order, which differs from its CUDA one in rare last
bits), the forward the eager region within one output rounding step
(bit for bit on its exact path: fp16, fp32 and the fast_exp=0 knob), every output element
must be written (outputs are poisoned with NaN first), and nothing may depend on the run.
Calls csa_ops.host directly so a failure names the kernel, not the op.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    PackSpec,
    assert_bitwise_equal,
    assert_within_one_step,
    cancel_near_threshold,
    eager_forward_backward,
    eager_region,
    make_pack,
    spec_params,
)

from csa_ops import host, reference
from csa_ops.config import Direction, with_knobs
from csa_ops.kernels.window.plan import WINDOW_MAX

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Ragged packs: empty segments, segments shorter than ratio, tails, spare rows (padding) and
# spare tokens (token capacity), odd and tiny head dims, every ratio/coff of the family.
PACKS = (
    PackSpec((3, 0, 5), ratio=1, coff=1, head_dim=7, extra_tokens=2, extra_rows=2),
    PackSpec((4, 1, 0, 2), ratio=1, coff=2, head_dim=1, extra_rows=1),
    PackSpec((5, 0, 1, 8), ratio=2, coff=2, head_dim=65, extra_tokens=3, extra_rows=1),
    PackSpec((7, 2, 0, 9, 301), ratio=3, coff=1, head_dim=128, extra_rows=3),
    PackSpec((11, 2, 6, 130), ratio=3, coff=2, head_dim=96, extra_tokens=1),
    PackSpec((9, 3, 0, 16, 1000, 37), ratio=4, coff=2, head_dim=128, extra_tokens=4,
             extra_rows=2),
    PackSpec((13, 4, 0, 257), ratio=4, coff=1, head_dim=512, extra_tokens=2),
    PackSpec((35, 15, 0, 16, 77), ratio=8, coff=2, head_dim=64, extra_rows=1),
    PackSpec((50, 0, 16, 9, 100), ratio=16, coff=2, head_dim=7, extra_tokens=5, extra_rows=2),
    PackSpec((70, 31, 64), ratio=32, coff=1, head_dim=130, extra_rows=1),
    PackSpec((4096,), ratio=4, coff=2, head_dim=512),
)
ACTIVE = [s for s in PACKS if s.ratio * s.coff <= WINDOW_MAX]


def _poison_allocator(nbytes: int = 1 << 26) -> None:
    # The caching allocator hands this NaN-filled block to the kernels' torch.empty outputs,
    # so an element the kernels never write shows up as NaN.
    block = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    block.view(torch.float16).fill_(float("nan"))
    del block


def _pack(spec, dtype, seed=0):
    return make_pack(spec, dtype=dtype, device="cuda", seed=seed)


def _grad_out(spec, dtype, seed=1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(spec.capacity, spec.head_dim, device="cuda", generator=gen).to(dtype)


def _run(pack, grad_out):
    spec = pack.spec
    args = (*pack.tensors(), spec.ratio, spec.coff)
    assert host.supports(*args)
    _poison_allocator()
    out = host.run_forward(*args, spec.capacity)
    _poison_allocator()
    grads = host.run_backward(grad_out, *args)
    return (out, *grads)


def _reference_grads(pack, grad_out):
    """(grad_kv, grad_score) of torch's eager autograd, grad_ape of the fp32 reference."""
    _, gkv, gs, _ = eager_forward_backward(pack, grad_out, total_comp=grad_out.shape[0])
    _, _, gape = reference.compressor_backward_reference(grad_out, *pack.tensors(),
                                                         pack.spec.ratio, pack.spec.coff)
    return gkv, gs, gape


def _forward_key(spec, dtype):
    return host.select_key(spec.ratio, spec.coff, spec.head_dim, str(dtype).split(".")[-1],
                           host.device_arch(), Direction.FORWARD)


def _forward_like_reference(out, ref, spec, what):
    """Bitwise on the exact forward path; on the fast one (bf16) within one rounding step
    with NaN and infinities (signs included) where the reference has them."""
    if not _forward_key(spec, out.dtype).knobs.fast_exp:
        assert_bitwise_equal(out, ref, what)
        return
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), what
    assert torch.equal(out[torch.isinf(ref)], ref[torch.isinf(ref)]), what
    assert_within_one_step(out[finite], ref[finite], what, max_fraction=1e-3)


CASES = [pytest.param(s, torch.bfloat16, id=f"{p.id}-bf16")
         for s, p in zip(ACTIVE, spec_params(ACTIVE))]
CASES += [pytest.param(ACTIVE[i], dt, id=f"{spec_params(ACTIVE)[i].id}-{str(dt)[6:]}")
          for i in (0, 2, 5, 8) for dt in (torch.float16, torch.float32)]


@pytest.mark.parametrize(("spec", "dtype"), CASES)
def test_matches_reference(spec, dtype):
    pack = _pack(spec, dtype)
    grad_out = _grad_out(spec, dtype)
    out, gkv, gs, gape = _run(pack, grad_out)
    ref_out = eager_region(*pack.args())
    rkv, rs, rape = _reference_grads(pack, grad_out)
    assert_within_one_step(out, ref_out, "forward", max_fraction=1e-3)
    assert_bitwise_equal(gkv, rkv, "grad_kv")
    assert_bitwise_equal(gs, rs, "grad_score")
    torch.testing.assert_close(gape, rape, atol=1e-3, rtol=1e-3)
    true_rows = spec.true_rows
    assert torch.count_nonzero(out[true_rows:]) == 0
    tokens = sum(spec.lengths)
    assert torch.count_nonzero(gkv[tokens:]) == 0 and torch.count_nonzero(gs[tokens:]) == 0


@pytest.mark.parametrize(("dtype", "fast"), ((torch.bfloat16, 1), (torch.bfloat16, 0),
                                             (torch.float16, 0)), ids=("bf16-fast",
                                                                       "bf16-exact", "fp16"))
def test_forward_paths_and_determinism(dtype, fast):
    # The exact path reproduces the reference bit for bit; the fast one (the bf16 default)
    # stays within one rounding step. Both, and all gradients, are bitwise run to run.
    spec = PackSpec((4096, 7, 0, 3000), ratio=4, coff=2, head_dim=128, extra_rows=5)
    pack = _pack(spec, dtype, seed=3)
    grad_out = _grad_out(spec, dtype, seed=4)
    default = _forward_key(spec, dtype)
    assert default.knobs.fast_exp == (dtype == torch.bfloat16)
    host.set_key(with_knobs(default, fast_exp=fast), Direction.FORWARD)
    try:
        first = _run(pack, grad_out)
        ref_out = eager_region(*pack.args())
        if fast:
            assert_within_one_step(first[0], ref_out, "forward", max_fraction=1e-3)
        else:
            assert_bitwise_equal(first[0], ref_out, "forward")
        for _ in range(3):
            again = _run(pack, grad_out)
            for a, b, name in zip(first, again, ("out", "grad_kv", "grad_score", "grad_ape")):
                assert_bitwise_equal(a, b, f"run-to-run {name}")
    finally:
        host.set_key(default, Direction.FORWARD)


@pytest.mark.parametrize("coff", (1, 2))
def test_nan_inf_like_reference(coff):
    spec = PackSpec((64, 5, 33), ratio=4, coff=coff, head_dim=64, extra_rows=1)
    pack = _pack(spec, torch.bfloat16, seed=5)
    pack.score[3, 0] = float("inf")
    pack.score[10, 1] = float("-inf")
    pack.score[20, 2] = float("nan")
    pack.kv[30, 3] = float("inf")
    pack.score[40:44, 4] = 80.0  # logits near fp32 exp overflow
    grad_out = _grad_out(spec, torch.bfloat16)
    grad_out[2, 5] = float("inf")
    out, gkv, gs, gape = _run(pack, grad_out)
    ref_out = eager_region(*pack.args())
    rkv, rs, rape = _reference_grads(pack, grad_out)
    _forward_like_reference(out, ref_out, spec, "forward")
    assert_bitwise_equal(gkv, rkv, "grad_kv")
    assert_bitwise_equal(gs, rs, "grad_score")
    assert torch.equal(torch.isnan(gape), torch.isnan(rape))
    assert torch.equal(torch.isinf(gape), torch.isinf(rape))


def test_misaligned_views_fall_back_to_copies():
    spec = PackSpec((40, 9), ratio=4, coff=2, head_dim=64)
    pack = _pack(spec, torch.bfloat16, seed=6)
    width = 2 * 64
    flat_kv = torch.empty(pack.kv.numel() + 1, dtype=pack.kv.dtype, device="cuda")
    flat_sc = torch.empty_like(flat_kv)
    kv = flat_kv[1:].view(-1, width)
    score = flat_sc[1:].view(-1, width)
    kv.copy_(pack.kv)
    score.copy_(pack.score)
    assert kv.data_ptr() % 16 != 0
    grad_out = _grad_out(spec, torch.bfloat16)
    args = (kv, score, pack.ape, pack.cu_seqlens, pack.cu_seqlens_comp, 4, 2)
    out = host.run_forward(*args, spec.capacity)
    gkv, gs, _ = host.run_backward(grad_out, *args)
    _forward_like_reference(out, eager_region(*pack.args()), spec, "forward")
    rkv, rs, _ = _reference_grads(pack, grad_out)
    assert_bitwise_equal(gkv, rkv, "grad_kv")
    assert_bitwise_equal(gs, rs, "grad_score")


@pytest.mark.parametrize("seed", range(4))
def test_adversarial_offsets_stay_in_bounds(seed):
    # Offsets that are non-monotonic, negative, past T or huge must not fault; the result is
    # unspecified, but every later kernel on the device must still run. cu_seqlens_comp[-1]
    # stays within the capacity: past it the kernels stop the call (test_row_capacity_gpu).
    gen = torch.Generator().manual_seed(seed)
    spec = PackSpec((64, 64), ratio=4, coff=2, head_dim=64, extra_rows=4)
    pack = _pack(spec, torch.bfloat16, seed=seed)
    for _ in range(6):
        choices = torch.tensor([0, 1, 5, 64, 127, 128, 129, 10**6, -1, -(2**31), 2**31 - 1])
        cu = choices[torch.randint(len(choices), (3,), generator=gen)].to(torch.int32)
        cuc = choices[torch.randint(len(choices), (3,), generator=gen)].to(torch.int32)
        cuc[-1] = min(int(cuc[-1]), spec.capacity)
        args = (pack.kv, pack.score, pack.ape, cu.cuda(), cuc.cuda(), 4, 2)
        host.run_forward(*args, spec.capacity)
        host.run_backward(_grad_out(spec, torch.bfloat16), *args)
    torch.cuda.synchronize()
    out = host.run_forward(*pack.tensors(), 4, 2, spec.capacity)
    _forward_like_reference(out, eager_region(*pack.args()), spec,
                            "forward after adversarial")


def test_graph_capture_needs_precompile_and_replays():
    spec = PackSpec((256, 100), ratio=2, coff=2, head_dim=32, extra_rows=3)
    pack = _pack(spec, torch.bfloat16, seed=9)
    grad_out = _grad_out(spec, torch.bfloat16)
    args = (*pack.tensors(), 2, 2)
    host.cache_clear()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="precompile"), torch.cuda.graph(graph,
                                                                               stream=stream):
            host.run_forward(*args, spec.capacity)
    keys = host.precompile(2, 32, 2, torch.bfloat16)
    assert host.cache_info()["size"] == 2 and len(keys) == 2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = host.run_forward(*args, spec.capacity)
        gkv, gs, gape = host.run_backward(grad_out, *args)
    misses = host.cache_info()["misses"]
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert host.cache_info()["misses"] == misses
    _forward_like_reference(out, eager_region(*pack.args()), spec,
                            "graph forward")
    rkv, rs, rape = _reference_grads(pack, grad_out)
    assert_bitwise_equal(gkv, rkv, "graph grad_kv")
    assert_bitwise_equal(gs, rs, "graph grad_score")
    torch.testing.assert_close(gape, rape, atol=1e-3, rtol=1e-3)


def test_exp_matches_torch_over_many_arguments():
    # One token of each two-token window gets logit x in [-100, 0], the other 0, so every
    # output depends on the kernel's exp(x) being torch's bit for bit (131072 values of x).
    spec = PackSpec((2,) * 4096, ratio=2, coff=1, head_dim=64)
    pack = _pack(spec, torch.float32, seed=10)
    x = -torch.rand(spec.num_tokens // 2, 64, device="cuda", dtype=torch.float64) * 100
    pack.score.view(-1, 2, 64)[:, 0] = x.float()
    pack.score.view(-1, 2, 64)[:, 1] = 0.0
    pack.ape.zero_()
    out = host.run_forward(*pack.tensors(), 2, 1, spec.capacity)
    assert_bitwise_equal(out, eager_region(*pack.args()), "exp-dominated forward")


@pytest.mark.parametrize("scale", (30.0, 90.0))
def test_division_and_exp_over_wide_logit_ranges(scale):
    # Logits spread over `scale` make the softmax weights span many binades (and, at 90,
    # underflow to tiny values), exercising both the Markstein and the exact division path.
    spec = PackSpec((32 * 257, 45), ratio=32, coff=1, head_dim=64, extra_rows=2)
    pack = _pack(spec, torch.float32, seed=11)
    gen = torch.Generator(device="cuda").manual_seed(12)
    pack.score.copy_(-scale * torch.rand(pack.score.shape, device="cuda", generator=gen))
    grad_out = _grad_out(spec, torch.float32)
    out, gkv, gs, _ = _run(pack, grad_out)
    assert_bitwise_equal(out, eager_region(*pack.args()), "forward")
    rkv, rs, _ = _reference_grads(pack, grad_out)
    assert_bitwise_equal(gkv, rkv, "grad_kv")
    assert_bitwise_equal(gs, rs, "grad_score")


@pytest.mark.parametrize("scale", (1.0, 30.0, 90.0))
@pytest.mark.parametrize(("ratio", "coff"), ((4, 2), (32, 1)))
def test_fast_forward_over_wide_logit_ranges_and_huge_values(scale, ratio, coff):
    # The bf16 default forward (ex2.approx, one division per column): within one rounding
    # step however far the weights spread (tiny and flushed ones included), and no overflow
    # of its scaled sum(e * v) where every value is near the bf16 maximum.
    spec = PackSpec((ratio * 300, 45), ratio=ratio, coff=coff, head_dim=64, extra_rows=2)
    assert _forward_key(spec, torch.bfloat16).knobs.fast_exp
    pack = _pack(spec, torch.bfloat16, seed=13)
    gen = torch.Generator(device="cuda").manual_seed(14)
    logits = -scale * torch.rand(pack.score.shape, device="cuda", generator=gen)
    pack.score.copy_(logits.to(torch.bfloat16))
    pack.kv[: spec.num_tokens // 2] = 3.0e38
    out = host.run_forward(*pack.tensors(), ratio, coff, spec.capacity)
    ref = eager_region(*pack.args())
    assert torch.isfinite(ref).all()
    _forward_like_reference(out, ref, spec, "fast forward")


@pytest.mark.parametrize("head_dim", (128, 512))
def test_fast_forward_near_the_certificate_threshold(head_dim):
    # Columns cancelling to degrees across the certificate's threshold: the default bf16
    # forward stays within one rounding step of the exact path (the eager region, bit for
    # bit) on every element, whichever path each column takes.
    spec = PackSpec((4 * 2048, 4 * 37 + 1), ratio=4, coff=2, head_dim=head_dim, extra_rows=3)
    default = _forward_key(spec, torch.bfloat16)
    assert default.knobs.fast_exp
    pack = _pack(spec, torch.bfloat16, seed=21)
    degrees = cancel_near_threshold(pack, seed=22)
    assert int(((degrees > 1e-3) & (degrees < 1e-2)).sum()) > degrees.numel() // 5
    out = host.run_forward(*pack.tensors(), spec.ratio, spec.coff, spec.capacity)
    ref = eager_region(*pack.args())
    host.set_key(with_knobs(default, fast_exp=0), Direction.FORWARD)
    try:
        exact = host.run_forward(*pack.tensors(), spec.ratio, spec.coff, spec.capacity)
    finally:
        host.set_key(default, Direction.FORWARD)
    assert_bitwise_equal(exact, ref, "exact forward")
    assert_within_one_step(out, ref, "default forward")
    assert not torch.equal(out, exact)  # some columns took the fast path
