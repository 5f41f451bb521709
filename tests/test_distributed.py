"""csa_ops.distributed on CPU with gloo: every CP result bitwise against one process.

One set of 4 processes (forkserver, one torch import) runs everything: groups of 1, 2, 3 and
4 ranks, both layouts, ragged packs whose sequences cross several ranks, short and empty
sequences, ratio-128 halos spanning several chunks, static capacities with padding tokens;
forward, backward (twice: bitwise run-to-run), gather_rows both ways, the errors (raised on
every rank, the group usable afterwards) and a torch.compile(fullgraph=True) step; in this
process, the index plan under a search that ignores view offsets. The model of the layouts
here is plain Python, independent of the module's tensor formulas.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import multiprocessing
import os
import re
import time
import traceback

import torch
import torch.distributed as dist
from helpers import assert_bitwise_equal

import csa_ops
from csa_ops import distributed

PROCESSES = 4
GROUP_SIZES = (1, 2, 3, 4)
LAYOUTS = ("contiguous", "zigzag")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    lengths: tuple
    ratio: int
    coff: int
    head_dim: int
    dtype: torch.dtype
    spare_rows: int | None = None  # None: capacity=None; else the largest owned count + this
    spare_tokens: int = 0          # padding tokens after each local pack (static form only)
    ape_dtype: torch.dtype = torch.float32


BF16, FP32 = torch.bfloat16, torch.float32
CASES = [
    Case("r2c2_ragged", (37, 0, 5, 64, 1), 2, 2, 8, FP32),
    Case("r2c2_static", (23, 9, 0, 41), 2, 2, 16, BF16, spare_rows=3, spare_tokens=2),
    Case("r4c1_ape_bf16", (50, 3, 0, 29), 4, 1, 16, BF16, ape_dtype=BF16),
    Case("r4c2_static", (61, 7, 130, 0, 2), 4, 2, 8, FP32, spare_rows=2, spare_tokens=3),
    Case("r4c2_bf16", (97, 1, 33), 4, 2, 8, BF16),
    Case("r128c1_static", (300, 0, 129, 5), 128, 1, 8, BF16, spare_rows=1, spare_tokens=1),
    Case("r128c2", (520, 127, 256), 128, 2, 8, FP32),
    Case("r1c1_no_halo", (5, 0, 3), 1, 1, 8, FP32, spare_rows=0),
    Case("no_sequences", (), 4, 2, 8, FP32, spare_rows=2),
    Case("no_complete_block", (3, 1, 0), 4, 2, 8, FP32),
]


# --- the layouts in plain Python ---------------------------------------------------------

def rank_chunks(rank: int, world: int, layout: str) -> list[int]:
    return [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]


def cuts(length: int, world: int, layout: str) -> list[int]:
    n = world * (2 if layout == "zigzag" else 1)
    return [(c * length) // n for c in range(n + 1)]


def local_positions(lengths, world: int, layout: str, rank: int) -> list[int]:
    """Global token positions of a rank's local pack, in local order."""
    positions, start = [], 0
    for length in lengths:
        cut = cuts(length, world, layout)
        for chunk in rank_chunks(rank, world, layout):
            positions += range(start + cut[chunk], start + cut[chunk + 1])
        start += length
    return positions


