"""The native launch path: prepared kernel calls in C++ (csa_ops/csrc/prepared_call.cpp).

A prepared call's per-call work (contiguity, the ape upcast, output and workspace allocation
through torch's caching allocator, the TVM-FFI kernel call on torch's current stream) costs
several microseconds per tensor in Python; the C++ object does it in about one. Beside it:
a C++ table of prepared calls by metadata signature, and the ops' C++ kernels at the
AutogradCUDA key, which run a repeated call on plain CUDA tensors from that table without
entering Python (csa_ops.ops registers them with the first native call). It is a torch C++
extension, so it is built per machine against the installed torch and tvm_ffi, and kept in
the kernel cache directory (``native/``) under a tag of everything it depends on.

- ``python -m csa_ops.precompile`` builds it, like the kernels (``--no-native`` skips it).
- Otherwise the first CUDA call that prepares a kernel call starts the build in a detached
  process and runs the Python path until the library exists; calls prepared after that use
  it. Its results are the Python path's bit for bit (the same kernels, arguments and
  allocations).
- ``CSA_OPS_NATIVE=0`` turns it off; without the kernel cache (``CSA_OPS_CACHE=0``) or
  without a C++ compiler everything runs the Python path.

    python -m csa_ops.native build [--cache-dir DIR]   # build now (prints the path)
    python -m csa_ops.native status                    # where it is, and whether it loads
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.machinery
import importlib.util
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

from . import kernel_cache
from .state import STATE, UNDECIDED

ENABLE_ENV = "CSA_OPS_NATIVE"
MODULE = "csa_ops_native"
SOURCE = pathlib.Path(__file__).resolve().parent / "csrc" / "prepared_call.cpp"
# A build that started this long ago and left no library is taken as dead.
_BUILD_PATIENCE_S = 600.0


def enabled() -> bool:
    return (os.environ.get(ENABLE_ENV, "1") not in ("0", "", "false", "off")
            and kernel_cache.enabled())


# The build's flags, beyond torch's own: part of the tag, so a change rebuilds.
_CFLAGS = ("-O2",)


def _tvm_ffi_build_paths() -> tuple[list[str], list[str]]:
    """(include directories, linker flags) of the installed tvm_ffi."""
    import tvm_ffi.libinfo

    libdir = str(pathlib.Path(tvm_ffi.libinfo.find_libtvm_ffi()).parent)
    includes = [tvm_ffi.libinfo.find_include_path(), tvm_ffi.libinfo.find_dlpack_include_path()]
    return includes, [f"-L{libdir}", "-ltvm_ffi", f"-Wl,-rpath,{libdir}"]


def tag() -> str:
    """Digest of everything the library depends on: its source, the build flags, torch
    (version and build), tvm_ffi, the Python ABI and the machine. Computed once per process
    (tests that change the source reset ``STATE.native_tag``)."""
    if STATE.native_tag is not None:
        return STATE.native_tag
    import torch

    digest = hashlib.sha256(SOURCE.read_bytes())
    for part in (*_CFLAGS, torch.__version__, str(torch.version.git_version),
                 str(torch.compiled_with_cxx11_abi()), kernel_cache._version("apache-tvm-ffi"),
                 sys.implementation.cache_tag, platform.machine()):
        digest.update(b"\0" + part.encode())
    STATE.native_tag = digest.hexdigest()[:16]
    return STATE.native_tag


def library_path(root: pathlib.Path | None = None) -> pathlib.Path:
    root = kernel_cache.directory() if root is None else root
    return root / "native" / f"{MODULE}.{tag()}.so"


def _import(path: pathlib.Path):
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def loaded() -> bool:
    """Whether this process has loaded the library (asks nothing, starts nothing)."""
    return STATE.native_module not in (UNDECIDED, None)


def module():
    """The loaded extension, or None (disabled, not built yet, or unloadable). A missing
    library starts one background build per process; a later call picks up its result."""
    if STATE.native_module is not UNDECIDED:
        return STATE.native_module
    if not enabled():
        STATE.native_module = None
        return None
    path = library_path()
    if not path.exists():
        _start_background_build(path)
        return None
    try:
        library = _import(path)
    except (ImportError, OSError) as error:
        # Set aside, not deleted (it may be a deployment's): no process tries it again.
        warnings.warn(f"csa_ops: setting aside the native launch library {path} ({error}); "
                      f"calls run the Python path", RuntimeWarning, stacklevel=2)
        with contextlib.suppress(OSError):
            os.replace(path, path.with_suffix(".rejected"))
        library = None
    STATE.native_module = library
    return library


def _start_background_build(path: pathlib.Path) -> None:
    """One detached build per library at a time, across processes: the build marker is
    created exclusively; one older than _BUILD_PATIENCE_S is a dead build's. A build that
    failed leaves ``.failed`` (with its log), and no process starts another: an explicit
    ``build()`` (precompile, ``python -m csa_ops.native build``) tries again."""
    if STATE.native_build_started:
        return
    STATE.native_build_started = True
    marker = path.with_suffix(".building")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.with_suffix(".failed").exists():
            return
        if marker.exists() and time.time() - marker.stat().st_mtime >= _BUILD_PATIENCE_S:
            marker.unlink()
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except OSError:  # another process holds the marker, or the cache is not writable
        return
    with open(path.with_suffix(".log"), "w") as log:
        subprocess.Popen(_build_command(path), stdin=subprocess.DEVNULL, stdout=log,
                         stderr=subprocess.STDOUT, start_new_session=True,
                         **_child_environment())


def _build_command(path: pathlib.Path) -> list[str]:
    # main() of this module as imported, not run as __main__ (runpy warns when the package
    # has already imported the module it runs).
    code = "import sys; from csa_ops.native import main; sys.exit(main(sys.argv[1:]))"
    return [sys.executable, "-c", code, "build", "--cache-dir", str(path.parent.parent)]


def _child_environment() -> dict:
    """The builder imports this very package (its directory first on the path: ``-c`` would
    put the working directory there) and finds the ninja that torch's extension builder
    runs, also from a virtual environment that is not activated."""
    package_root = str(pathlib.Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    with contextlib.suppress(ImportError):
        import ninja

        env["PATH"] = os.pathsep.join(filter(None, [ninja.BIN_DIR, env.get("PATH")]))
    return {"env": env, "cwd": package_root}


def build(root: pathlib.Path | None = None) -> pathlib.Path:
    """Build the library into the cache under ``root`` now (in a child process, which also
    checks that it loads) and return its path; a valid existing library is kept."""
    path = library_path(root)
    if path.exists():
        return path
    subprocess.run(_build_command(path), check=True, capture_output=True, text=True,
                   **_child_environment())
    return path


def _build_here(root: pathlib.Path) -> pathlib.Path:
    """The build itself (``python -m csa_ops.native build``): compile in a private
    directory, import the result, then publish it by atomic rename. A failure leaves
    ``.failed`` beside the library's path, which stops background builds (see
    _start_background_build); a success removes it."""
    from torch.utils import cpp_extension

    path = library_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_builds(path.parent)
    includes, ldflags = _tvm_ffi_build_paths()
    try:
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".build-") as tmp:
            cpp_extension.load(name=MODULE, sources=[str(SOURCE)], build_directory=tmp,
                               extra_cflags=list(_CFLAGS), extra_include_paths=includes,
                               extra_ldflags=ldflags, is_python_module=True, verbose=False)
            staged = pathlib.Path(tmp) / f"{MODULE}.publish"
            shutil.copyfile(pathlib.Path(tmp) / f"{MODULE}.so", staged)
            os.chmod(staged, 0o755)
            os.replace(staged, path)
    except BaseException as error:
        with contextlib.suppress(OSError):
            path.with_suffix(".failed").write_text(f"{type(error).__name__}: {error}\n")
        raise
    finally:
        with contextlib.suppress(OSError):
            path.with_suffix(".building").unlink()
    with contextlib.suppress(OSError):
        path.with_suffix(".failed").unlink()
    return path


def _remove_dead_builds(directory: pathlib.Path) -> None:
    """Private build directories a killed build left behind."""
    for stale in directory.glob(".build-*"):
        with contextlib.suppress(OSError):
            if time.time() - stale.stat().st_mtime >= _BUILD_PATIENCE_S:
                shutil.rmtree(stale)


def prepared_call(spec):
    """The C++ prepared call of a CallSpec (csa_ops.launch_description), or None where the
    native path does not run (see the module docstring)."""
    try:
        import tvm_ffi
    except ImportError:
        return None
    if not all(isinstance(launch.kernel, tvm_ffi.Function) for launch in spec.launches):
        return None  # a kernel compiled in memory for the DSL's own call
    native = module()
    if native is None:
        return None
    sources = {"input": native.INPUT, "output": native.OUTPUT,
               "workspace": native.WORKSPACE, "constant": native.CONSTANT}
    inputs, out_names = list(spec.inputs), list(spec.outputs)
    layout = spec.slots()

    def slots(constants):
        return [(sources[source], inputs.index(name) if source == "input" else
                 out_names.index(name) if source == "output" else
                 0 if source == "workspace" else int(constants[name]))
                for source, name in layout]

    aligned = spec.alignments()
    # The C++ object holds its own references to the functions.
    return native.PreparedCall(
        [(launch.kernel.__chandle__(), slots(launch.constants)) for launch in spec.launches],
        [aligned.get(name, 0) for name in inputs],
        [inputs.index(name) for name in spec.in_place],
        [inputs.index(name) for name in spec.to_float],
        [(inputs.index(like), None if shape is None else list(shape))
         for like, shape in spec.outputs.values()],
        [(out_names.index(o), inputs.index(i)) for o, i in spec.restore],
        spec.workspace, inputs.index(spec.live) if spec.live else -1)


def is_prepared_call(call: Any) -> bool:
    """Whether `call` is a C++ prepared call (the native module is loaded where one exists)."""
    return loaded() and isinstance(call, STATE.native_module.PreparedCall)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m csa_ops.native",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("build", "status"))
    parser.add_argument("--cache-dir", type=pathlib.Path, default=None,
                        help="cache root (default: the kernel cache directory)")
    args = parser.parse_args(argv)
    root = kernel_cache.directory() if args.cache_dir is None else args.cache_dir
    if args.command == "build":
        print(_build_here(root))
        return 0
    path = library_path(root)
    print(f"{path}: {'present' if path.exists() else 'absent'}; enabled: {enabled()}")
    if path.exists():
        _import(path)
        print("loads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
