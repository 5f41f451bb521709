"""One csa::compressor_extend call per decode case, for `ncu` (CUDA only).

    ncu --profile-from-start off --set full python3 bench/profile_extend.py \
        --config d512_r128c1 --batches 1,256

Each case is bench_serving.py's decode step, launched through the op's own key
(extend_plan.for_size) as time_extend.py launches it. Every kernel is compiled and run
twice before the profiler starts, so the profiled range holds only the cases' launches,
in the order of --batches.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_serving
import time_extend
import torch

from csa_ops import host
from csa_ops.kernels import extend_plan
from csa_ops.config import Direction


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="d512_r4c2", choices=sorted(bench_serving.CONFIGS))
    p.add_argument("--batches", default="256", help="decode batch sizes")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("profile_extend.py needs a CUDA device")
    serving = bench_serving.parse_args(["--no-compile"])
    head_dim, ratio, coff, _ = bench_serving._config(serving, args.config)
    forward = host.select_key(ratio, coff, head_dim, "bfloat16", "sm_90a", Direction.FORWARD)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    steps = []
    for batch in (int(b) for b in args.batches.split(",")):
        case = bench_serving.decode_case(serving, head_dim, ratio, coff, batch)
        key = extend_plan.for_size(forward, extend_plan.size_class(batch, batch))
        print(f"decode B{batch}: {key!r}", flush=True)
        steps.append(time_extend._launcher(key, case, case["kv_state"], case["score_state"],
                                           batch, batch, num_sms))
    for step in steps:
        step(0)
        step(1)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for step in steps:
        step(2)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
