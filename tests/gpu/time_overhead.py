"""Host overhead of one eager call (Python + dispatcher + launch), forward and backward.

Not collected by pytest: ``python tests/gpu/time_overhead.py``. Two views: CUDA events
around many back-to-back calls at a tiny shape (the host is the bottleneck there, so the
per-call time is the host cost) and the profiler's CPU time per op call.
"""

from __future__ import annotations

import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import csa_ops


def _inputs(tokens=256, head_dim=128, ratio=4, coff=2):
    cu, cuc = csa_ops.offsets_for([tokens], ratio, "cuda")
    kv = torch.randn(tokens, coff * head_dim, device="cuda", dtype=torch.bfloat16)
    score = torch.randn_like(kv)
    ape = torch.randn(ratio, coff * head_dim, device="cuda")
    rows = tokens // ratio
    grad_out = torch.randn(rows, head_dim, device="cuda", dtype=torch.bfloat16)
    return kv, score, ape, cu, cuc, ratio, coff, rows, grad_out


def _per_call_us(fn, calls=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def main():
    kv, score, ape, cu, cuc, ratio, coff, rows, grad_out = _inputs()
    forward = lambda: torch.ops.csa.compressor(kv, score, ape, cu, cuc, ratio, coff, rows)  # noqa: E731
    backward = lambda: torch.ops.csa.compressor_backward(  # noqa: E731
        grad_out, kv, score, ape, cu, cuc, ratio, coff)
    result = {"forward_us_per_call": _per_call_us(forward),
              "backward_us_per_call": _per_call_us(backward)}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(200):
            forward()
            backward()
        torch.cuda.synchronize()
    for event in prof.key_averages():
        if event.key in ("csa::compressor", "csa::compressor_backward"):
            result[f"profiler_cpu_us[{event.key}]"] = event.cpu_time_total / event.count
    print(json.dumps(result, indent=2))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
