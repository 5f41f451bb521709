"""One case of test_row_capacity_gpu, in a process of its own (a device-side assertion
leaves the CUDA context unusable): a call with more rows than its output holds must stop.

    python tests/gpu/row_capacity_child.py CASE

Prints VALID after the case's call within capacity (where it has one) ran and synchronized,
and NOT STOPPED if the call past capacity returned and synchronized without an error.
"""

from __future__ import annotations

import sys

import torch

import csa_ops
from csa_ops import CompressorState

# One pack of 2 segments over T tokens: `fits` has cu_seqlens_comp[-1] = CAPACITY rows,
# `past` (the same shapes) more. Tokens past cu_seqlens[-1] are never read.
PACKS = {  # family: (ratio, coff, head_dim, T, fits cu, past cu)
    "window": (4, 2, 64, 128, (0, 64, 96), (0, 64, 128)),
    "streaming": (128, 2, 64, 1024, (0, 512, 768), (0, 512, 1024)),
    "reference": (128, 1, 64, 1024, (0, 512, 768), (0, 512, 1024)),  # fp32: no kernel
}


def _offsets(cu, ratio):
    cuc = [0]
    for lo, hi in zip(cu[:-1], cu[1:]):
        cuc.append(cuc[-1] + (hi - lo) // ratio)
    as_int32 = {"dtype": torch.int32, "device": "cuda"}
    return torch.tensor(cu, **as_int32), torch.tensor(cuc, **as_int32)


def _pack(family):
    ratio, coff, head_dim, tokens, fits, past = PACKS[family]
    dtype = torch.float32 if family == "reference" else torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    kv, score = (torch.randn(tokens, coff * head_dim, device="cuda", generator=gen).to(dtype)
                 for _ in range(2))
    ape = torch.randn(ratio, coff * head_dim, device="cuda", generator=gen)
    fits, past = _offsets(fits, ratio), _offsets(past, ratio)
    return (kv, score, ape), fits, past, ratio, coff, int(fits[1][-1])


def _valid():
    torch.cuda.synchronize()
    print("VALID", flush=True)


def op_call(family: str, backward: bool) -> None:
    """The op twice with one signature (the second through the prepared, native call)."""
    inputs, fits, past, ratio, coff, capacity = _pack(family)
    grad_out = torch.randn(capacity, inputs[0].shape[1] // coff, device="cuda").to(
        inputs[0].dtype)
    for offsets in (fits, past):
        if backward:
            torch.ops.csa.compressor_backward(grad_out, *inputs, *offsets, ratio, coff)
        else:
            torch.ops.csa.compressor(*inputs, *offsets, ratio, coff, capacity)
        if offsets is fits:
            _valid()


def graph_replay(family: str) -> None:
    """A captured forward replayed over offsets copied in: first within, then past."""
    inputs, fits, past, ratio, coff, capacity = _pack(family)
    csa_ops.precompile(ratio, inputs[0].shape[1] // coff, coff, inputs[0].dtype)
    cu, cuc = (t.clone() for t in fits)
    torch.ops.csa.compressor(*inputs, cu, cuc, ratio, coff, capacity)  # warm
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.csa.compressor(*inputs, cu, cuc, ratio, coff, capacity)
    graph.replay()
    _valid()
    cu.copy_(past[0])
    cuc.copy_(past[1])
    graph.replay()


def compiled(family: str) -> None:
    """torch.compile with generated code (Inductor's Triton kernels), static capacity."""
    from csa_ops import lowering

    lowering.mode = "generate"
    inputs, fits, past, ratio, coff, capacity = _pack(family)
    fn = torch.compile(torch.ops.csa.compressor, fullgraph=True)
    fn(*inputs, *fits, ratio, coff, capacity)
    _valid()
    fn(*inputs, *past, ratio, coff, capacity)


# Extend: (ratio, coff, head_dim, new tokens, requests, padding rows) of the int32-saturating
# batches (one valid request, then invalid ones whose wrapped token counts sum the rows past
# INT32_MAX): a decode-sized call, a decode step's shape, a split call (batch scans), a split
# call of few requests (rows by lanes); the family by window (r4 c2: register windows, r17 c2:
# streaming).
PAST_INT32 = {"one_launch": (48, 40, 5), "step": (40, 40, 0), "split": (600, 40, 7),
              "lanes": (3400, 32, 500)}
EXTEND_FAMILIES = {"window": (4, 2), "streaming": (17, 2)}


def extend_past_int32(family: str, path: str) -> None:
    from serving_helpers import check_rows_past_int32

    ratio, coff = EXTEND_FAMILIES[family]
    tokens, batch, extra = PAST_INT32[path]
    check_rows_past_int32(torch.ops.csa.compressor_extend.default, ratio, coff, 64, tokens,
                          batch, extra, torch.bfloat16, "cuda")


def extend_step(ratio: int, coff: int) -> None:
    """A request of 10 rows at capacity 10, then at capacity 3 (with the same kernel)."""
    head_dim = 64
    state = CompressorState(2, ratio, coff, head_dim, torch.bfloat16, "cuda")
    kv, score = (torch.randn(10 * ratio, coff * head_dim, device="cuda").bfloat16()
                 for _ in range(2))
    ape = torch.randn(ratio, coff * head_dim, device="cuda")
    as_int32 = {"dtype": torch.int32, "device": "cuda"}
    request = (torch.tensor([0, 10 * ratio], **as_int32), torch.tensor([0], **as_int32),
               torch.tensor([0], **as_int32))
    for capacity in (10, 3):
        torch.ops.csa.compressor_extend(kv, score, ape, *request, state.kv, state.score,
                                        ratio, coff, capacity)
        if capacity == 10:
            _valid()


CASES = {
    "window_forward": lambda: op_call("window", False),
    "window_backward": lambda: op_call("window", True),
    "streaming_forward": lambda: op_call("streaming", False),
    "streaming_backward": lambda: op_call("streaming", True),
    "reference_forward": lambda: op_call("reference", False),
    "reference_backward": lambda: op_call("reference", True),
    "window_graph": lambda: graph_replay("window"),
    "streaming_graph": lambda: graph_replay("streaming"),
    "compiled_generated": lambda: compiled("window"),
    "extend_window": lambda: extend_step(4, 2),
    "extend_streaming": lambda: extend_step(128, 1),
    **{f"extend_{family}_{path}": (lambda f=family, p=path: extend_past_int32(f, p))
       for family in EXTEND_FAMILIES for path in PAST_INT32},
}

if __name__ == "__main__":
    CASES[sys.argv[1]]()
    torch.cuda.synchronize()
    print("NOT STOPPED", flush=True)
