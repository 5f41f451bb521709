"""Timers and ceilings: per-call wall time, CUDA-graph replay time, kernel time from the
profiler, copy bandwidth.

Every timed sample is a batch of back-to-back calls that rotate over input sets whose total
size exceeds L2, so no call finds its inputs cached; a sample's time is divided by the batch
and the median over samples is reported.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def calls_per_sample(step: Callable[[int], object], device_side: bool, most: int, sets: int,
                     device: torch.device) -> int:
    """Calls per timed sample, never fewer than the input sets (each set once). Device-side
    samples (graph replay, the profiler's kernel time) take `most` calls, the same for
    every variant: a graph replay's fixed cost (H200: 7-16 us) is shared by its calls, so a
    variant given fewer would pay more of it per call (prefill r128 c1: 14.37 us per call
    at 23 calls, 13.94 at 50). Wall-time samples last about 5 ms, by one timed call of
    `step`, and hold at most `most`."""
    if device_side:
        return max(sets, most)
    start = time.perf_counter()
    step(1)
    synchronize(device)
    one_call = time.perf_counter() - start
    return max(sets, 2, min(most, math.ceil(5e-3 / max(one_call, 1e-7))))


def l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0  # CPU runs are for seeing the harness work, not for cache-exact numbers
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20))


def num_input_sets(set_bytes: int, device: torch.device, cap: int = 64) -> int:
    """Enough input sets that one rotation streams at least 3x L2 (LRU never hits)."""
    need = 3 * l2_bytes(device)
    return max(2, min(cap, -(-need // max(set_bytes, 1))))


def _median_per_call(samples: list[float], batch: int) -> tuple[float, list[float]]:
    per_call = [s / batch for s in samples]
    return statistics.median(per_call), per_call


def time_calls(fn: Callable[[int], object], batch: int, warmup: int, iters: int,
               device: torch.device) -> tuple[float, list[float]]:
    """Median seconds per call of ``fn(i)`` for i in 0..batch-1, issued back to back.

    On CUDA, events bracket the whole batch, so the number is the per-call wall time: the
    larger of host launch cost and device time.
    """
    for _ in range(warmup):
        for i in range(batch):
            fn(i)
    synchronize(device)
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(batch):
                fn(i)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e-3)
        else:
            t = time.perf_counter()
            for i in range(batch):
                fn(i)
            samples.append(time.perf_counter() - t)
    return _median_per_call(samples, batch)


def capture_graph(fn: Callable[[int], object], batch: int, warmup: int):
    """One CUDA graph holding ``batch`` back-to-back calls (warmed up on a side stream first,
    so lazy compiles and allocator growth happen outside the capture), and the static
    outputs of its first call, which every replay rewrites."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(max(warmup, 1)):
            for i in range(batch):
                fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        first = fn(0)
        for i in range(1, batch):
            fn(i)
    torch.cuda.synchronize()
    return graph, first


def time_graph(graph: torch.cuda.CUDAGraph, batch: int, warmup: int,
               iters: int) -> tuple[float, list[float]]:
    """Median seconds per call inside replays of ``graph``: device time, launch gaps gone."""
    for _ in range(max(warmup, 1)):
        graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e-3)
    return _median_per_call(samples, batch)


def kernel_time(fn: Callable[[int], object], batch: int, warmup: int,
                iters: int) -> tuple[float, list[float]]:
    """Median seconds per call of the GPU kernels ``fn(i)`` launches (i in 0..batch-1),
    from the profiler's kernel records (CUPTI): the sum of their durations, without the
    launch gaps between kernels that a graph replay still has."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(max(warmup, 1)):
        for i in range(batch):
            fn(i)
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(batch):
                fn(i)
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        samples.append(sum(e.time_range.elapsed_us() for e in kernels) * 1e-6)
    return _median_per_call(samples, batch)


def graph_time_per_call(fn: Callable[[object], object], inputs: list, batch: int = 20,
                        warmup: int = 1, iters: int = 30) -> float:
    """Median seconds per call of ``fn(x)`` inside replays of a graph of ``batch`` calls
    that cycle over ``inputs`` (one capture, then ``iters`` timed replays)."""
    graph, _ = capture_graph(lambda i: fn(inputs[i % len(inputs)]), batch, warmup)
    median, _ = time_graph(graph, batch, warmup, iters)
    return median


def host_time_per_call(fn: Callable[[], object], calls: int = 200) -> float:
    """Seconds of host time per call of ``fn``: no synchronization inside the timed loop, so
    it is the Python, dispatch and launch cost, not the device time."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls


def syncs_host(fn: Callable[[], object]) -> str | None:
    """The error text if ``fn`` synchronizes with the host (so cannot be graph-captured)."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return None


def copy_bandwidth(device: torch.device, nbytes: int, iters: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    median, _ = time_calls(lambda _i: dst.copy_(src), batch=1, warmup=3, iters=iters,
                           device=device)
    return 2 * nbytes / median
