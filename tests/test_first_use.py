"""What a new user runs first: the README's ``csa_ops.precompile`` line and the demo."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import csa_ops
from csa_ops import host
from csa_ops.kernels import extend_plan

ROOT = Path(__file__).resolve().parents[1]


def test_precompile_defaults_to_bfloat16(tmp_path, monkeypatch):
    monkeypatch.setenv("CSA_OPS_CACHE_DIR", str(tmp_path))  # keep the user's cache untouched
    keys = csa_ops.precompile(ratio=4, head_dim=128, coff=2, arch="sm_90a")  # cross-compiles
    assert len(keys) == 2  # forward and backward
    keys = keys.values() if isinstance(keys, dict) else keys
    assert {key.dtype for key in keys} == {"bfloat16"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_precompile_without_arch_needs_a_gpu():
    with pytest.raises(RuntimeError, match="arch"):
        csa_ops.precompile(ratio=4, head_dim=128, coff=2)


@pytest.mark.parametrize("direction", ("fwd", "bwd", "ext"))
def test_a_capture_that_needs_a_compile_names_the_precompile_that_covers_it(direction,
                                                                            monkeypatch):
    # A capture is simulated (no GPU here): the error comes before anything compiles. The
    # call it names must compile the kernel the capture needed: csa::compressor's two
    # directions, or csa::compressor_extend's kernels of every call size.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    forward, backward = (key for _, key in host.configuration_keys(6, 48, 2, torch.bfloat16,
                                                                   "sm_90a"))
    keys = {"fwd": forward, "bwd": backward,
            "ext": extend_plan.for_size(forward, extend_plan.SizeClass.STEP)}
    entry = "precompile_extend" if direction == "ext" else "precompile"
    compiles = extend_plan.keys(forward) if direction == "ext" else (forward, backward)
    assert keys[direction] in compiles
    named = f"csa_ops.{entry}(ratio=6, head_dim=48, coff=2, dtype=torch.bfloat16)"
    with pytest.raises(RuntimeError, match=re.escape(named)):
        host.KERNELS.get(direction, keys[direction])


def test_numpy_is_a_dependency():
    """torch imports without numpy but warns "Failed to initialize NumPy" at every start."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "numpy" in {dep.split(">")[0].split("=")[0].strip() for dep in project["dependencies"]}


@pytest.mark.slow
def test_demo_runs_without_warnings(tmp_path):
    env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
                        "CSA_OPS_CACHE_DIR": str(tmp_path / "kernels")}
    done = subprocess.run([sys.executable, "-W", "error::UserWarning", "-m", "csa_ops.demo",
                           "--iters", "1"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "NumPy" not in done.stderr
    assert done.stdout.count("eager and compiled match the reference") == 2  # both rows
    # The table: ours beside the reference, a row per configuration and pass, every cell
    # timed (CUDA graphs only on a GPU).
    rows = [line for line in done.stdout.splitlines() if re.match(r"\| r\d+ c\d ", line)]
    assert len(rows) == 4, done.stdout
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert len(cells) == 7 and all(re.fullmatch(r"\d+\.\d{3}", c) for c in cells[2:4])
        speedups = r"\d+\.\d{3} \(\S+x / \S+x\)"
        assert all(re.fullmatch(speedups, c) for c in cells[4:6]), row
        if torch.cuda.is_available():
            assert re.fullmatch(speedups, cells[6]), row
        else:
            assert cells[6] == "n/a", row
