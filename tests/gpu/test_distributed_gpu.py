"""csa_ops.distributed on CUDA, bitwise against the single-GPU csa::compressor.

A group of one (NCCL, in this process) runs the CP path's kernels, forward and backward,
both layouts (zigzag's two chunks exchange a halo even on one rank), and its CP step
(compressor, gather_rows, backward) captured in a CUDA graph and replayed over new pack
boundaries under static capacities, and under torch.compile (Inductor: the index plan alone,
then the whole step). With two GPUs or more, one process per GPU runs the same checks at the
production configurations over the whole group. The layout model is the CPU test's
(tests/test_distributed.py), plain Python.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from test_distributed import Failures, local_positions, owned_rows, reporting

import csa_ops
from csa_ops import distributed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

LAYOUTS = ("contiguous", "zigzag")
DTYPE = torch.bfloat16
# (ratio, coff, head_dim): CSA, HCA, GLM-family training, and the other coff at each ratio.
CONFIGS = [(4, 2, 128), (4, 2, 512), (4, 1, 512), (128, 1, 512), (128, 2, 128), (2, 2, 128)]
# Long sequences crossing every rank, empty and sub-block ones, and one short enough that a
# ratio-128 halo spans the chunks of several ranks on eight GPUs.
LENGTHS = (4096, 3, 0, 1500, 700, 130, 8191)
# CUDA graphs: static token and row capacities, offsets padded to one B with empty sequences.
GRAPH_PACKS = [(3000, 5, 0, 1027), (4000,), (17, 0, 1, 2500, 64), (0,)]
GRAPH_CONFIG = (4, 2, 128)
TOKEN_CAPACITY, ROW_CAPACITY, TOTAL_CAPACITY = 4200, 1100, 1100


def _pack(lengths, ratio, coff, head_dim, seed):
    """The global pack, drawn on the CPU (the same on every rank) and moved to this GPU."""
    gen = torch.Generator().manual_seed(seed)
    width = coff * head_dim
    tokens = sum(lengths)
    kv = torch.randn(tokens, width, generator=gen).to(DTYPE)
    score = (torch.randn(tokens, width, generator=gen) * 2).to(DTYPE)
    ape = torch.randn(ratio, width, generator=gen) * 0.5
    cu, cuc = csa_ops.offsets_for(lengths, ratio)
    return [t.cuda() for t in (kv, score, ape, cu, cuc)]


def _probe(rows, head_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, head_dim, generator=gen).to(DTYPE).cuda()


def _probe_sum(rows, head_dim, world):
    """gather_rows' backward on an owner: the ranks' probes summed in rank order, fp32."""
    total = _probe(rows, head_dim, 100).float()
    for rank in range(1, world):
        total = total + _probe(rows, head_dim, 100 + rank).float()
    return total.to(DTYPE)


def _one_gpu(kv, score, ape, cu, cuc, ratio, coff, grad_out, total_comp=None):
    leaves = [t.clone().requires_grad_(True) for t in (kv, score, ape)]
    out = torch.ops.csa.compressor(*leaves, cu, cuc, ratio, coff, total_comp)
    return (out.detach(), *torch.autograd.grad(out, leaves, grad_out))


def _ape_close(failures, actual, expected, what):
    scale = float(expected.abs().max())
    ok = bool(((actual - expected).abs() <= 1e-3 * scale).all())
    failures.check(ok, f"{what}: grad_ape beyond 1e-3")


def check_case(group, world, rank, layout, config, capacity_spare, failures):
    ratio, coff, head_dim = config
    tag = f"P{world} {layout} r{ratio} c{coff} d{head_dim} spare={capacity_spare} rank {rank}"
    kv, score, ape, cu, cuc = _pack(LENGTHS, ratio, coff, head_dim, seed=ratio + coff)
    positions = torch.tensor(local_positions(LENGTHS, world, layout, rank)).cuda()
    mine = owned_rows(LENGTHS, ratio, world, layout, rank)
    largest = max(len(owned_rows(LENGTHS, ratio, world, layout, r)) for r in range(world))
    capacity = None if capacity_spare is None else largest + capacity_spare
    leaves = [t.clone().requires_grad_(True) for t in (kv[positions], score[positions], ape)]
    rows, row_index = distributed.compressor(*leaves, cu, cuc, ratio=ratio, coff=coff,
                                             group=group, layout=layout, capacity=capacity)
    true_rows = int(cuc[-1])
    grad_out = _probe(true_rows, head_dim, seed=7)
    grad_out[::3] = 0  # rows of zero gradient: -0 score gradients must survive
    ref = _one_gpu(kv, score, ape, cu, cuc, ratio, coff, grad_out)
    padding = rows.shape[0] - len(mine)
    failures.bitwise(row_index.cpu(), torch.tensor(mine + [-1] * padding), f"{tag}: row_index")
    failures.bitwise(rows.detach(), torch.cat([ref[0][mine], ref[0].new_zeros(padding, head_dim)]),
                     f"{tag}: rows")
    grad_rows = torch.cat([grad_out, torch.full_like(grad_out[:1], 7.0)])[row_index]
    grads = torch.autograd.grad(rows, leaves, grad_rows, retain_graph=True)
    for name, grad, expected in zip(("grad_kv", "grad_score"), grads, ref[1:3]):
        failures.bitwise(grad, expected[positions], f"{tag}: {name}")
    _ape_close(failures, grads[2], ref[3], tag)

    total_comp = true_rows + 2
    all_rows = distributed.gather_rows(rows, row_index, total_comp, group=group)
    failures.bitwise(all_rows.detach(), torch.cat([ref[0], ref[0].new_zeros(2, head_dim)]),
                     f"{tag}: gather_rows")
    summed = _probe_sum(total_comp, head_dim, world)
    grads = torch.autograd.grad(all_rows, leaves, _probe(total_comp, head_dim, 100 + rank))
    ref = _one_gpu(kv, score, ape, cu, cuc, ratio, coff, summed[:true_rows])
    for name, grad, expected in zip(("grad_kv", "grad_score"), grads, ref[1:3]):
        failures.bitwise(grad, expected[positions], f"{tag}: {name} through gather_rows")
    _ape_close(failures, grads[2], ref[3], f"{tag} through gather_rows")


def _padded_offsets(lengths, ratio, segments):
    return csa_ops.offsets_for(list(lengths) + [0] * (segments - len(lengths)), ratio, "cuda")


def check_graph_replays(group, world, rank, layout, failures):
    """The CP step (compressor, gather_rows, backward) captured once, replayed per pack."""
    ratio, coff, head_dim = GRAPH_CONFIG
    segments = max(len(p) for p in GRAPH_PACKS)
    width = coff * head_dim
    kv = torch.zeros(TOKEN_CAPACITY, width, dtype=DTYPE, device="cuda", requires_grad=True)
    score = torch.zeros_like(kv, requires_grad=True)
    ape = torch.zeros(ratio, width, device="cuda", requires_grad=True)
    cu, cuc = _padded_offsets(GRAPH_PACKS[0], ratio, segments)
    own_probe = _probe(TOTAL_CAPACITY, head_dim, 100 + rank)

    def load(lengths, seed):
        g_kv, g_score, g_ape, _, _ = _pack(lengths, ratio, coff, head_dim, seed)
        positions = torch.tensor(local_positions(lengths, world, layout, rank),
                                 dtype=torch.long).cuda()
        with torch.no_grad():
            for static, value in ((kv, g_kv[positions]), (score, g_score[positions])):
                static.normal_()  # tokens past the local pack are padding: never read
                static[:value.shape[0]] = value
            ape.copy_(g_ape)
            new_cu, new_cuc = _padded_offsets(lengths, ratio, segments)
            cu.copy_(new_cu)
            cuc.copy_(new_cuc)
        return g_kv, g_score, g_ape, positions

    def step():
        rows, row_index = distributed.compressor(kv, score, ape, cu, cuc, ratio=ratio, coff=coff,
                                                 group=group, layout=layout,
                                                 capacity=ROW_CAPACITY)
        all_rows = distributed.gather_rows(rows, row_index, TOTAL_CAPACITY, group=group)
        return (all_rows, *torch.autograd.grad(all_rows, (kv, score, ape), own_probe))

    load(GRAPH_PACKS[0], seed=0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream: kernels built, NCCL set up
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    summed = _probe_sum(TOTAL_CAPACITY, head_dim, world)
    for seed, lengths in enumerate(GRAPH_PACKS):
        g_kv, g_score, g_ape, positions = load(lengths, seed)
        graph.replay()
        torch.cuda.synchronize()
        tag = f"P{world} {layout} graph replay {lengths} rank {rank}"
        padded_cu, padded_cuc = _padded_offsets(lengths, ratio, segments)
        ref = _one_gpu(g_kv, g_score, g_ape, padded_cu, padded_cuc, ratio, coff, summed,
                       TOTAL_CAPACITY)
        failures.bitwise(captured[0], ref[0], f"{tag}: all rows")
        local = positions.shape[0]
        for name, grad, expected in zip(("grad_kv", "grad_score"), captured[1:3], ref[1:3]):
            failures.bitwise(grad[:local], expected[positions], f"{tag}: {name}")
            failures.check(not bool(grad[local:].any()), f"{tag}: {name} of padding tokens")
        _ape_close(failures, captured[3], ref[3], tag)


@pytest.fixture(scope="module")
def group_of_one(tmp_path_factory):
    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    store = dist.FileStore(str(tmp_path_factory.mktemp("cp") / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"r{c[0]}_c{c[1]}_d{c[2]}")
@pytest.mark.parametrize("capacity_spare", [None, 5], ids=["capacity_none", "static"])
def test_group_of_one_matches_the_op(group_of_one, layout, config, capacity_spare):
    failures = Failures()
    check_case(group_of_one, 1, 0, layout, config, capacity_spare, failures)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_group_of_one_cuda_graph_replays(group_of_one, layout):
    failures = Failures()
    check_graph_replays(group_of_one, 1, 0, layout, failures)
    assert not failures, "\n".join(failures)


def test_group_of_one_compiles_whole(group_of_one):
    """torch.compile(fullgraph=True), Inductor, of the static CP step: bitwise as eager."""
    ratio, coff, head_dim = CONFIGS[0]
    kv, score, ape, cu, cuc = _pack(LENGTHS, ratio, coff, head_dim, seed=3)
    total_comp = int(cuc[-1]) + 1
    own_probe = _probe(total_comp, head_dim, 100)

    def step(kv, score, ape, cu, cuc):
        rows, row_index = distributed.compressor(kv, score, ape, cu, cuc, ratio=ratio, coff=coff,
                                                 group=group_of_one, layout="zigzag",
                                                 capacity=total_comp)
        return distributed.gather_rows(rows, row_index, total_comp, group=group_of_one)

    def run(fn):
        leaves = [t.clone().requires_grad_(True) for t in (kv, score, ape)]
        all_rows = fn(*leaves, cu, cuc)
        return (all_rows.detach(), *torch.autograd.grad(all_rows, leaves, own_probe))

    torch._dynamo.reset()
    eager, compiled = run(step), run(torch.compile(step, fullgraph=True))
    torch._dynamo.reset()
    failures = Failures()
    for name, a, e in zip(("all_rows", "grad_kv", "grad_score", "grad_ape"), compiled, eager):
        failures.bitwise(a, e, f"compiled {name}")
    assert not failures, "\n".join(failures)


def test_plan_compiles_bitwise():
    """The CP index plan alone under Inductor (Triton searchsorted on CUDA) against eager:
    the stage where a search over a sliced offset tensor went one segment off on torch 2.11,
    and with it every output of the compiled step."""
    ratio, coff, head_dim = CONFIGS[0]
    failures = Failures()
    cu, cuc = csa_ops.offsets_for(LENGTHS, ratio, "cuda")
    # The failing test's rank, an inner contiguous rank, a zigzag rank of a real exchange.
    for layout, world, rank in (("zigzag", 1, 0), ("contiguous", 3, 1), ("zigzag", 2, 1)):
        zigzag = layout == "zigzag"
        segments = len(LENGTHS) * (2 if zigzag else 1)
        capacity = max(len(owned_rows(LENGTHS, ratio, world, layout, r)) for r in range(world))
        tokens = len(local_positions(LENGTHS, world, layout, rank)) + 3  # 3 padding tokens
        geo = distributed._Geometry(world, rank, zigzag, ratio, coff, head_dim, segments,
                                    coff * ratio - 1, tokens, capacity + 2,
                                    capacity + 2 + segments * (coff - 1))

        def plan(cu, cuc, geo=geo):
            return tuple(distributed._plan(cu, cuc, geo))

        torch._dynamo.reset()
        compiled = torch.compile(plan, fullgraph=True)(cu, cuc)
        for name, a, e in zip(distributed._Plan._fields, compiled, plan(cu, cuc)):
            failures.bitwise(a, e, f"P{world} {layout} rank {rank}: compiled plan {name}")
    torch._dynamo.reset()
    assert not failures, "\n".join(failures)


def gpu_worker(rank: int, world: int, directory: str):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    store = dist.FileStore(os.path.join(directory, "store"), world)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    failures = Failures()
    with reporting(directory, rank, failures):
        for layout in LAYOUTS:
            for config in CONFIGS:
                check_case(None, world, rank, layout, config, 3, failures)
            check_case(None, world, rank, layout, CONFIGS[0], None, failures)
            check_graph_replays(None, world, rank, layout, failures)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices or more")
def test_every_gpu_matches_one_gpu(tmp_path):
    world = torch.cuda.device_count()
    for ratio, coff, head_dim in CONFIGS:  # the ranks then load the kernels from the cache
        csa_ops.precompile(ratio, head_dim, coff, DTYPE)
    torch.multiprocessing.spawn(gpu_worker, args=(world, str(tmp_path)), nprocs=world)
    failures = []
    for rank in range(world):
        with open(tmp_path / f"rank{rank}.json") as f:
            failures += json.load(f)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:30])
