"""The native launch path (csa_ops.native) on the CPU: the C++ prepared call builds against
the installed torch, and a recording TVM-FFI function in place of a kernel shows that each
argument reaches it by name, inputs are made contiguous, aligned and upcast (in-place ones
never copied), outputs are allocated, filled and cast back, launches run in order, errors
surface, bad programs are refused; the Python path runs the same call description with the
same results; the library is cached, tagged, rebuilt in the background when missing and
discarded when corrupt."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
import tvm_ffi

from csa_ops import host, native
from csa_ops.config import Direction
from csa_ops.launch_description import CallSpec, Launch, python_call
from csa_ops.state import STATE, UNDECIDED

BWD_INPUTS = ("grad_out", "kv", "score", "ape", "cu", "cuc")
BWD_OUTPUTS = {"grad_kv": ("kv", None), "grad_score": ("score", None),
               "grad_ape": ("ape", None)}
BWD_CONSTANTS = {"num_tokens": 12, "num_rows": 3, "num_segs": 1, "grid": 7}


@pytest.fixture(scope="session")
def background_build(tmp_path_factory):
    """The library built as a process's first use builds it: module() finds none, starts
    one detached build and carries on without it. What that first use saw, for the test of
    that path; the library, for the tests that load it (a build takes most of a minute: one
    per test process serves both: session-scoped, so a worker that interleaves this module's
    tests with others' does not build it again)."""
    root = tmp_path_factory.mktemp("native-cache")
    path = native.library_path(root)
    marker = path.with_suffix(".building")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CSA_OPS_CACHE_DIR", str(root))
        _undecided(patch)
        first_use = native.module()
        marker_at_first_use = marker.exists()
    deadline = time.monotonic() + 300
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(1)
    assert path.exists(), path.with_suffix(".log").read_text()
    while marker.exists() and time.monotonic() < deadline:
        time.sleep(0.2)  # the builder removes its marker after publishing
    return {"root": root, "first_use": first_use, "marker_at_first_use": marker_at_first_use}


@pytest.fixture(scope="session")
def built_root(background_build):
    return background_build["root"]


def _undecided(patch: pytest.MonkeyPatch) -> None:
    """A process that has not yet decided whether it has the library."""
    patch.setattr(STATE, "native_module", UNDECIDED)
    patch.setattr(STATE, "native_build_started", False)


@pytest.fixture
def fresh_module_state(monkeypatch):
    _undecided(monkeypatch)


@pytest.fixture
def loaded(built_root, monkeypatch, fresh_module_state):
    monkeypatch.setenv("CSA_OPS_CACHE_DIR", str(built_root))
    module = native.module()
    assert module is not None
    return module


def _bwd_key():
    (_, key), = [(d, k) for d, k in host.configuration_keys(4, 128, 2, torch.bfloat16, "sm_90a")
                 if d == "bwd"]
    return key


def _bwd_spec(kernel, workspace=64, upcast=True):
    return CallSpec(Direction.BACKWARD, _bwd_key(), inputs=BWD_INPUTS, outputs=BWD_OUTPUTS,
                    launches=(Launch(tvm_ffi.convert(kernel), BWD_CONSTANTS),),
                    workspace=workspace, workspace_alias="grad_ape",
                    to_float=("ape",) * upcast, restore=(("grad_ape", "ape"),) * upcast)


def _python_path(spec):
    return python_call(spec, lambda index: 0, 0, device_guard=False)


# Both launch paths run a CallSpec: the C++ prepared call and the Python path.
PATHS = {"native": native.prepared_call, "python": _python_path}


def _bwd_call(kernel, workspace=64, upcast=True, path="native"):
    spec = _bwd_spec(kernel, workspace, upcast)
    return PATHS[path](spec), spec.key


def _tensors(ape_dtype=torch.bfloat16, misaligned_kv=False):
    torch.manual_seed(0)
    kv = torch.randn(12, 256).bfloat16()
    if misaligned_kv:  # a view one element into its allocation
        kv = torch.cat([torch.zeros(1, dtype=torch.bfloat16), kv.flatten()])[1:].view(12, 256)
    score = torch.randn(256, 12).bfloat16().t()  # not contiguous
    ape = torch.randn(4, 256).to(ape_dtype)
    cu = torch.tensor([0, 12], dtype=torch.int32)
    cuc = torch.tensor([0, 3], dtype=torch.int32)
    grad_out = torch.randn(3, 128).bfloat16()
    return grad_out, kv, score, ape, cu, cuc


def _read(address: int, like: torch.Tensor) -> torch.Tensor:
    """A copy of the memory at ``address`` read as a tensor shaped and typed like ``like``."""
    raw = (ctypes.c_uint8 * (like.numel() * like.element_size())).from_address(address)
    return torch.frombuffer(bytearray(raw), dtype=like.dtype).view(like.shape).clone()


@pytest.mark.parametrize("path", PATHS)
def test_each_argument_reaches_the_kernel_by_name(loaded, path):
    seen = {}
    names = [name for name, _ in host.ARGUMENTS["bwd"]]

    def kernel(*values):
        seen.update(zip([*names, "stream"], values))
        # What the kernel reads: inputs contiguous and aligned, ape as fp32.
        seen["kv_seen"] = _read(values[names.index("kv")], tensors[1])
        seen["score_seen"] = _read(values[names.index("score")], tensors[2].contiguous())
        seen["ape_seen"] = _read(values[names.index("ape")], tensors[3].float())
        # What it writes: grad_ape in fp32, cast back to ape's dtype by the call.
        grad_ape = (ctypes.c_float * tensors[3].numel()).from_address(values[names.index("grad_ape")])
        for i in range(tensors[3].numel()):
            grad_ape[i] = 1.5 + i

    call, key = _bwd_call(kernel, path=path)
    tensors = _tensors(misaligned_kv=True)
    grad_kv, grad_score, grad_ape = call(*tensors)

    assert seen["kv"] % key.align_bytes == 0 and seen["kv"] != tensors[1].data_ptr()
    assert torch.equal(seen["kv_seen"], tensors[1])
    assert torch.equal(seen["score_seen"], tensors[2].contiguous())
    assert torch.equal(seen["ape_seen"], tensors[3].float())
    for name, tensor in zip(BWD_INPUTS, tensors):
        if name in ("grad_out", "cu", "cuc"):  # already contiguous and aligned: passed as is
            assert seen[name] == tensor.data_ptr(), name
    assert seen["grad_kv"] == grad_kv.data_ptr() and seen["grad_score"] == grad_score.data_ptr()
    assert seen["workspace"] not in {seen[name] for name in ("grad_kv", "grad_score", "grad_ape")}
    assert [seen[name] for name in BWD_CONSTANTS] == list(BWD_CONSTANTS.values())
    assert seen["stream"] == 0  # host tensors: no stream
    assert grad_kv.shape == tensors[1].shape and grad_kv.dtype == torch.bfloat16
    assert grad_score.shape == tensors[2].shape and grad_score.is_contiguous()
    assert grad_ape.dtype == torch.bfloat16
    expected = (1.5 + torch.arange(grad_ape.numel(), dtype=torch.float32)).view(4, 256)
    assert torch.equal(grad_ape, expected.bfloat16())


@pytest.mark.parametrize("path", PATHS)
def test_without_workspace_the_alias_is_passed(loaded, path):
    seen = []
    call, _ = _bwd_call(lambda *values: seen.append(values), workspace=0, upcast=False,
                        path=path)
    tensors = _tensors(ape_dtype=torch.float32)
    _, _, grad_ape = call(*tensors)
    names = [name for name, _ in host.ARGUMENTS["bwd"]]
    assert seen[0][names.index("workspace")] == grad_ape.data_ptr()
    assert seen[0][names.index("ape")] == tensors[3].data_ptr()  # fp32 already: no copy
    assert grad_ape.dtype == torch.float32


@pytest.mark.parametrize("path", PATHS)
def test_a_single_output_comes_back_as_a_tensor(loaded, path):
    (_, key), = [(d, k) for d, k in host.configuration_keys(4, 128, 2, torch.bfloat16, "sm_90a")
                 if d == "fwd"]
    constants = {"num_tokens": 12, "num_rows": 3, "num_segs": 1, "grid": 2}
    call = PATHS[path](CallSpec(
        Direction.FORWARD, key, inputs=("kv", "score", "ape", "cu", "cuc"),
        outputs={"out": ("kv", (3, 128))},
        launches=(Launch(tvm_ffi.convert(lambda *values: None), constants),),
        workspace_alias="out"))
    _, kv, score, ape, cu, cuc = _tensors(ape_dtype=torch.float32)
    out = call(kv, score, ape, cu, cuc)
    assert isinstance(out, torch.Tensor) and out.shape == (3, 128) and out.dtype == kv.dtype


def _extend_spec(kernels, state_align_key):
    """An extend call of two launches (a split call), its state written in place."""
    constants = [{"num_tokens": 5, "num_rows": 2, "num_requests": 2, "num_slots": 3,
                  "grid": grid} for grid in (1, 9)]
    return CallSpec(
        Direction.EXTEND, state_align_key,
        inputs=("kv", "score", "ape", "cu", "start_pos", "slots", "kv_state", "score_state"),
        outputs={"out": ("kv", (2, 128)), "cuc": ("cu", None)},
        launches=tuple(Launch(tvm_ffi.convert(k), c) for k, c in zip(kernels, constants)),
        to_float=("ape",), in_place=("kv_state", "score_state"), live="ape")


def _extend_tensors(misaligned_state=False, empty_kv=False):
    tokens = 0 if empty_kv else 5
    kv = torch.randn(tokens, 256).bfloat16()
    kv_state = torch.zeros(3 * 8 * 256 + 1, dtype=torch.bfloat16)
    kv_state = (kv_state[1:] if misaligned_state else kv_state[:-1]).view(3, 8, 256)
    return (kv, kv.clone(), torch.randn(4, 256), torch.tensor([0, 2, tokens], dtype=torch.int32),
            torch.tensor([0, 7], dtype=torch.int32), torch.tensor([2, 0], dtype=torch.int32),
            kv_state, torch.zeros(3, 8, 256))


@pytest.mark.parametrize("path", PATHS)
def test_launches_run_in_order_with_state_in_place(loaded, path):
    names = [name for name, _ in host.ARGUMENTS["ext"]]
    order = []
    call = PATHS[path](_extend_spec([lambda *v: order.append(("first", v)),
                                     lambda *v: order.append(("second", v))], _bwd_key()))
    tensors = _extend_tensors()
    out, cuc = call(*tensors)
    assert [name for name, _ in order] == ["first", "second"]
    (_, first), (_, second) = order
    assert first[names.index("grid")] == 1 and second[names.index("grid")] == 9
    assert first[:names.index("num_tokens")] == second[:names.index("num_tokens")]
    # In place: the state tensors themselves, not copies.
    assert first[names.index("kv_state")] == tensors[6].data_ptr()
    assert first[names.index("score_state")] == tensors[7].data_ptr()
    assert out.shape == (2, 128) and out.dtype == torch.bfloat16
    assert cuc.shape == (3,) and cuc.dtype == torch.int32


@pytest.mark.parametrize("path", PATHS)
def test_a_misaligned_in_place_input_launches_nothing(loaded, path):
    launched = []
    call = PATHS[path](_extend_spec([lambda *v: launched.append(v)] * 2, _bwd_key()))
    assert call(*_extend_tensors(misaligned_state=True)) is None
    assert not launched


@pytest.mark.parametrize("path", PATHS)
def test_an_empty_tensor_passes_a_live_address(loaded, path):
    names = [name for name, _ in host.ARGUMENTS["ext"]]
    seen = []
    call = PATHS[path](_extend_spec([lambda *v: seen.append(v)] * 2, _bwd_key()))
    tensors = _extend_tensors(empty_kv=True)
    call(*tensors)
    addresses = [seen[0][names.index(name)] for name in ("kv", "score", "ape")]
    assert 0 not in addresses and addresses[0] == addresses[1] == addresses[2]


def test_kernel_errors_and_bad_calls_raise(loaded):
    def failing(*values):
        raise ValueError("the kernel refused")

    call, _ = _bwd_call(failing)
    tensors = _tensors()
    with pytest.raises(RuntimeError, match="ValueError: the kernel refused"):
        call(*tensors)
    with pytest.raises(RuntimeError, match="expected 6 tensors, got 5"):
        call(*tensors[:5])
    with pytest.raises(RuntimeError, match="argument 2 is not a tensor"):
        call(tensors[0], tensors[1], 3, *tensors[3:])


@pytest.mark.parametrize("slots, outputs, restore, workspace, in_place, live, message", [
    ([(0, 1)], [(0, None)], [], 0, [], -1, r"bad slot \(0, 1\)"),
    ([(1, 1)], [(0, None)], [], 0, [], -1, r"bad slot \(1, 1\)"),
    ([(2, 0)], [(0, None)], [], 0, [], -1, r"bad slot \(2, 0\)"),  # no workspace
    ([(3, 5)], [(1, None)], [], 0, [], -1, "output like input 1 of 1"),
    ([(3, 5)], [(0, None)], [(1, 0)], 0, [], -1, r"bad restore pair \(1, 0\)"),
    ([(3, 5)] * 24, [(0, None)], [], 0, [], -1, "24 slots, at most 23"),
    ([(3, 5)], [(0, None)], [], 0, [1], -1, "in_place input 1 of 1"),
    ([(3, 5)], [(0, None)], [], 0, [], 1, "live input 1 of 1"),
])
def test_bad_programs_are_refused(loaded, slots, outputs, restore, workspace, in_place, live,
                                  message):
    function = tvm_ffi.convert(lambda *values: None)
    with pytest.raises(RuntimeError, match=message):
        loaded.PreparedCall([(function.__chandle__(), slots)], [0], in_place, [], outputs,
                            restore, workspace, live)
    with pytest.raises(RuntimeError, match="null handle"):
        loaded.PreparedCall([(0, [(3, 5)])], [0], [], [], [(0, None)], [], 0, -1)
    with pytest.raises(RuntimeError, match="no launch"):
        loaded.PreparedCall([], [0], [], [], [(0, None)], [], 0, -1)


def test_only_tvm_ffi_functions_take_the_native_path(built_root, monkeypatch,
                                                     fresh_module_state):
    monkeypatch.setenv("CSA_OPS_CACHE_DIR", str(built_root))
    spec = _bwd_spec(lambda *values: None, workspace=0)
    in_memory = CallSpec(**{**spec.__dict__, "launches": (Launch(lambda *values: None,
                                                                 BWD_CONSTANTS),)})
    assert native.prepared_call(in_memory) is None  # a kernel compiled in memory
    monkeypatch.setenv("CSA_OPS_NATIVE", "0")
    assert native.prepared_call(spec) is None
    monkeypatch.delenv("CSA_OPS_NATIVE")
    monkeypatch.setenv("CSA_OPS_CACHE", "0")  # no cache, no native library
    monkeypatch.setattr(STATE, "native_module", UNDECIDED)
    assert not native.enabled()
    assert native.prepared_call(spec) is None


def test_the_tag_follows_the_source_and_the_flags(monkeypatch, tmp_path):
    tag = native.tag()
    changed = tmp_path / "prepared_call.cpp"
    changed.write_bytes(native.SOURCE.read_bytes() + b"\n// changed\n")
    monkeypatch.setattr(native, "SOURCE", changed)
    monkeypatch.setattr(STATE, "native_tag", None)
    assert native.tag() != tag
    source_tag = native.tag()
    monkeypatch.setattr(native, "_CFLAGS", ("-O3",))
    monkeypatch.setattr(STATE, "native_tag", None)
    assert native.tag() not in (tag, source_tag)
    assert native.library_path(tmp_path).name == f"{native.MODULE}.{native.tag()}.so"


def test_a_corrupt_library_is_set_aside_with_a_warning(tmp_path, monkeypatch,
                                                       fresh_module_state):
    monkeypatch.setenv("CSA_OPS_CACHE_DIR", str(tmp_path))
    path = native.library_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\x7fELF truncated")
    with pytest.warns(RuntimeWarning, match="setting aside the native launch library"):
        assert native.module() is None
    assert not path.exists() and path.with_suffix(".rejected").exists()
    assert native.module() is None  # decided once per process: no second attempt


def test_a_missing_library_is_built_in_the_background(background_build):
    """The first use starts one detached build and carries on without the library; the
    library it publishes loads in the next process."""
    root = background_build["root"]
    path = native.library_path(root)
    assert background_build["first_use"] is None
    assert background_build["marker_at_first_use"]
    assert path.exists()
    assert not path.with_suffix(".building").exists()
    assert not any(p.name.startswith(".build-") for p in path.parent.iterdir())
    loads = subprocess.run(
        [sys.executable, "-c", "from csa_ops import native; print(native.module() is not None)"],
        env={**os.environ, "CSA_OPS_CACHE_DIR": str(root)}, capture_output=True, text=True,
        check=True)
    assert loads.stdout.strip() == "True"
    assert shutil.which("ninja")  # what cpp_extension builds with


def test_an_explicit_build_runs_the_builder_unless_the_library_is_there(built_root, tmp_path,
                                                                         monkeypatch):
    """build() (precompile, conftest's GPU sessions) runs the builder the background build
    runs (whose real build the fixture made), waits for it, and keeps a present library."""
    calls = []

    def recording_run(command, **kwargs):
        calls.append((command, kwargs["check"]))

    monkeypatch.setattr(native.subprocess, "run", recording_run)
    assert native.build(built_root) == native.library_path(built_root)
    assert calls == []  # present: kept, no build
    path = native.library_path(tmp_path)
    assert native.build(tmp_path) == path
    assert calls == [(native._build_command(path), True)]


def test_a_recent_build_marker_keeps_a_second_process_from_building(tmp_path, monkeypatch,
                                                                    fresh_module_state):
    monkeypatch.setenv("CSA_OPS_CACHE_DIR", str(tmp_path))
    path = native.library_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.with_suffix(".building").touch()
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))
    assert native.module() is None
    assert started == []


