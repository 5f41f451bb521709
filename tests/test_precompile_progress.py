"""``python -m csa_ops.precompile`` shows where a long build stands: one line per kernel as it
is done (its count of the total, compiled or present, its time, the time since the start),
none with --quiet. The kernel export is stubbed at its boundary (host.KERNELS.export): the
real cross-compile through this command is tested in test_kernel_cache."""

from __future__ import annotations

import importlib
import re
import time

import pytest
import torch

from csa_ops import host
from csa_ops.kernels import extend_plan

command = importlib.import_module("csa_ops.precompile")  # csa_ops.precompile is the function

RATIO, HEAD_DIM, COFF = 2, 16, 1
ARCHS = ("sm_90a", "sm_100a")
ARGS = ["--ratio", str(RATIO), "--coff", str(COFF), "--head-dim", str(HEAD_DIM), "--arch",
        *ARCHS, "--no-native"]
LINE = re.compile(r"\[ *(\d+)/(\d+)\] (compiled|present) +(fwd|bwd|ext) ratio=(\d+) coff=(\d+) "
                  r"head_dim=(\d+) bfloat16 (sm_\w+) \((\d+\.\d) s, (\d+\.\d) s elapsed\)")
COMPILE_S = 0.02  # the stub's compile time, so that elapsed times add up visibly


def _expected_kernels():
    """(direction, key) of every kernel, from host and extend_plan directly."""
    kernels = []
    for arch in ARCHS:
        keys = host.configuration_keys(RATIO, HEAD_DIM, COFF, torch.bfloat16, arch)
        kernels += [*keys, *(("ext", key) for key in extend_plan.keys(keys[0][1]))]
    return kernels


class _Export:
    """host.KERNELS.export's contract: True when it compiled, False when root held it."""

    def __init__(self, events):
        self.events, self.built = events, set()

    def __call__(self, direction, key, root):
        self.events.append(("export", str(direction), key))
        if (direction, key, str(root)) in self.built:
            return False
        time.sleep(COMPILE_S)
        self.built.add((direction, key, str(root)))
        return True


@pytest.fixture
def events(monkeypatch):
    events = []
    monkeypatch.setattr(host.KERNELS, "export", _Export(events))
    return events


def _progress(lines):
    return [LINE.fullmatch(line) for line in lines]


def test_a_line_per_kernel_as_it_is_done(events, tmp_path):
    counts = command.build_cache([RATIO], [COFF], [HEAD_DIM], [torch.bfloat16], ARCHS, tmp_path,
                                 log=lambda line: events.append(("line", line)))
    expected = _expected_kernels()
    assert counts == {"compiled": len(expected), "present": 0}
    # Each kernel's line comes right after its export, before the next kernel starts.
    assert [kind for kind, *_ in events] == ["export", "line"] * len(expected)
    matches = _progress([event[1] for event in events if event[0] == "line"])
    assert all(matches), [event[1] for event in events if event[0] == "line"]
    exported = [(direction, key) for kind, direction, key in
                (e for e in events if e[0] == "export")]
    assert exported == [(str(direction), key) for direction, key in expected]
    for count, (match, (direction, key)) in enumerate(zip(matches, expected), start=1):
        assert (int(match[1]), int(match[2])) == (count, len(expected))
        assert match[3] == "compiled" and match[4] == str(direction)
        assert (int(match[5]), int(match[6]), int(match[7])) == (RATIO, COFF, HEAD_DIM)
        assert match[8] == key.arch
        assert float(match[9]) >= 0.0
    elapsed = [float(match[10]) for match in matches]
    assert elapsed == sorted(elapsed)
    assert elapsed[-1] >= round(COMPILE_S * len(expected), 1) - 0.1


def test_command_prints_progress_then_the_summary_and_quiet_prints_no_progress(
        events, tmp_path, capsys):
    total = len(_expected_kernels())
    assert command.main([*ARGS, "--cache-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert all(_progress(lines[:total])) and len(lines) == total + 1
    assert lines[-1] == f"{tmp_path}: {total} kernels compiled, 0 already present"
    # Again: every kernel present, each still counted.
    assert command.main([*ARGS, "--cache-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [match[3] for match in _progress(lines[:total])] == ["present"] * total
    assert lines[-1] == f"{tmp_path}: 0 kernels compiled, {total} already present"
    assert command.main([*ARGS, "--cache-dir", str(tmp_path / "other"), "--quiet"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{tmp_path / 'other'}: {total} kernels compiled, 0 already present"]


def test_an_unsupported_configuration_fails_before_anything_compiles(events, tmp_path, capsys):
    # Every combination is checked first: a bad one listed last costs no compile of the
    # good ones (no family runs fp32 at ratio 128).
    argv = ["--ratio", str(RATIO), "128", "--coff", "1", "--head-dim", "128", "--dtype",
            "float32", "--arch", "sm_90a", "--no-native", "--cache-dir", str(tmp_path)]
    assert command.main(argv) == 2
    assert "no kernel family supports ratio=128" in capsys.readouterr().err
    assert events == []
