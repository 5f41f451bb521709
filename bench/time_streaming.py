"""Kernel timing of the streaming family on the current GPU.

Per shape: forward and backward kernel time per call from CUDA-graph replays of 20 launches
that rotate over input sets larger than 3x the device's L2, against the DRAM floor (the
algorithmic bytes over the measured device-to-device copy bandwidth). Knob variants (--variants) are
timed beside the default key. Prints a table; --json writes it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import timing  # bench/ is the script's folder, so on sys.path
import torch

from csa_ops import host
from csa_ops.config import Direction
from csa_ops.kernels.streaming import plan as streaming_plan

SHAPES = (  # (tokens, head_dim, ratio, coff)
    (65536, 128, 128, 1),
    (65536, 128, 128, 2),
    (65536, 512, 128, 1),
    (65536, 512, 128, 2),
    (131072, 128, 128, 1),
    (131072, 128, 128, 2),
    (131072, 512, 128, 1),
    (131072, 512, 128, 2),
)


class Launch:
    """A compiled key with its tensors bound once, so a call is one kernel launch."""

    def __init__(self, key, backward, tensors, sizes, grid):
        self.args = ("bwd" if backward else "fwd", key, tensors, sizes, grid)
        host.launch_key(*self.args)  # compiles (or loads) outside the timed region

    def __call__(self):
        host.launch_key(*self.args)


def _inputs(tokens, d, ratio, coff, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kv = torch.randn(tokens, coff * d, device="cuda", generator=gen).to(dtype)
    score = (2 * torch.randn(tokens, coff * d, device="cuda", generator=gen)).to(dtype)
    ape = 0.5 * torch.randn(ratio, coff * d, device="cuda", generator=gen)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    cuc = torch.tensor([0, tokens // ratio], dtype=torch.int32, device="cuda")
    grad_out = torch.randn(tokens // ratio, d, device="cuda", generator=gen).to(dtype)
    return kv, score, ape, cu, cuc, grad_out


def _launches(key, backward, sets, sms):
    out = []
    for kv, score, ape, cu, cuc, grad_out in sets:
        tokens, width = kv.shape
        rows, d = grad_out.shape
        if backward:
            plan = streaming_plan.plan_backward(key, tokens, rows, sms)
            work = torch.empty(max(plan.workspace, 4), device="cuda")
            outs = (torch.empty_like(kv), torch.empty_like(kv),
                    torch.empty(key.ratio, width, device="cuda"), work)
            tensors = (grad_out, kv, score, ape, cu, cuc, *outs)
        else:
            plan = streaming_plan.plan_forward(key, tokens, rows, sms)
            work = torch.empty(max(plan.workspace, 4), device="cuda")
            outs = (torch.empty(rows, d, dtype=kv.dtype, device="cuda"), work)
            tensors = (kv, score, ape, cu, cuc, *outs)
        launch = Launch(key, backward, tensors, (tokens, rows, 1), plan.grid)
        launch.keep = outs
        out.append(launch)
    return out


def launches_time(launches) -> float:
    """Kernel time per launch from graph replays cycling over the bound launches."""
    return timing.graph_time_per_call(lambda launch: launch(), launches) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--only", default="",
                        help="comma-separated shape filters, e.g. '1x65536 d512 r128 c2'")
    parser.add_argument("--directions", default="fwd,bwd", help="fwd, bwd or both")
    parser.add_argument("--variants", default="",
                        help="';'-separated configure overrides, e.g. 'cv=4;cv=4,ctas=3'")
    args = parser.parse_args()
    only = [f.strip() for f in args.only.split(",") if f.strip()]
    names = [f"1x{tokens} d{d} r{ratio} c{coff}" for tokens, d, ratio, coff in SHAPES]
    unknown = [f for f in only if f not in names]
    if unknown:
        parser.error(f"--only: no shape named {unknown}; the shapes are {names}")
    directions = [d.strip() for d in args.directions.split(",")]
    if not directions or not set(directions) <= {"fwd", "bwd"}:
        parser.error(f"--directions takes fwd, bwd or fwd,bwd, got {args.directions!r}")
    variants = [{kv.split("=")[0]: int(kv.split("=")[1]) for kv in v.split(",")}
                for v in args.variants.split(";") if v]
    dtype = getattr(torch, args.dtype)
    arch = host.device_arch()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    device = torch.device("cuda")
    bw = timing.copy_bandwidth(device, 2**30)
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s")
    rows_out = []
    for name, (tokens, d, ratio, coff) in zip(names, SHAPES, strict=True):
        if only and name not in only:
            continue
        eb = torch.tensor([], dtype=dtype).element_size()
        rows = tokens // ratio
        in_bytes = 2 * tokens * coff * d * eb
        fwd_bytes = in_bytes + rows * d * eb
        bwd_bytes = fwd_bytes + rows * d * eb + in_bytes
        nsets = timing.num_input_sets(in_bytes, device, cap=8)
        sets = [_inputs(tokens, d, ratio, coff, dtype, seed) for seed in range(nsets)]
        rec = {"shape": name,
               "floor_fwd_us": fwd_bytes / bw * 1e6, "floor_bwd_us": bwd_bytes / bw * 1e6}
        for backward in (False, True):
            if ("bwd" if backward else "fwd") not in directions:
                continue
            direction = Direction.of(backward)
            base = streaming_plan.configure(ratio, coff, d, args.dtype, arch, direction)
            tag = "bwd" if backward else "fwd"
            rec[f"{tag}_us"] = launches_time(_launches(base, backward, sets, sms))
            rec[f"{tag}_key"] = str(dataclasses.asdict(base.knobs))
            for var in variants:
                key = streaming_plan.configure(ratio, coff, d, args.dtype, arch, direction, **var)
                if key == base or not streaming_plan.supports(key):
                    continue
                t = launches_time(_launches(key, backward, sets, sms))
                knobs = dataclasses.asdict(key.knobs)
                rec.setdefault("variants", []).append({"dir": tag, "knobs": knobs, "us": t})
                print(f"  {rec['shape']} {tag} {knobs}: {t:.2f} us "
                      f"(default {rec[tag + '_us']:.2f})")
        rows_out.append(rec)
        del sets
        torch.cuda.empty_cache()
    print(f"{'shape':<24}{'fwd us':>9}{'floor':>8}{'x':>6}{'bwd us':>9}{'floor':>8}{'x':>6}")
    for r in rows_out:
        cells = [f"{r['shape']:<24}"]
        for tag in ("fwd", "bwd"):
            us, floor = r.get(f"{tag}_us", float("nan")), r[f"floor_{tag}_us"]
            cells.append(f"{us:9.2f}{floor:8.2f}{us / floor:6.2f}")
        print("".join(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bw": bw, "rows": rows_out},
                      f, indent=1)


if __name__ == "__main__":
    main()