def test_the_call_table_finds_calls_by_signature(loaded):
    calls = []
    call, _ = _bwd_call(lambda *values: calls.append(values))
    tensors = _tensors()
    table = loaded.CallTable()
    table.insert(call, 6, *tensors, 4, 2)
    grads = table(*tensors, 4, 2)
    assert len(calls) == 1 and len(grads) == 3 and grads[2].dtype == torch.bfloat16
    other = _tensors()
    assert table(*other, 4, 2) is not None  # same metadata, other tensors: the same call
    misses = [
        (*tensors, 4, 1),                               # a scalar differs
        (*tensors, 4, True),                            # a bool is not an int here
        (*tensors, 4, 2**70),                           # beyond int64
        (*tensors, 4, None),
        (tensors[0][:2], *tensors[1:], 4, 2),           # a shape differs
        (tensors[0].float(), *tensors[1:], 4, 2),       # a dtype differs
        (*tensors[:5], 4, 2),                           # fewer arguments
        (*tensors, 4, 2, "extra"),
    ]
    for args in misses:
        assert table(*args) is None
    assert len(calls) == 2
    table.clear()
    assert len(table) == 0 and table(*tensors, 4, 2) is None


def test_prepared_calls_enter_native_calls_in_the_table(loaded):
    from csa_ops import dispatch

    memo = dispatch.PreparedCalls(limit=2)
    call, _ = _bwd_call(lambda *values: None)
    tensors = _tensors()
    signature = dispatch.signature(tensors, 4, 2)
    assert memo.remember(signature, call, (*tensors, 4, 2), 6) is call
    assert memo[signature] is call and len(memo.table) == 1
    assert memo.table(*tensors, 4, 2) is not None
    memo.remember(dispatch.signature(tensors, 4, 1), lambda *a: None, (*tensors, 4, 1), 6)
    assert len(memo.table) == 1  # a Python call stays out of the table
    memo.clear()
    assert len(memo.table) == 0


