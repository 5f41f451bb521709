"""A static capacity below the true row count stops the call on CUDA, on every path: the
kernels (both families, forward and backward, csa::compressor_extend's launches, prepared
and native calls, CUDA graph replays) print a message and trap; the torch reference where
no kernel runs and Inductor's generated code raise torch's device-side assert. Each case runs
in a process of its own (row_capacity_child.py), all at once, since the context it stops is
lost to everything after it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from csa_ops.config import CAPACITY_MESSAGE

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CHILD = Path(__file__).with_name("row_capacity_child.py")
TESTS = Path(__file__).parents[1]
# The cases whose call past capacity runs torch code (its device-side assert) rather than
# one of the kernels (which print CAPACITY_MESSAGE and trap).
TORCH_PATHS = {"reference_forward", "reference_backward", "compiled_generated"}
# The saturating batches (INT32_MAX rows against one valid request's rows plus padding)
# have no call within capacity first.
NO_VALID_CALL = {f"extend_{family}_{path}" for family in ("window", "streaming")
                 for path in ("one_launch", "step", "split", "lanes")}
CASES = ["window_forward", "window_backward", "streaming_forward", "streaming_backward",
         "reference_forward", "reference_backward", "window_graph", "streaming_graph",
         "compiled_generated", "extend_window", "extend_streaming", *sorted(NO_VALID_CALL)]


@pytest.fixture(scope="module")
def outcomes():
    """{case: (returncode, output)} of every case, run as concurrent processes."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]))
    procs = {name: subprocess.Popen([sys.executable, str(CHILD), name], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
             for name in CASES}
    results = {}
    for name, proc in procs.items():
        output, _ = proc.communicate(timeout=600)
        results[name] = (proc.returncode, output)
    return results


@pytest.mark.parametrize("case", CASES)
def test_capacity_below_the_row_count_stops_the_call(case, outcomes):
    returncode, output = outcomes[case]
    print(output[-3000:])
    assert "NOT STOPPED" not in output, "the call past capacity returned without an error"
    assert returncode != 0
    if case not in NO_VALID_CALL:
        assert "VALID" in output, "the call within capacity failed"
    if case in TORCH_PATHS:
        assert "device-side assert" in output
    else:
        assert CAPACITY_MESSAGE in output
