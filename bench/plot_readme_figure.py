"""The README's performance figure, drawn from the committed H200 results.

    python bench/plot_readme_figure.py [--results bench/results/h200] [--out F.png]

Per shape: the DRAM floor, the op's default kernels (the forward at ratio 128 is the
certified one, from streaming_parity.json; every other time from results.json) and
torch.compile of the eager reference, forward and forward + backward. Prints the numbers
it plots. Needs matplotlib (the bench extra).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
US = 1e6
_PLOTTED = ("op fwd kernel (graph)", "op bwd kernel (graph)", "compiled ref fwd",
            "compiled ref fwd+bwd")


def _parity_shape(name: str) -> str:
    """'1x65536 d128 r128 c1' (time_streaming.py) -> 'r128c1_1x65536_d128' (the bench's)."""
    pack, dim, ratio, coff = name.split()
    return f"{ratio}{coff}_{pack}_{dim}"


def load(results_dir: Path) -> list[dict]:
    """One dict per shape, in the bench's order: floors, our kernels, torch.compile (us)."""
    rows = json.loads((results_dir / "results.json").read_text())["results"]
    parity = json.loads((results_dir / "streaming_parity.json").read_text())["rows"]
    certified = {_parity_shape(r["shape"]): r["fwd_us"] for r in parity
                 if "'parity': 1" in r["fwd_key"]}
    shapes: dict[str, dict] = {}  # in the order of the op's kernel rows
    for r in sorted(rows, key=lambda r: r["variant"] != "op fwd kernel (graph)"):
        if "median_s" not in r or r["rms_norm"] or r["variant"] not in _PLOTTED:
            continue
        entry = shapes.setdefault(r["shape"], {"shape": r["shape"]})
        us = r["median_s"] * US
        if r["variant"] == "op fwd kernel (graph)":
            entry["floor_fwd"], entry["fwd"] = r["floor_s"] * US, us
        elif r["variant"] == "op bwd kernel (graph)":
            entry["floor_bwd"], entry["bwd"] = r["floor_s"] * US, us
        elif r["variant"] == "compiled ref fwd":
            entry["compiled_fwd"] = us
        elif r["variant"] == "compiled ref fwd+bwd":
            entry["compiled_fwd_bwd"] = us
    for shape, fwd in certified.items():
        shapes[shape]["fwd"] = fwd  # the default forward, not results.json's fast one
    keys = ("floor_fwd", "fwd", "floor_bwd", "bwd", "compiled_fwd", "compiled_fwd_bwd")
    missing = [s for s, e in shapes.items() if any(k not in e for k in keys)]
    if missing:
        raise ValueError(f"results lack rows for {missing}: need {keys}")
    if unknown := sorted(set(certified) - set(shapes)):
        raise ValueError(f"streaming_parity.json has shapes results.json lacks: {unknown}")
    return list(shapes.values())


def _label(shape: str) -> str:
    rc, pack, dim = shape.split("_")
    return f"{rc}\n{pack}\n{dim}"


def draw(entries: list[dict], device: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("forward", "floor_fwd", "fwd", "compiled_fwd"),
              ("forward + backward", None, None, "compiled_fwd_bwd"))
    fig, axes = plt.subplots(2, 1, figsize=(11, 6.4), sharex=True, layout="constrained")
    x = range(len(entries))
    width = 0.27
    for ax, (title, floor, ours, compiled) in zip(axes, panels):
        floors = [e[floor] if floor else e["floor_fwd"] + e["floor_bwd"] for e in entries]
        kernels = [e[ours] if ours else e["fwd"] + e["bwd"] for e in entries]
        ax.bar([i - width for i in x], floors, width, color="0.75", label="DRAM floor")
        ax.bar(list(x), kernels, width, color="tab:blue", label="csa-ops kernels (default)")
        ax.bar([i + width for i in x], [e[compiled] for e in entries], width,
               color="tab:orange", label="torch.compile of the eager reference")
        ax.set_yscale("log")
        ax.set_ylabel("us per call")
        ax.set_title(title, fontsize=10, loc="left")
        ax.grid(axis="y", which="major", alpha=0.3)
    axes[1].set_xticks(list(x), [_label(e["shape"]) for e in entries], fontsize=7)
    fig.suptitle(f"{device}, bf16: kernel time per call (CUDA graph replay) against the DRAM "
                 "floor; torch.compile per-call wall time", fontsize=10)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=3,
               fontsize=8, frameon=False)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=ROOT / "bench/results/h200")
    p.add_argument("--out", type=Path, default=ROOT / "docs/figures/performance.png")
    args = p.parse_args(argv)
    entries = load(args.results)
    device = json.loads((args.results / "results.json").read_text())["meta"]["device_name"]
    print("| shape | floor fwd / bwd us | fwd us | bwd us | compiled fwd / fwd+bwd us |")
    print("|---|---|---|---|---|")
    for e in entries:
        print(f"| {e['shape']} | {e['floor_fwd']:.3g} / {e['floor_bwd']:.3g} | "
              f"{e['fwd']:.3g} | {e['bwd']:.4g} | "
              f"{e['compiled_fwd']:.4g} / {e['compiled_fwd_bwd']:.5g} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    draw(entries, device, args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main()