def owned_rows(lengths, ratio: int, world: int, layout: str, rank: int) -> list[int]:
    """Global rows whose block's last token the rank holds, in global order."""
    rows, row = [], 0
    mine = rank_chunks(rank, world, layout)
    for length in lengths:
        cut = cuts(length, world, layout)
        for block in range(length // ratio):
            last = (block + 1) * ratio - 1
            holder = next(c for c in range(len(cut) - 1) if cut[c] <= last < cut[c + 1])
            if holder in mine:
                rows.append(row)
            row += 1
    return rows


def capacity_of(case: Case, world: int, layout: str):
    if case.spare_rows is None:
        return None
    largest = max(len(owned_rows(case.lengths, case.ratio, world, layout, r)) for r in
                  range(world))
    return largest + case.spare_rows


# --- the one-process reference -------------------------------------------------------------

def global_pack(case: Case):
    gen = torch.Generator().manual_seed(len(case.lengths) * 1000 + case.ratio * 10 + case.coff)
    width = case.coff * case.head_dim
    tokens = sum(case.lengths)

    def draw(rows, scale, dtype):
        return (torch.randn(rows, width, generator=gen, dtype=torch.float64) * scale).to(dtype)

    kv, score = draw(tokens, 1.0, case.dtype), draw(tokens, 2.0, case.dtype)
    ape = draw(case.ratio, 0.5, case.ape_dtype)
    cu, cuc = csa_ops.offsets_for(case.lengths, case.ratio)
    return kv, score, ape, cu, cuc


def probe(rows: int, case: Case, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, case.head_dim, generator=gen, dtype=torch.float64).to(case.dtype)


def one_process(kv, score, ape, cu, cuc, case: Case, grad_out):
    leaves = [t.clone().requires_grad_(True) for t in (kv, score, ape)]
    out = torch.ops.csa.compressor(*leaves, cu, cuc, case.ratio, case.coff)
    return (out.detach(), *torch.autograd.grad(out, leaves, grad_out))


def ordered_probe_sum(case: Case, rows: int, world: int) -> torch.Tensor:
    """What gather_rows' backward gives an owner: the ranks' probes summed in rank order, fp32,
    rounded once."""
    total = probe(rows, case, seed=100).float()
    for rank in range(1, world):
        total = total + probe(rows, case, seed=100 + rank).float()
    return total.to(case.dtype)


def ape_close(actual, expected, case: Case) -> bool:
    # A bf16 grad_ape is the fp32 sum rounded once: orders may round one step apart.
    rtol = 2.0**-7 if case.ape_dtype == BF16 else 0.0
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    diff = (actual.double() - expected.double()).abs()
    return bool((diff <= 1e-3 * scale + rtol * expected.double().abs()).all())


# --- one case on one rank --------------------------------------------------------------------

class Failures(list):
    """Mismatches collected, not raised: a rank that stopped early would leave the others
    waiting in the next collective."""

    def check(self, ok: bool, what: str):
        if not ok:
            self.append(what)

    def bitwise(self, actual, expected, what: str):
        try:
            assert_bitwise_equal(actual, expected, what)
        except AssertionError as error:
            self.append(str(error))


def run_case(case: Case, layout: str, group, world: int, rank: int, failures: Failures):
    tag = f"P{world} {layout} {case.name} rank {rank}"
    kv, score, ape, cu, cuc = global_pack(case)
    total_rows = int(cuc[-1])
    capacity = capacity_of(case, world, layout)
    positions = torch.tensor(local_positions(case.lengths, world, layout, rank), dtype=torch.long)
    padding = case.spare_tokens if capacity is not None else 0
    gen = torch.Generator().manual_seed(rank)
    pad = torch.randn(padding, kv.shape[1], generator=gen).to(case.dtype)
    leaves = [torch.cat([kv[positions], pad]), torch.cat([score[positions], pad]), ape.clone()]
    leaves = [t.requires_grad_(True) for t in leaves]
    rows, row_index = distributed.compressor(*leaves, cu, cuc, ratio=case.ratio, coff=case.coff,
                                             group=group, layout=layout, capacity=capacity)

    mine = owned_rows(case.lengths, case.ratio, world, layout, rank)
    groups_largest = max(len(owned_rows(case.lengths, case.ratio, world, layout, r))
                         for r in range(world))
    expected_rows = groups_largest if capacity is None else capacity
    grad_out = probe(total_rows, case, seed=7)
    # Rows of zero gradient give -0 score gradients (p * (-0 - +0)): a sum of a +0 from a
    # rank that does not consume an element would turn them into +0.
    grad_out[::3] = 0
    ref = one_process(kv, score, ape, cu, cuc, case, grad_out)
    expected_index = torch.tensor(mine + [-1] * (expected_rows - len(mine)), dtype=torch.long)
    failures.bitwise(row_index, expected_index, f"{tag}: row_index")
    failures.bitwise(rows.detach(), torch.cat([ref[0][mine], ref[0].new_zeros(
        expected_rows - len(mine), case.head_dim)]), f"{tag}: rows")

    # Padding rows (index -1: the appended row) get a nonzero gradient: it must reach nothing.
    grad_rows = torch.cat([grad_out, torch.full((1, case.head_dim), 7.0, dtype=case.dtype)])
    grad_rows = grad_rows[row_index]
    grads = torch.autograd.grad(rows, leaves, grad_rows, retain_graph=True)
    again = torch.autograd.grad(rows, leaves, grad_rows, retain_graph=True)
    for name, grad, expected in zip(("grad_kv", "grad_score"), grads, ref[1:3]):
        failures.bitwise(grad, torch.cat([expected[positions], torch.zeros_like(pad)]),
                         f"{tag}: {name}")
    failures.check(ape_close(grads[2], ref[3], case), f"{tag}: grad_ape beyond 1e-3")
    for name, first, second in zip(("grad_kv", "grad_score", "grad_ape"), grads, again):
        failures.bitwise(second, first, f"{tag}: {name} run to run")

    total_comp = total_rows + 2
    all_rows = distributed.gather_rows(rows, row_index, total_comp, group=group)
    failures.bitwise(all_rows.detach(), torch.cat([ref[0], ref[0].new_zeros(2, case.head_dim)]),
                     f"{tag}: gather_rows")
    own_probe = probe(total_comp, case, seed=100 + rank)
    grad_rows, *gathered_grads = torch.autograd.grad(all_rows, [rows, *leaves], own_probe)
    summed = ordered_probe_sum(case, total_comp, world)
    expected = torch.cat([summed, summed.new_zeros(1, case.head_dim)])[row_index]
    failures.bitwise(grad_rows, expected, f"{tag}: gather_rows backward")
    ref = one_process(kv, score, ape, cu, cuc, case, summed[:total_rows])
    for name, grad, expected in zip(("grad_kv", "grad_score"), gathered_grads, ref[1:3]):
        failures.bitwise(grad, torch.cat([expected[positions], torch.zeros_like(pad)]),
                         f"{tag}: {name} through gather_rows")
    failures.check(ape_close(gathered_grads[2], ref[3], case),
                   f"{tag}: grad_ape through gather_rows beyond 1e-3")


# --- errors: raised on every rank of the group, which stays usable -------------------------

ERROR_CASE = Case("errors", (61, 7, 130, 0, 2), 4, 2, 8, FP32)


def local_inputs(case: Case, world: int, layout: str, rank: int, lengths=None):
    kv, score, ape, _, _ = global_pack(case)
    lengths = case.lengths if lengths is None else lengths
    positions = local_positions(lengths, world, layout, rank)
    cu, cuc = csa_ops.offsets_for(lengths, case.ratio)
    return kv[positions], score[positions], ape, cu, cuc


def expect_error(failures: Failures, tag: str, error, pattern: str, call, group):
    try:
        call()
        failures.append(f"{tag}: no {error.__name__} raised")
    except error as caught:
        failures.check(bool(re.search(pattern, str(caught))),
                       f"{tag}: {error.__name__} {caught!s:.300} does not match {pattern!r}")
    dist.barrier(group)  # every rank got here: none is left waiting in a collective


def compressor_errors(group, world: int, rank: int, failures: Failures):
    case, last = ERROR_CASE, world - 1
    base = local_inputs(case, world, "contiguous", rank)
    largest = max(len(owned_rows(case.lengths, 4, world, "contiguous", r)) for r in range(world))

    def call(kv, score, ape, cu, cuc, **options):
        options = {"ratio": 4, "coff": 2, "group": group, **options}
        return lambda: distributed.compressor(kv, score, ape, cu, cuc, **options)

    shifted = local_inputs(case, world, "contiguous", rank, lengths=(60, 8, 130, 0, 2))
    longer = local_inputs(case, world, "contiguous", rank, lengths=(*case.lengths, 0))
    kv, score, ape, cu, cuc = base
    checks = [
        ("offsets differ", ValueError, r"`cu_seqlens` \(a checksum.*differs between ranks 0 and",
         call(*(shifted if rank == last else base))),
        ("sequence counts differ", ValueError, r"number of sequences .*differs",
         call(*(longer if rank == last else base))),
        ("kv short, capacity None", ValueError, r"`kv` of rank 0 has \d+ tokens.*exactly",
         call(kv[:-1] if rank == 0 else kv, score[:-1] if rank == 0 else score, ape, cu, cuc)),
        ("kv long, capacity None", ValueError, r"`kv` of rank 0 has .*exactly",
         call(torch.cat([kv, kv[:1]]) if rank == 0 else kv,
              torch.cat([score, score[:1]]) if rank == 0 else score, ape, cu, cuc)),
        ("kv short, static", ValueError, rf"`kv` of rank {last} has .*at least",
         call(kv[:-1] if rank == last else kv, score[:-1] if rank == last else score, ape, cu,
              cuc, capacity=largest)),
        ("capacity below owned rows", ValueError, rf"`capacity` = {largest - 1} is smaller",
         call(*base, capacity=largest - 1)),
        ("capacity differs", ValueError, r"`capacity` \(-1 = None\) differs",
         call(*base, capacity=largest + (rank == last))),
        ("score dtype on one rank", ValueError,
         r"`score` must have the dtype" if rank == last else rf"rank {last} .*rejected",
         call(kv, score.to(BF16) if rank == last else score, ape, cu, cuc)),
        ("cu_seqlens_comp inconsistent", ValueError, r"`cu_seqlens_comp` must count",
         call(kv, score, ape, cu, cuc + torch.tensor([0, 0, 0, 0, 0, 1], dtype=torch.int32))),
        ("layout", ValueError, r"`layout` must be one of contiguous, zigzag",
         call(*base, layout="ring")),
        ("capacity < 0", ValueError, r"`capacity` must be an int >= 0", call(*base, capacity=-1)),
        ("ratio", ValueError, r"^csa_ops.distributed.compressor: `ratio` must be",
         call(*base, ratio=0)),
        ("coff", ValueError, r"`coff` must be 1 or 2", call(*base, coff=3)),
    ]
    for name, error, pattern, thunk in checks:
        expect_error(failures, f"P{world} rank {rank} {name}", error, pattern, thunk, group)


def gather_errors(group, world: int, rank: int, failures: Failures):
    kv, score, ape, cu, cuc = local_inputs(ERROR_CASE, world, "contiguous", rank)
    rows, index = distributed.compressor(kv, score, ape, cu, cuc, ratio=4, coff=2, group=group)
    true_rows, last = int(cuc[-1]), world - 1

    def gather(rows, index, total_comp):
        return lambda: distributed.gather_rows(rows, index, total_comp, group=group)

    checks = [
        ("total_comp too small", r"`total_comp` = \d+ is smaller than the row count",
         gather(rows, index, true_rows - 1)),
        ("total_comp differs", r"`total_comp` differs",
         gather(rows, index, true_rows + (rank == last))),
        ("row capacity differs", r"row count of `rows` .*differs",
         gather(rows[:-1], index[:-1], true_rows) if rank == last else gather(rows, index,
                                                                               true_rows)),
        ("row_index dtype", r"`row_index` must be a 1-D int64" if rank == last
         else rf"rank {last} .*rejected", gather(rows, index.int() if rank == last else index,
                                                 true_rows)),
        ("total_comp type", r"`total_comp` must be an int >= 0", gather(rows, index, None)),
    ]
    for name, pattern, thunk in checks:
        expect_error(failures, f"P{world} rank {rank} gather {name}", ValueError, pattern, thunk,
                     group)


# --- torch.compile: the static form traces whole; capacity=None breaks the graph ----------

def compiled_steps(group, world: int, rank: int, failures: Failures):
    case, layout = CASES[3], "zigzag"
    kv, score, ape, cu, cuc = local_inputs(case, world, layout, rank)
    total_comp = int(cuc[-1]) + 1
    own_probe = probe(total_comp, case, seed=100 + rank)

    def step(kv, score, ape, cu, cuc, capacity):
        rows, index = distributed.compressor(kv, score, ape, cu, cuc, ratio=case.ratio,
                                             coff=case.coff, group=group, layout=layout,
                                             capacity=capacity)
        return distributed.gather_rows(rows, index, total_comp, group=group)

    def run(fn, capacity):
        leaves = [t.clone().requires_grad_(True) for t in (kv, score, ape)]
        all_rows = fn(*leaves, cu, cuc, capacity)
        return (all_rows.detach(), *torch.autograd.grad(all_rows, leaves, own_probe))

    capacity = capacity_of(case, world, layout)
    torch._dynamo.reset()
    eager = run(step, capacity)
    # aot_eager: Dynamo and AOTAutograd trace forward and backward, no C++ build on the CPU.
    for form, fullgraph, cap in (("static", True, capacity), ("capacity=None", False, None)):
        compiled = run(torch.compile(step, backend="aot_eager", fullgraph=fullgraph), cap)
        for name, a, e in zip(("all_rows", "grad_kv", "grad_score", "grad_ape"), compiled, eager):
            failures.bitwise(a, e, f"P{world} rank {rank} compiled {form} {name}")
    try:
        torch.compile(step, backend="aot_eager", fullgraph=True)(kv, score, ape, cu, cuc, None)
        failures.append(f"rank {rank}: capacity=None traced whole under fullgraph=True")
    except torch._dynamo.exc.Unsupported:
        pass
    torch._dynamo.reset()


# --- the process set -------------------------------------------------------------------------

@contextlib.contextmanager
def reporting(directory: str, rank: int, failures: Failures):
    """A rank's body: an exception it raises is recorded (and raised again), and the rank's
    failures land in rank<k>.json for the parent whatever happens; the process group is
    destroyed after a body that returns."""
    try:
        yield
    except Exception:
        failures.append(f"rank {rank} raised:\n{traceback.format_exc()}")
        raise
    finally:
        with open(os.path.join(directory, f"rank{rank}.json"), "w") as f:
            json.dump(list(failures), f)
    dist.destroy_process_group()


def worker(rank: int, directory: str):
    torch.set_num_threads(1)  # four processes share the machine's cores
    failures = Failures()
    with reporting(directory, rank, failures):
        try:
            distributed.gather_rows(torch.zeros(1, 8), torch.zeros(1, dtype=torch.long), 1)
            failures.append(f"rank {rank}: no error before init_process_group")
        except RuntimeError as error:
            failures.check("torch.distributed is not initialized" in str(error), str(error))
        store = dist.FileStore(os.path.join(directory, "store"), PROCESSES)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=PROCESSES,
                                timeout=datetime.timedelta(seconds=60))
        for size in GROUP_SIZES:
            # The default group for all four processes (group=None), a new group otherwise.
            group = None if size == PROCESSES else dist.new_group(list(range(size)))
            if rank < size:
                for layout in LAYOUTS:
                    for case in CASES:
                        run_case(case, layout, group, size, rank, failures)
                if size in (2, 3):
                    compressor_errors(group, size, rank, failures)
                    gather_errors(group, size, rank, failures)
            dist.barrier()
        pair = dist.new_group([0, 1])
        if rank < 2:
            compiled_steps(pair, 2, rank, failures)
        dist.barrier()


