"""csa_ops.launcher: the prepacked launch, its layout check, fallback and kill switch (CPU)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from csa_ops import launcher

SIGNATURE = (("ptr", torch.bfloat16, 16), ("ptr", torch.float32, 16), ("ptr", torch.int32, 4),
             ("i32",), ("i32",))


class _RecordingKernel:
    """Stands in for a compiled DSL function: converts like the DSL, records what it runs."""

    def __init__(self, convert):
        self._convert = convert
        self.runs: list[list[int]] = []
        self.calls: list[tuple] = []

    def generate_execution_args(self, *args):
        return self._convert(args)

    def run_compiled_program(self, addresses):
        kinds = [slot[0] for slot in SIGNATURE] + ["stream"]
        self.runs.append([(ctypes.c_int32 if kind == "i32" else ctypes.c_uint64)
                          .from_address(address).value for address, kind in zip(addresses, kinds)])

    def __call__(self, *args):
        self.calls.append(args)


def _by_address(args):
    """The DSL's convention: one C address per argument, pointing at its value."""
    slots = []
    for arg in args:
        if isinstance(arg, launcher.runtime().int32):
            slots.append(ctypes.c_int32(int(arg)))
        elif isinstance(arg, launcher.runtime().stream):
            slots.append(ctypes.c_uint64(int(arg)))
        else:
            slots.append(ctypes.c_uint64(_pointer_value(arg)))
    return [ctypes.addressof(s) for s in slots], slots


def _pointer_value(pointer):
    """The address a cute Pointer holds, through the DSL's C-argument protocol."""
    (address,) = pointer.__c_pointers__()
    return ctypes.c_uint64.from_address(address).value


def _by_value(args):
    addresses, slots = _by_address(args)
    return [type(s).from_address(a).value for s, a in zip(slots, addresses)], slots


def test_layout_check_accepts_the_by_address_convention():
    assert launcher.layout_mismatch(_RecordingKernel(_by_address), SIGNATURE) is None


def _one_short(args):
    addresses, slots = _by_address(args)
    return addresses[:-1], slots


def _reordered(args):
    addresses, slots = _by_address(args)
    return addresses[::-1], slots


@pytest.mark.parametrize(("convert", "reason"), [
    (_by_value, "not passed by address"),
    (_one_short, "packed arguments for a signature"),
    (_reordered, "reads back"),
])
def test_layout_check_rejects_other_conventions(convert, reason):
    kernel = _RecordingKernel(convert)
    got = launcher.layout_mismatch(kernel, SIGNATURE)
    assert got is not None and reason in got


def test_prepacked_launch_passes_each_calls_values():
    kernel = _RecordingKernel(_by_address)
    launch = launcher.make_launcher(kernel, SIGNATURE)
    assert launch.prepacked
    launch([0x1000, 0x2000, 0x3004, 7, -3], 0xBEEF)
    launch([0x5000, 0x6000, 0x7008, 2**31 - 1, 0], 0)
    assert kernel.runs == [[0x1000, 0x2000, 0x3004, 7, -3, 0xBEEF],
                           [0x5000, 0x6000, 0x7008, 2**31 - 1, 0, 0]]
    assert kernel.calls == []


def test_mismatch_falls_back_to_the_public_call_with_a_warning():
    kernel = _RecordingKernel(_by_value)
    with pytest.warns(RuntimeWarning, match="prepacked kernel launch disabled"):
        launch = launcher.make_launcher(kernel, SIGNATURE)
    assert not launch.prepacked
    launch([0x1000, 0x2000, 0x3004, 7, 9], 0xBEEF)
    (args,) = kernel.calls
    rt = launcher.runtime()
    assert [_pointer_value(a) for a in args[:3]] == [0x1000, 0x2000, 0x3004]
    assert [int(a) for a in args[3:5]] == [7, 9]
    assert isinstance(args[5], rt.stream) and int(args[5]) == 0xBEEF
    assert args[0].dtype is rt.types[torch.bfloat16] and args[2].dtype is rt.types[torch.int32]
    assert kernel.runs == []


def test_kill_switch_forces_the_public_call(monkeypatch):
    monkeypatch.setattr(launcher, "PREPACKED", False)
    kernel = _RecordingKernel(_by_address)
    launch = launcher.make_launcher(kernel, SIGNATURE)
    assert not launch.prepacked
    launch([0x1000, 0x2000, 0x3004, 1, 2], 5)
    assert len(kernel.calls) == 1 and kernel.runs == []


def test_kill_switch_reads_the_environment(monkeypatch):
    import importlib

    monkeypatch.setenv("CSA_OPS_PREPACKED_LAUNCH", "0")
    try:
        reloaded = importlib.reload(launcher)
        assert reloaded.PREPACKED is False
        assert reloaded.current_stream_handle is reloaded._public_stream_handle
    finally:
        monkeypatch.delenv("CSA_OPS_PREPACKED_LAUNCH")
        reloaded = importlib.reload(launcher)
        assert reloaded.PREPACKED is True


def test_stream_handle_falls_back_without_the_raw_query(monkeypatch):
    monkeypatch.delattr(torch._C, "_cuda_getCurrentRawStream", raising=False)
    assert launcher._stream_handle_function() is launcher._public_stream_handle
