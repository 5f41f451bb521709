"""Kernel timing of the CuTe-DSL compressor kernels on the current GPU.

Per shape: device-to-device copy bandwidth (the DRAM ceiling), then forward and backward
kernel time per call from CUDA-graph replays of 20 launches that rotate over input sets
larger than 3x the device's L2, and the host time of one eager call. Prints a table; --json
writes it. ``--knobs "pdl=0;linear=0"`` times the default keys with knobs overridden.
``--no-grad-ape-sum`` builds the backwards without their grad_ape sum launch (timing only:
grad_ape is then wrong) to measure what that launch costs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import timing  # bench/ is the script's folder, so on sys.path
import torch

from csa_ops import config, host
from csa_ops.kernels import FAMILIES
from csa_ops.config import Direction

SHAPES = (  # (segments, tokens per segment, head_dim, ratio, coff)
    (1, 8192, 128, 4, 2),
    (3, 8192, 128, 4, 2),
    (1, 8192, 512, 4, 2),
    (3, 8192, 512, 4, 2),
    (1, 65536, 512, 4, 2),
    (1, 8192, 128, 4, 1),
    (1, 8192, 128, 2, 2),
    (3, 8192, 512, 2, 2),
    (1, 16384, 128, 16, 2),
)


def _label(segs, seqlen, d, ratio, coff) -> str:
    return f"{segs}x{seqlen} d{d} r{ratio} c{coff}"


def _inputs(segs, seqlen, d, ratio, coff, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tokens = segs * seqlen
    kv = torch.randn(tokens, coff * d, device="cuda", generator=gen).to(dtype)
    score = (2 * torch.randn(tokens, coff * d, device="cuda", generator=gen)).to(dtype)
    ape = 0.5 * torch.randn(ratio, coff * d, device="cuda", generator=gen)
    cu = torch.arange(segs + 1, dtype=torch.int32, device="cuda") * seqlen
    cuc = torch.arange(segs + 1, dtype=torch.int32, device="cuda") * (seqlen // ratio)
    rows = segs * (seqlen // ratio)
    grad_out = torch.randn(rows, d, device="cuda", generator=gen).to(dtype)
    return kv, score, ape, cu, cuc, rows, grad_out


def graph_time(fn, sets) -> float:
    """Microseconds per launch of ``fn(set)`` from CUDA-graph replays cycling over ``sets``."""
    return timing.graph_time_per_call(fn, sets) * 1e6


def _host_time(fn, s) -> float:
    return timing.host_time_per_call(lambda: fn(s)) * 1e6


def _steps_apart(got: torch.Tensor, want: torch.Tensor) -> tuple[int, int]:
    """(elements that differ, elements more than one rounding step apart)."""
    a, r = got.double(), want.double()
    exponent = torch.floor(torch.log2(torch.maximum(a.abs(), r.abs()).clamp_min(2.0**-126)))
    step = torch.exp2(exponent) * torch.finfo(got.dtype).eps  # spacing in that binade
    same = (a == r) | (a.isnan() & r.isnan())
    return int((~same).sum()), int(((a - r).abs() > step).sum())


def _verdict(backward: bool, got, default) -> str:
    """A key's outputs against the default key's, which the GPU suite pins to torch's eager
    autograd (launch knobs must not change a bit): gradients of kv and score, or the
    forward's output."""
    pairs = list(zip(got[:2], default[:2])) if backward else [(got, default)]
    differing, beyond = (sum(x) for x in zip(*(_steps_apart(a, b) for a, b in pairs)))
    if differing == 0:
        return "bitwise"
    return f"MISMATCH ({differing} elements differ, {beyond} beyond one step)"


def _time_key(key, backward, fn, sets, dtype, default) -> tuple[float, str]:
    """Pins key for its problem, compiles it, checks it (`default`: the default key's
    outputs on sets[0]), times it."""
    host.set_key(key, Direction.of(backward))
    host.precompile(key.ratio, key.head_dim, key.coff, dtype)
    verdict = _verdict(backward, fn(sets[0]), default)
    return graph_time(fn, sets), verdict


