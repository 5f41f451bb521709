"""The row-epilogue kernel of csa::compressor_extend_store on CUDA (H200), against the torch
route of the same epilogue, encoding and paged store (serving_store.epilogue_store) on the
same device and on the CPU: the whole cache bitwise, for every format, dtype, norm-weight
dtype, RoPE width and rotation it takes, on rows that reach the formats' edges (zero rows
and blocks, values past +-448 and past fp32 squares, amax below the scale floors, NaN,
Inf), with invalid requests, rows past cu_seqlens_comp[-1] and block-table entries out of
range (none of which may write), and under a CUDA graph replay.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from helpers import assert_bitwise_equal

import csa_ops
from csa_ops import epilogue, reference_epilogue, row_epilogue, serving_store

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = "cuda"
PAGE_SIZE = 5
RATIO = 4


@dataclasses.dataclass(frozen=True)
class Case:
    cache_format: str
    dtype: torch.dtype
    head_dim: int
    rope_dim: int
    rotate: bool
    weight_dtype: torch.dtype = torch.float32
    eps: float = 1e-6

    @property
    def id(self) -> str:
        return (f"{self.cache_format}-{str(self.dtype)[6:]}-d{self.head_dim}-rope{self.rope_dim}"
                f"{'-rot' if self.rotate else ''}-w{str(self.weight_dtype)[6:]}")


CASES = [
    Case("fp8_ds_mla", torch.bfloat16, 512, 64, False),
    Case("fp8_ds_mla", torch.bfloat16, 512, 64, False, torch.bfloat16, 1e-5),
    Case("fp8_ds_mla", torch.float16, 512, 64, True),
    Case("fp8_ds_mla", torch.float32, 512, 64, False),
    Case("mxfp4", torch.bfloat16, 128, 64, True),
    Case("mxfp4", torch.bfloat16, 128, 0, True, torch.bfloat16),
    Case("mxfp4", torch.float16, 64, 32, False),
    Case("mxfp4", torch.bfloat16, 1024, 64, True),
    Case("fp8_block128", torch.bfloat16, 128, 64, True),
    Case("fp8_block128", torch.float32, 256, 0, False, torch.float16),
    Case("fp8_block128", torch.bfloat16, 512, 64, False),
    Case("none", torch.bfloat16, 512, 64, False),
    Case("none", torch.float16, 128, 64, True, torch.bfloat16),
    Case("none", torch.float32, 64, 2, True),
    Case("none", torch.bfloat16, 32, 0, False),
]


class Call:
    """An extend call's pooled rows (random, with edge rows), its requests and offsets, a
    block table and a cache of random bytes (so any write shows)."""

    # rows per request; request 2 has an out-of-range slot and request 4 a negative
    # position: their rows must write nothing.
    ROWS = (3, 0, 4, 7, 2, 11, 1)
    CAPACITY_EXTRA = 3  # rows past cu_seqlens_comp[-1]

    def __init__(self, case: Case, seed: int = 0):
        d, gen = case.head_dim, torch.Generator().manual_seed(seed)
        counts = list(self.ROWS)
        num_rows = sum(counts) + self.CAPACITY_EXTRA
        rows = torch.randn(num_rows, d, generator=gen, dtype=torch.float64)
        rows *= torch.exp(3 * torch.randn(num_rows, 1, generator=gen, dtype=torch.float64))
        rows[0] = 0.0  # a zero row
        rows[1, 5] = float("nan")
        rows[3, -1] = float("inf")
        rows[5, : d // 4] = 1e30  # squares past fp32: the norm's inverse is 0
        rows[6, ::3] = 0.0
        rows[7] = 1e-20 * rows[7]  # amax below the floors after the norm (weight below)
        self.rows = rows.to(case.dtype)
        weight = 1 + 0.25 * torch.randn(d, generator=gen)
        weight[: d // 8] = 3000.0  # values past +-448
        weight[d // 8: d // 4] = 1e-38  # blocks below the scale floors
        weight[d // 4: d // 4 + 16] = 0.0  # zero columns
        self.norm_weight = weight.to(case.weight_dtype)
        positions = 40 * RATIO
        angles = torch.arange(positions, dtype=torch.float64)[:, None] * 10000.0 ** (
            -torch.arange(0, max(case.rope_dim, 2), 2, dtype=torch.float64) / max(case.rope_dim, 2))
        self.cos = torch.cos(angles).float() if case.rope_dim else torch.empty(0, 0)
        self.sin = torch.sin(angles).float() if case.rope_dim else torch.empty(0, 0)
        self.cos = self.cos[:, : case.rope_dim // 2].contiguous()
        self.sin = self.sin[:, : case.rope_dim // 2].contiguous()
        batch = len(counts)
        # start positions: rows q from start // ratio on; some reach past the RoPE tables.
        starts = [RATIO * int(s) + int(r) for s, r in zip(
            torch.randint(0, 30, (batch,), generator=gen), torch.randint(0, RATIO, (batch,),
                                                                         generator=gen))]
        starts[4] = -4
        starts[6] = 60 * RATIO  # position past the tables: the last table row
        self.start_pos = torch.tensor(starts, dtype=torch.int32)
        lengths = [RATIO * c for c in counts]
        self.cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
        self.num_tokens = int(self.cu[-1])
        self.num_slots = batch + 2
        slots = torch.randperm(self.num_slots, generator=gen)[:batch].to(torch.int32)
        slots[2] = self.num_slots
        self.slots = slots
        self.cuc = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int32)
        pages = 16
        num_pages = batch * pages - 3
        table = torch.randperm(batch * pages, generator=gen).view(batch, pages).to(torch.int32)
        table[5, 2] = -1  # out of range: nothing written through it
        self.block_table = table  # entries >= num_pages also write nothing
        self.cache = serving_store.new_cache(num_pages, PAGE_SIZE, d, case.cache_format,
                                             case.dtype)
        fill = torch.randint(0, 256, self.cache.shape, generator=gen, dtype=torch.uint8)
        self.cache.copy_(fill if case.cache_format != "none" else fill.to(case.dtype) - 100)

    def args(self, case: Case, device, cache=None) -> list:
        on = [t.to(device) for t in (self.rows, self.cuc)]
        return [*on, self.num_tokens, self.cu.to(device), self.start_pos.to(device),
                self.slots.to(device), self.num_slots, self.norm_weight.to(device), case.eps,
                self.cos.to(device), self.sin.to(device), case.rope_dim, case.rotate,
                case.cache_format, self.cache.to(device, copy=True) if cache is None else cache,
                self.block_table.to(device), PAGE_SIZE, RATIO]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_adversarial_call_stores_the_torch_routes_bytes(case):
    call = Call(case, seed=CASES.index(case))
    kernel_args = call.args(case, DEVICE)
    assert row_epilogue.launch_store(*kernel_args), "the kernel did not take the call"
    torch_args = call.args(case, DEVICE)
    serving_store.epilogue_store(*torch_args)
    cpu_args = call.args(case, "cpu")
    serving_store.epilogue_store(*cpu_args)
    assert_bitwise_equal(kernel_args[14].cpu(), torch_args[14].cpu(), "cache (CUDA torch)")
    # On the CPU a NaN row's bf16 RoPE bytes may carry another NaN (x86's default NaN is
    # negative): the decoded values agree, NaN for NaN.
    decoded = [serving_store.dequantize_cache(c.cpu(), case.cache_format, PAGE_SIZE)
               for c in (kernel_args[14], cpu_args[14])]
    assert_bitwise_equal(*decoded, "cache values (CPU)")
    assert not torch.equal(kernel_args[14].cpu(), call.cache), "nothing was written"


@pytest.mark.parametrize("case", [Case("none", torch.bfloat16, 96, 0, False),
                                  Case("mxfp4", torch.bfloat16, 32, 0, False),
                                  Case("fp8_ds_mla", torch.bfloat16, 512, 64, False)],
                         ids=["d96", "mxfp4-d32", "fp8_ds_mla-page_bytes"])
def test_unsupported_calls_take_the_torch_route(case):
    """What the kernel does not take (a non-power-of-two head_dim, 17-byte mxfp4 rows,
    fp8_ds_mla pages whose size misaligns its stores): launch declines and writes nothing
    (the op then takes the torch route)."""
    call = Call(case)
    if case.cache_format == "fp8_ds_mla":  # 4 bytes past the layout's page size
        call.cache = torch.cat((call.cache, call.cache[:, :4]), dim=1).contiguous()
    args = call.args(case, DEVICE)
    before = args[14].clone()
    assert not row_epilogue.launch_store(*args)
    assert torch.equal(args[14], before)


def test_graph_replay_stores_what_eager_launches_store():
    case = CASES[0]
    call = Call(case, seed=11)
    csa_ops.precompile_store(case.head_dim, case.cache_format, case.rope_dim, case.rotate,
                             case.eps, case.dtype, case.weight_dtype)
    eager = call.args(case, DEVICE)
    assert row_epilogue.launch_store(*eager)
    replayed = call.args(case, DEVICE)
    assert row_epilogue.launch_store(*replayed)  # a warm-up outside the capture
    replayed[14].copy_(call.cache.to(DEVICE))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        row_epilogue.launch_store(*replayed)
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise_equal(replayed[14], eager[14], "cache")


def test_op_runs_the_kernel_and_the_torch_route_alike():
    """csa::compressor_extend_store end to end (the extend kernel, then the store kernel),
    eager and under torch.compile(fullgraph=True), against the same call under
    row_epilogue.torch_route()."""
    from serving_helpers import make_requests, step_inputs

    d, ratio, coff = 512, 4, 2
    req = make_requests((37, 1, 130, 8), ratio, coff, d, torch.bfloat16, device=DEVICE, seed=5)
    kv, score, cu, start_pos, slots = step_inputs(req, list(enumerate(req.lengths)),
                                                  [0] * 4, [0, 1, 2, 3])
    weight = (1 + 0.1 * torch.randn(d)).to(DEVICE)
    angles = torch.arange(200, dtype=torch.float64)[:, None] * 10000.0 ** (
        -torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    cos, sin = torch.cos(angles).float().to(DEVICE), torch.sin(angles).float().to(DEVICE)
    table = torch.arange(4 * 8, dtype=torch.int32, device=DEVICE).view(4, 8)
    op = torch.ops.csa.compressor_extend_store.default
    compiled = torch.compile(lambda *args: op(*args) + 0, fullgraph=True)
    caches = []
    for route, call in ((row_epilogue.torch_route, op), (contextlib.nullcontext, op),
                        (contextlib.nullcontext, compiled)):
        state = csa_ops.CompressorState(4, ratio, coff, d, torch.bfloat16, DEVICE)
        cache = serving_store.new_cache(32, PAGE_SIZE, d, "fp8_ds_mla", device=DEVICE)
        with route():
            call(kv, score, req.ape, cu, start_pos, slots, state.kv, state.score, weight, 1e-6,
                 cos, sin, 64, False, "fp8_ds_mla", cache, table, PAGE_SIZE, ratio, coff)
        caches.append(cache)
    assert_bitwise_equal(caches[1], caches[0], "cache (kernel)")
    assert_bitwise_equal(caches[2], caches[0], "cache (compiled, kernel)")


# The training kernels against the torch route:
# dtype, weight dtype, head_dim, rope_dim, rotate, position offsets, ratio, coff.
TRAINING = [
    (torch.bfloat16, torch.float32, 32, 16, True, True, 4, 2),
    (torch.bfloat16, torch.float32, 512, 64, False, False, 4, 2),
    (torch.bfloat16, torch.bfloat16, 512, 64, False, True, 128, 1),
    (torch.float16, torch.float32, 128, 64, True, True, 4, 2),
    (torch.float32, torch.float16, 64, 0, False, False, 8, 1),
    (torch.bfloat16, torch.float32, 1024, 32, True, False, 4, 1),
]


def _training_call(config):
    """One training call's inputs (ragged sequences, an empty one, padding rows past
    cu_seqlens_comp[-1], position offsets, positions past the RoPE tables), the op's keyword
    arguments, the epilogue's parameters and pooled rows with edge rows (zero, NaN, 1e30)."""
    dtype, weight_dtype, d, rope, rotate, offsets, ratio, coff = config
    gen = torch.Generator().manual_seed(d + ratio)
    lengths = (37 * ratio // 4, 0, 3, 129 * ratio // 4 + 1, 16 * ratio)
    cu, cuc = csa_ops.offsets_for(lengths, ratio, device=DEVICE)
    total = int(cuc[-1]) + 3
    kv = torch.randn(int(cu[-1]), coff * d, generator=gen).to(DEVICE, dtype)
    score = torch.randn(int(cu[-1]), coff * d, generator=gen).to(DEVICE, dtype)
    ape = torch.randn(ratio, coff * d, generator=gen).to(DEVICE)
    weight = (1 + 0.25 * torch.randn(d, generator=gen)).to(DEVICE, weight_dtype)
    angles = torch.arange(40 * ratio, dtype=torch.float64)[:, None] * 10000.0 ** (
        -torch.arange(0, max(rope, 2), 2, dtype=torch.float64) / max(rope, 2))
    cos = torch.cos(angles)[:, : rope // 2].float().contiguous().to(DEVICE) if rope else None
    sin = torch.sin(angles)[:, : rope // 2].float().contiguous().to(DEVICE) if rope else None
    position_offset = (torch.tensor([5, 0, 17, 30 * ratio, 3], dtype=torch.int32, device=DEVICE)
                       if offsets else None)
    eps = 1e-6
    kwargs = dict(ratio=ratio, coff=coff, norm_weight=weight, eps=eps, cos=cos, sin=sin,
                  rope_dim=rope, rotate=rotate, position_offset=position_offset,
                  total_comp=total)
    params = reference_epilogue.EpilogueParams(weight, eps, cos, sin, rope, rotate)
    pooled = torch.randn(total, d, generator=gen, dtype=torch.float64)
    pooled[0] = 0.0
    pooled[2, 1] = float("nan")
    pooled[4, : d // 4] = 1e30
    return (kv, score, ape, cu, cuc), kwargs, params, pooled.to(DEVICE, dtype)


def _training_ids(configs):
    return ["-".join(str(v).replace("torch.", "") for v in c) for c in configs]


@pytest.mark.parametrize("config", TRAINING, ids=_training_ids(TRAINING))
def test_training_kernel_gives_the_torch_routes_rows(config):
    """csa::compressor_epilogue's forward by the kernel against its torch route on the same
    pooled rows (directly, with edge rows), and end to end through the op."""
    (kv, score, ape, cu, cuc), kwargs, params, pooled = _training_call(config)
    ratio, position_offset = kwargs["ratio"], kwargs["position_offset"]
    with row_epilogue.kernel_route():
        got = row_epilogue.launch_rows(pooled, cuc, position_offset, ratio, params.norm_weight,
                                       params.eps, params.cos, params.sin, params.rope_dim,
                                       params.rotate)
    assert got is not None, "the kernel did not take the call"
    want = reference_epilogue.training_rows(pooled, cuc, position_offset, ratio, params)
    assert_bitwise_equal(got, want, "rows")

    with row_epilogue.kernel_route():
        fused = epilogue.compressor_epilogue(kv, score, ape, cu, cuc, **kwargs)
    with row_epilogue.torch_route():
        composed = epilogue.compressor_epilogue(kv, score, ape, cu, cuc, **kwargs)
    assert_bitwise_equal(fused, composed, "op rows")
    assert bool((fused[int(cuc[-1]):] == 0).all())


def _assert_weight_grad_close(got, want, rows: int, name: str):
    """grad_weight: the same column sums in another fixed order (fp32 summation error over
    ``rows`` terms), then one rounding to the weight's dtype (one step of it apart at most);
    NaN where the reference has NaN."""
    assert got.dtype == want.dtype and got.shape == want.shape, name
    assert bool((got.isnan() == want.isnan()).all()), f"{name}: NaN pattern"
    finite = ~want.isnan()
    rtol = max(torch.finfo(want.dtype).eps, 1e-5)
    atol = 1e-6 * rows * float(want[finite].abs().max()) if bool(finite.any()) else 0.0
    torch.testing.assert_close(got[finite], want[finite], rtol=rtol, atol=atol, msg=name)


TRAINING_BACKWARD = TRAINING + [(torch.bfloat16, torch.float32, 4096, 64, True, True, 4, 1)]


@pytest.mark.parametrize("config", TRAINING_BACKWARD, ids=_training_ids(TRAINING_BACKWARD))
def test_training_backward_kernel_gives_the_torch_routes_gradients(config):
    """csa::compressor_epilogue_backward's way back through the epilogue by the kernel
    against its torch route: the pooled rows' gradient bitwise (edge rows included),
    grad_weight within fp32 summation error; end to end through the op, grad_kv,
    grad_score and grad_ape bitwise (the pooling backward of the same rows' gradient), the
    backward staged: the kernel fused into the pooling sums grad_ape in its own order
    (tests/gpu/test_epilogue_gpu.py compares it with this route)."""
    (kv, score, ape, cu, cuc), kwargs, params, pooled = _training_call(config)
    ratio, position_offset = kwargs["ratio"], kwargs["position_offset"]
    gen = torch.Generator().manual_seed(7)
    grad_out = torch.randn(pooled.shape, generator=gen).to(DEVICE, pooled.dtype)
    grad_out[3] = float("inf")
    rows = pooled.shape[0]
    for name, given in (("edge rows", pooled), ("clean rows", pooled.nan_to_num(0.0, 1.0, -1.0))):
        with row_epilogue.kernel_route():
            got = row_epilogue.launch_rows_backward(
                grad_out, given, cuc, position_offset, ratio, params.norm_weight, params.eps,
                params.cos, params.sin, params.rope_dim, params.rotate)
        assert got is not None, "the kernel did not take the call"
        want = reference_epilogue.training_rows_backward(grad_out, given, cuc,
                                                         position_offset, ratio, params)
        assert_bitwise_equal(got[0], want[0], f"grad rows ({name})")
        _assert_weight_grad_close(got[1], want[1], rows, f"grad_weight ({name})")

    grad_out = torch.randn(pooled.shape, generator=gen).to(DEVICE, pooled.dtype)
    args = (grad_out, kv, score, ape, cu, cuc, ratio, kwargs["coff"], params.norm_weight,
            params.eps, params.cos, params.sin, params.rope_dim, position_offset, params.rotate)
    with row_epilogue.kernel_route(), row_epilogue.staged_backward():
        staged = torch.ops.csa.compressor_epilogue_backward(*args)
        again = torch.ops.csa.compressor_epilogue_backward(*args)
    with row_epilogue.torch_route():
        composed = torch.ops.csa.compressor_epilogue_backward(*args)
    for i, name in enumerate(("grad_kv", "grad_score", "grad_ape")):
        assert_bitwise_equal(staged[i], composed[i], name)
    _assert_weight_grad_close(staged[3], composed[3], rows, "grad_weight")
    for i in range(4):
        assert_bitwise_equal(again[i], staged[i], "run to run")


@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_training_kernel_rows_of_no_segment_and_zero_eps(eps):
    """cu_seqlens_comp of no segment whose last offset still counts rows: the reference's
    rows (the epilogue of the given rows at position 0), and eps 0 on zero rows (NaN)."""
    d = 128
    gen = torch.Generator().manual_seed(9)
    pooled = torch.randn(5, d, generator=gen).to(DEVICE, torch.bfloat16)
    pooled[1] = 0.0
    weight = torch.randn(d, generator=gen).to(DEVICE)  # negative entries: signed zeros
    angles = torch.rand(8, 32, generator=gen, dtype=torch.float64) * 6.3
    cos, sin = torch.cos(angles).float().to(DEVICE), torch.sin(angles).float().to(DEVICE)
    params = reference_epilogue.EpilogueParams(weight, eps, cos, sin, 64, True)
    for cuc in ([3], [0, 2, 4]):
        cuc = torch.tensor(cuc, dtype=torch.int32, device=DEVICE)
        with row_epilogue.kernel_route():
            got = row_epilogue.launch_rows(pooled, cuc, None, 4, weight, eps, cos, sin, 64, True)
        want = reference_epilogue.training_rows(pooled, cuc, None, 4, params)
        assert_bitwise_equal(got, want, f"rows, cu_seqlens_comp {cuc.tolist()}")


@pytest.mark.parametrize("d, real_rows, padding", [(64, 1025, 0), (512, 2500, 600),
                                                   (128, 5000, 1)])
def test_training_backward_kernel_over_many_rows_per_cta(d, real_rows, padding):
    """More rows than the backward's 1024 CTAs: each CTA walks several rows (shared memory
    reused row after row, grad_weight's partial summed across them, a short last CTA,
    padding rows spread over CTAs): the rows' gradient bitwise the torch route's."""
    gen = torch.Generator().manual_seed(d + real_rows)
    lengths = [4 * (real_rows // 3), 4 * (real_rows - 2 * (real_rows // 3)) + 3,
               4 * (real_rows // 3)]
    cu, cuc = csa_ops.offsets_for(lengths, 4, device=DEVICE)
    assert int(cuc[-1]) == real_rows
    total = real_rows + padding
    pooled = torch.randn(total, d, generator=gen).to(DEVICE, torch.bfloat16)
    grad_out = torch.randn(total, d, generator=gen).to(DEVICE, torch.bfloat16)
    weight = (1 + 0.25 * torch.randn(d, generator=gen)).to(DEVICE)
    angles = torch.rand(4 * total, 32, generator=gen, dtype=torch.float64) * 6.3
    cos, sin = torch.cos(angles).float().to(DEVICE), torch.sin(angles).float().to(DEVICE)
    params = reference_epilogue.EpilogueParams(weight, 1e-6, cos, sin, 64, True)
    with row_epilogue.kernel_route():
        got = row_epilogue.launch_rows_backward(grad_out, pooled, cuc, None, 4, weight, 1e-6,
                                                cos, sin, 64, True)
    want = reference_epilogue.training_rows_backward(grad_out, pooled, cuc, None, 4, params)
    assert_bitwise_equal(got[0], want[0], "grad rows")
    assert bool((got[0][real_rows:] == 0).all())
    _assert_weight_grad_close(got[1], want[1], total, "grad_weight")
