"""csa::compressor_extend kernel keys side by side, interleaved in one process (CUDA only).

    python bench/time_extend.py --config d512_r4c2 \
        "step:vec=2,threads=128,preload_decode=1,request_rows=1" \
        "sized:vec=2,threads=128,preload_decode=1" "p:vec=4,threads=128,part=1"

Each variant is LABEL:KNOBS, the forward key of --config (either family: d512_r128c1 runs
the streaming kernel) with those knobs (csa_ops.config.parse_knobs; part=1 runs a split
call's two launches), or LABEL alone, the key the op itself launches for each case's call
(extend_plan.for_size). Labels starting with "p" run the prefill cases (4 requests
continuing from state, bench_serving.py's), the others the decode steps; --mixed adds
prefill cases of D decode requests batched ahead of one request continuing by the first
--prefill-tokens (an engine's mixed step). Every key is launched directly
(host.launch_key) on the same inputs; its rows, cu_seqlens_comp and new state must equal
the first variant's bit for bit. Then rounds of CUDA-graph replays (--rounds, every variant
in each round, so drift hits all alike) and, in the first three rounds, the profiler's
kernel time (a split call's: the sum of its two launches' durations, which overlap). The
training forward joins the prefill cases.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_serving
import timing
import torch

import csa_ops
from csa_ops import host
from csa_ops.config import Direction, parse_knobs, with_knobs
from csa_ops.kernels import extend_plan

CALLS = 50  # launches per graph


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variants", nargs="+", help="LABEL:KNOBS (labels starting with p: prefill)")
    p.add_argument("--config", default="d512_r4c2", choices=sorted(bench_serving.CONFIGS))
    p.add_argument("--batches", default="1,64,256,1024", help="decode batch sizes")
    p.add_argument("--prefill-tokens", default="2048", help="new tokens per request (list)")
    p.add_argument("--mixed", default="",
                   help="decode requests batched ahead of one prefill request of the first "
                        "--prefill-tokens (list; prefill cases)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--dtype", choices=sorted(bench_serving._DTYPES), default="bf16")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("time_extend.py needs a CUDA device")
    return args


def mixed_case(serving, head_dim: int, ratio: int, coff: int, decodes: int,
               tokens: int) -> dict:
    """`decodes` one-token requests, then one request continuing from position 1000 by
    `tokens`: an engine's mixed step (decodes first, as vLLM orders them). Random state:
    the variants are checked against each other, not against a reference."""
    gen, dev, width = torch.Generator().manual_seed(2), serving.device, coff * head_dim
    batch = decodes + 1
    lengths = [1] * decodes + [tokens]
    starts = [2 * ratio + i % ratio for i in range(decodes)] + [1000]
    nbytes = 2 * sum(lengths) * width * serving.dtype.itemsize
    sets = timing.num_input_sets(nbytes, dev, cap=8)
    state = csa_ops.CompressorState(sets * batch, ratio, coff, head_dim, serving.dtype, dev)
    state.kv.copy_(bench_serving._randn(gen, state.kv.shape, serving.dtype, dev))
    state.score.copy_(bench_serving._randn(gen, state.score.shape, torch.float32, dev, 2.0))
    cu, _ = csa_ops.offsets_for(lengths, ratio, dev)
    return {"kv": [bench_serving._randn(gen, (sum(lengths), width), serving.dtype, dev)
                   for _ in range(sets)],
            "score": [bench_serving._randn(gen, (sum(lengths), width), serving.dtype, dev, 2.0)
                      for _ in range(sets)],
            "ape": bench_serving._randn(gen, (ratio, width), torch.float32, dev, 0.5),
            "cu": cu, "start": torch.tensor(starts, dtype=torch.int32, device=dev),
            "slots": [torch.randperm(batch, generator=gen).int().to(dev) + j * batch
                      for j in range(sets)],
            "state": state, "sets": sets,
            "rows": sum((p + n) // ratio - p // ratio for p, n in zip(starts, lengths))}


def _launcher(key, case, kv_state, score_state, num_rows, batch, num_sms):
    """step(i): the key's launches (extend_plan.plans) on input set i (bench_serving's
    rotation)."""
    sets, head_dim = case["sets"], key.head_dim
    num_tokens = case["kv"][0].shape[0]
    launches = [(part, laid.grid)
                for part, laid in extend_plan.plans(key, num_tokens, batch, num_rows, num_sms)]
    device = case["kv"][0].device
    out = torch.empty(num_rows, head_dim, dtype=case["kv"][0].dtype, device=device)
    cuc = torch.empty(batch + 1, dtype=torch.int32, device=device)
    sizes = (num_tokens, num_rows, batch, kv_state.shape[0])

    def step(i):
        tensors = (case["kv"][i % sets], case["score"][i % sets], case["ape"], case["cu"],
                   case["start"], case["slots"][i % sets], kv_state, score_state, out, cuc)
        for part, grid in launches:
            host.launch_key("ext", part, tensors, sizes, grid)
        return out, cuc

    return step


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int8) if t.is_floating_point() else t


def _check(name, steps, kv_state, score_state) -> None:
    """Every variant's first call against the first variant's, from the same state."""
    saved = kv_state.clone(), score_state.clone()
    first = None
    for label, step in steps.items():
        kv_state.copy_(saved[0])
        score_state.copy_(saved[1])
        got = [t.clone() for t in (*step(0), kv_state, score_state)]
        if first is None:
            first = label, got
            continue
        same = all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, first[1], strict=True))
        if not same:
            raise SystemExit(f"{name}: {label} differs from {first[0]}")
    kv_state.copy_(saved[0])
    score_state.copy_(saved[1])


def time_case(name, steps, rounds: int, sets: int) -> None:
    calls = max(sets, CALLS)
    graphs = {label: timing.capture_graph(step, calls, 2)[0] for label, step in steps.items()}
    replay = {label: [] for label in steps}
    kernel = {label: [] for label in steps}
    for r in range(rounds):
        for label, step in steps.items():
            replay[label].append(timing.time_graph(graphs[label], calls, 2, 10)[0] * 1e6)
            if r < 3:
                kernel[label].append(timing.kernel_time(step, calls, 2, 3)[0] * 1e6)
    for label in steps:
        print(f"{name:18s} {label:12s} graph {statistics.median(replay[label]):7.2f} us "
              f"(min {min(replay[label]):6.2f})  kernel {statistics.median(kernel[label]):7.2f} "
              "us", flush=True)


def variant_keys(variants: list[str], forward) -> dict:
    """LABEL -> forward key `forward` with LABEL:KNOBS's knobs, or None for a bare LABEL
    (the op's own key for each case's call)."""
    keys = {}
    for variant in variants:
        label, sep, knobs = variant.partition(":")
        keys[label] = with_knobs(forward, **parse_knobs(knobs)) if sep else None
    return keys


def main(argv=None) -> None:
    args = parse_args(argv)
    serving = bench_serving.parse_args(["--no-compile", "--dtype", args.dtype])
    head_dim, ratio, coff, _ = bench_serving._config(serving, args.config)
    dtype = str(serving.dtype).removeprefix("torch.")
    forward = host.select_key(ratio, coff, head_dim, dtype, "sm_90a", Direction.FORWARD)
    keys = variant_keys(args.variants, forward)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    cases = []
    for batch in (int(b) for b in args.batches.split(",")):
        case = bench_serving.decode_case(serving, head_dim, ratio, coff, batch)
        cases.append((f"decode B{batch}", False, case, case["kv_state"], case["score_state"],
                      batch, batch))
    for tokens in (int(t) for t in args.prefill_tokens.split(",")):
        serving.prefill_tokens = tokens
        case = bench_serving.prefill_case(serving, head_dim, ratio, coff)
        cases.append((f"prefill 4x{tokens}", True, case, case["state"].kv, case["state"].score,
                      case["rows"], len(bench_serving.PREFILL_STARTS)))
    for decodes in (int(d) for d in args.mixed.split(",") if d):
        tokens = int(args.prefill_tokens.split(",")[0])
        case = mixed_case(serving, head_dim, ratio, coff, decodes, tokens)
        cases.append((f"mixed {decodes}+1x{tokens}", True, case, case["state"].kv,
                      case["state"].score, case["rows"], decodes + 1))
    for name, prefill, case, kv_state, score_state, num_rows, batch in cases:
        tokens = case["kv"][0].shape[0]
        own = extend_plan.for_size(forward, extend_plan.size_class(tokens, batch))
        steps = {label: _launcher(own if key is None else key, case, kv_state, score_state,
                                  num_rows, batch, num_sms)
                 for label, key in keys.items() if label.startswith("p") == prefill}
        if not steps:
            continue
        _check(name, steps, kv_state, score_state)
        if prefill and "train_rows" in case:
            steps["training fwd"] = bench_serving.prefill_steps(case)["training forward"]
        time_case(name, steps, args.rounds, case["sets"])


if __name__ == "__main__":
    main()
