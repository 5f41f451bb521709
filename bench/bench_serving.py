"""Serving benchmark of csa::compressor_extend: decode steps and prefill from state.

    python bench/bench_serving.py             # the H200 rows (CUDA): decode B 1/64/256/1024,
                                              # prefill 4 x 2048 continuing from state
    python bench/bench_serving.py --smoke     # tiny shapes on the CPU: the harness works

Writes serving.json, serving.md and serving.png (with the bench extra's matplotlib) under
--out (default bench/out/). Each case also gets
its DRAM floor: the bytes any implementation must move (serving_traffic.py) over the
device's measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report
import serving_traffic
import timing
import torch
import variants
from serving_baseline import decode_step_eager

import csa_ops
from csa_ops import reference

CONFIGS = {"d512_r4c2": (512, 4, 2), "d512_r128c1": (512, 128, 1)}
FLOOR = "DRAM floor"  # the variant name of each case's floor row
PREFILL_STARTS = (1000, 37, 4099, 5)  # positions the 4 prefill requests continue from
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated config names")
    p.add_argument("--batches", default="1,64,256,1024", help="decode batch sizes")
    p.add_argument("--prefill-tokens", type=int, default=2048, help="new tokens per request")
    p.add_argument("--head-dim", type=int, default=None, help="override the configs' head_dim")
    p.add_argument("--smoke", action="store_true",
                   help="CPU, head_dim 32, batch 2, 300 prefill tokens, 1 warm-up, 2 iters")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled baseline")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--calls", type=int, default=None,
                   help="calls (steps) per graph replay or profiled sample, and the most per "
                        "wall-time sample (default 50 CUDA, 2 CPU)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"))
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.batches, args.prefill_tokens = "cpu", "2", 300
        args.head_dim, args.warmup, args.iters = 32, 1, 2
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no CUDA device")
    args.dtype = _DTYPES[args.dtype]
    args.batch_list = [int(b) for b in args.batches.split(",")]
    return args


def _log(message: str) -> None:
    print(message, flush=True)


def _config(args, name: str):
    """(head_dim, ratio, coff, label); the label names the head_dim actually run."""
    head_dim, ratio, coff = CONFIGS[name]
    head_dim = args.head_dim or head_dim
    return head_dim, ratio, coff, f"d{head_dim}_r{ratio}c{coff}"


def _randn(gen, shape, dtype, device, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(device=device, dtype=dtype)


# ---------------------------------------------------------------------------------------
# Cases: input sets that rotate so that no call finds its inputs in L2.


def decode_case(args, head_dim: int, ratio: int, coff: int, batch: int) -> dict:
    """One token per request, positions past the first block; request i completes a block
    when i % ratio == 0. Set j owns slots [j*batch, (j+1)*batch), permuted."""
    gen, dev, width = torch.Generator().manual_seed(0), args.device, coff * head_dim
    state_bytes = coff * ratio * width * (args.dtype.itemsize + 4)
    sets = timing.num_input_sets(batch * (state_bytes + 4 * width), dev, cap=16)
    start = 2 * ratio + (ratio - 1 - torch.arange(batch) % ratio)
    return {
        "kv": [_randn(gen, (batch, width), args.dtype, dev) for _ in range(sets)],
        "score": [_randn(gen, (batch, width), args.dtype, dev, 2.0) for _ in range(sets)],
        "slots": [(torch.randperm(batch, generator=gen) + j * batch).int().to(dev)
                  for j in range(sets)],
        "kv_state": _randn(gen, (sets * batch, coff * ratio, width), args.dtype, dev),
        "score_state": _randn(gen, (sets * batch, coff * ratio, width), torch.float32, dev, 2.0),
        "ape": _randn(gen, (ratio, width), torch.float32, dev, 0.5),
        "cu": torch.arange(batch + 1, dtype=torch.int32, device=dev),
        "start": start.int().to(dev), "sets": sets, "ratio": ratio, "coff": coff,
        "batch": batch,
    }


def decode_steps(case: dict, compile_: bool) -> dict:
    c = case
    n = c["sets"]

    def op(i):
        return torch.ops.csa.compressor_extend(
            c["kv"][i % n], c["score"][i % n], c["ape"], c["cu"], c["start"], c["slots"][i % n],
            c["kv_state"], c["score_state"], c["ratio"], c["coff"], c["batch"])[0]

    def eager_with(fn):
        return lambda i: fn(c["kv"][i % n], c["score"][i % n], c["ape"], c["start"],
                            c["slots"][i % n], c["kv_state"], c["score_state"], c["ratio"],
                            c["coff"])

    steps = {"op": op, "eager step": eager_with(decode_step_eager)}
    if compile_:
        steps["compiled step"] = eager_with(torch.compile(decode_step_eager, fullgraph=True,
                                                          dynamic=False))
    return steps


def check_decode(case: dict, steps: dict, tol: float) -> dict:
    """Every baseline's rows of set 0 against the op's (completing requests only)."""
    saved = case["kv_state"].clone(), case["score_state"].clone()
    done = ((case["start"].long() + 1) % case["ratio"] == 0).nonzero().flatten()
    results, want = {}, None
    for name, step in steps.items():
        case["kv_state"].copy_(saved[0])
        case["score_state"].copy_(saved[1])
        rows = step(0)
        rows = rows[:done.numel()] if name == "op" else rows[done]
        want = rows if want is None else want
        results[name] = variants.check(rows, (want,), tol)
    return results


def prefill_case(args, head_dim: int, ratio: int, coff: int) -> dict:
    """4 requests continuing from PREFILL_STARTS by --prefill-tokens each: the state is
    primed by an extend over the history; the training forward gets the new tokens alone."""
    gen, dev, width = torch.Generator().manual_seed(1), args.device, coff * head_dim
    new, starts = args.prefill_tokens, PREFILL_STARTS
    history = [_randn(gen, (2, p, width), args.dtype, dev) for p in starts]
    tokens = _randn(gen, (2, len(starts) * new, width), args.dtype, dev)
    ape = _randn(gen, (ratio, width), torch.float32, dev, 0.5)
    sets = timing.num_input_sets(2 * tokens[0].numel() * args.dtype.itemsize, dev, cap=8)
    lengths = [new] * len(starts)
    cu, cuc = csa_ops.offsets_for(lengths, ratio, dev)
    start = torch.tensor(starts, dtype=torch.int32, device=dev)
    rows = sum((p + new) // ratio - p // ratio for p in starts)
    primed = csa_ops.CompressorState(len(starts), ratio, coff, head_dim, args.dtype, dev)
    hist_cu, _ = csa_ops.offsets_for(list(starts), ratio, dev)
    slots = torch.arange(len(starts), dtype=torch.int32, device=dev)
    primed.extend(torch.cat([h[0] for h in history]), torch.cat([h[1] for h in history]), ape,
                  hist_cu, torch.zeros_like(start), slots, total_comp=None)
    state = csa_ops.CompressorState(sets * len(starts), ratio, coff, head_dim, args.dtype, dev)
    state.kv.copy_(primed.kv.repeat(sets, 1, 1))
    state.score.copy_(primed.score.repeat(sets, 1, 1))
    return {"kv": [tokens[0].clone() for _ in range(sets)],
            "score": [tokens[1].clone() for _ in range(sets)], "history": history, "ape": ape,
            "cu": cu, "cuc": cuc, "start": start, "rows": rows, "state": state, "sets": sets,
            "slots": [slots + j * len(starts) for j in range(sets)], "ratio": ratio,
            "coff": coff, "train_rows": int(cuc[-1])}


def prefill_steps(case: dict) -> dict:
    c, n = case, case["sets"]

    def op(i):
        return torch.ops.csa.compressor_extend(
            c["kv"][i % n], c["score"][i % n], c["ape"], c["cu"], c["start"], c["slots"][i % n],
            c["state"].kv, c["state"].score, c["ratio"], c["coff"], c["rows"])[0]

    def training(i):
        return torch.ops.csa.compressor(c["kv"][i % n], c["score"][i % n], c["ape"], c["cu"],
                                        c["cuc"], c["ratio"], c["coff"], c["train_rows"])

    return {"op": op, "training forward": training}


def check_prefill(case: dict, steps: dict, tol: float) -> dict:
    """The op's rows against csa::compressor over history + new tokens (first call, set 0);
    the training forward against csa_ops.reference on its own tokens."""
    c, ratio = case, case["ratio"]
    saved = c["state"].kv.clone(), c["state"].score.clone()
    got = steps["op"](0)
    c["state"].kv.copy_(saved[0])
    c["state"].score.copy_(saved[1])
    new = c["kv"][0].shape[0] // len(c["history"])
    whole = [torch.cat([h[j], c["kv" if j == 0 else "score"][0][i * new:(i + 1) * new]])
             for j in range(2) for i, h in enumerate(c["history"])]
    lengths = [p + new for p in PREFILL_STARTS]
    cu, cuc = csa_ops.offsets_for(lengths, ratio, c["cu"].device)
    full = torch.ops.csa.compressor(torch.cat(whole[:4]), torch.cat(whole[4:]), c["ape"], cu,
                                    cuc, ratio, c["coff"], None)
    keep = torch.cat([torch.arange(cuc[i] + p // ratio, cuc[i + 1], device=full.device)
                      for i, p in enumerate(PREFILL_STARTS)])
    ref = reference.compressor_reference(c["kv"][0], c["score"][0], c["ape"], c["cu"], c["cuc"],
                                         ratio, c["coff"], c["train_rows"])
    return {"op": variants.check(got, (full[keep],), tol) + (bool(torch.equal(got, full[keep])),),
            "training forward": variants.check(steps["training forward"](0), (ref,), tol)}


# ---------------------------------------------------------------------------------------
# Timing and the report.


def calls_per_sample(step, mode: str, args, sets: int) -> int:
    """timing.calls_per_sample for a timing mode: "graph" and "kernel" are device-side, and
    take --calls (50 on CUDA) for every variant of a case."""
    most = args.calls or (50 if args.device.type == "cuda" else 2)
    return timing.calls_per_sample(step, mode != "call", most, sets, args.device)


def time_step(step, mode: str, args, sets: int) -> dict:
    """Median seconds per call: "call" = per-call wall time, "graph" = replay of one CUDA
    graph holding the calls (device time, host launches gone), "kernel" = the durations of
    the step's GPU kernels (profiler records: the gaps between kernels gone too)."""
    if mode in ("graph", "kernel") and args.device.type != "cuda":
        return {"status": "n/a (CUDA only)"}
    try:
        calls = calls_per_sample(step, mode, args, sets)
        if mode == "call":
            median, samples = timing.time_calls(step, calls, args.warmup, args.iters, args.device)
        elif mode == "kernel":
            median, samples = timing.kernel_time(step, calls, args.warmup, args.iters)
        else:
            reason = timing.syncs_host(lambda: step(0))
            if reason is not None:
                return {"status": f"n/a (syncs with host: {reason[:80]})"}
            graph, _ = timing.capture_graph(step, calls, args.warmup)
            median, samples = timing.time_graph(graph, calls, args.warmup, args.iters)
        return {"status": "ok", "median_s": median, "samples_s": samples, "calls": calls}
    except Exception as exc:  # noqa: BLE001  (one broken variant must not end the run)
        timing.synchronize(args.device)
        return {"status": f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}


