"""The persistent kernel cache on a GPU: a fresh process with a deployed cache runs both
directions with zero compiles, through the native launch path the deployment built, and its
results are bitwise those of an in-memory JIT run (Python launch path)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

_RUN = textwrap.dedent("""
    import sys, torch
    import csa_ops
    from csa_ops import host, native
    torch.manual_seed(0)
    cu, cuc = csa_ops.offsets_for([1000, 3, 517], 4, "cuda")
    tokens = int(cu[-1])
    kv = torch.randn(tokens, 256, device="cuda").bfloat16().requires_grad_()
    score = torch.randn(tokens, 256, device="cuda").bfloat16().requires_grad_()
    ape = torch.randn(4, 256, device="cuda", requires_grad=True)
    out = csa_ops.compressor(kv, score, ape, cu, cuc, ratio=4, coff=2, total_comp=400)
    out.backward(torch.randn_like(out))
    torch.save([t.cpu() for t in (out, kv.grad, score.grad, ape.grad)], sys.argv[1])
    info = host.cache_info()
    print(info["misses"], info["disk_loads"], int("cutlass" in sys.modules),
          int(native.loaded()))
""")


def _run(path, env):
    done = subprocess.run([sys.executable, "-c", _RUN, str(path)], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=600, check=True)
    return [int(x) for x in done.stdout.split()[-4:]]


def test_deployed_cache_runs_without_compiling_and_matches_a_jit_run(tmp_path):
    cache = tmp_path / "cache"
    arch = {(9, 0): "sm_90a", (10, 0): "sm_100a"}.get(torch.cuda.get_device_capability())
    if arch is None:
        pytest.skip("no kernel targets this GPU")
    subprocess.run([sys.executable, "-m", "csa_ops.precompile", "--ratio", "4", "--coff", "2",
                    "--head-dim", "128", "--arch", arch, "--cache-dir", str(cache)],
                   capture_output=True, text=True, timeout=600, check=True)
    jit = _run(tmp_path / "jit.pt", {"CSA_OPS_CACHE": "0"})
    assert jit[:2] == [2, 0] and jit[3] == 0  # compiled in memory, nothing loaded, no cache
    loaded = _run(tmp_path / "cached.pt", {"CSA_OPS_CACHE_DIR": str(cache)})
    # Zero compiles, two loads, the DSL never imported, the deployed native library.
    assert loaded == [0, 2, 0, 1]
    for a, b in zip(torch.load(tmp_path / "jit.pt"), torch.load(tmp_path / "cached.pt")):
        assert torch.equal(a, b)
