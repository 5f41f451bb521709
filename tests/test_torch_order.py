"""kernels/torch_order.py: torch's CUDA order for the eager region's softmax and sum.

The derivation from torch's launch configurations, pinned to what bench/probe_torch_order.py
measured on the H200, and its elementwise emulation against scalar loops of the same order.
(tests/gpu/test_kernels_streaming.py checks both against torch's own kernels.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from csa_ops.config import Direction, with_knobs
from csa_ops.kernels.shared import torch_order
from csa_ops.kernels.streaming import plan as streaming_plan


def test_torch_order_configurations():
    # torch's launch configurations (ATen's SoftMax.cu and Reduce.cuh) as torch_order derives
    # them; tests/gpu/test_kernels_streaming.py checks the derived order against torch.
    assert (torch_order.softmax_chains(128, 512), torch_order.sum_split(128, 512)) == (1, 4)
    assert (torch_order.softmax_chains(256, 128), torch_order.sum_split(256, 128)) == (1, 4)
    assert torch_order.sum_split(32, 512) == 1  # under 16 values per thread: no split
    assert torch_order.sum_split(128, 65) == 1 and torch_order.sum_split(256, 65) == 16
    assert torch_order.softmax_chains(128, 64) == 16 and torch_order.softmax_chains(256, 32) == 32
    assert torch_order.softmax_chains(32, 64) == 1  # short windows: one thread per column
    # Few outputs narrow the block and deepen the split: the kernels assume min_rows.
    assert torch_order.sum_split(128, 64) == 4 and torch_order.sum_split(128, 64, rows=1) == 8
    assert torch_order.min_rows(64) == 2 and torch_order.min_rows(512) == 1
    assert not torch_order.supported(512, 128) and not torch_order.supported(128, 1)
    forward = streaming_plan.configure(128, 2, 512, "bfloat16", "sm_90a", Direction.FORWARD)
    assert forward.knobs.parity == 1
    assert streaming_plan.configure(128, 2, 512, "bfloat16", "sm_90a", Direction.BACKWARD).knobs.parity == 0
    assert streaming_plan.configure(256, 2, 512, "bfloat16", "sm_90a", Direction.FORWARD).knobs.parity == 0
    assert not streaming_plan.supports(with_knobs(
        streaming_plan.configure(256, 2, 512, "bfloat16", "sm_90a", Direction.FORWARD), parity=1))


def test_torch_order_matches_the_recorded_probe():
    # bench/probe_torch_order.py on the H200 (torch 2.11): for each shape, the chain counts
    # and splits whose emulation equals torch's own kernels bit for bit.
    path = Path(__file__).resolve().parents[1] / "bench/results/h200/torch_order_probe.json"
    cases = json.loads(path.read_text())["cases"]
    assert len(cases) == 275
    for case in cases:
        window, head_dim, rows = case["window"], case["head_dim"], case["rows"]
        assert torch_order.softmax_chains(window, head_dim) in case["softmax_chains_matching"]
        assert torch_order.sum_split(window, head_dim, rows) in case["sum_split_matching"]


def _scalar_forward(sg, kvg, chains, split):
    """The documented order with Python floats rounded to fp32 after every operation; exp is
    torch's (the same per-element function the emulation uses)."""
    def f32(x):
        return float(torch.tensor(x, dtype=torch.float32))

    def halving(parts):
        parts, h = list(parts), len(parts) // 2
        while h:
            for c in range(h):
                parts[c] = f32(parts[c] + parts[c + h])
            h //= 2
        return parts[0]

    window = sg.shape[0]
    m = max(float(x) for x in sg)
    e = [float(torch.exp(torch.tensor(float(x) - m, dtype=torch.float32))) for x in sg]
    part = [0.0] * chains
    for k in range(window):
        part[k % chains] = f32(part[k % chains] + e[k])
    s = halving(part)
    terms = [f32(float(kvg[k]) * f32(e[k] / s)) for k in range(window)]
    acc = [[0.0] * 4 for _ in range(split)]
    for y in range(split):
        for j, k in enumerate(range(y, window, split)):
            acc[y][j % 4] = f32(acc[y][j % 4] + terms[k])
    return halving([f32(f32(f32(a[0] + a[1]) + a[2]) + a[3]) for a in acc])


@pytest.mark.parametrize(("window", "head_dim", "rows"), [(128, 512, 2), (256, 65, 1),
                                                         (100, 64, 3), (40, 7, 2)])
def test_emulation_is_the_documented_order(window, head_dim, rows):
    gen = torch.Generator().manual_seed(window + head_dim)
    sg = 2 * torch.randn(rows, window, head_dim, generator=gen)
    kvg = torch.randn(rows, window, head_dim, generator=gen)
    out = torch_order.forward(sg, kvg)
    chains = torch_order.softmax_chains(window, head_dim)
    split = torch_order.sum_split(window, head_dim, rows)
    for r, c in ((0, 0), (rows - 1, head_dim - 1), (rows // 2, head_dim // 3)):
        expected = _scalar_forward(sg[r, :, c], kvg[r, :, c], chains, split)
        assert float(out[r, c]) == expected, (r, c)
