"""csa::compressor_epilogue (+ backward) and csa::compressor_extend_store on CUDA (H200).

The training op against the composition of csa_ops.reference_epilogue run on the CPU from
the CUDA pooled rows, its gradients against torch autograd of the composition as models
write it, bitwise determinism; the store's bytes against the CUDA training rows encoded on
the CPU, chunking invariance, the rows it must skip, and a decode step replayed from a CUDA
graph. Three configurations, bf16: the compressed KV cache's (d512 r4 c2), the
heavily-compressed one's (d512 r128 c1) and the indexer's (d128 r4 c2, rotated).
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from helpers import PackSpec, assert_bitwise_equal, make_pack
from serving_helpers import make_requests, permuted_slots, random_schedule, step_inputs

import csa_ops
from csa_ops import CompressorState, epilogue, host, reference_epilogue, row_epilogue, serving_store

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

FORWARD = torch.ops.csa.compressor_epilogue.default
BACKWARD = torch.ops.csa.compressor_epilogue_backward.default
STORE = torch.ops.csa.compressor_extend_store.default
DEVICE = "cuda"
DTYPE = torch.bfloat16
EPS = 1e-6
PAGE_SIZE = 5  # not a power of two: q // page_size and q % page_size both matter


@dataclasses.dataclass(frozen=True)
class Config:
    """A pooling configuration, its epilogue and the training pack it is tested on."""

    name: str
    ratio: int
    coff: int
    head_dim: int
    rope_dim: int
    rotate: bool
    lengths: tuple
    extra_tokens: int
    extra_rows: int

    @property
    def spec(self) -> PackSpec:
        return PackSpec(self.lengths, self.ratio, self.coff, self.head_dim,
                        extra_tokens=self.extra_tokens, extra_rows=self.extra_rows)


MAIN = Config("d512_r4_c2", 4, 2, 512, 64, False, (700, 0, 3, 129, 1001), 5, 3)
HCA = Config("d512_r128_c1", 128, 1, 512, 64, False, (2100, 127, 0, 900, 1300), 7, 2)
INDEXER = Config("d128_r4_c2_rot", 4, 2, 128, 64, True, (1000, 3, 517, 2049), 2, 4)
CONFIGS = [pytest.param(c, id=c.name) for c in (MAIN, HCA, INDEXER)]


def rope_tables(rope_dim: int, max_position: int, device):
    """(cos, sin) fp32 (max_position, rope_dim // 2): angle p * 10000**(-2i / rope_dim)."""
    inv_freq = 10000.0 ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq
    return torch.cos(angles).float().to(device), torch.sin(angles).float().to(device)


# ---------------------------------------------------------------------------------------
# The training op.


def training_inputs(config: Config, device, seed: int = 0, requires_grad: bool = False,
                    dtype=DTYPE, ape_dtype=torch.float32):
    """The op's arguments by name, at a static capacity with position offsets."""
    pack = make_pack(config.spec, dtype, device=device, seed=seed, ape_dtype=ape_dtype)
    gen = torch.Generator().manual_seed(seed + 100)
    weight = (1 + 0.25 * torch.randn(config.head_dim, generator=gen)).to(device)
    offsets = torch.randint(0, 8, (len(config.lengths),), generator=gen, dtype=torch.int32)
    cos, sin = rope_tables(config.rope_dim, max(config.lengths) + 8, device)
    leaves = [pack.kv, pack.score, pack.ape, weight]
    if requires_grad:
        leaves = [t.clone().requires_grad_(True) for t in leaves]
    kv, score, ape, weight = leaves
    return {"kv": kv, "score": score, "ape": ape, "cu_seqlens": pack.cu_seqlens,
            "cu_seqlens_comp": pack.cu_seqlens_comp, "ratio": config.ratio,
            "coff": config.coff, "norm_weight": weight, "eps": EPS, "cos": cos, "sin": sin,
            "rope_dim": config.rope_dim, "position_offset": offsets.to(device),
            "rotate": config.rotate, "total_comp": config.spec.capacity}


def positional(inputs: dict) -> tuple:
    return tuple(inputs[name] for name in epilogue.FORWARD_ARGS)


POOLING_ARGS = ("kv", "score", "ape", "cu_seqlens", "cu_seqlens_comp", "ratio", "coff",
                "total_comp")
LEAVES = ("kv", "score", "ape", "norm_weight")


def cpu_composition(inputs: dict) -> torch.Tensor:
    """The comparator: csa::compressor's rows on the inputs' device, then the epilogue of
    csa_ops.reference_epilogue on the CPU (the CPU op's own numerics) from those rows."""
    pooled = torch.ops.csa.compressor(*(inputs[n] for n in POOLING_ARGS)).detach().cpu()
    positions, valid = reference_epilogue.training_positions(
        inputs["cu_seqlens_comp"].cpu(), inputs["position_offset"].cpu(), pooled.shape[0],
        inputs["ratio"])
    cpu = {n: inputs[n].detach().cpu() for n in ("norm_weight", "cos", "sin")}
    params = reference_epilogue.EpilogueParams(cpu["norm_weight"], inputs["eps"], cpu["cos"],
                                               cpu["sin"], inputs["rope_dim"],
                                               inputs["rotate"])
    return reference_epilogue.epilogue_rows(pooled, positions, valid, params)


def row_positions(inputs: dict, rows: int) -> list:
    """Position of every output row from the lengths in plain Python: block b of sequence s
    at b * ratio + position_offset[s]; padding rows at 0 (their values are dropped)."""
    cu, offsets = inputs["cu_seqlens"].tolist(), inputs["position_offset"].tolist()
    positions = []
    for s, offset in enumerate(offsets):
        positions += [b * inputs["ratio"] + offset
                      for b in range((cu[s + 1] - cu[s]) // inputs["ratio"])]
    return positions + [0] * (rows - len(positions))


def sylvester(d: int, device) -> torch.Tensor:
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def model_forward(inputs: dict) -> torch.Tensor:
    """The composition as model code writes it (a mean, complex RoPE, a Hadamard matrix),
    apart from csa_ops.reference_epilogue: csa::compressor's rows, then per step fp32 from
    the rounded values, rounded to bf16; padding rows zeros."""
    pooled = torch.ops.csa.compressor(*(inputs[n] for n in POOLING_ARGS))
    rows, d = pooled.shape
    x = pooled.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + inputs["eps"])
    x = (x * inputs["norm_weight"].float()).to(DTYPE)
    rope_dim = inputs["rope_dim"]
    if rope_dim:
        index = torch.tensor(row_positions(inputs, rows), device=x.device)
        freqs = torch.complex(inputs["cos"][index], inputs["sin"][index])
        tail = x[:, d - rope_dim:].float().reshape(rows, -1, 2).contiguous()
        turned = torch.view_as_real(torch.view_as_complex(tail) * freqs).reshape(rows, -1)
        x = torch.cat([x[:, :d - rope_dim], turned.to(DTYPE)], 1)
    if inputs["rotate"]:
        x = (x.float() @ sylvester(d, x.device) * d**-0.5).to(DTYPE)
    true_rows = sum(n // inputs["ratio"] for n in inputs["cu_seqlens"].diff().tolist())
    return torch.cat([x[:true_rows], torch.zeros_like(x[true_rows:])])


def op_grads(inputs: dict, grad_out: torch.Tensor) -> tuple:
    """(out, grad_kv, grad_score, grad_ape, grad_weight) of the op through autograd."""
    out = FORWARD(*positional(inputs))
    grads = torch.autograd.grad(out, [inputs[n] for n in LEAVES], grad_out)
    return (out.detach(), *grads)


def random_grad_out(inputs: dict, seed: int = 3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (inputs["total_comp"], inputs["norm_weight"].shape[0])
    return torch.randn(shape, generator=gen).to(device=inputs["kv"].device,
                                                dtype=inputs["kv"].dtype)


@pytest.mark.parametrize("config", CONFIGS)
def test_training_rows_match_the_composition_on_the_cpu(config):
    """Bitwise the CPU composition from the same pooled rows (every step of it is an IEEE
    operation or the correctly rounded square root, the same bits on both devices);
    padding rows exact zeros; run to run the same bits."""
    inputs = training_inputs(config, DEVICE)
    out = FORWARD(*positional(inputs))
    assert out.shape == (config.spec.capacity, config.head_dim) and out.dtype == DTYPE
    assert_bitwise_equal(out.cpu(), cpu_composition(inputs), "epilogue rows")
    padding = out[config.spec.true_rows:]
    assert_bitwise_equal(padding, torch.zeros_like(padding), "padding rows")
    assert_bitwise_equal(FORWARD(*positional(inputs)), out, "run to run")


@pytest.mark.parametrize("config", CONFIGS)
def test_training_op_and_backward_are_bitwise_run_to_run(config, deterministic):
    inputs = training_inputs(config, DEVICE, requires_grad=True)
    grad_out = random_grad_out(inputs)
    first, second = op_grads(inputs, grad_out), op_grads(inputs, grad_out)
    for name, a, b in zip(("out", "grad_kv", "grad_score", "grad_ape", "grad_weight"), first,
                          second):
        assert_bitwise_equal(a, b, name)


def composition_inputs(dtype, head_dim: int, rope_dim: int, rotate: bool, rows: int = 257):
    """On the CPU: rows over 2**-8..2**8 of scale, an epilogue, positions, a gradient."""
    gen = torch.Generator().manual_seed(head_dim + rope_dim)
    pooled = (torch.randn(rows, head_dim, generator=gen)
              * 2.0 ** torch.randint(-8, 8, (rows, 1), generator=gen)).to(dtype)
    cos, sin = rope_tables(rope_dim, 64, "cpu")
    params = reference_epilogue.EpilogueParams(
        1 + 0.25 * torch.randn(head_dim, generator=gen), EPS, cos, sin, rope_dim, rotate)
    positions = torch.randint(0, 64, (rows,), generator=gen)
    valid = torch.arange(rows) < rows - 3
    grad_out = torch.randn(rows, head_dim, generator=gen).to(dtype)
    return pooled, positions, valid, params, grad_out


def composition_on(device, pooled, positions, valid, params, grad_out):
    """(rows, grad_pooled, grad_weight, encodings) of csa_ops.reference_epilogue on
    ``device``, on the CPU."""
    params = dataclasses.replace(params, norm_weight=params.norm_weight.to(device),
                                 cos=params.cos.to(device), sin=params.sin.to(device))
    pooled, positions, valid = pooled.to(device), positions.to(device), valid.to(device)
    rows = reference_epilogue.epilogue_rows(pooled, positions, valid, params)
    grads = reference_epilogue.epilogue_rows_backward(grad_out.to(device), pooled, positions,
                                                      valid, params)
    d = pooled.shape[1]
    formats = [fmt for fmt, fits in (("fp8_block128", d % 128 == 0), ("mxfp4", d % 32 == 0),
                                     ("fp8_ds_mla", d == 512)) if fits]
    encoded = [part for fmt in formats for part in reference_epilogue.encode_rows(rows, fmt)]
    return [t.cpu() for t in (rows, *grads, *encoded)]


@pytest.mark.parametrize("dtype, head_dim, rope_dim, rotate", [
    pytest.param(torch.bfloat16, 128, 64, True, id="bf16_d128_rot"),
    pytest.param(torch.float32, 96, 32, False, id="fp32_d96"),
    pytest.param(torch.bfloat16, 512, 64, False, id="bf16_d512"),
])
def test_the_composition_gives_the_cpu_bits(dtype, head_dim, rope_dim, rotate):
    """csa_ops.reference_epilogue on CUDA and on the CPU from the same rows: the rows,
    grad_pooled and every format's bytes bitwise (the fp8_block128 scales amax / 448 among
    them; d96: a mean divided by no power of two). grad_weight is torch's column sum,
    in each device's own order: within a few fp32 steps."""
    inputs = composition_inputs(dtype, head_dim, rope_dim, rotate)
    cuda, cpu = composition_on(DEVICE, *inputs), composition_on("cpu", *inputs)
    assert_bitwise_equal(cuda[0], cpu[0], "rows")
    assert_bitwise_equal(cuda[1], cpu[1], "grad_pooled")
    scale = float(cpu[2].abs().max())
    torch.testing.assert_close(cuda[2], cpu[2], rtol=0, atol=1e-5 * scale, msg="grad_weight")
    assert len(cuda) > 3
    for i, (a, b) in enumerate(zip(cuda[3:], cpu[3:])):
        assert_bitwise_equal(a, b, f"encoded part {i}")


# Tolerances, fractions of each gradient's largest value. Both sides round to bf16 at the
# same points, so they differ only where the epilogue's backward sums in another order (a
# mean and a matrix product in autograd, a tree and butterflies in the op) and a rounding to
# bf16 then goes the other way: one step of one element of an intermediate gradient, which
# moves a bf16 gradient element by about a step of itself and an fp32 sum over rows (ape,
# norm weight) by a step of one of its terms. The CPU tests' fp32 bound (2e-5) is for fp32
# rows, which have no such flips; on the CPU at bf16 the largest differences are 2**-10
# (grad_score), 2**-12 (grad_ape) and 2**-13.5 (grad_weight, rotated).
GRAD_TOLERANCE = {"grad_kv": 2.0**-7, "grad_score": 2.0**-7, "grad_ape": 2.0**-9,
                  "grad_weight": 2.0**-9}


@pytest.mark.parametrize("config", CONFIGS)
def test_gradients_match_torch_autograd_of_the_composition(config):
    """grad_kv, grad_score, grad_ape and grad_weight of the op against torch autograd of
    model_forward (fp32 between bf16 roundings, the pooling op's own backward)."""
    inputs = training_inputs(config, DEVICE, requires_grad=True)
    grad_out = random_grad_out(inputs)
    got = op_grads(inputs, grad_out)[1:]
    want = torch.autograd.grad(model_forward(inputs), [inputs[n] for n in LEAVES], grad_out)
    for (name, tolerance), a, e in zip(GRAD_TOLERANCE.items(), got, want):
        assert a.dtype == e.dtype and a.shape == e.shape, name
        scale = float(e.abs().max()) + 1e-30
        torch.testing.assert_close(a, e, rtol=0, atol=tolerance * scale, msg=name)


# ---------------------------------------------------------------------------------------
# The training forward in one kernel (the register-window family's configurations).

# (config, rows' dtype, ape's dtype, weight dtype, position offsets): both coffs, every row
# dtype (fp32: the exact softmax), ape upcast, weights of each dtype, with and without
# offsets, a rotated row of two warps.
FUSED_FORWARDS = {
    "d512-bf16": (MAIN, torch.bfloat16, torch.float32, torch.float32, True),
    "d128-rot-bf16-ape": (INDEXER, torch.bfloat16, torch.bfloat16, torch.bfloat16, False),
    "d512-fp16": (MAIN, torch.float16, torch.float32, torch.float16, True),
    "d256-c1-fp32": (Config("d256_r4_c1", 4, 1, 256, 32, False, (33, 0, 7, 260), 3, 5),
                     torch.float32, torch.float32, torch.float32, False),
    "d512-r2-norope": (Config("d512_r2_c2", 2, 2, 512, 0, True, (1, 2, 3, 401), 0, 2),
                       torch.bfloat16, torch.float32, torch.float32, True),
}


def fused_inputs(name: str, seed: int = 0) -> dict:
    config, dtype, ape_dtype, weight_dtype, offsets = FUSED_FORWARDS[name]
    inputs = training_inputs(config, DEVICE, seed, dtype=dtype, ape_dtype=ape_dtype)
    inputs["norm_weight"] = inputs["norm_weight"].to(weight_dtype)
    if not offsets:
        inputs["position_offset"] = None
    return inputs


@pytest.fixture
def fused_kernels():
    """The fused training kernels on (the default, stated here for the tests)."""
    with row_epilogue.fused_training():
        yield


@pytest.mark.parametrize("name", list(FUSED_FORWARDS))
def test_the_fused_forward_writes_the_two_launches_bytes(name, fused_kernels):
    """The forward in one launch (kernels/window/forward_epilogue.py) against the pooling
    kernel followed by the row-epilogue kernel: every byte, padding rows zeros; the None
    capacity (a host sync) gives the true rows."""
    inputs = fused_inputs(name)
    args = positional(inputs)
    fused = row_epilogue.launch_forward_epilogue(*args[:7], inputs["total_comp"],
                                                 *args[7:12], inputs["position_offset"],
                                                 inputs["rotate"])
    assert fused is not None, "the fused kernel does not take the call"
    with row_epilogue.two_launch_forward():
        two = FORWARD(*args)
    assert_bitwise_equal(fused, two, "fused rows")
    assert_bitwise_equal(FORWARD(*args), two, "the op's rows")
    true_rows = inputs["cu_seqlens_comp"][-1].item()
    unsized = FORWARD(*args[:-1], None)
    assert_bitwise_equal(unsized, two[:true_rows], "total_comp=None")
    if inputs["position_offset"] is not None and inputs["rope_dim"]:
        # The same bits as the CPU composition of the CUDA pooled rows.
        assert_bitwise_equal(fused.cpu(), cpu_composition(inputs), "against the CPU")


@pytest.mark.parametrize("name", list(FUSED_FORWARDS))
def test_the_fused_backward_gives_the_staged_gradients(name, fused_kernels):
    """The backward in one launch (kernels/window/backward_epilogue.py) against the staged
    route (pooling forward, row-epilogue backward, pooling backward): grad_kv and grad_score
    bitwise (the rows' gradient is the same bits), grad_ape and grad_weight within fp32
    summation error (each a fixed-order sum of its own per-CTA partials: in a 16-bit ape,
    one step of its dtype); run to run the same bits."""
    inputs = fused_inputs(name)
    grad_out = random_grad_out(inputs)
    args = positional(inputs)[:-1]  # the backward takes the forward's but total_comp
    fused = row_epilogue.launch_backward_epilogue(grad_out, *args[:12],
                                                  inputs["position_offset"], inputs["rotate"])
    assert fused is not None, "the fused kernel does not take the call"
    with row_epilogue.staged_backward():
        staged = BACKWARD(grad_out, *args)
    for label, a, b in zip(("grad_kv", "grad_score", "grad_ape", "grad_weight"), fused, staged):
        assert a.dtype == b.dtype and a.shape == b.shape, label
        if label in ("grad_kv", "grad_score"):
            assert_bitwise_equal(a, b, label)
        else:
            step = 1e-5 if a.dtype == torch.float32 else 2.0**-7
            scale = float(b.float().abs().max()) + 1e-30
            torch.testing.assert_close(a, b, rtol=0, atol=step * scale, msg=label)
    for label, a, b in zip(("grad_kv", "grad_score", "grad_ape", "grad_weight"),
                           BACKWARD(grad_out, *args), fused):
        assert_bitwise_equal(a, b, f"{label} run to run")


def test_a_captured_fused_step_replays_the_eager_bytes(fused_kernels):
    """precompile_epilogue with the configuration builds the fused kernels, so a capture
    takes them (no kernel is loaded during the capture); a replay over new inputs writes
    what eager calls do, forward and backward."""
    config = MAIN
    csa_ops.precompile_epilogue(config.head_dim, config.rope_dim, config.rotate, EPS, DTYPE,
                                torch.float32, True, ratio=config.ratio, coff=config.coff)
    inputs, fresh = training_inputs(config, DEVICE, seed=5), training_inputs(config, DEVICE,
                                                                             seed=6)
    grad_out = random_grad_out(inputs)
    backward_args = (grad_out, *positional(inputs)[:-1])
    compiled = host.KERNELS.info()["size"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = FORWARD(*positional(inputs))
        grads = BACKWARD(*backward_args)
    assert host.KERNELS.info()["size"] == compiled, "a kernel was loaded during the capture"
    for name in ("kv", "score", "ape", "norm_weight"):
        inputs[name].copy_(fresh[name])
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise_equal(out, FORWARD(*positional(inputs)), "replayed rows")
    for label, a, b in zip(("grad_kv", "grad_score", "grad_ape", "grad_weight"), grads,
                           BACKWARD(*backward_args)):
        assert_bitwise_equal(a, b, f"replayed {label}")


# ---------------------------------------------------------------------------------------
# The serving store: requests fed in steps, rows stored into a paged cache.


@dataclasses.dataclass(frozen=True)
class StoreCase:
    cache_format: str
    config: Config
    lengths: tuple
    decode_tail: int  # the last tokens of each request, one per step, in chunked schedules

    @property
    def id(self) -> str:
        return f"{self.cache_format}-{self.config.name}"


STORE_CASES = {c.id: c for c in (
    StoreCase("none", MAIN, (300, 1, 57, 133), 9),
    StoreCase("fp8_ds_mla", MAIN, (300, 1, 57, 133), 9),
    StoreCase("fp8_ds_mla", HCA, (700, 127, 390), 130),
    StoreCase("fp8_block128", INDEXER, (300, 1, 57, 133), 9),
    StoreCase("mxfp4", INDEXER, (300, 1, 57, 133), 9),
)}


def store_params(*ids):
    return [pytest.param(STORE_CASES[i], id=i) for i in ids or STORE_CASES]


class Store:
    """Requests, their slots' state, block table and a cache of one format, on one device;
    the cache starts as random bytes, so any write shows."""

    def __init__(self, case: StoreCase, device, seed: int = 0, lengths=None):
        c = case.config
        self.case, self.config = case, c
        lengths = tuple(case.lengths if lengths is None else lengths)
        self.req = make_requests(lengths, c.ratio, c.coff, c.head_dim, DTYPE, device=device,
                                 seed=seed)
        gen = torch.Generator().manual_seed(seed + 1)
        self.norm_weight = (1 + 0.25 * torch.randn(c.head_dim, generator=gen)).to(device)
        self.cos, self.sin = rope_tables(c.rope_dim, max(lengths) + 1, device)
        num_slots = len(lengths) + 3
        self.slot_of = permuted_slots(len(lengths), num_slots, seed)
        self.state = CompressorState(num_slots, c.ratio, c.coff, c.head_dim, DTYPE, device)
        pages = max(1, -(-max(n // c.ratio for n in lengths) // PAGE_SIZE))
        num_pages = len(lengths) * pages + 2  # two spare pages nobody owns
        order = torch.randperm(num_pages, generator=gen)[:len(lengths) * pages]
        self.block_table = order.view(len(lengths), pages).to(device, torch.int32)
        self.cache = serving_store.new_cache(num_pages, PAGE_SIZE, c.head_dim,
                                             case.cache_format, DTYPE, device)
        fill = torch.randint(0, 256, self.cache.shape, generator=gen, dtype=torch.uint8)
        self.cache.copy_(fill if case.cache_format != "none" else fill.to(DTYPE) - 300)
        self.initial = self.cache.clone()

    @property
    def lengths(self) -> list:
        return self.req.lengths

    def args(self, step, consumed, state=None, cache=None) -> list:
        """The op's positional arguments for one step of (request, new tokens) pairs."""
        c = self.config
        state = self.state if state is None else state
        kv, score, cu, start_pos, slots = step_inputs(self.req, step, consumed, self.slot_of)
        table = self.block_table[[i for i, _ in step]]
        return [kv, score, self.req.ape, cu, start_pos, slots, state.kv, state.score,
                self.norm_weight, EPS, self.cos, self.sin, c.rope_dim, c.rotate,
                self.case.cache_format, self.cache if cache is None else cache, table,
                PAGE_SIZE, c.ratio, c.coff]

    def run(self, schedule) -> None:
        consumed = [0] * len(self.lengths)
        for step in schedule:
            cuc = STORE(*self.args(step, consumed))
            rows = [(consumed[i] + n) // self.config.ratio - consumed[i] // self.config.ratio
                    for i, n in step]
            assert cuc.tolist() == [sum(rows[:j]) for j in range(len(rows) + 1)]
            for i, n in step:
                consumed[i] += n

    def one_prefill(self) -> None:
        self.run([list(enumerate(self.lengths))])

    def training_rows(self) -> list:
        """The training op's rows of each request's whole sequence (position offset 0), on
        the CPU: what every stored row is the encoding of."""
        c, req = self.config, self.req
        counts = [n // c.ratio for n in self.lengths]
        cu, cuc = ([0] + [sum(v[:i + 1]) for i in range(len(v))] for v in (self.lengths,
                                                                             counts))
        as_int32 = {"dtype": torch.int32, "device": req.device}
        rows = epilogue.compressor_epilogue(
            torch.cat(req.kv), torch.cat(req.score), req.ape, torch.tensor(cu, **as_int32),
            torch.tensor(cuc, **as_int32), ratio=c.ratio, coff=c.coff,
            norm_weight=self.norm_weight, eps=EPS, cos=self.cos, sin=self.sin,
            rope_dim=c.rope_dim, rotate=c.rotate)
        return list(rows.cpu().split(counts))

    def cache_row(self, i: int, q: int) -> tuple:
        """(page, slot in the page) of request i's compressed row q."""
        return int(self.block_table[i, q // PAGE_SIZE]), q % PAGE_SIZE


def row_views(cache: torch.Tensor, cache_format: str) -> tuple:
    """The (num_pages, page_size, bytes or values) views a cache row is made of."""
    if cache_format == "fp8_ds_mla":
        return reference_epilogue.ds_mla_views(cache, PAGE_SIZE)
    return (cache,)


def expected_cache(s: Store, placed) -> torch.Tensor:
    """On the CPU: the initial cache with request i's row q encoded into its cache row for
    every (i, q) in ``placed``, and no other byte changed."""
    want = s.initial.cpu()
    encoded = [reference_epilogue.encode_rows(rows, s.case.cache_format)
               for rows in s.training_rows()]
    for view, part in zip(row_views(want, s.case.cache_format), zip(*encoded)):
        for i, q in placed:
            view[s.cache_row(i, q)] = part[i][q]
    return want


def all_rows(s: Store) -> list:
    return [(i, q) for i, n in enumerate(s.lengths) for q in range(n // s.config.ratio)]


@pytest.mark.parametrize("case", store_params())
def test_one_prefill_stores_the_training_rows_encoded(case):
    """Every cache row a request's block maps to holds the reference encoding (on the CPU)
    of the CUDA training op's row, where the pooled rows are bitwise equal by the serving
    contract; no other byte changes, the padding of fp8_ds_mla pages included."""
    s = Store(case, DEVICE, seed=1)
    s.one_prefill()
    assert_bitwise_equal(s.cache.cpu(), expected_cache(s, all_rows(s)), "cache")


@pytest.mark.parametrize("case", store_params())
def test_chunked_prefill_and_decode_store_what_one_prefill_stores(case):
    """Random prefill pieces, then decode steps mixed into the same calls (some of them
    pure decode steps): the whole cache bitwise that of one prefill."""
    whole = Store(case, DEVICE, seed=2)
    whole.one_prefill()
    chunked = Store(case, DEVICE, seed=2)
    schedule = random_schedule(chunked.lengths, case.config.ratio, seed=2,
                               decode_tail=case.decode_tail)
    assert any(all(n == 1 for _, n in step) for step in schedule), "no pure decode step"
    chunked.run(schedule)
    assert_bitwise_equal(chunked.cache, whole.cache, "cache")


SKIP_LENGTHS = (41, 23, 48, 17, 30)  # rows 10, 5, 12, 4, 7 at ratio 4: up to three pages
INVALID = {1: "slot", 3: "start_pos"}  # requests CUDA must skip, and what makes them invalid


@pytest.mark.parametrize("table", ["bad_pages", "narrow", "none_in_range"])
@pytest.mark.parametrize("case", store_params("fp8_ds_mla-d512_r4_c2", "mxfp4-d128_r4_c2_rot"))
def test_invalid_requests_and_pages_out_of_range_write_nothing(case, table):
    """One prefill call whose invalid requests (a slot past the state, a negative position)
    and block-table entries out of range (negative, past the cache, past the table's width)
    must write nothing: the whole cache equals the initial one with exactly the other rows
    stored."""
    s = Store(case, DEVICE, seed=3, lengths=SKIP_LENGTHS)
    args = s.args(list(enumerate(SKIP_LENGTHS)), [0] * len(SKIP_LENGTHS))
    args[5][1] = s.state.num_slots  # slots
    args[4][3] = -4  # start_pos
    rows = {(i, q) for i, q in all_rows(s) if i not in INVALID}
    if table == "bad_pages":
        args[16][0, 0] = -1  # request 0's rows 0..4
        args[16][2, 1] = s.cache.shape[0]  # request 2's rows 5..9
        rows -= {(0, q) for q in range(PAGE_SIZE)} | {(2, q) for q in range(5, 10)}
    elif table == "narrow":
        args[16] = args[16][:, :1].contiguous()
        rows = {(i, q) for i, q in rows if q < PAGE_SIZE}
    else:
        args[16].fill_(-3)
        rows = set()
    STORE(*args)
    assert_bitwise_equal(s.cache.cpu(), expected_cache(s, sorted(rows)), "cache")


BATCH, STEPS = 8, 6


@contextlib.contextmanager
def syncs_are_errors():
    """Inside, an operation that synchronizes the host with the device raises."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@pytest.mark.parametrize("case", store_params("none-d512_r4_c2", "fp8_ds_mla-d512_r4_c2",
                                              "fp8_block128-d128_r4_c2_rot",
                                              "mxfp4-d128_r4_c2_rot"))
def test_decode_step_replayed_from_a_cuda_graph_stores_what_eager_steps_store(case):
    """A decode step of BATCH requests captured once (after csa_ops.precompile_extend and a
    warm-up call: a capture fails on any host sync or compile), replayed with each step's
    tokens and positions copied into its inputs: after every step the cache, the offsets
    and the state equal an eager step's bitwise, and at the end the cache holds the
    training rows of the whole sequences encoded."""
    c = case.config
    # Staggered prefixes: each step completes blocks of some requests, of several at once.
    prefix = [c.ratio * (1 + i % 3) - 1 - i % c.ratio for i in range(BATCH)]
    s = Store(case, DEVICE, seed=4, lengths=[p + STEPS for p in prefix])
    s.run([list(enumerate(prefix))])
    eager_state = CompressorState(s.state.num_slots, c.ratio, c.coff, c.head_dim, DTYPE,
                                  DEVICE)
    eager_state.kv.copy_(s.state.kv)
    eager_state.score.copy_(s.state.score)
    eager_cache = s.cache.clone()
    csa_ops.precompile_extend(c.ratio, c.head_dim, c.coff, DTYPE)
    step = [(i, 1) for i in range(BATCH)]
    static = s.args(step, prefix)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the warm-up call, on scratch copies of state and cache
        scratch = CompressorState(s.state.num_slots, c.ratio, c.coff, c.head_dim, DTYPE,
                                  DEVICE)
        scratch_cache = s.cache.clone()
        with syncs_are_errors():  # names the line that syncs, where a capture cannot
            STORE(*static[:6], scratch.kv, scratch.score, *static[8:15], scratch_cache,
                  *static[16:])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_cuc = STORE(*static)
    consumed = list(prefix)
    for k in range(STEPS):
        fresh = s.args(step, consumed, state=eager_state, cache=eager_cache)
        for index in (0, 1, 4):  # kv, score, start_pos
            static[index].copy_(fresh[index])
        graph.replay()
        want_cuc = STORE(*fresh)
        assert_bitwise_equal(graph_cuc, want_cuc, f"cu_seqlens_comp of step {k}")
        assert_bitwise_equal(s.cache, eager_cache, f"cache after step {k}")
        consumed = [n + 1 for n in consumed]
    assert_bitwise_equal(s.state.kv, eager_state.kv, "kv_state")
    assert_bitwise_equal(s.state.score, eager_state.score, "score_state")
    assert_bitwise_equal(s.cache.cpu(), expected_cache(s, all_rows(s)), "cache")
