"""Per-call CUDA-graph replay time against the calls a graph holds (CUDA only).

    python bench/time_graph_calls.py                          # bench_serving.py's prefill
    python bench/time_graph_calls.py --calls 8,16,50 --decode 1,256

A graph replay has a fixed cost that its calls share, so a per-call figure depends on how
many calls the graph holds: variants compared side by side must replay the same number
(bench_serving.calls_per_sample). This script measures that dependence on
bench_serving.py's own cases: the prefill op and the training forward (4 requests
continuing from state) for each --configs entry, and the op's decode steps at --decode
batch sizes (r4 c2). Each count is timed in the order given, so repeating one (the
default repeats 23 and 50) shows the run's noise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_serving
import torch

import csa_ops  # noqa: F401  (registers the ops)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", default="8,16,23,35,50,100,23,50",
                   help="calls per graph, timed in this order")
    p.add_argument("--configs", default=",".join(bench_serving.CONFIGS),
                   help="prefill configs (bench_serving.CONFIGS)")
    p.add_argument("--decode", default="1,256", help="r4 c2 decode batch sizes ('' for none)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("time_graph_calls.py needs a CUDA device")
    args.call_list = [int(c) for c in args.calls.split(",")]
    args.batch_list = [int(b) for b in args.decode.split(",") if b]
    return args


def per_call_us(step, calls: int, serving: argparse.Namespace, sets: int):
    """bench_serving.time_step's graph replay per call (us) at `calls` calls per graph (at
    least the input sets), or its status where it could not time."""
    row = bench_serving.time_step(step, "graph", argparse.Namespace(**vars(serving) | {
        "calls": calls}), sets)
    return round(row["median_s"] * 1e6, 2) if "median_s" in row else row["status"]


def main(argv=None) -> dict:
    args = parse_args(argv)
    serving = bench_serving.parse_args(["--no-compile"])
    results = {"meta": {"device_name": torch.cuda.get_device_name(), "torch": torch.__version__},
               "rows": []}

    def record(case: str, variant: str, step, sets: int) -> None:
        times = [(calls, per_call_us(step, calls, serving, sets)) for calls in args.call_list]
        results["rows"].append({"case": case, "variant": variant, "per_call_us": times})
        print(f"{case:28s} {variant:17s} " + "  ".join(f"{c}: {t}" for c, t in times),
              flush=True)

    for name in args.configs.split(","):
        head_dim, ratio, coff, label = bench_serving._config(serving, name)
        case = bench_serving.prefill_case(serving, head_dim, ratio, coff)
        for variant, step in bench_serving.prefill_steps(case).items():
            record(f"prefill {label} 4x{serving.prefill_tokens}", variant, step, case["sets"])
        del case
    head_dim, ratio, coff, label = bench_serving._config(serving, "d512_r4c2")
    for batch in args.batch_list:
        case = bench_serving.decode_case(serving, head_dim, ratio, coff, batch)
        record(f"decode {label} B{batch}", "op",
               bench_serving.decode_steps(case, False)["op"], case["sets"])
        del case
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