def run_case(name: str, kind: str, steps: dict, checks: dict, args, sets: int) -> list:
    rows = []
    for variant, step in steps.items():
        ok, errors, *bitwise = checks[variant]
        for mode in ("call", "graph", "kernel"):
            row = {"case": name, "kind": kind, "variant": variant, "timing": mode,
                   "max_error": errors, "bitwise": bitwise[0] if bitwise else None}
            row |= time_step(step, mode, args, sets) if ok else {
                "status": f"MISMATCH (scaled max error {errors})"}
            rows.append(row)
            shown = f"{row['median_s'] * 1e6:10.2f} us" if "median_s" in row else row["status"]
            _log(f"  {name:28s} {variant:17s} {mode:5s} {shown}")
    return rows


def floor_row(name: str, kind: str, nbytes: int, bandwidth: float) -> dict:
    """The case's DRAM floor: `nbytes` (serving_traffic) at the measured copy bandwidth."""
    return {"case": name, "kind": kind, "variant": FLOOR, "timing": "floor", "status": "ok",
            "median_s": nbytes / bandwidth, "bytes": nbytes, "max_error": [], "bitwise": None}


def add_derived(rows: list) -> None:
    """Speedups over the eager and compiled steps (decode), op / training forward
    (prefill) and op / DRAM floor, each against the same case (and timing mode)."""
    times = {(r["case"], r["variant"], r["timing"]): r["median_s"] for r in rows
             if "median_s" in r}
    for r in rows:
        t = r.get("median_s")
        if t is None or r["variant"] != "op":
            continue
        floor = times.get((r["case"], FLOOR, "floor"))
        r["op_over_floor"] = t / floor if floor else None
        for base in ("eager step", "compiled step"):
            ref = times.get((r["case"], base, r["timing"]))
            r[f"speedup_vs_{base.split()[0]}"] = ref / t if ref else None
        train = times.get((r["case"], "training forward", r["timing"]))
        r["op_over_training"] = t / train if train else None