def test_autograd_kernels_run_table_hits_and_defer_everything_else(loaded):
    """The C++ kernels at a backend's Autograd key (CPU here, CUDA in the package): a call
    whose signature is in the table runs there; a miss, a gradient to record or an error
    goes to the Python Autograd kernel, whose exceptions keep their type."""
    from csa_ops import ops

    launched, deferred = [], []
    call, _ = _bwd_call(lambda *values: launched.append(values))

    def python_kernel(keyset, *args):
        deferred.append(keyset)
        return ops._compressor_backward_autograd(keyset, *args)

    op = torch.ops.csa.compressor_backward.default
    tensors = _tensors()
    expected = op(*tensors, 4, 2)  # the reference, before any registration
    table = loaded.CallTable()
    loaded.register_autograd_kernels(table, "CPU", [("compressor_backward", python_kernel)])
    try:
        loaded.register_autograd_kernels(table, "CPU", [])  # the same table: nothing to do
        with pytest.raises(RuntimeError, match="registered with another table"):
            loaded.register_autograd_kernels(loaded.CallTable(), "CPU", [])
        for a, b in zip(op(*tensors, 4, 2), expected):  # a miss: deferred to Python
            assert torch.equal(a, b)
        assert len(deferred) == 1 and not launched
        table.insert(call, 6, *tensors, 4, 2)
        grads = op(*tensors, 4, 2)  # a hit: the prepared call, no Python
        assert len(deferred) == 1 and len(launched) == 1 and grads[2].dtype == torch.bfloat16
        leaf = tensors[1].clone().requires_grad_(True)
        op(tensors[0], leaf, *tensors[2:], 4, 2)  # autograd records it: deferred
        assert len(deferred) == 2 and len(launched) == 1
        with torch.no_grad():
            op(tensors[0], leaf, *tensors[2:], 4, 2)  # nothing to record: a hit
        assert len(deferred) == 2 and len(launched) == 2
        with pytest.raises(ValueError, match="ratio"):
            op(*tensors, 0, 2)
        assert len(deferred) == 3
    finally:
        loaded.unregister_autograd_kernels()
    op(*tensors, 4, 2)
    assert len(deferred) == 3 and len(launched) == 2


