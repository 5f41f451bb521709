"""Host overhead of one eager call (Python + dispatcher + launch), forward and backward.

Where the native launch path is built (csa_ops.native), the breakdown also times the op's
overload through the dispatcher to its C++ Autograd kernel, and the C++ call table alone.

``python bench/time_overhead.py [out.json]``. Two views: CUDA events around many
back-to-back calls at a tiny shape (the host is the bottleneck there, so the per-call time is
the host cost) and the profiler's CPU time per op call.
"""

from __future__ import annotations

import json
import sys

import timing  # bench/ is the script's folder, so on sys.path
import torch
from torch.profiler import ProfilerActivity, profile

import csa_ops


def _inputs(tokens=256, head_dim=128, ratio=4, coff=2):
    cu, cuc = csa_ops.offsets_for([tokens], ratio, "cuda")
    kv = torch.randn(tokens, coff * head_dim, device="cuda", dtype=torch.bfloat16)
    score = torch.randn_like(kv)
    ape = torch.randn(ratio, coff * head_dim, device="cuda")
    rows = tokens // ratio
    grad_out = torch.randn(rows, head_dim, device="cuda", dtype=torch.bfloat16)
    return kv, score, ape, cu, cuc, ratio, coff, rows, grad_out


def _per_call_us(fn, calls=2000):
    """Median over 10 batches of back-to-back calls, after one untimed batch."""
    batch = max(1, calls // 10)
    median, _ = timing.time_calls(lambda _: fn(), batch, warmup=1, iters=10,
                                  device=torch.device("cuda"))
    return median * 1e6


def _noop_ops():
    """torch's own per-call floor on this host: no-op ops registered the ways ours could be."""
    @torch.library.custom_op("csa_overhead::custom_noop", mutates_args=())
    def custom_noop(x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(0)

    library = torch.library.Library("csa_overhead", "FRAGMENT")
    library.define("library_noop(Tensor x) -> Tensor")
    library.impl("library_noop", lambda x: x.new_empty(0), "CUDA")
    library.define("autograd_noop(Tensor x) -> Tensor")
    library.impl("autograd_noop", lambda x: x.new_empty(0), "CUDA")
    torch.library.register_autograd("csa_overhead::autograd_noop", lambda ctx, g: g,
                                    lib=library)
    return library


def _breakdown(kv, score, ape, cu, cuc, ratio, coff, rows, grad_out):
    """Per-call cost of each layer of the forward path (host time: the kernel is tiny)."""
    from csa_ops import dispatch, host, ops, validation

    problem = host.problem("fwd", kv, score, cu, cuc, ratio, coff)
    launch = host.KERNELS.get("fwd", problem.key)
    call = host.prepare("fwd", (kv, score, ape, cu, cuc), ratio, coff, rows)
    out = torch.empty(rows, kv.shape[1] // coff, device="cuda", dtype=kv.dtype)
    plan = problem.family.plan_forward(problem.key, kv.shape[0], rows, problem.num_sms)
    values = [t.data_ptr() for t in (kv, score, ape, cu, cuc, out, ape)]
    values += [kv.shape[0], rows, cu.numel() - 1, plan.grid]
    stream = torch.cuda.current_stream().cuda_stream
    args = (kv, score, ape, cu, cuc)
    library = _noop_ops()  # noqa: F841  (keeps the no-op ops registered)
    overload = torch.ops.csa.compressor.default
    table = ops._PREPARED.table  # the native launch path's call table, where it is built
    native_rows = {} if table is None else {
        # Through the dispatcher to the C++ Autograd kernel, and the table alone.
        "overload_call_us": _per_call_us(lambda: overload(kv, score, ape, cu, cuc, ratio,
                                                          coff, rows)),
        "call_table_us": _per_call_us(lambda: table(kv, score, ape, cu, cuc, ratio, coff,
                                                    rows)),
    }
    return {
        **native_rows,
        "custom_op_noop_us": _per_call_us(lambda: torch.ops.csa_overhead.custom_noop(kv)),
        "library_noop_us": _per_call_us(lambda: torch.ops.csa_overhead.library_noop(kv)),
        "library_autograd_noop_us": _per_call_us(
            lambda: torch.ops.csa_overhead.autograd_noop(kv)),
        "cuda_impl_direct_us": _per_call_us(lambda: ops._compressor_cuda(
            kv, score, ape, cu, cuc, ratio, coff, rows)),
        "validation_full_us": _per_call_us(lambda: validation.check_arguments(
            kv, score, ape, cu, cuc, ratio, coff, rows)),
        "signature_lookup_us": _per_call_us(
            lambda: ops._PREPARED.get(dispatch.signature(args, ratio, coff, rows))),
        "prepared_call_us": _per_call_us(lambda: call(kv, score, ape, cu, cuc)),
        "empty_out_us": _per_call_us(lambda: torch.empty(
            (rows, kv.shape[1] // coff), dtype=kv.dtype, device=kv.device)),
        "launch_us": _per_call_us(lambda: launch(*values, stream)),
        "torch_add_us": _per_call_us(lambda: torch.add(kv, score)),
        **_backward_breakdown(kv, score, ape, cu, cuc, ratio, coff, grad_out),
    }


def _backward_breakdown(kv, score, ape, cu, cuc, ratio, coff, grad_out):
    """The backward op's layers: its prepared call, its launch (main kernel + grad_ape sum)
    and its four allocations."""
    from csa_ops import host, ops

    tensors = (grad_out, kv, score, ape, cu, cuc)
    problem = host.problem("bwd", kv, score, cu, cuc, ratio, coff)
    launch = host.KERNELS.get("bwd", problem.key)
    plan = problem.family.plan_backward(problem.key, kv.shape[0], grad_out.shape[0],
                                        problem.num_sms)
    call = host.prepare("bwd", tensors, ratio, coff, None)
    grads = call(*tensors)
    work = torch.empty(plan.workspace, dtype=torch.float32, device=kv.device)
    values = [t.data_ptr() for t in (*tensors, *grads, work)]
    values += [kv.shape[0], grad_out.shape[0], cu.numel() - 1, plan.grid]
    stream = torch.cuda.current_stream().cuda_stream
    overload = torch.ops.csa.compressor_backward.default
    table = ops._PREPARED.table
    native_rows = {} if table is None else {
        "backward_overload_call_us": _per_call_us(lambda: overload(*tensors, ratio, coff)),
        "backward_call_table_us": _per_call_us(lambda: table(*tensors, ratio, coff)),
    }
    return {
        **native_rows,
        "backward_cuda_impl_direct_us": _per_call_us(
            lambda: ops._compressor_backward_cuda(*tensors, ratio, coff)),
        "backward_prepared_call_us": _per_call_us(lambda: call(*tensors)),
        "backward_launch_us": _per_call_us(lambda: launch(*values, stream)),
        "empty_like_us": _per_call_us(lambda: torch.empty_like(kv)),
        "new_empty_us": _per_call_us(lambda: kv.new_empty(kv.shape)),
        "empty_pair_unbind_us": _per_call_us(
            lambda: kv.new_empty((2, *kv.shape)).unbind(0)),
        "backward_grid": plan.grid,
    }


def _print_profile(fn, calls=2000):
    """Where the host time of one call goes, by function (cProfile, own time)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def main():
    kv, score, ape, cu, cuc, ratio, coff, rows, grad_out = _inputs()
    forward = lambda: torch.ops.csa.compressor(kv, score, ape, cu, cuc, ratio, coff, rows)
    backward = lambda: torch.ops.csa.compressor_backward(
        grad_out, kv, score, ape, cu, cuc, ratio, coff)
    result = {"forward_us_per_call": _per_call_us(forward),
              "backward_us_per_call": _per_call_us(backward)}
    result.update(_breakdown(kv, score, ape, cu, cuc, ratio, coff, rows, grad_out))
    kv_grad = kv.detach().requires_grad_()

    def forward_backward():
        out = torch.ops.csa.compressor(kv_grad, score, ape, cu, cuc, ratio, coff, rows)
        torch.autograd.grad(out, kv_grad, grad_out)

    result["forward_backward_autograd_us"] = _per_call_us(forward_backward, calls=500)
    # The autograd engine runs CUDA backward nodes on its own device thread; on the calling
    # thread instead, the difference is the hand-off, and cProfile can see the backward.
    with torch.autograd.set_multithreading_enabled(False):
        result["forward_backward_autograd_one_thread_us"] = _per_call_us(forward_backward,
                                                                         calls=500)
        _print_profile(forward_backward, calls=500)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(200):
            forward()
            backward()
        torch.cuda.synchronize()
    for event in prof.key_averages():
        if event.key in ("csa::compressor", "csa::compressor_backward"):
            result[f"profiler_cpu_us[{event.key}]"] = event.cpu_time_total / event.count
    print(json.dumps(result, indent=2))
    _print_profile(forward)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