def _fmt(value, unit="x") -> str:
    return "n/a" if value is None else f"{value:.2f}{unit}"


def targets(rows: list, batch: int = 256) -> list:
    """The H200 serving targets: the decode kernel time, then the graph-replay rows."""
    ops = [r for r in rows if r["variant"] == "op" and "median_s" in r]
    graph = [r for r in ops if r["timing"] == "graph"]
    lines = []
    for r in ops:
        if r["case"] == f"decode d512_r4c2 B{batch}" and r["timing"] == "kernel":
            us = r["median_s"] * 1e6
            lines.append(f"decode B{batch} d512 r4c2 kernel time {us:.2f} us (target <= 4 us): "
                         f"{'met' if us <= 4 else 'not met'}")
    for r in graph:
        if r.get("speedup_vs_compiled") is not None:
            s = r["speedup_vs_compiled"]
            lines.append(f"{r['case']}: {s:.1f}x the compiled step, graph vs graph "
                         f"(target >= 10x): {'met' if s >= 10 else 'not met'}")
        if r.get("op_over_training") is not None:
            ratio = r["op_over_training"]
            lines.append(f"{r['case']}: {ratio:.2f}x the training forward (target <= 1.15x): "
                         f"{'met' if ratio <= 1.15 else 'not met'}")
    return lines