def test_a_failed_build_is_recorded_and_not_retried_in_the_background(tmp_path, monkeypatch,
                                                                      fresh_module_state):
    from torch.utils import cpp_extension

    def failing_load(**kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(cpp_extension, "load", failing_load)
    path = native.library_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.with_suffix(".building").touch()
    with pytest.raises(RuntimeError, match="no compiler here"):
        native._build_here(tmp_path)
    assert "no compiler here" in path.with_suffix(".failed").read_text()
    assert not path.with_suffix(".building").exists()
    assert not any(p.name.startswith(".build-") for p in path.parent.iterdir())
    monkeypatch.setenv("CSA_OPS_CACHE_DIR", str(tmp_path))
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))
    assert native.module() is None
    assert started == []


_EXIT_WHILE_REGISTERED = """
import sys, torch, tvm_ffi
sys.path.insert(0, sys.argv[1])
import test_native as t
from csa_ops import native, ops
module = native.module()
call, _ = t._bwd_call(lambda *values: None)
tensors = t._tensors()
table = module.CallTable()
table.insert(call, 6, *tensors, 4, 2)
module.register_autograd_kernels(table, "CPU", [
    ("compressor_backward", ops._compressor_backward_autograd)])
assert len(torch.ops.csa.compressor_backward.default(*tensors, 4, 2)) == 3  # a hit
del call, table  # the kernels hold the last references
print("exiting")
"""


