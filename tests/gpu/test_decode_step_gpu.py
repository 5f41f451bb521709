"""csa::compressor_extend_store's decode step in one kernel (kernels/window/extend_store.py) on
CUDA, against the same step as two launches (the extend kernel, then the store kernel, which
tests/gpu/test_store_kernel_gpu.py holds to the torch route): cu_seqlens_comp, both state
tensors and the whole cache bitwise, for every format, each row dtype, ratios 2 to 8 at both
coffs, rows the epilogue holds in one to four warps; with requests that complete a block and
requests that do not, invalid requests (a slot past the state, a negative position), block-
table entries out of range (negative, past the cache, past the table's width), positions past
the RoPE tables, and calls of one token per request on average whose requests hold several
rows or none. What the kernel does not take, it declines before writing anything.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import assert_bitwise_equal

import csa_ops
from csa_ops import CompressorState, host, row_epilogue, serving_store

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = "cuda"
STORE = torch.ops.csa.compressor_extend_store.default
PAGE_SIZE = 5
TABLE_ROWS = 48  # RoPE positions: some rows sit past them (the last table row)
TABLE_WIDTH = 5  # pages per request: rows from PAGE_SIZE * TABLE_WIDTH on write nothing


@dataclasses.dataclass(frozen=True)
class Case:
    cache_format: str
    ratio: int
    coff: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    weight_dtype: torch.dtype = torch.float32
    rope_dim: int = 64
    rotate: bool = False

    @property
    def id(self) -> str:
        return (f"{self.cache_format}-r{self.ratio}c{self.coff}-d{self.head_dim}-"
                f"{str(self.dtype)[6:]}-w{str(self.weight_dtype)[6:]}-rope{self.rope_dim}"
                f"{'-rot' if self.rotate else ''}")


CASES = [
    Case("fp8_ds_mla", 4, 2, 512),  # DeepSeek-V4's main compressor
    Case("mxfp4", 4, 2, 128, rotate=True, weight_dtype=torch.bfloat16),  # its indexer's
    Case("fp8_block128", 4, 1, 256, torch.float16, rope_dim=0),
    Case("none", 2, 2, 512, torch.float32, rotate=True),
    Case("none", 8, 2, 128, rope_dim=2),
    Case("fp8_ds_mla", 2, 1, 512, torch.float16, torch.float16),
]


class Step:
    """One call's inputs: random state, tokens and positions, a block table with entries out
    of range and a cache of random bytes (so any write shows)."""

    def __init__(self, case: Case, lengths, seed: int, page_size: int = PAGE_SIZE,
                 width: int = TABLE_WIDTH, table_rows: int = TABLE_ROWS):
        gen = torch.Generator().manual_seed(seed)
        self.page_size = page_size
        r, c, d = case.ratio, case.coff, case.head_dim
        batch = len(lengths)
        self.case = case
        self.num_slots = batch + 3
        tokens = sum(lengths)

        def draw(*shape, dtype=case.dtype, scale=1.0):
            return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)

        self.kv, self.score = draw(tokens, c * d), draw(tokens, c * d, scale=2.0)
        self.ape = draw(r, c * d, dtype=torch.float32)
        state = CompressorState(self.num_slots, r, c, d, case.dtype, "cpu")
        self.kv_state = draw(*state.kv.shape)
        self.score_state = draw(*state.score.shape, dtype=torch.float32, scale=2.0)
        # Half the requests complete a block with their next token.
        starts = torch.randint(0, 24 * r, (batch,), generator=gen)
        starts[::2] = starts[::2] // r * r + r - 1
        slots = torch.randperm(self.num_slots, generator=gen)[:batch].to(torch.int32)
        num_pages = batch * width
        table = torch.randperm(num_pages + 4, generator=gen)[:batch * width]
        table = table.view(batch, width).to(torch.int32)
        if batch > 7:
            starts[1] = 0  # its first block
            starts[3] = -4  # invalid: writes nothing
            slots[5] = self.num_slots  # invalid
            starts[7] = (page_size * width + 1) * r - 1  # a row past the table's width
            table[0, :] = -1
            table[2, :] = num_pages + 1  # past the cache
        self.start_pos = starts.to(torch.int32)
        self.slots = slots
        self.cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(),
                               dtype=torch.int32)
        self.block_table = table
        self.norm_weight = (1 + 0.25 * torch.randn(d, generator=gen)).to(case.weight_dtype)
        angles = torch.arange(table_rows, dtype=torch.float64)[:, None] * 10000.0 ** (
            -torch.arange(0, max(case.rope_dim, 2), 2, dtype=torch.float64)
            / max(case.rope_dim, 2))
        half = case.rope_dim // 2
        rows = table_rows if half else 0
        self.cos = torch.cos(angles)[:rows, :half].float().contiguous()
        self.sin = torch.sin(angles)[:rows, :half].float().contiguous()
        cache = serving_store.new_cache(num_pages, page_size, d, case.cache_format, case.dtype)
        fill = torch.randint(0, 256, cache.shape, generator=gen, dtype=torch.uint8)
        self.cache = fill if case.cache_format != "none" else fill.to(case.dtype) - 100

    def args(self) -> list:
        """The op's arguments on the GPU, state and cache fresh copies."""
        c = self.case
        on = [t.to(DEVICE, copy=True) for t in (
            self.kv, self.score, self.ape, self.cu, self.start_pos, self.slots, self.kv_state,
            self.score_state, self.norm_weight)]
        return [*on, 1e-6, self.cos.to(DEVICE), self.sin.to(DEVICE), c.rope_dim, c.rotate,
                c.cache_format, self.cache.to(DEVICE, copy=True), self.block_table.to(DEVICE),
                self.page_size, c.ratio, c.coff]