def test_context_parallel_matches_one_process(tmp_path):
    # A forkserver imports torch and this module once; each rank is a fork of it.
    multiprocessing.set_forkserver_preload(["torch", "csa_ops", "pytest"])
    context = torch.multiprocessing.start_processes(
        worker, args=(str(tmp_path),), nprocs=PROCESSES, join=False, start_method="forkserver")
    deadline = time.monotonic() + 240
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise AssertionError("the CP processes did not finish in 240 s")
    failures = []
    for rank in range(PROCESSES):
        with open(tmp_path / f"rank{rank}.json") as f:
            failures += json.load(f)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:30])


def test_chunk_of_inverts_the_cut_points():
    """The closed form the module uses for "which chunk holds token u" against the cuts."""
    for chunks in range(1, 9):
        for length in range(40):
            cut = cuts(length, chunks, "contiguous")
            offsets = torch.arange(length)
            expected = [next(c for c in range(chunks) if cut[c] <= u < cut[c + 1])
                        for u in range(length)]
            found = distributed._chunk_of(offsets, torch.tensor(length), chunks)
            assert found.tolist() == expected, (chunks, length)


def _plan_of(lengths, ratio: int, coff: int, world: int, rank: int, layout: str):
    """The module's index tables of one rank's static call, as compressor builds them."""
    cu, cuc = csa_ops.offsets_for(lengths, ratio)
    zigzag = layout == "zigzag"
    segments = len(lengths) * (2 if zigzag else 1)
    capacity = max(len(owned_rows(lengths, ratio, world, layout, r)) for r in range(world)) + 1
    tokens = len(local_positions(lengths, world, layout, rank)) + 2  # two padding tokens
    geo = distributed._Geometry(world, rank, zigzag, ratio, coff, 8, segments,
                                coff * ratio - 1, tokens, capacity,
                                capacity + segments * (coff - 1))
    return distributed._plan(cu, cuc, geo)


