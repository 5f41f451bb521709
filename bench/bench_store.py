"""Serving store benchmark of csa::compressor_extend_store: decode steps and prefill.

    python bench/bench_store.py               # the H200 rows (CUDA)
    python bench/bench_store.py --quick       # one tiny shape, any device (CPU: eager only)

Per config and shape (bf16, fp32 norm weight, RoPE 64, page_size 64), in one run: ``extend``
(csa::compressor_extend alone, the baseline), ``store kernel`` (the op: on CUDA a decode
step's one kernel where it takes the call, else the extend kernel then the row-epilogue
kernel), ``store 2 launches`` (the op as the extend kernel then the store kernel for every
call), ``store fused prefill`` (prefill shapes: the op under row_epilogue.fused_prefill(), a
split call's two fused launches), ``store torch`` (the op under
row_epilogue.torch_route()), ``store compiled`` (torch.compile of the extend then
serving_store.epilogue_store; fullgraph=True, else False, recorded; an error is recorded),
each as wall time of back-to-back eager calls and on CUDA as CUDA-graph replay
(bench_serving.time_step); and ``DRAM floor``: the store's bytes (store_bytes) at the
measured copy bandwidth, and at the H200's nominal 4.8 TB/s.
Every variant's state and cache after one call from the same initial state and cache are
compared bitwise with ``store kernel``'s; a mismatch is recorded, not raised. Writes
results.json, results.md and results.png under --out (default bench/out/store).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from collections import namedtuple
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report
import serving_traffic
import timing
import torch
from bench_serving import PREFILL_STARTS, time_step

import csa_ops
from csa_ops import reference_epilogue as ref
from csa_ops import row_epilogue, serving_store

PAGE_SIZE, EPS, DTYPE = 64, 1e-6, torch.bfloat16
DECODE_CONTEXT = 16384  # decode positions are drawn below this
NOMINAL_BANDWIDTH = 4.8e12  # H200 HBM3e, bytes/s
FLOOR, KERNEL = "DRAM floor", "store kernel"
TWO_LAUNCHES = "store 2 launches"  # the extend kernel, then the store kernel
FUSED_PREFILL = "store fused prefill"  # a split call's two fused launches (opt-in)
STORE = torch.ops.csa.compressor_extend_store.default
Config = namedtuple("Config", "head_dim ratio coff cache_format rope_dim rotate",
                    defaults=(64, False))
CONFIGS = {"d512_r4c2_ds_mla": Config(512, 4, 2, "fp8_ds_mla"),
           "d512_r128c1_ds_mla": Config(512, 128, 1, "fp8_ds_mla"),
           "d128_r4c2_rot_mxfp4": Config(128, 4, 2, "mxfp4", rotate=True)}
SHAPES = (*(f"decode{k}_B{b}" for k in ("", "_blocks") for b in (1, 64, 256, 1024)),
          "prefill_4x2048")
QUICK_SHAPES = ("decode_blocks_B4",)
_SHAPE_RE = re.compile(r"^(decode|decode_blocks)_B(\d+)$|^prefill_(\d+)x(\d+)$")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated config names")
    p.add_argument("--shapes", help="comma-separated decode_B<b> (random positions), "
                   "decode_blocks_B<b> (each request completes a block), prefill_<B>x<tokens>")
    p.add_argument("--quick", action="store_true", help=f"only {QUICK_SHAPES[0]} (smoke run)")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled variant")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--calls", type=int, help="calls per graph replay (default 50 CUDA, 2 CPU)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "store"))
    args = p.parse_args(argv)
    args.device = torch.device(args.device)
    args.shape_list = args.shapes.split(",") if args.shapes else (
        QUICK_SHAPES if args.quick else SHAPES)
    bad = [s for s in args.shape_list if not _SHAPE_RE.match(s)]
    if bad or any(c not in CONFIGS for c in args.configs.split(",")):
        p.error(f"unknown shape or config in {bad or args.configs}")
    return args


def requests(shape: str, ratio: int, gen) -> tuple[list, list]:
    """(start positions, new tokens) per request: decode positions at random, or each one
    token short of a block end (decode_blocks); prefill from bench_serving's positions."""
    kind, batch, count, tokens = _SHAPE_RE.match(shape).groups()
    if kind is None:
        return [PREFILL_STARTS[i % 4] for i in range(int(count))], [int(tokens)] * int(count)
    if kind == "decode":
        starts = torch.randint(2 * ratio, DECODE_CONTEXT, (int(batch),), generator=gen)
    else:
        starts = torch.randint(2, DECODE_CONTEXT // ratio, (int(batch),), generator=gen) * ratio - 1
    return starts.tolist(), [1] * int(batch)


def store_bytes(cfg: Config, starts, lengths) -> int:
    """serving_traffic's extend bytes (new kv and score, state read and written), each
    emitted row written in the cache format instead of bf16, its RoPE rows and the norm
    weight read."""
    rows = sum((p + n) // cfg.ratio - p // cfg.ratio for p, n in zip(starts, lengths))
    extend = serving_traffic.call_bytes(starts, lengths, cfg.ratio, cfg.coff, cfg.head_dim,
                                        DTYPE.itemsize)
    cache_row = (ref.DS_MLA_ROW_BYTES + ref.DS_MLA_SCALE_BYTES if cfg.cache_format == "fp8_ds_mla"
                 else ref.row_bytes(cfg.cache_format, cfg.head_dim))
    return extend + rows * (cache_row + 4 * cfg.rope_dim - cfg.head_dim * DTYPE.itemsize) + (
        4 * cfg.head_dim)


class Case:
    """Input sets (tokens, slots, block tables onto pages of their own) rotating over more
    than 3x L2; the state and a cache of random bytes, which reset() restores."""

    def __init__(self, cfg: Config, starts, lengths, device, gen) -> None:
        self.cfg, self.device = cfg, device
        r, batch, width, tokens = cfg.ratio, len(starts), cfg.coff * cfg.head_dim, sum(lengths)
        end = [(p + n) // r for p, n in zip(starts, lengths)]
        columns = [range(p // r // PAGE_SIZE, (q - 1) // PAGE_SIZE + 1) if q > p // r
                   else range(0) for p, q in zip(starts, end)]  # the pages a call writes
        pages = sum(map(len, columns))
        page_bytes = serving_store.new_cache(1, PAGE_SIZE, cfg.head_dim, cfg.cache_format).nbytes
        self.sets = n = timing.num_input_sets(
            batch * cfg.coff * r * width * (DTYPE.itemsize + 4)
            + 2 * tokens * width * DTYPE.itemsize + pages * page_bytes, device, cap=16)

        def randn(*shape, scale=1.0, dtype=DTYPE):
            return (torch.randn(shape, generator=gen) * scale).to(device=device, dtype=dtype)

        self.kv = [randn(tokens, width) for _ in range(n)]
        self.score = [randn(tokens, width, scale=2.0) for _ in range(n)]
        self.ape = randn(r, width, scale=0.5, dtype=torch.float32)
        self.weight = 1 + randn(cfg.head_dim, scale=0.25, dtype=torch.float32)
        self.cu, _ = csa_ops.offsets_for(lengths, r, device)
        self.start = torch.tensor(starts, dtype=torch.int32, device=device)
        self.slots = [(torch.randperm(batch, generator=gen) + j * batch).int().to(device)
                      for j in range(n)]
        self.kv_state = randn(n * batch, cfg.coff * r, width)
        self.score_state = randn(n * batch, cfg.coff * r, width, scale=2.0, dtype=torch.float32)
        angles = torch.arange(max(end) * r + 1, dtype=torch.float64)[:, None] * 10000.0 ** (
            -torch.arange(0, cfg.rope_dim, 2, dtype=torch.float64) / cfg.rope_dim)
        self.cos, self.sin = (f(angles).float().to(device) for f in (torch.cos, torch.sin))
        order = (torch.randperm(n * pages, generator=gen) + 1).tolist()  # page 0: never written
        self.tables = []
        for _ in range(n):
            table = torch.zeros(batch, max(end) // PAGE_SIZE + 1, dtype=torch.int32)
            for i, cols in enumerate(columns):
                table[i, list(cols)] = torch.tensor([order.pop() for _ in cols], dtype=torch.int32)
            self.tables.append(table.to(device))
        self.cache = serving_store.new_cache(1 + n * pages, PAGE_SIZE, cfg.head_dim,
                                             cfg.cache_format, DTYPE, device)
        self.cache.copy_(torch.randint(0, 256, self.cache.shape, generator=gen,
                                       dtype=torch.uint8))
        self.mutable = (self.kv_state, self.score_state, self.cache)
        self.initial = [t.clone() for t in self.mutable]
        # The op's own row capacity: exact on the CPU, a bound from shapes on CUDA.
        self.rows = serving_store._row_capacity(self.kv[0], self.cu, self.start, r,
                                                exact=device.type == "cpu")

    def reset(self) -> None:
        for t, saved in zip(self.mutable, self.initial):
            t.copy_(saved)

    def inputs(self, i: int) -> list:
        """csa::compressor_extend_store's positional arguments on input set i."""
        c, j = self.cfg, i % self.sets
        return [self.kv[j], self.score[j], self.ape, self.cu, self.start, self.slots[j],
                self.kv_state, self.score_state, self.weight, EPS, self.cos, self.sin,
                c.rope_dim, c.rotate, c.cache_format, self.cache, self.tables[j], PAGE_SIZE,
                c.ratio, c.coff]

    def extend(self, *a):
        return torch.ops.csa.compressor_extend(*a[:8], a[18], a[19], self.rows)

    def composed(self, *a):
        """The op as torch ops: the extend, then serving_store.epilogue_store of its rows."""
        pooled, cuc = self.extend(*a)
        serving_store.epilogue_store(pooled, cuc, a[0].shape[0], *a[3:6], a[6].shape[0],
                                     *a[8:19])
        return cuc


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"


def outcome(case: Case, fn, route) -> list:
    """State and cache after fn(set 0) from the initial state and cache."""
    case.reset()
    with route():
        fn(*case.inputs(0))
    timing.synchronize(case.device)
    return [t.clone() for t in case.mutable]


def compiled(case: Case) -> tuple:
    """(torch.compile of case.composed, note): fullgraph=True if it runs, else False."""
    note = {}
    for fullgraph in (True, False):
        torch._dynamo.reset()
        fn = torch.compile(case.composed, fullgraph=fullgraph, dynamic=False)
        try:
            outcome(case, fn, row_epilogue.torch_route)
            return fn, note | {"fullgraph": fullgraph}
        except Exception as exc:  # noqa: BLE001  (recorded; the run goes on)
            timing.synchronize(case.device)
            note[f"fullgraph={fullgraph}"] = _error(exc)
    raise RuntimeError("; ".join(f"{k}: {v}" for k, v in note.items()))


def compare(got: list, want: list | None, with_cache: bool) -> str | None:
    """None when bitwise equal (or no kernel outcome to compare with), else what differs."""
    names = ("kv_state", "score_state", "cache")[:3 if with_cache else 2]
    flat = [(n, g.flatten().view(torch.uint8), w.flatten().view(torch.uint8))
            for n, g, w in zip(names, got, want or [])]
    diffs = [f"{n}: {int((g != w).sum())} bytes differ" for n, g, w in flat
             if not torch.equal(g, w)]
    return f"mismatch with {KERNEL}: " + "; ".join(diffs) if diffs else None


def run_case(config: str, shape: str, args, bandwidth: float, gen) -> list:
    cfg, name = CONFIGS[config], f"{config} {shape}"
    starts, lengths = requests(shape, cfg.ratio, gen)
    case = Case(cfg, starts, lengths, args.device, gen)
    fns = {"extend": case.extend, KERNEL: STORE, TWO_LAUNCHES: STORE, "store torch": STORE}
    if shape.startswith("prefill"):
        fns[FUSED_PREFILL] = STORE
    if not args.no_compile:
        fns["store compiled"] = compiled
    routes = {v: row_epilogue.torch_route for v in ("store torch", "store compiled")}
    routes[TWO_LAUNCHES] = row_epilogue.two_launch_step
    routes[FUSED_PREFILL] = row_epilogue.fused_prefill
    checks, want = {}, None
    for variant in sorted(fns, key=lambda v: v != KERNEL):  # the kernel's outcome first
        route, note = routes.get(variant, contextlib.nullcontext), {}
        try:
            if variant == "store compiled":
                fns[variant], note = compiled(case)
            got = outcome(case, fns[variant], route)
            if variant == KERNEL:
                want, note = got, {"cache_bytes_changed": int((got[2] != case.initial[2]).sum())}
            error = compare(got, want, variant != "extend")
        except Exception as exc:  # noqa: BLE001  (recorded; the other variants still run)
            timing.synchronize(case.device)
            fns[variant], error = None, _error(exc)
        checks[variant] = (error, note)
    nbytes = store_bytes(cfg, starts, lengths)
    rows = [{"case": name, "config": config, "shape": shape, "variant": FLOOR, "timing": "floor",
             "status": "ok", "median_s": nbytes / bandwidth, "bytes": nbytes,
             "nominal_floor_s": nbytes / NOMINAL_BANDWIDTH}]
    for variant, fn in fns.items():
        (error, note), route = checks[variant], routes.get(variant, contextlib.nullcontext)
        for mode in ("wall", "graph") if args.device.type == "cuda" else ("wall",):
            row = {"case": name, "config": config, "shape": shape, "variant": variant,
                   "timing": mode, "error": error, **note}
            if fn is None:
                row["status"] = f"error: {error}"
            else:
                with route():
                    row |= time_step(lambda i, fn=fn: fn(*case.inputs(i)),
                                     "call" if mode == "wall" else mode, args, case.sets)
            rows.append(row)
            shown = f"{row['median_s'] * 1e6:10.2f} us" if "median_s" in row else row["status"]
            print(f"  {name:36s} {variant:14s} {mode:5s} {shown}  {error or 'bitwise'}",
                  flush=True)
    return rows


def add_derived(rows: list) -> None:
    """x_extend: time over the extend's (same case and timing); x_floor: over the floor."""
    times = {(r["case"], r["variant"], r["timing"]): r["median_s"] for r in rows
             if "median_s" in r}
    for r in rows:
        if "median_s" in r and r["variant"] != FLOOR:
            ext = times.get((r["case"], "extend", r["timing"]))
            r["x_extend"] = r["median_s"] / ext if ext else None
            r["x_floor"] = r["median_s"] / times[(r["case"], FLOOR, "floor")]


def markdown(results: dict) -> str:
    meta = results["meta"]
    lines = [(f"# csa::compressor_extend_store on {meta['device_name']} (bf16, torch "
              f"{meta['torch']}, cutlass-dsl {meta['cutlass_dsl'] or 'n/a'})"), "",
             (f"Copy bandwidth {meta['copy_bandwidth_Bps'] / 1e9:.0f} GB/s (read + write); the "
              f"floor rows move the store's bytes at it. Page size {PAGE_SIZE}; medians of "
              f"{meta['iters']} samples."), "",
             "| case | variant | timing | time us | x extend | x floor | check |",
             "|---|---|---|---|---|---|---|"]
    for r in results["results"]:
        us = f"{r['median_s'] * 1e6:.2f}" if "median_s" in r else r["status"]
        check = (f"{r['bytes'] / 1e6:.3f} MB; {r['nominal_floor_s'] * 1e6:.2f} us at 4.8 TB/s"
                 if r["variant"] == FLOOR else (r["error"] or "bitwise") + (
                     f" (fullgraph={r['fullgraph']})" if "fullgraph" in r else ""))
        x_ext, x_floor = (f"{r[k]:.2f}x" if r.get(k) else "" for k in ("x_extend", "x_floor"))
        lines.append(f"| {r['case']} | {r['variant']} | {r['timing']} | {us} | {x_ext} | "
                     f"{x_floor} | {check} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    """One panel per config: a bar per variant and shape (graph replay where measured, else
    wall time) beside the floor."""
    plt = report.pyplot()
    rows = [r for r in results["results"] if "median_s" in r]
    mode = "graph" if any(r["timing"] == "graph" for r in rows) else "wall"
    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig, axes = plt.subplots(1, len(configs), figsize=(7 * len(configs), 5), squeeze=False)
    for ax, config in zip(axes[0], configs):
        mine = [r for r in rows if r["config"] == config and r["timing"] in (mode, "floor")]
        shapes = list(dict.fromkeys(r["shape"] for r in mine))
        variants = list(dict.fromkeys(r["variant"] for r in mine))
        width = 0.8 / len(variants)
        for k, variant in enumerate(variants):
            us = [next((r["median_s"] * 1e6 for r in mine if r["shape"] == s
                        and r["variant"] == variant), 0.0) for s in shapes]
            ax.bar([i + k * width for i in range(len(shapes))], us, width, label=variant)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))], shapes, rotation=25,
                      fontsize=7)
        ax.set(yscale="log", ylabel=f"us per call ({mode})", title=config)
        ax.legend(fontsize=7)
    report.save_figure(fig, results, "csa::compressor_extend_store", path)


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0, gen = time.perf_counter(), torch.Generator().manual_seed(0)
    bandwidth = timing.copy_bandwidth(args.device, (2048 if args.device.type == "cuda" else 64)
                                      << 20)
    meta = report.environment(args.device) | {
        "argv": sys.argv[1:] if argv is None else list(argv), "dtype": str(DTYPE),
        "page_size": PAGE_SIZE, "warmup": args.warmup, "iters": args.iters,
        "l2_bytes": timing.l2_bytes(args.device), "copy_bandwidth_Bps": bandwidth,
        "nominal_bandwidth_Bps": NOMINAL_BANDWIDTH}
    rows: list = []
    for config in args.configs.split(","):
        for shape in args.shape_list:
            torch._dynamo.reset()
            rows += run_case(config, shape, args, bandwidth, gen)
    add_derived(rows)
    meta["elapsed_s"] = time.perf_counter() - t0
    results, out = {"meta": meta, "results": rows}, Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(results)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "results.md").write_text(table)
    drawn = report.draw_if_available(plot, results, out / "results.png")
    print(f"{table}\nwrote results.json, results.md{', results.png' * drawn} under {out} in "
          f"{meta['elapsed_s']:.1f}s", flush=True)
    return results


if __name__ == "__main__":
    main()
