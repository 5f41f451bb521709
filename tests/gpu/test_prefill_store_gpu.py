"""csa::compressor_extend_store's split calls in two fused launches (the head rows and
states: kernels/window/extend_store.py; the other rows: kernels/window/rows_store.py) on
CUDA, against the same call as the extend kernel's launches followed by the store kernel
(which tests/gpu/test_store_kernel_gpu.py holds to the torch route): cu_seqlens_comp, both
state tensors and the whole cache bitwise, for every format, each row dtype, ratios 2 to 8
at both coffs; with requests that continue a sequence and requests that start one, empty and
one-token requests, invalid requests, block-table entries out of range (negative, past the
cache, past the table's width, for some of a request's rows only) and rows past the RoPE
tables; batches whose rows' requests the rows launch finds by lanes (at most 32) or by a
scan (more, and a prefill among decode requests).
"""

from __future__ import annotations

import pytest
import torch
from test_decode_step_gpu import (
    CASES,
    Step,
    assert_a_replay_stores_what_an_eager_call_stores,
    assert_fused_stores_what_two_launches_store,
)

import csa_ops
from csa_ops import row_epilogue
from csa_ops.kernels import extend_plan
from csa_ops.kernels.calls import SizeClass

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _fused_prefill():
    with row_epilogue.fused_prefill():
        yield

# Ten requests, 3,157 new tokens: a split call placing its rows by lanes (FEW_LARGE).
LENGTHS = [1201, 0, 377, 640, 2, 1, 513, 290, 33, 100]
PAGE_SIZE = 16
WIDTH = 36  # pages per request: request 0's last rows at ratio 2 lie past the table's width
TABLE_ROWS = 1024  # RoPE positions: the longest requests' last rows sit past them


def prefill(case, lengths=LENGTHS, seed=0) -> Step:
    return Step(case, lengths, seed, page_size=PAGE_SIZE, width=WIDTH, table_rows=TABLE_ROWS)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_adversarial_prefill_in_two_fused_launches_stores_what_three_launches_store(case):
    assert extend_plan.size_class(sum(LENGTHS), len(LENGTHS)) == SizeClass.FEW_LARGE
    step = prefill(case, seed=CASES.index(case))
    got = assert_fused_stores_what_two_launches_store(step)
    assert not torch.equal(got[15].cpu(), step.cache), "nothing was stored"


BATCHES = {  # (lengths, size class): the rows' requests by lanes, or by the CTA's scan
    "lanes-32": ([100] * 32, SizeClass.FEW_LARGE),  # a warp's lanes full
    "scan-33": ([100] * 33, SizeClass.LARGE),  # one more
    "mixed": ([1, 2, 1, 1100] + [1, 3] * 20, SizeClass.LARGE),  # a prefill among decodes
    "many": ([2, 1, 5] * 100, SizeClass.LARGE),  # three requests a thread in the scan
}


@pytest.mark.parametrize("batch", list(BATCHES))
def test_every_batch_shape_stores_what_three_launches_store(batch):
    lengths, size = BATCHES[batch]
    assert extend_plan.size_class(sum(lengths), len(lengths)) == size
    assert_fused_stores_what_two_launches_store(prefill(CASES[0], lengths, seed=len(lengths)))


def test_a_captured_prefill_replays_the_fused_bytes():
    """precompile_store with the configuration (within fused_prefill()) builds both fused
    kernels, so a capture takes them; a replay stores what the eager call stores."""
    case = CASES[1]
    csa_ops.precompile_store(case.head_dim, case.cache_format, case.rope_dim, case.rotate,
                             1e-6, case.dtype, case.weight_dtype, ratio=case.ratio,
                             coff=case.coff)
    csa_ops.precompile_extend(case.ratio, case.head_dim, case.coff, case.dtype)
    assert_a_replay_stores_what_an_eager_call_stores(prefill(case, seed=5))
