"""The demo's table and options without running it (tests/test_first_use.py runs it): the
columns ours against the reference, the speedups, the rows, and the errors of --configs."""

from __future__ import annotations

import argparse

import pytest
import torch

from csa_ops import demo

NAMES = [name for name, _, _ in demo.IMPLEMENTATIONS]


def _times(reference_eager, reference_compiled, ours, reduce_overhead=True):
    times = {"reference eager": reference_eager, "reference compiled": reference_compiled,
             "ours eager": ours, "ours compiled": ours}
    if reduce_overhead:
        times["ours reduce-overhead"] = ours
    return {name: {"forward": ms, "forward+backward": 2 * ms} for name, ms in times.items()}


def test_table_has_a_row_per_configuration_and_pass_with_speedups():
    table = demo.format_table([(4, 2, _times(40.0, 8.0, 2.0)),
                               (128, 1, _times(3.0, 2.0, 4.0, reduce_overhead=False))], 512)
    header, rule, *rows = table.splitlines()
    assert header == "| block | pass | " + " | ".join(f"{n} ms" for n in NAMES) + " |"
    assert rule.count("---") == len(NAMES) + 2
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert [c[:2] for c in cells] == [["r4 c2 d512", "forward"],
                                      ["r4 c2 d512", "forward+backward"],
                                      ["r128 c1 d512", "forward"],
                                      ["r128 c1 d512", "forward+backward"]]
    # Ours over the reference eager / compiled: 40/2 and 8/2; below 10 two digits.
    assert cells[0][2:] == ["40.000", "8.000", "2.000 (20x / 4x)", "2.000 (20x / 4x)",
                            "2.000 (20x / 4x)"]
    assert cells[3][2:] == ["6.000", "4.000", "8.000 (0.75x / 0.5x)", "8.000 (0.75x / 0.5x)",
                            "n/a"]  # no CUDA graphs on the CPU


def test_sizes_are_the_realistic_block_on_cuda():
    args = demo._parser(torch.device("cuda")).parse_args([])
    assert sum(int(v) for v in args.lengths.split(",")) == 32768
    assert (args.dim, args.head_dim, args.configs) == (4096, 512, [(4, 2), (128, 1)])
    assert demo._parser(torch.device("cpu")).parse_args(["--configs", "8x1"]).configs == [(8, 1)]


@pytest.mark.parametrize("text", ["4x3", "0x1", "4", "4x2,", "axb", ""])
def test_configs_errors_name_the_option(text):
    with pytest.raises(argparse.ArgumentTypeError, match="--configs takes RATIOxCOFF"):
        demo._configs(text)


def test_check_compares_ours_with_the_reference():
    cpu = torch.device("cpu")
    args = demo._parser(cpu).parse_args(["--lengths", "9,0,6", "--dim", "8", "--head-dim", "4"])
    row = demo._Row(args, cpu, torch.float32, 2, 2)
    row.fns = {name: row.fns[name] for name in ("reference eager", "ours eager")}  # no compile
    assert "r2 c2: 7 rows (+8 padding); eager and compiled match the reference" in row.check(
        torch.float32)
    ours = row.fns["ours eager"]
    row.fns["ours eager"] = lambda *args: ours(*args) * 1.001
    with pytest.raises(AssertionError, match="ours eager"):
        row.check(torch.float32)