def test_a_process_exits_cleanly_with_the_kernels_registered(built_root):
    """torch's dispatcher frees registered kernels when the process ends, after Python: the
    kernels must not release Python or TVM-FFI objects then."""
    done = subprocess.run([sys.executable, "-c", _EXIT_WHILE_REGISTERED,
                           os.path.dirname(__file__)],
                          env={**os.environ, "CSA_OPS_CACHE_DIR": str(built_root)},
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("exiting")


def test_threads_call_while_the_table_changes(loaded):
    """The C++ kernels read the table without the GIL while Python inserts and clears."""
    import threading

    from csa_ops import ops

    call, _ = _bwd_call(lambda *values: None, upcast=False)
    tensors = _tensors(ape_dtype=torch.float32)
    table = loaded.CallTable()
    table.insert(call, 6, *tensors, 4, 2)
    loaded.register_autograd_kernels(table, "CPU", [
        ("compressor_backward", ops._compressor_backward_autograd)])
    op = torch.ops.csa.compressor_backward.default
    errors = []

    def caller():
        try:
            for _ in range(200):
                grads = op(*tensors, 4, 2)
                assert len(grads) == 3 and grads[0].shape == tensors[1].shape
        except Exception as error:  # noqa: BLE001 (reported below)
            errors.append(error)

    try:
        threads = [threading.Thread(target=caller) for _ in range(4)]
        for thread in threads:
            thread.start()
        for _ in range(200):
            table.clear()
            table.insert(call, 6, *tensors, 4, 2)
        for thread in threads:
            thread.join()
    finally:
        loaded.unregister_autograd_kernels()
    assert errors == []


def test_outputs_are_filled_as_torch_empty_fills_them_under_deterministic_algorithms(loaded):
    """torch.use_deterministic_algorithms fills fresh tensors (NaN for floats), as the
    Python launch path's torch.empty_like does; the kernels overwrite every element."""
    call, _ = _bwd_call(lambda *values: None, upcast=False)  # writes nothing
    tensors = _tensors(ape_dtype=torch.float32)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        filled = call(*tensors)
    finally:
        torch.use_deterministic_algorithms(previous)
    for tensor in filled:
        assert bool(torch.isnan(tensor).all())
