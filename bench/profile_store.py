"""One csa::compressor_extend_store call per case inside a profiler range, for `ncu`:

    ncu --profile-from-start off --section SpeedOfLight --section WarpStateStats \
        --section LaunchStats --section Occupancy python3 bench/profile_store.py

The cases are bench_store.py's (config and shape names); each is built, compiled and run
twice before the range opens, so the profiled kernels are one step's: the extend kernel(s)
and the store kernel.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from bench_store import CONFIGS, STORE, Case, requests

DEFAULT_CASES = ("d512_r4c2_ds_mla:decode_B64", "d512_r4c2_ds_mla:decode_B256",
                 "d512_r4c2_ds_mla:prefill_4x2048")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(DEFAULT_CASES),
                   help="comma-separated config:shape pairs of bench_store.py")
    args = p.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    cases = []
    for item in args.cases.split(","):
        config, shape = item.split(":")
        cfg = CONFIGS[config]
        case = Case(cfg, *requests(shape, cfg.ratio, gen), torch.device("cuda"), gen)
        for _ in range(2):
            STORE(*case.inputs(0))
        cases.append(case)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for case in cases:
        STORE(*case.inputs(1))
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
