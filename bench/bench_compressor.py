"""Side-by-side benchmark of csa::compressor against the eager and compiled baselines.

    python bench/bench_compressor.py                 # the production shapes
    python bench/bench_compressor.py --quick         # a tiny set, any device

Prints a markdown table, writes results.json and results.png under --out. See README.md.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report
import timing
import torch
import variants
from variants import Case, Shape, Variant

import csa_ops  # noqa: F401  (registers torch.ops.csa.*)

PRODUCTION_SHAPES = (
    "r4c2_1x8192_d128", "r4c2_3x8192_d128", "r4c2_1x8192_d512", "r4c2_3x8192_d512",
    "r4c2_1x65536_d512", "r4c1_1x8192_d128", "r2c2_3x8192_d512",
    "r128c1_1x65536_d128", "r128c1_1x131072_d128", "r128c1_1x65536_d512",
    "r128c1_1x131072_d512", "r128c2_1x65536_d128", "r128c2_1x131072_d128",
    "r128c2_1x65536_d512", "r128c2_1x131072_d512",
)
# Both kernel families (window and streaming) and both coff, in seconds even on a CPU.
QUICK_SHAPES = ("r4c2_2x64_d128", "r128c1_1x256_d128")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    p.add_argument("--shapes", default=None,
                   help="comma-separated r<ratio>c<coff>_<B>x<len>_d<d> (default: production)")
    p.add_argument("--quick", action="store_true", help="a tiny shape set (smoke run)")
    p.add_argument("--variants", default=None,
                   help="comma-separated substrings; a variant runs if its name holds one")
    p.add_argument("--skip", default=None,
                   help="comma-separated substrings; a variant whose name holds one is skipped")
    p.add_argument("--list", action="store_true", help="print the variant names and exit")
    p.add_argument("--warmup", type=int, default=2, help="untimed batches before timing")
    p.add_argument("--iters", type=int, default=10, help="timed batches (median reported)")
    p.add_argument("--batch", type=int, default=None,
                   help="calls per graph replay, and the most per wall-time batch (default: "
                        "20 on CUDA, 2 on CPU; wall-time batches of calls over 0.25 ms hold "
                        "fewer; never fewer than the input sets)")
    p.add_argument("--copy-mib", type=int, default=None,
                   help="buffer size of the copy-bandwidth probe (default 2048 CUDA, 64 CPU)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"))
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    names = args.shapes.split(",") if args.shapes else (
        QUICK_SHAPES if args.quick else PRODUCTION_SHAPES)
    args.shape_list = [Shape.parse(n) for n in names if n.strip()]
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no CUDA device")
    return args


def _keys(text: str | None) -> list[str]:
    return [k.strip() for k in (text or "").split(",") if k.strip()]


def _selected(args) -> list[Variant]:
    chosen = list(variants.VARIANTS.values())
    if args.variants:
        chosen = [v for v in chosen if any(k in v.name for k in _keys(args.variants))]
    return [v for v in chosen if not any(k in v.name for k in _keys(args.skip))]


def _log(message: str) -> None:
    print(message, flush=True)


def _kernel_path(case: Case) -> str:
    """Which implementation csa::compressor runs for this case on this device."""
    if case.device.type != "cuda":
        return "reference (CPU)"
    try:
        from csa_ops import host
        return "kernel" if host.supports(*case.args(0), case.shape.ratio,
                                         case.shape.coff) else "reference fallback"
    except Exception as exc:  # noqa: BLE001  (a half-built host must not stop the bench)
        return f"reference fallback ({type(exc).__name__})"


def _batch_size(step, variant: Variant, case: Case, args) -> int:
    """timing.calls_per_sample for a variant: graph replays take --batch calls (20 on CUDA)
    whatever the variant, wall-time batches last about 5 ms."""
    most = args.batch or (20 if case.device.type == "cuda" else 2)
    return timing.calls_per_sample(step, variant.timing == "graph", most, case.num_sets,
                                   case.device)


def run_variant(variant: Variant, case: Case, expected: dict, args) -> dict:
    """Build, check against csa_ops.reference, then time one variant on one case."""
    row = {"variant": variant.name, "direction": variant.direction, "timing": variant.timing}
    if variant.cuda_only and case.device.type != "cuda":
        return row | {"status": "n/a (CUDA only)"}
    try:
        if variant.compiled:
            torch._dynamo.reset()  # each compiled variant starts from a clean dynamo cache
        step = variant.build(case)
        start = time.perf_counter()
        outputs = step(0)
        timing.synchronize(case.device)
        row["first_call_s"] = time.perf_counter() - start
        key = (variant.direction, variant.rms_norm)
        if key not in expected:
            expected[key] = case.expected(variant.direction, variant.rms_norm)
        tolerance = variants.tolerance(case.dtype, variant.direction)
        ok, errors = variants.check(outputs, expected[key], tolerance)
        row["max_error"] = errors
        del outputs
        if not ok:
            return row | {"status": f"MISMATCH (scaled max error {errors})"}
        batch = _batch_size(step, variant, case, args)
        if variant.timing == "graph":
            reason = timing.syncs_host(lambda: step(0))
            if reason is not None:
                return row | {"status": f"n/a (syncs with host: {reason[:80]})"}
            graph, first = timing.capture_graph(step, batch, args.warmup)
            # The replay itself must compute the answer: poison its outputs, replay, check.
            for t in first if isinstance(first, (tuple, list)) else (first,):
                t.fill_(float("nan"))
            graph.replay()
            ok, errors = variants.check(first, expected[key], tolerance)
            if not ok:
                return row | {"status": f"MISMATCH in replay (scaled max error {errors})"}
            median, samples = timing.time_graph(graph, batch, args.warmup, args.iters)
            del graph, first
        else:
            median, samples = timing.time_calls(step, batch, args.warmup, args.iters,
                                                case.device)
        return row | {"status": "ok", "median_s": median, "samples_s": samples, "batch": batch}
    except Exception as exc:  # noqa: BLE001  (one broken variant must not end the run)
        timing.synchronize(case.device)
        return row | {"status": f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}


def run_shape(shape: Shape, chosen: list[Variant], args, bandwidth: float, t0: float,
              lowering_mode: str | None) -> list:
    dtype = _DTYPES[args.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = variants.algorithmic_bytes(shape, itemsize)
    set_bytes = 2 * shape.tokens * shape.coff * shape.head_dim * itemsize
    case = Case(shape, args.device, dtype, timing.num_input_sets(set_bytes, args.device))
    path = _kernel_path(case)
    _log(f"[{time.perf_counter() - t0:7.1f}s] {shape.name}: {case.num_sets} input sets, op runs "
         f"{path}")
    expected: dict = {}
    rows = []
    for variant in chosen:
        row = run_variant(variant, case, expected, args)
        row |= {"shape": shape.name, "tokens": shape.tokens, "ratio": shape.ratio,
                "coff": shape.coff, "head_dim": shape.head_dim, "op_path": path,
                "input_sets": case.num_sets,
                "bytes": nbytes[variant.direction],
                "floor_s": nbytes[variant.direction] / bandwidth, "role": variant.role,
                "rms_norm": variant.rms_norm}
        rows.append(row)
        shown = f"{row['median_s'] * 1e6:10.1f} us" if "median_s" in row else row["status"]
        compile_note = (f" (first call {row['first_call_s']:.1f}s)"
                        if variant.compiled and "first_call_s" in row else "")
        _log(f"[{time.perf_counter() - t0:7.1f}s]   {variant.name:34s} {shown}{compile_note}")
    del case, expected
    variants.set_lowering_mode(lowering_mode)  # variants switch it; leave it as found
    # Fresh dynamo state per shape, so no cache-size limit or stale guard affects the next.
    torch._dynamo.reset()
    gc.collect()
    if args.device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = time.perf_counter()
    lowering_mode = variants.lowering_mode()
    chosen = _selected(args)
    if args.list:
        _log("\n".join(f"{v.name}  ({v.direction}, {v.timing})" for v in chosen))
        return {}
    copy_mib = args.copy_mib or (2048 if args.device.type == "cuda" else 64)
    bandwidth = timing.copy_bandwidth(args.device, copy_mib << 20)
    meta = report.environment(args.device) | {
        "argv": sys.argv[1:] if argv is None else list(argv), "dtype": args.dtype,
        "copy_bandwidth_Bps": bandwidth, "copy_probe_bytes": copy_mib << 20,
        "l2_bytes": timing.l2_bytes(args.device), "warmup": args.warmup, "iters": args.iters}
    _log(f"{meta['device_name']}: copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write); "
         f"{len(args.shape_list)} shapes x {len(chosen)} variants")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    results = {"meta": meta, "results": rows}
    for shape in args.shape_list:
        rows += run_shape(shape, chosen, args, bandwidth, t0, lowering_mode)
        report.add_derived(rows)
        meta["elapsed_s"] = time.perf_counter() - t0
        report.write(results, report.markdown(results), out, plot_png=False)  # partial, if cut
    table = report.markdown(results)
    paths = report.write(results, table, out, plot_png=not args.no_plot)
    _log(table)
    first_calls = sum(r.get("first_call_s", 0.0) for r in rows)
    _log(f"wrote {', '.join(str(p) for p in paths)} in {meta['elapsed_s']:.1f}s "
         f"({first_calls:.1f}s of it in first calls, i.e. compiles)")
    return results


if __name__ == "__main__":
    main()
