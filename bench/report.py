"""The fixed report: environment stamp, derived columns, markdown tables, JSON and PNG."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import platform
import subprocess
from pathlib import Path

import torch

NA = "n/a"


def _version(dist: str, module: str | None = None) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:  # an unpacked tree on PYTHONPATH has the module but no dist-info
        return getattr(__import__(module or dist), "__version__", None)
    except Exception:  # noqa: BLE001
        return None


def _driver() -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20, check=True)
        return done.stdout.strip().splitlines()[0]
    except Exception:  # noqa: BLE001  (no nvidia-smi on CPU machines)
        return None


def environment(device: torch.device) -> dict:
    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "cutlass_dsl": _version("nvidia-cutlass-dsl", "cutlass"),
        "triton": _version("triton"), "device": str(device), "driver": None,
        "device_name": platform.processor() or platform.machine(), "capability": None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env |= {"device_name": props.name, "capability": f"{props.major}.{props.minor}",
                "sm_count": props.multi_processor_count, "driver": _driver()}
    return env


def add_derived(rows: list[dict]) -> None:
    """GB/s, fraction of the DRAM floor, speedups over the eager and compiled baselines
    (the baselines' per-call wall time of the same shape and direction)."""
    base = {(r["shape"], r["direction"], r["rms_norm"], r["role"]): r["median_s"]
            for r in rows if r.get("role") and "median_s" in r}
    for r in rows:
        if "median_s" not in r:
            continue
        t = r["median_s"]
        r["GBps"] = r["bytes"] / t / 1e9
        r["frac_of_floor"] = r["floor_s"] / t
        for role in ("eager", "compiled"):
            ref = base.get((r["shape"], r["direction"], r["rms_norm"], role))
            r[f"speedup_vs_{role}"] = ref / t if ref else None


def _us(seconds) -> str:
    if seconds is None:
        return NA
    us = seconds * 1e6
    return f"{us:.1f}" if us >= 10 else f"{us:.2f}"


def _x(value) -> str:
    return NA if value is None else f"{value:.1f}x"


def _find(rows, shape, name):
    return next((r for r in rows if r["shape"] == shape and r["variant"] == name), {})


def _kernel_vs_floor(r: dict) -> str:
    return f"{_us(r['median_s'])} ({r['median_s'] / r['floor_s']:.2f})" if "median_s" in r else NA


def _speedups(kernel: dict, call: dict) -> str:
    return f"{_x(kernel.get('speedup_vs_compiled'))} / {_x(call.get('speedup_vs_compiled'))}"


# Per shape: the op's kernel and call times against the floor and the compiled baseline
# (kernel time against the DRAM floor and torch.compile), one line each.
_SUMMARY_HEAD = ("| shape | op path | floor fwd / bwd us | op fwd kernel us (x floor) | "
                 "op bwd kernel us (x floor) | op fwd / fwd+bwd call us | compiled ref fwd / "
                 "fwd+bwd us | fwd vs compiled (kernel / call) | fwd+bwd vs compiled "
                 "(kernel / call) |")


def _summary(rows: list[dict]) -> list[str]:
    lines = [_SUMMARY_HEAD, "|" + "---|" * 9]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        def get(name, shape=shape):
            return _find(rows, shape, name)
        floors = {r["direction"]: r["floor_s"] for r in rows if r["shape"] == shape}
        path = next(r["op_path"] for r in rows if r["shape"] == shape)
        fc, fbc = get("op fwd call"), get("op fwd+bwd call")
        cf, cfb = get("compiled ref fwd"), get("compiled ref fwd+bwd")
        lines.append(
            f"| {shape} | {path} | {_us(floors.get('fwd'))} / {_us(floors.get('bwd'))} | "
            f"{_kernel_vs_floor(get('op fwd kernel (graph)'))} | "
            f"{_kernel_vs_floor(get('op bwd kernel (graph)'))} | "
            f"{_us(fc.get('median_s'))} / {_us(fbc.get('median_s'))} | "
            f"{_us(cf.get('median_s'))} / {_us(cfb.get('median_s'))} | "
            f"{_speedups(get('op fwd kernel (graph)'), fc)} | "
            f"{_speedups(get('op fwd+bwd kernel (graph)'), fbc)} |")
    return lines


def markdown(results: dict) -> str:
    meta, rows = results["meta"], results["results"]
    head = (f"{meta['device_name']} (cc {meta['capability'] or NA}, driver {meta['driver'] or NA})"
            f", torch {meta['torch']}, CUDA {meta['cuda'] or NA}, cutlass-dsl "
            f"{meta['cutlass_dsl'] or NA}, {meta['dtype']}; copy bandwidth "
            f"{meta['copy_bandwidth_Bps'] / 1e9:.1f} GB/s; medians of {meta['iters']} batches")
    lines = [head, "", ("| shape | variant | time us | GB/s | % of floor | vs eager | "
             "vs compiled | status |"), "|" + "---|" * 8]
    for r in rows:
        if "median_s" in r:
            measured = f"{_us(r['median_s'])} | {r['GBps']:.3g} | {100 * r['frac_of_floor']:.1f}%"
        else:
            measured = f"{NA} | {NA} | {NA}"
        lines.append(f"| {r['shape']} | {r['variant']} | {measured} | "
                     f"{_x(r.get('speedup_vs_eager'))} | {_x(r.get('speedup_vs_compiled'))} | "
                     f"{r['status']} |")
    lines += ["", ("Kernel times are per call inside a CUDA graph of back-to-back calls; call "
              "times are per-call wall time; speedups are against the baselines' call times."), ""]
    return "\n".join(lines + _summary(rows))


def plot(results: dict, path: Path) -> None:
    """Time and achieved bandwidth against tokens, one column per direction."""
    plt = pyplot()
    rows = [r for r in results["results"] if "median_s" in r]
    directions = ("fwd", "bwd", "fwd+bwd")
    names = list(dict.fromkeys(r["variant"] for r in results["results"]))
    colors = {n: plt.get_cmap("tab20")(i % 20) for i, n in enumerate(names)}
    configs = list(dict.fromkeys((r["ratio"], r["coff"], r["head_dim"]) for r in rows))
    markers = dict(zip(configs, "osD^v<>phX*8", strict=False))
    fig, axes = plt.subplots(2, 3, figsize=(20, 11), squeeze=False)
    bandwidth = results["meta"]["copy_bandwidth_Bps"] / 1e9
    for col, direction in enumerate(directions):
        t_ax, bw_ax = axes[0][col], axes[1][col]
        for cfg in configs:
            group = sorted((r for r in rows if (r["ratio"], r["coff"], r["head_dim"]) == cfg
                            and r["direction"] == direction), key=lambda r: r["tokens"])
            floors = sorted({(r["tokens"], r["floor_s"]) for r in group})
            if floors:
                t_ax.plot(*zip(*[(t, f * 1e6) for t, f in floors], strict=True), ls="--", c="k", lw=0.8,
                          marker="_", ms=14)
            for name in names:
                pts = [r for r in group if r["variant"] == name]
                if not pts:
                    continue
                x = [r["tokens"] for r in pts]
                style = {"color": colors[name], "marker": markers.get(cfg, "o"), "ms": 5}
                t_ax.plot(x, [r["median_s"] * 1e6 for r in pts], **style)
                bw_ax.plot(x, [r["GBps"] for r in pts], **style)
        bw_ax.axhline(bandwidth, c="k", ls="--", lw=0.8)
        for ax, label in ((t_ax, "time per call (us); dashed: DRAM floor"),
                          (bw_ax, "achieved GB/s; dashed: copy bandwidth")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{direction}: {label}", fontsize=9)
            ax.set_xlabel("tokens")
            ax.grid(True, which="both", alpha=0.3)
        handles = [plt.Line2D([], [], color=colors[n], lw=2, label=n) for n in names
                   if any(r["variant"] == n and r["direction"] == direction for r in rows)]
        if handles:
            t_ax.legend(handles=handles, fontsize=7, loc="upper left")
    cfg_handles = [plt.Line2D([], [], color="gray", ls="", marker=markers[c],
                              label=f"ratio {c[0]} coff {c[1]} d {c[2]}") for c in configs]
    if cfg_handles:
        axes[1][0].legend(handles=cfg_handles, fontsize=7, loc="lower right")
    save_figure(fig, results, "csa::compressor", path)


def pyplot():
    """matplotlib.pyplot on the file-only backend (no display on the bench machines)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, results: dict, op: str, path: Path) -> None:
    """Titles `fig` with the op and the run's device, dtype and torch, saves and closes it."""
    meta = results["meta"]
    fig.suptitle(f"{op} on {meta['device_name']} ({meta['dtype']}, torch {meta['torch']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def draw_if_available(draw, results: dict, path: Path) -> bool:
    """draw(results, path) when matplotlib (the bench extra) is installed; without it the
    run still succeeds and says the plot was skipped."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed (pip install 'csa-ops[bench]'): skipped the plot",
              flush=True)
        return False
    draw(results, path)
    return True


def write(results: dict, table: str, out: Path, plot_png: bool = True) -> list[Path]:
    """Writes the JSON and markdown, then the plot (`draw_if_available`)."""
    paths = [out / "results.json", out / "results.md"]
    paths[0].write_text(json.dumps(results, indent=1, default=str))
    paths[1].write_text(table + "\n")
    if plot_png and draw_if_available(plot, results, out / "results.png"):
        paths.append(out / "results.png")
    return paths