def fused(args) -> torch.Tensor | None:
    capacity = serving_store._row_capacity(args[0], args[3], args[4], args[18], False)
    return row_epilogue.launch_extend_store(*args, capacity)


def assert_same_step(got: list, got_cuc, want: list, want_cuc) -> None:
    assert_bitwise_equal(got_cuc, want_cuc, "cu_seqlens_comp")
    assert_bitwise_equal(got[6], want[6], "kv_state")
    assert_bitwise_equal(got[7], want[7], "score_state")
    assert_bitwise_equal(got[15], want[15], "cache")


def assert_fused_stores_what_two_launches_store(step: Step) -> list:
    """The call by the fused kernels (which must take it) against the extend and store
    kernels; returns the fused call's arguments."""
    got = step.args()
    got_cuc = fused(got)
    assert got_cuc is not None, "the fused kernels did not take the call"
    want = step.args()
    with row_epilogue.two_launch_step():
        want_cuc = STORE(*want)
    assert_same_step(got, got_cuc, want, want_cuc)
    return got


def assert_a_replay_stores_what_an_eager_call_stores(step: Step) -> None:
    """A call captured by the fused kernels (compiled before: a capture cannot compile) and
    replayed from the same state and cache stores what the eager op stores."""
    eager = step.args()
    eager_cuc = STORE(*eager)
    replayed = step.args()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_cuc = fused(replayed)
    assert graph_cuc is not None, "the capture did not take the fused kernels"
    for i, t in ((6, step.kv_state), (7, step.score_state), (15, step.cache)):
        replayed[i].copy_(t.to(DEVICE))  # the capture ran nothing; as before the call
    graph.replay()
    torch.cuda.synchronize()
    assert_same_step(replayed, graph_cuc, eager, eager_cuc)


UNEVEN = {  # one token per request on average, some requests with several rows or none
    "decode": lambda batch, r: [1] * batch,
    "uneven": lambda batch, r: [3 * r + 1, 0, 0, 2] + [0] * (3 * r - 1) + [1] * (batch - 3 * r - 3),
}


@pytest.mark.parametrize("pattern", list(UNEVEN))
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_adversarial_step_in_one_launch_stores_what_two_launches_store(case, pattern):
    lengths = UNEVEN[pattern](40, case.ratio)
    assert sum(lengths) == len(lengths)  # a decode step's size class
    step = Step(case, lengths, seed=CASES.index(case))
    got = assert_fused_stores_what_two_launches_store(step)
    assert not torch.equal(got[15].cpu(), step.cache), "nothing was stored"


@pytest.mark.parametrize("batch", [1, 300])
def test_one_and_many_requests(batch):
    """A step of one request and one past the decode-sized class (its own size class, the
    same kernel)."""
    case = CASES[0]
    lengths = [1] * batch
    step = Step(case, lengths, seed=batch)
    if batch == 1:  # the one request must be valid and complete a block
        step.start_pos[0], step.slots[0] = 4 * case.ratio - 1, 0
    assert_fused_stores_what_two_launches_store(step)


@pytest.mark.parametrize("case", [
    pytest.param(Case("none", 16, 2, 512), id="window32-d512"),  # ape's rows past its smem
    pytest.param(Case("mxfp4", 4, 2, 64, rope_dim=0), id="d64"),  # half a warp per row
    pytest.param(Case("none", 4, 2, 1024, torch.float32), id="fp32-d1024"),  # 32-byte vectors
])
def test_what_the_kernel_does_not_take_it_declines(case):
    step = Step(case, [1] * 12, seed=7)
    args = step.args()
    before = [args[i].clone() for i in (6, 7, 15)]
    assert fused(args) is None
    for name, i, b in zip(("kv_state", "score_state", "cache"), (6, 7, 15), before):
        assert_bitwise_equal(args[i], b, name)


def test_a_captured_step_replays_the_one_launch_bytes():
    """precompile_store with the configuration builds the fused kernel, so a capture takes
    it; a replay stores what the eager step stores."""
    case = CASES[1]
    csa_ops.precompile_store(case.head_dim, case.cache_format, case.rope_dim, case.rotate,
                             1e-6, case.dtype, case.weight_dtype, ratio=case.ratio,
                             coff=case.coff)
    csa_ops.precompile_extend(case.ratio, case.head_dim, case.coff, case.dtype)
    assert_a_replay_stores_what_an_eager_call_stores(Step(case, [1] * 16, seed=9))


def test_a_capture_without_the_fused_kernel_runs_the_two_launches(monkeypatch):
    """A capture whose fused kernel was never compiled (nor is in the disk cache) cannot
    compile it: the step captures as the extend and store kernels, which replay the same
    bytes, and nothing is compiled during the capture."""
    monkeypatch.setenv("CSA_OPS_CACHE", "0")
    case, eps = CASES[0], 3e-6  # an epsilon no other test compiles a fused kernel for
    csa_ops.precompile_store(case.head_dim, case.cache_format, case.rope_dim, case.rotate,
                             eps, case.dtype, case.weight_dtype)  # the store kernel alone
    csa_ops.precompile_extend(case.ratio, case.head_dim, case.coff, case.dtype)
    step = Step(case, [1] * 16, seed=11)
    eager = step.args()
    eager[9] = eps
    with row_epilogue.two_launch_step():
        eager_cuc = STORE(*eager)
    replayed = step.args()
    replayed[9] = eps
    compiled = host.KERNELS.info()["size"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_cuc = STORE(*replayed)
    assert host.KERNELS.info()["size"] == compiled, "a kernel was loaded during the capture"
    for i, t in ((6, step.kv_state), (7, step.score_state), (15, step.cache)):
        replayed[i].copy_(t.to(DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    assert_same_step(replayed, graph_cuc, eager, eager_cuc)