def markdown(results: dict) -> str:
    meta = results["meta"]
    title = (f"# csa::compressor_extend on {meta['device_name']} ({meta['dtype']}, "
             f"torch {meta['torch']})")
    header = ("| case | variant | timing | time us | vs eager step | vs compiled step | "
              "op / training fwd | op / DRAM floor | check |")
    bandwidth = (f"Copy bandwidth {meta['copy_bandwidth_Bps'] / 1e9:.0f} GB/s (read + write); "
                 "the floor rows move the bytes serving_traffic.py counts at it.")
    lines = [title, "", bandwidth,
             "", header, "|---|---|---|---|---|---|---|---|---|"]
    for r in results["results"]:
        time_us = f"{r['median_s'] * 1e6:.2f}" if "median_s" in r else r["status"]
        if r["variant"] == FLOOR:
            check = f"{r['bytes'] / 1e6:.2f} MB"
        elif r.get("bitwise"):
            check = "bitwise"
        else:
            check = f"max err {max(r['max_error'], default=0):.1e}"
        lines.append(f"| {r['case']} | {r['variant']} | {r['timing']} | {time_us} | "
                     f"{_fmt(r.get('speedup_vs_eager'))} | {_fmt(r.get('speedup_vs_compiled'))} "
                     f"| {_fmt(r.get('op_over_training'))} | {_fmt(r.get('op_over_floor'))} "
                     f"| {check} |")
    if results["targets"]:
        lines += ["", "Targets (kernel time, graph replay):", ""]
        lines += [f"- {t}" for t in results["targets"]]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    """Decode step time against batch (left) and prefill from state against the training
    forward (right): graph replay where it was measured (CUDA), else per-call wall time."""
    plt = report.pyplot()
    rows = [r for r in results["results"] if "median_s" in r]
    timing = "graph" if any(r["timing"] == "graph" for r in rows) else "call"

    def times(kind, config, variant):
        """(case, us) of one variant's rows: the floor's own row, else `timing`'s."""
        want = "floor" if variant == FLOOR else timing
        return [(r["case"], r["median_s"] * 1e6) for r in rows
                if r["kind"] == kind and r["case"].split()[1] == config
                and r["variant"] == variant and r["timing"] == want]

    configs = list(dict.fromkeys(r["case"].split()[1] for r in rows))
    colors = {c: plt.get_cmap("tab10")(i) for i, c in enumerate(configs)}
    fig, (dec_ax, pre_ax) = plt.subplots(1, 2, figsize=(15, 6))
    styles = {"op": "-", "compiled step": "--", "eager step": ":", FLOOR: "-."}
    for config in configs:
        for variant, ls in styles.items():
            pts = sorted((int(case.rsplit("B", 1)[1]), us)
                         for case, us in times("decode", config, variant))
            if pts:
                dec_ax.plot(*zip(*pts, strict=True), ls=ls, marker="o", ms=4,
                            color=colors[config], label=f"{config} {variant}")
    dec_ax.set_xscale("log", base=2)
    dec_ax.set_yscale("log")
    dec_ax.set_xlabel("requests (one new token each)")
    dec_ax.set_title(f"decode step: time per step (us, {timing})", fontsize=10)
    dec_ax.grid(True, which="both", alpha=0.3)
    dec_ax.legend(fontsize=7)
    bars = ("op", "training forward", FLOOR)
    for j, variant in enumerate(bars):
        heights = [next((us for _, us in times("prefill", c, variant)), 0.0) for c in configs]
        pre_ax.bar([k + (j - 1) * 0.27 for k in range(len(configs))], heights, 0.27,
                   label=variant)
    pre_ax.set_xticks(range(len(configs)), configs)
    pre_ax.set_title(f"4 requests continuing from state: time per call (us, {timing})",
                     fontsize=10)
    pre_ax.legend(fontsize=8)
    report.save_figure(fig, results, "csa::compressor_extend", path)


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = time.perf_counter()
    tol = variants.tolerance(args.dtype, "fwd")
    bandwidth = timing.copy_bandwidth(args.device, (2048 if args.device.type == "cuda" else 64)
                                      << 20)
    meta = report.environment(args.device) | {
        "argv": sys.argv[1:] if argv is None else list(argv), "dtype": str(args.dtype),
        "warmup": args.warmup, "iters": args.iters, "l2_bytes": timing.l2_bytes(args.device),
        "copy_bandwidth_Bps": bandwidth}
    itemsize = args.dtype.itemsize
    rows: list = []
    for config in args.configs.split(","):
        head_dim, ratio, coff, label = _config(args, config)
        for batch in args.batch_list:
            torch._dynamo.reset()
            case = decode_case(args, head_dim, ratio, coff, batch)
            steps = decode_steps(case, compile_=not args.no_compile)
            checks = check_decode(case, steps, tol)
            name = f"decode {label} B{batch}"
            nbytes = serving_traffic.call_bytes(case["start"].tolist(), [1] * batch, ratio,
                                                coff, head_dim, itemsize)
            rows += [*run_case(name, "decode", steps, checks, args, case["sets"]),
                     floor_row(name, "decode", nbytes, bandwidth)]
            del case, steps
        case = prefill_case(args, head_dim, ratio, coff)
        steps = prefill_steps(case)
        name = f"prefill {label} 4x{args.prefill_tokens}"
        nbytes = serving_traffic.call_bytes(PREFILL_STARTS, [args.prefill_tokens] * 4, ratio,
                                            coff, head_dim, itemsize)
        rows += [*run_case(name, "prefill", steps, check_prefill(case, steps, tol), args,
                           case["sets"]),
                 floor_row(name, "prefill", nbytes, bandwidth)]
        del case, steps
    add_derived(rows)
    meta["elapsed_s"] = time.perf_counter() - t0
    results = {"meta": meta, "results": rows, "targets": targets(rows)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(results)
    (out / "serving.json").write_text(json.dumps(results, indent=1))
    (out / "serving.md").write_text(table)
    written = [out / "serving.json", out / "serving.md"]
    if report.draw_if_available(plot, results, out / "serving.png"):
        written.append(out / "serving.png")
    _log(table)
    _log(f"wrote {', '.join(map(str, written))} in {meta['elapsed_s']:.1f}s")
    return results


if __name__ == "__main__":
    main()
