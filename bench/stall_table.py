"""Where a kernel's warps wait, instruction by instruction, from an `ncu` report.

    ncu --set full --import-source yes -o step python3 bench/profile_store.py --cases ...
    ncu -i step.ncu-rep --page source --csv --print-source sass > step.csv
    python bench/stall_table.py step.csv --top 40

Reads the source page's CSV (one row per SASS instruction, in address order, with its warp
stall samples) and prints, as markdown, the share of the samples in each tenth of the
program and the instructions holding the most samples. A latency-bound kernel's samples sit
on the instructions that wait (a load's first use, a barrier, a shuffle): the table says
which part of the chain costs the time.
"""

from __future__ import annotations

import argparse
import csv
import io
from dataclasses import dataclass

SAMPLES = "Warp Stall Sampling (All Samples)"
SOURCE = "Source"


@dataclass(frozen=True)
class Instruction:
    index: int  # in address order
    address: str
    samples: float
    sass: str


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def parse(text: str) -> list[Instruction]:
    """The instructions of the first kernel on the page (rows after the first header that
    names the SASS and its stall samples). Raises ValueError on a page without them."""
    rows = list(csv.reader(io.StringIO(text)))
    for at, header in enumerate(rows):
        if SOURCE in header and SAMPLES in header:
            break
    else:
        raise ValueError(f"stall_table: no header with {SOURCE!r} and {SAMPLES!r} (was the "
                         f"report taken with --import-source and the source page exported?)")
    source, samples = header.index(SOURCE), header.index(SAMPLES)
    address = next((i for i, name in enumerate(header) if "Address" in name), None)
    found = []
    for row in rows[at + 1:]:
        if len(row) <= max(source, samples) or row == header:
            break  # the next kernel's page, or the end
        found.append(Instruction(len(found), row[address] if address is not None else "",
                                 _number(row[samples]), row[source].strip()))
    return found


def tenths(found: list[Instruction]) -> list[float]:
    """The share of all samples (%) in each tenth of the program, by instruction count."""
    total = sum(i.samples for i in found) or 1.0
    n = len(found)
    return [100 * sum(i.samples for i in found[k * n // 10:(k + 1) * n // 10]) / total
            for k in range(10)]


def markdown(found: list[Instruction], top: int) -> str:
    total = sum(i.samples for i in found) or 1.0
    lines = [f"{len(found)} instructions, {int(total)} samples", "",
             "| tenth of the program | " + " | ".join(str(k) for k in range(10)) + " |",
             "|---" * 11 + "|",
             "| samples % | " + " | ".join(f"{s:.1f}" for s in tenths(found)) + " |", "",
             "| # | address | samples | % | instruction |", "|---|---|---|---|---|"]
    heaviest = sorted(found, key=lambda i: -i.samples)[:top]
    for i in sorted(heaviest, key=lambda i: i.index):
        lines.append(f"| {i.index} | {i.address} | {int(i.samples)} | "
                     f"{100 * i.samples / total:.1f} | `{i.sass}` |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    p.add_argument("--top", type=int, default=40, help="instructions to list")
    args = p.parse_args(argv)
    with open(args.csv, encoding="utf-8", errors="replace") as f:
        print(markdown(parse(f.read()), args.top))


if __name__ == "__main__":
    main()
