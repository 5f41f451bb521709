"""Merge bench runs (results.json of bench_compressor.py) into one table, JSON and plot.

    python bench/merge_results.py RUN1/results.json RUN2/results.json --out bench/out/merged

For runs split over several device sessions: every run must come from the same GPU and
software stack (checked), the merged meta keeps each run's own stamp and copy bandwidth,
and a row measured again in a later run replaces the earlier one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import report

# What must agree for rows of different runs to sit in one table.
_SAME = ("device_name", "capability", "driver", "torch", "cuda", "cutlass_dsl", "dtype")


def merge(runs: list[dict]) -> dict:
    if not runs:
        raise ValueError("merge: no runs given")
    first = runs[0]["meta"]
    for run in runs[1:]:
        differs = [k for k in _SAME if run["meta"].get(k) != first.get(k)]
        if differs:
            raise ValueError(f"merge: runs differ in {differs}; refusing to mix them")
    meta = dict(first)
    meta["runs"] = [run["meta"] for run in runs]
    # A (shape, variant) measured again in a later run replaces the earlier row (a re-run
    # after a policy change); first-seen order is kept.
    latest: dict[tuple[str, str], dict] = {}
    for run in runs:
        for row in run["results"]:
            latest[(row["shape"], row["variant"])] = row
    rows = list(latest.values())
    report.add_derived(rows)
    return {"meta": meta, "results": rows}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    merged = merge([json.loads(path.read_text()) for path in args.inputs])
    args.out.mkdir(parents=True, exist_ok=True)
    table = report.markdown(merged)
    paths = report.write(merged, table, args.out, plot_png=not args.no_plot)
    print(table)
    print("wrote", ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