def sweep_keys(base, backward: bool):
    """Every key the base key's family enumerates for its problem (autotuning)."""
    direction = Direction.of(backward)
    return FAMILIES[base.family].enumerate_keys(base.ratio, base.coff, base.head_dim,
                                                base.dtype, base.arch, direction)


def _sweep(dirs, ratio, coff, d, dtype_name, dtype, fwd, bwd, sets, t_fwd, t_bwd) -> None:
    """Times and checks every enumerated window key (vector width, CTA size, knobs)."""
    for backward, fn, t_default in ((False, fwd, t_fwd), (True, bwd, t_bwd)):
        if ("bwd" if backward else "fwd") not in dirs:
            continue
        base = _window_base(ratio, coff, d, dtype_name, backward)
        if base is None:
            continue
        default = fn(sets[0])
        for key in sweep_keys(base, backward):
            t, verdict = _time_key(key, backward, fn, sets, dtype, default)
            print(f"  {'bwd' if backward else 'fwd'} {knob_text(key.knobs)}: {t:.2f} us "
                  f"(default {t_default:.2f}) {verdict}")
        host.set_key(base, Direction.of(backward))


def knob_text(knobs) -> str:
    return str(dataclasses.asdict(knobs))


def with_variant(key, variant: str):
    """``key`` with "name=value,..." applied; a name its family lacks raises ValueError
    instead of timing the default."""
    return config.with_knobs(key, **config.parse_knobs(variant))


def _window_base(ratio, coff, d, dtype_name, backward):
    base = host.select_key(ratio, coff, d, dtype_name, host.device_arch(), Direction.of(backward))
    return base if base is not None and base.family == "window" else None


def _check_knobs(spec, shapes, dtype_name) -> None:
    """Applies every variant to every default window key before anything is timed."""
    for _segs, _seqlen, d, ratio, coff in shapes:
        for backward in (False, True):
            base = _window_base(ratio, coff, d, dtype_name, backward)
            for variant in filter(None, spec.split(";")) if base else ():
                with_variant(base, variant)


def _knob_variants(spec, ratio, coff, d, dtype_name, dtype, fwd, bwd, sets, t_fwd, t_bwd):
    """Times the default keys with knobs overridden: spec "pdl=0;linear=0;pdl=0,linear=0"."""
    for backward, fn, t_default in ((False, fwd, t_fwd), (True, bwd, t_bwd)):
        base = _window_base(ratio, coff, d, dtype_name, backward)
        if base is None:
            continue
        default = fn(sets[0])
        for variant in filter(None, spec.split(";")):
            key = with_variant(base, variant)
            t, verdict = _time_key(key, backward, fn, sets, dtype, default)
            print(f"  {'bwd' if backward else 'fwd'} {variant}: {t:.2f} us "
                  f"(default {t_default:.2f}) {verdict}")
        host.set_key(base, Direction.of(backward))


