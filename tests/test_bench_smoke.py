"""The benchmark harness runs end to end on the CPU and reports sane numbers."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import BENCH, bench_module

ROOT = Path(__file__).resolve().parents[1]
# One window-family shape and one streaming-family shape, both coff.
SHAPES = "r4c2_2x64_d128,r128c1_1x256_d64"


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, str(BENCH / "bench_compressor.py"), "--quick", "--device", "cpu",
           "--shapes", SHAPES, "--warmup", "1", "--iters", "2", "--out", str(out),
           # One lowering mode proves the mode rows work; each further mode costs compiles.
           "--skip", "[auto],[generate]"]
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env,
                          check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, done.stdout


def _rows(out: Path) -> list[dict]:
    return json.loads((out / "results.json").read_text())["results"]


def _is_lowering_row(row: dict) -> bool:
    return row["variant"].startswith("op compiled [")  # owned and gated by csa_ops.lowering


def test_outputs_exist(bench_run):
    out, stdout = bench_run
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "results.png").stat().st_size > 10_000
    table = (out / "results.md").read_text()
    assert "| shape | variant | time us |" in table and table.strip() in stdout
    for shape in SHAPES.split(","):
        assert f"| {shape} | eager ref fwd |" in table


def test_environment_stamp(bench_run):
    meta = json.loads((bench_run[0] / "results.json").read_text())["meta"]
    assert meta["torch"] == torch.__version__
    assert meta["device"] == "cpu" and meta["capability"] is None
    assert 1e8 < meta["copy_bandwidth_Bps"] < 1e13


def test_every_variant_checked_and_timed(bench_run):
    rows = _rows(bench_run[0])
    names = {r["variant"] for r in rows}
    for required in ("eager ref fwd", "eager ref fwd+bwd", "compiled ref fwd",
                     "compiled ref fwd+bwd", "op fwd call", "op bwd call", "op fwd+bwd call",
                     "op fwd kernel (graph)"):
        assert required in names
    for r in rows:
        if r["timing"] == "graph":
            assert r["status"] == "n/a (CUDA only)" and "median_s" not in r
            continue
        if _is_lowering_row(r) and r["status"] != "ok":
            assert r["status"].startswith(("error", "MISMATCH")), r
            continue
        assert r["status"] == "ok", r
        assert all(e <= 0.05 for e in r["max_error"]), r
        assert 0 < r["median_s"] < 10 and len(r["samples_s"]) == 2
        assert math.isclose(r["GBps"], r["bytes"] / r["median_s"] / 1e9)
        assert r["frac_of_floor"] > 0 and r["floor_s"] > 0


def test_speedups_against_baselines(bench_run):
    rows = _rows(bench_run[0])
    for r in rows:
        if r["variant"] in ("eager ref fwd", "eager ref fwd+bwd"):
            assert r["speedup_vs_eager"] == 1.0
        if r["direction"] == "bwd" and "median_s" in r:
            assert r["speedup_vs_eager"] is None  # no backward-only baseline exists
    eager = {(r["shape"], r["direction"]): r["median_s"] for r in rows
             if r["variant"].startswith("eager ref") and r["timing"] == "wall"}
    for r in rows:
        if r["variant"] == "op fwd call":
            assert math.isclose(r["speedup_vs_eager"], eager[(r["shape"], "fwd")] / r["median_s"])


@pytest.fixture(scope="module")
def variants():
    return bench_module("variants")


@pytest.mark.parametrize(("ratio", "coff", "family", "knobs"), [
    (4, 2, "window", {"vec": 2}), (128, 1, "streaming", {"cv": 4, "ctas": 4})])
def test_time_extend_takes_variants_of_either_family(ratio, coff, family, knobs):
    from csa_ops import host
    from csa_ops.config import Direction, with_knobs

    time_extend = bench_module("time_extend")
    forward = host.select_key(ratio, coff, 512, "bfloat16", "sm_90a", Direction.FORWARD)
    text = ",".join(f"{name}={value}" for name, value in knobs.items())
    keys = time_extend.variant_keys(["own", "p:part=1", f"v:{text}"], forward)
    assert keys == {"own": None, "p": with_knobs(forward, part=1),
                    "v": with_knobs(forward, **knobs)}
    assert keys["v"].family == family


def test_floor_bytes_read_inputs_once_and_write_outputs_once(variants):
    nbytes = variants.algorithmic_bytes(variants.Shape.parse("r4c2_1x8192_d128"), 2)
    inputs = 2 * 8192 * (2 * 128) * 2  # kv + score, bf16
    fwd = inputs + 2048 * 128 * 2
    assert nbytes == {"fwd": fwd, "bwd": fwd + inputs, "fwd+bwd": 2 * fwd + inputs}


def test_serving_floor_bytes_count_the_state_traffic():
    traffic = bench_module("serving_traffic")
    d, es = 512, 2
    pair = d * (es + 4)  # one column half of a state entry: values and fp32 logits
    token = 2 * 2 * d * es  # kv + score, both coff halves
    # r4 c2 decode: a token that completes no block writes its own entry, both halves...
    assert traffic.request_bytes(9, 1, 4, 2, d, es) == token + 2 * pair
    # ...one that completes a block reads the window's 7 old pairs and the other halves of
    # the 3 entries that move, writes those 3 entries and its own, and emits a row.
    assert traffic.request_bytes(11, 1, 4, 2, d, es) == token + d * es + (10 + 8) * pair
    # r128 c1: completing a block reads its 127 old entries and leaves no entry to write.
    assert traffic.request_bytes(255, 1, 128, 1, d, es) == token // 2 + d * es + 127 * pair
    # A fresh prefill of 8 tokens at r4 c2 reads no state and writes the last block.
    assert traffic.request_bytes(0, 8, 4, 2, d, es) == 8 * token + 2 * d * es + 8 * pair
    assert traffic.call_bytes([9, 11], [1, 1], 4, 2, d, es) == 4 * (4 * 2 + 2) + sum(
        traffic.request_bytes(p, 1, 4, 2, d, es) for p in (9, 11))


def test_check_rejects_wrong_outputs(variants):
    want = torch.randn(64, 32, dtype=torch.bfloat16)
    tol = variants.tolerance(torch.bfloat16, "fwd")
    assert variants.check(want.clone(), (want,), tol)[0]
    off_by_one_row = want.clone()
    off_by_one_row[7] = want[8]
    assert not variants.check(off_by_one_row, (want,), tol)[0]
    nan = want.clone()
    nan[3, 3] = float("nan")
    assert not variants.check(nan, (want,), tol)[0]
    assert not variants.check(want[:-1], (want,), tol)[0]


def test_merge_joins_runs_of_one_stack_only(bench_run, tmp_path):
    out, _ = bench_run
    run = json.loads((out / "results.json").read_text())
    merged_dir = tmp_path / "merged"
    cmd = [sys.executable, str(BENCH / "merge_results.py"), str(out / "results.json"),
           str(out / "results.json"), "--out", str(merged_dir), "--no-plot"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    merged = json.loads((merged_dir / "results.json").read_text())
    # The second run re-measures every row: it replaces them, order kept.
    assert [(r["shape"], r["variant"]) for r in merged["results"]] == \
        [(r["shape"], r["variant"]) for r in run["results"]]
    assert len(merged["meta"]["runs"]) == 2
    other = json.loads(json.dumps(run))
    other["meta"]["torch"] = "0.0.0"
    (tmp_path / "other.json").write_text(json.dumps(other))
    cmd[3] = str(tmp_path / "other.json")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert done.returncode != 0 and "differ in ['torch']" in done.stderr


def test_without_matplotlib_writes_json_and_markdown(tmp_path):
    """The bench extra is optional: without matplotlib the run succeeds and skips the plot."""
    argv = [str(BENCH / "bench_compressor.py"), "--device", "cpu", "--shapes", "r4c2_2x64_d128",
            "--variants", "eager ref fwd", "--warmup", "1", "--iters", "2", "--out", str(tmp_path)]
    script = ("import runpy, sys\n"
              "sys.modules['matplotlib'] = None  # import matplotlib raises ImportError\n"
              f"sys.argv = {argv!r}\n"
              f"runpy.run_path({argv[0]!r}, run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "skipped the plot" in done.stdout
    assert _rows(tmp_path) and (tmp_path / "results.md").read_text().strip()
    assert not (tmp_path / "results.png").exists()


@pytest.fixture(scope="module")
def time_kernels():
    return bench_module("time_kernels")


@pytest.mark.parametrize("backward", [False, True])
def test_knob_variants_apply_known_names_and_reject_others(time_kernels, backward):
    from csa_ops import host
    from csa_ops.config import Direction

    base = host.select_key(4, 2, 128, "bfloat16", "sm_90a", Direction.of(backward))
    assert base.family == "window"
    applied = time_kernels.with_variant(base, "pdl=0,linear=0")
    assert (applied.knobs.pdl, applied.knobs.linear) == (0, 0)
    assert applied.knobs.vec == base.knobs.vec
    with pytest.raises(ValueError, match="no knob pdll"):
        time_kernels.with_variant(base, "pdll=0")
    with pytest.raises(ValueError, match="name=integer"):
        time_kernels.with_variant(base, "pdl")


@pytest.mark.parametrize("ratio, coff", [(4, 2), (128, 1)])
def test_sweep_enumerates_supported_keys_of_the_default_keys_family(time_kernels, ratio, coff):
    from csa_ops import host
    from csa_ops.config import Direction

    for backward in (False, True):
        base = host.select_key(ratio, coff, 512, "bfloat16", "sm_90a",
                               Direction.of(backward))
        keys = list(time_kernels.sweep_keys(base, backward))
        assert len(keys) > 1 and base in keys
        assert all(k.family == base.family and host.FAMILIES[k.family].supports(k)
                   for k in keys)

def test_sweep_verdict_compares_with_the_default_keys_bits(time_kernels):
    base = torch.tensor([1.0, 2.0, -3.0, float("nan")], dtype=torch.bfloat16)
    step = torch.tensor([2.0**-7, 2.0**-6, 2.0**-6, 0.0], dtype=torch.bfloat16)
    assert time_kernels._verdict(False, base.clone(), base) == "bitwise"
    assert time_kernels._verdict(False, base + step * torch.tensor([1, 0, 0, 0]), base) == \
        "MISMATCH (1 elements differ, 0 beyond one step)"
    grads = (base, base + step * torch.tensor([0, 2, 0, 0]), base)  # grad_ape is not compared
    other = (base, base, -base)
    assert time_kernels._verdict(True, grads, other) == \
        "MISMATCH (1 elements differ, 1 beyond one step)"


@pytest.mark.parametrize("mode", ["graph", "kernel"])
def test_serving_device_timings_give_every_variant_the_same_calls(mode):
    # A graph replay's fixed cost is shared by its calls: every variant of a case replays
    # the same number, whatever one eager call of it costs (the step is never run here).
    serving = bench_module("bench_serving")
    args = serving.parse_args(["--device", "cpu", "--calls", "50"])

    def step(i):
        raise AssertionError("device-side modes must not size samples by a timed call")

    assert serving.calls_per_sample(step, mode, args, sets=8) == 50
    assert serving.calls_per_sample(step, mode, args, sets=64) == 64  # every input set once
    wall = serving.calls_per_sample(lambda i: None, "call", args, sets=8)
    assert 8 <= wall <= 50


def test_compressor_graph_batches_give_every_variant_the_same_calls():
    # bench_compressor.py sizes batches through the same helper: a graph variant replays
    # --batch calls whatever one call of it costs; a wall-time variant is timed first.
    bench = bench_module("bench_compressor")
    args = bench.parse_args(["--device", "cpu", "--batch", "20", "--shapes", "r4c2_2x64_d128"])
    case = bench.Case(args.shape_list[0], args.device, torch.bfloat16, 3)
    graph = next(v for v in bench.variants.VARIANTS.values() if v.timing == "graph")
    wall = next(v for v in bench.variants.VARIANTS.values() if v.timing != "graph")

    def step(i):
        raise AssertionError("graph batches must not be sized by a timed call")

    assert bench._batch_size(step, graph, case, args) == max(20, case.num_sets)
    assert case.num_sets <= bench._batch_size(lambda i: None, wall, case, args) <= max(
        20, case.num_sets)


def test_epilogue_bench_runs_every_variant_checked(tmp_path):
    """bench_epilogue.py end to end on the CPU at one tiny shape: every variant of both
    directions agrees with the fused op and is timed, beside the floor and the op alone
    (unchecked: other outputs); the JSON, the table and the plot are written."""
    cmd = [sys.executable, str(BENCH / "bench_epilogue.py"), "--device", "cpu", "--shapes",
           "r4c2_1x32_d64", "--warmup", "1", "--iters", "1", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=os.environ | {"PYTHONUNBUFFERED": "1"}, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    for direction in ("fwd", "fwd+bwd"):
        timed = {r["variant"]: r for r in rows if r["direction"] == direction}
        assert set(timed) == {"floor", "eager", "op + compiled epilogue", "compiled block",
                              "fused op", "fused op, kernel epilogue",
                              "fused op, torch epilogue", "fused op, unfused", "op alone"}
        assert all(r["ok"] for name, r in timed.items() if name not in ("floor", "op alone")), \
            timed
        assert timed["op alone"]["ok"] is None
        assert all(math.isfinite(r["us"]) and r["us"] > 0 for r in timed.values())
    assert {p.name for p in tmp_path.iterdir()} >= {"results.json", "results.md", "results.png"}


def test_store_bench_runs_every_variant_checked(tmp_path):
    """bench_store.py --quick end to end on the CPU (eager calls): every configuration's
    extend, store and torch-route rows timed and checked bitwise against the store's cache,
    the compiled row timed and its check recorded; the JSON, the table and the plot."""
    cmd = [sys.executable, str(BENCH / "bench_store.py"), "--quick", "--warmup", "1",
           "--iters", "1", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=os.environ | {"PYTHONUNBUFFERED": "1"}, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    variants = {r["variant"] for r in rows}
    assert {"DRAM floor", "extend", "store kernel", "store 2 launches", "store torch",
            "store compiled"} <= variants
    for r in rows:
        if r["variant"] in ("store kernel", "store 2 launches", "store torch"):
            assert not r.get("error"), r
    assert {p.name for p in tmp_path.iterdir()} >= {"results.json", "results.md", "results.png"}


def test_stall_table_reads_the_source_page_of_the_first_kernel():
    """bench/stall_table.py on an ncu source page as `ncu --csv` writes it (quoted fields,
    thousands separators, a second kernel's page after the first): the first kernel's
    instructions in order, its samples per tenth, its heaviest instructions; a page without
    the stall samples is refused by name."""
    stall_table = bench_module("stall_table")
    header = '"# Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"'
    body = [f'"{0x10 * i:#06x}","OP{i} R{i}, R{i}","{"1,000" if i == 7 else i}","4"'
            for i in range(20)]
    page = "\n".join([header, *body, header, '"0x0000","OTHER","99999","1"'])
    found = stall_table.parse(page)
    assert [i.sass for i in found] == [f"OP{i} R{i}, R{i}" for i in range(20)]
    assert found[7].samples == 1000 and found[3].samples == 3
    total = 1000 + sum(range(20)) - 7
    shares = stall_table.tenths(found)
    assert shares[3] == pytest.approx(100 * (6 + 1000) / total)
    assert sum(shares) == pytest.approx(100)
    table = stall_table.markdown(found, top=2)
    assert "| 7 | 0x0070 | 1000 |" in table and "| 19 | 0x0130 | 19 |" in table
    assert "| 18 |" not in table
    with pytest.raises(ValueError, match="Warp Stall Sampling"):
        stall_table.parse('"# Address","Source"\n"0x0","NOP"')
