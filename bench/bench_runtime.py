"""Host-side costs users meet first: import, first call, per-call launch.

Fresh processes measure ``import csa_ops`` over ``import torch``, a configuration's first
call (forward + backward) with a cold and with a warm kernel cache, and how many kernels
each compiled. In this process: CUDA-synchronized wall time per call over thousands of calls
at 256 tokens (d128, r4 c2), side by side with a ``torch.add`` call, and forward + backward
through autograd beside ``torch.nn.functional.linear``'s. Writes JSON and markdown.

    python bench/bench_runtime.py --out bench/out/runtime
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch

_IMPORT = """
import time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import csa_ops
t2 = time.perf_counter()
import sys
print(t1 - t0, t2 - t1, int('torch._inductor' in sys.modules), int('cutlass' in sys.modules))
"""

_FIRST_CALL = """
import time, torch
import csa_ops
from csa_ops import host
from csa_ops.state import STATE
device = "{device}"
# CUDA context and torch's autograd engine started outside the measurement: the first
# call of any op pays them, and they are torch's, not the configuration's.
x = torch.randn(8, 8, device=device, requires_grad=True)
torch.nn.functional.linear(x, x).sum().backward()
lengths, ratio, coff, d = [256], 4, 2, {head_dim}
cu, cuc = csa_ops.offsets_for(lengths, ratio, device)
kv = torch.randn(256, coff * d, device=device, dtype=torch.bfloat16, requires_grad=True)
score = torch.randn_like(kv, requires_grad=True)
ape = torch.randn(ratio, coff * d, device=device, requires_grad=True)
if device == "cuda":
    torch.cuda.synchronize()
t = time.perf_counter()
out = csa_ops.compressor(kv, score, ape, cu, cuc, ratio=ratio, coff=coff, total_comp=64)
out.sum().backward()
if device == "cuda":
    torch.cuda.synchronize()
info = host.cache_info()
print(time.perf_counter() - t, info["misses"], info["disk_loads"])
"""


def _python(code: str, env: dict[str, str]) -> list[float]:
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                          capture_output=True, text=True, check=True)
    return [float(x) for x in done.stdout.split()[-4:]] if done.stdout else []


def _copy_native_library(cache: pathlib.Path) -> None:
    """The fresh processes' cache gets this machine's native launch library where it is
    built (a deployment has it), so their first calls load it and none starts a build."""
    from csa_ops import native

    built = native.library_path()
    if built.exists():
        target = native.library_path(cache)
        target.parent.mkdir(parents=True)
        target.write_bytes(built.read_bytes())


def fresh_process_costs(device: str, head_dim: int, repeats: int) -> dict:
    imports = [_python(_IMPORT, {}) for _ in range(repeats)]
    result = {
        "import_torch_s": statistics.median(r[0] for r in imports),
        "import_csa_ops_extra_s": statistics.median(r[1] for r in imports),
        "import_pulls_inductor": bool(imports[0][2]),
        "import_pulls_dsl": bool(imports[0][3]),
    }
    with tempfile.TemporaryDirectory() as cache:
        env = {"CSA_OPS_CACHE_DIR": cache}
        _copy_native_library(pathlib.Path(cache))
        code = _FIRST_CALL.format(device=device, head_dim=head_dim)
        cold = _python(code, env)
        warm = [_python(code, env) for _ in range(repeats)]
    result.update({
        "first_call_cold_s": cold[-3], "first_call_cold_compiles": int(cold[-2]),
        "first_call_warm_s": statistics.median(w[-3] for w in warm),
        "first_call_warm_compiles": max(int(w[-2]) for w in warm),
        "first_call_warm_disk_loads": int(warm[0][-1]),
    })
    return result


def _per_call_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def per_call_costs(calls: int, rounds: int = 3) -> dict:
    """Per-call costs of the op's launch paths: the native one (csa_ops.native, where its
    library is built) and the Python one, interleaved in rounds with torch.add (this host's
    per-call times drift between and within processes); each ratio is the median over
    rounds of the ratio within a round. Once the native library has registered its C++
    Autograd kernels they stay registered, so the Python rounds include their hand-off to
    the Python kernels (a process with CSA_OPS_NATIVE=0 has none)."""
    import csa_ops
    from csa_ops import host, native
    from csa_ops.state import STATE

    ratio, coff, d, tokens = 4, 2, 128, 256
    cu, cuc = csa_ops.offsets_for([tokens], ratio, "cuda")
    rows = tokens // ratio
    kv = torch.randn(tokens, coff * d, device="cuda", dtype=torch.bfloat16)
    score, ape = torch.randn_like(kv), torch.randn(ratio, coff * d, device="cuda")
    grad_out = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16)
    fwd = torch.ops.csa.compressor.default
    bwd = torch.ops.csa.compressor_backward.default
    leaves = [t.clone().requires_grad_(True) for t in (kv, score, ape)]
    x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad_lin = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)

    def op_train():
        out = fwd(*leaves, cu, cuc, ratio, coff, rows)
        out.backward(grad_out)

    def linear_train():
        torch.nn.functional.linear(x, w).backward(grad_lin)

    def one_round() -> dict:
        add = _per_call_us(lambda: torch.add(kv, score), calls)
        row = {
            "torch_add_us": add,
            "forward_us": _per_call_us(lambda: fwd(kv, score, ape, cu, cuc, ratio, coff, rows),
                                       calls),
            "backward_op_us": _per_call_us(
                lambda: bwd(grad_out, kv, score, ape, cu, cuc, ratio, coff), calls),
            "fwd_bwd_autograd_us": _per_call_us(op_train, calls // 4),
            "linear_fwd_bwd_autograd_us": _per_call_us(linear_train, calls // 4),
        }
        row["forward_x_add"] = row["forward_us"] / add
        row["backward_op_x_add"] = row["backward_op_us"] / add
        return row

    fwd(kv, score, ape, cu, cuc, ratio, coff, rows)  # the first call may start the build
    paths = {"native": [], "python": []}
    for _ in range(rounds):
        if native.module() is not None:
            STATE.forget_calls()
            paths["native"].append(one_round())
        with host.python_launch_path():
            paths["python"].append(one_round())
    STATE.forget_calls()
    result = {"launch_path": "native" if paths["native"] else "python"}
    for path, rows_of in paths.items():
        for name in (rows_of[0] if rows_of else {}):
            value = statistics.median(row[name] for row in rows_of)
            result[name if path == result["launch_path"] else f"{path}_{name}"] = value
    return result


def _markdown(result: dict) -> str:
    lines = ["| metric | value |", "|---|---|"]
    for name, value in result.items():
        if isinstance(value, float):
            value = f"{value:.4g}"
        lines.append(f"| {name} | {value} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/out/runtime"))
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                    "torch": torch.__version__}
    result.update(fresh_process_costs(device, 128, args.repeats))
    if device == "cuda":
        result.update(per_call_costs(args.calls))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "runtime.json").write_text(json.dumps(result, indent=1))
    (args.out / "runtime.md").write_text(_markdown(result))
    print(_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