def latency_baselines(nbytes: int) -> tuple[float, float]:
    """(us per launch of a one-element kernel, us per copy of nbytes/2 to nbytes/2), both in
    the same CUDA-graph method: the launch floor and the copy floor of a small shape."""
    one = torch.zeros(1, device="cuda")
    src = torch.empty(max(1, nbytes // 2), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t_launch = graph_time(lambda _: one.add_(1.0), [None])
    t_copy = graph_time(lambda _: dst.copy_(src), [None])
    return t_launch, t_copy


def _drop_grad_ape_sum() -> None:
    """Both families' backward entries trace without the grad_ape sum launch (compiled
    fresh: the kernel cache would hand back the real kernels)."""
    from csa_ops.kernels.streaming import kernels as streaming
    from csa_ops.kernels.window import backward as window

    os.environ["CSA_OPS_CACHE"] = "0"
    for module in (window, streaming):
        module.launch_sum_parts = lambda *args, **kwargs: None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--only", default="", help="time only shapes whose label has this")
    parser.add_argument("--sweep", nargs="?", const="fwd,bwd", default="",
                        help="also time every enumerated window key of these directions "
                             "(fwd,bwd; autotuning data)")
    parser.add_argument("--knobs", default="",
                        help='knob variants of the default keys, e.g. "pdl=0;linear=0"')
    parser.add_argument("--no-grad-ape-sum", action="store_true",
                        help="timing only: backwards without their grad_ape sum launch")
    args = parser.parse_args()
    if args.no_grad_ape_sum:
        _drop_grad_ape_sum()
    dtype = getattr(torch, args.dtype)
    shapes = [s for s in SHAPES if args.only in _label(*s)]
    try:
        _check_knobs(args.knobs, shapes, args.dtype)
    except ValueError as error:
        parser.error(str(error))
    device = torch.device("cuda")
    bw = timing.copy_bandwidth(device, 2**30)
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s")
    rows_out = []
    for segs, seqlen, d, ratio, coff in shapes:
        eb = torch.tensor([], dtype=dtype).element_size()
        tokens = segs * seqlen
        rows = segs * (seqlen // ratio)
        in_bytes = 2 * tokens * coff * d * eb
        fwd_bytes = in_bytes + rows * d * eb
        bwd_bytes = fwd_bytes + rows * d * eb + in_bytes
        nsets = timing.num_input_sets(in_bytes, device, cap=8)
        sets = [_inputs(segs, seqlen, d, ratio, coff, dtype, seed) for seed in range(nsets)]
        host.precompile(ratio, d, coff, dtype)

        def fwd(s, ratio=ratio, coff=coff):
            return host.run_forward(*s[:5], ratio, coff, s[5])

        def bwd(s, ratio=ratio, coff=coff):
            return host.run_backward(s[6], *s[:5], ratio, coff)

        t_fwd, t_bwd = graph_time(fwd, sets), graph_time(bwd, sets)
        if segs * seqlen <= 8192:
            t_launch, t_copy = latency_baselines(fwd_bytes)
            print(f"  one-element kernel {t_launch:.2f} us, copy of the forward's bytes "
                  f"{t_copy:.2f} us, forward {t_fwd:.2f}, backward {t_bwd:.2f}")
        if args.knobs:
            _knob_variants(args.knobs, ratio, coff, d, args.dtype, dtype, fwd, bwd, sets,
                           t_fwd, t_bwd)
        if args.sweep:
            _sweep(args.sweep, ratio, coff, d, args.dtype, dtype, fwd, bwd, sets, t_fwd, t_bwd)
        h_fwd, h_bwd = _host_time(fwd, sets[0]), _host_time(bwd, sets[0])
        floor_f, floor_b = fwd_bytes / bw * 1e6, bwd_bytes / bw * 1e6
        rec = {"shape": _label(segs, seqlen, d, ratio, coff), "fwd_us": t_fwd,
               "bwd_us": t_bwd, "floor_fwd_us": floor_f, "floor_bwd_us": floor_b,
               "host_fwd_us": h_fwd, "host_bwd_us": h_bwd}
        rows_out.append(rec)
        del sets
        torch.cuda.empty_cache()
    print(f"{'shape':<26}{'fwd us':>8}{'floor':>7}{'x':>6}{'bwd us':>8}{'floor':>7}{'x':>6}"
          f"{'host f':>8}{'host b':>8}")
    for r in rows_out:
        print(f"{r['shape']:<26}{r['fwd_us']:8.2f}{r['floor_fwd_us']:7.2f}"
              f"{r['fwd_us'] / r['floor_fwd_us']:6.2f}{r['bwd_us']:8.2f}{r['floor_bwd_us']:7.2f}"
              f"{r['bwd_us'] / r['floor_bwd_us']:6.2f}{r['host_fwd_us']:8.1f}"
              f"{r['host_bwd_us']:8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            report = {"device": torch.cuda.get_device_name(), "copy_bw": bw, "rows": rows_out}
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