def test_plan_holds_under_a_search_that_ignores_view_offsets(monkeypatch):
    """torch 2.11's Inductor searches a sliced boundary tensor (cu[1:]) from its buffer's
    start on CUDA: compiled CP steps put every position one segment too far. The plan must
    not depend on the boundary tensor's storage offset. A search that drops it (as that
    lowering does) must give the same tables, bit for bit."""
    real_search = torch.searchsorted
    packs = [((4096, 3, 0, 1500, 700, 130, 8191), 4, 2), ((61, 7, 130, 0, 2), 4, 2),
             ((300, 0, 129, 5), 128, 1), ((5, 0, 3), 1, 1)]
    expected = {}
    for lengths, ratio, coff in packs:
        for world, layout in ((1, "zigzag"), (3, "contiguous"), (2, "zigzag")):
            for rank in range(world):
                key = (lengths, ratio, coff, world, rank, layout)
                expected[key] = _plan_of(lengths, ratio, coff, world, rank, layout)

    def search_from_buffer_start(sorted_sequence, values, **options):
        base = sorted_sequence.as_strided(sorted_sequence.shape, sorted_sequence.stride(), 0)
        return real_search(base, values, **options)

    monkeypatch.setattr(torch, "searchsorted", search_from_buffer_start)
    for key, plan in expected.items():
        for name, found, wanted in zip(plan._fields, _plan_of(*key), plan):
            assert_bitwise_equal(found, wanted, f"{key}: {name}")
