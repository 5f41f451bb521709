"""``import csa_ops`` is light (at most 0.3 s over ``import torch``), and the first trace
registers the Inductor lowering.

Each check runs in a fresh interpreter: what a module imports depends on what the process
imported before.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import textwrap

import pytest

# Never imported by ``import csa_ops`` (beyond what ``import torch`` imported already).
HEAVY = ("torch._inductor", "cutlass", "cuda", "csa_ops.lowering", "csa_ops.host")
# The budget is 0.3 s on the H200's host; this bound leaves room for slow, shared CI boxes.
EXTRA_IMPORT_S = 1.0

_IMPORT = """
import json, sys, time
start = time.perf_counter()
import torch
after_torch = time.perf_counter()
before = set(sys.modules)
import csa_ops
done = time.perf_counter()
print(json.dumps({"torch_s": after_torch - start, "csa_ops_s": done - after_torch,
                  "new": sorted(set(sys.modules) - before)}))
"""


def _child(code: str, env: dict | None = None, timeout: int = 300) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=os.environ | (env or {}), check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def _heavy(modules) -> list[str]:
    return [m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY)]


def test_import_leaves_inductor_and_the_dsl_out():
    runs = [json.loads(_child(_IMPORT).splitlines()[-1]) for _ in range(3)]
    assert _heavy(runs[0]["new"]) == []
    extra = statistics.median(r["csa_ops_s"] for r in runs)
    torch_s = statistics.median(r["torch_s"] for r in runs)
    print(f"import torch {torch_s:.3f} s, then import csa_ops {extra:.3f} s (median of 3)")
    assert extra < EXTRA_IMPORT_S, f"import csa_ops took {extra:.3f} s after import torch"


def test_lowering_attribute_resolves_lazily():
    out = _child("""
        import sys, csa_ops
        assert "csa_ops.lowering" not in sys.modules
        print(csa_ops.lowering.get_mode(), "torch._inductor.lowering" in sys.modules)
        """)
    assert out.split() == ["auto", "True"]


_COMPILE = """
import sys, torch, csa_ops
from torch._inductor.utils import run_and_get_code

torch._inductor.config.force_disable_caches = True
# An unrelated compile first: Inductor memoizes its decomposition table on its first compile.
torch.compile(lambda x: x.sin() + 1)(torch.randn(8))
assert "csa_ops.lowering" not in sys.modules

cu, cuc = csa_ops.offsets_for([37, 5, 64], 4)
kv, score, ape = torch.randn(106, 256), torch.randn(106, 256), torch.randn(4, 256)
fn = torch.compile(lambda *args: torch.ops.csa.compressor(*args), fullgraph=True)
# total_comp=None: only the decomposition registered with the lowering generates this call.
out, (code,) = run_and_get_code(fn, kv, score, ape, cu, cuc, 4, 2, None)
torch.testing.assert_close(out, torch.ops.csa.compressor(kv, score, ape, cu, cuc, 4, 2, None))
lowering = csa_ops.lowering
path = lowering.policy.choose("fwd", kv.device, kv.dtype, 4, 2, 128, 106)
print(lowering.available, path, "torch.ops.csa.compressor.default(" in code)
"""


@pytest.mark.slow
def test_first_trace_registers_the_lowering(tmp_path):
    out = _child(_COMPILE, {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})
    available, path, extern_call = out.split()[-3:]
    assert available == "True" and path == "generate", out
    assert extern_call == "False", "the policy chose generated code but Inductor called the op"


@pytest.mark.slow
def test_disable_switch_keeps_the_opaque_op(tmp_path):
    out = _child(_COMPILE, {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path),
                            "CSA_OPS_LOWERING_DISABLE": "1"})
    available, _, extern_call = out.split()[-3:]
    assert (available, extern_call) == ("False", "True"), out
