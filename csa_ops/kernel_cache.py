"""Persistent on-disk cache of exported kernels: compiled once per machine, not per process.

An entry is the DSL's TVM-FFI export of one compiled kernel, linked into a shared library
(``<name>.<digest>.so``), plus a manifest (``<name>.json``) naming everything that changes the
binary (the identity) and the library's SHA-256. The manifest is written last, both by
atomic rename, so a reader sees a whole entry or none. A per-entry file lock makes
concurrent processes (eight ranks starting at once) compile each kernel at most once. An
entry whose manifest is unreadable, names another identity, or whose library fails its
hash or its load is discarded with a warning and rebuilt.

Location: ``$CSA_OPS_CACHE_DIR``, else ``$XDG_CACHE_HOME/csa-ops`` (``~/.cache/csa-ops``).
``CSA_OPS_CACHE=0`` turns the cache off. Loading needs neither the DSL nor a C compiler;
storing links with ``$CC`` (or ``cc``/``gcc``) and, where none is found, keeps the object
file, which only the DSL can load.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import importlib.util
import json
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from .state import STATE

ENABLE_ENV = "CSA_OPS_CACHE"
DIR_ENV = "CSA_OPS_CACHE_DIR"
FORMAT = 1  # bump when the entry layout changes
_EXPORTED_NAME = "csa_kernel"


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1") not in ("0", "", "false", "off")


def directory() -> pathlib.Path:
    configured = os.environ.get(DIR_ENV)
    if configured:
        return pathlib.Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "csa-ops"


def _version(distribution: str) -> str:
    # importlib.metadata costs tens of milliseconds to import: only a miss asks for it.
    versions = STATE.versions
    if distribution not in versions:
        import importlib.metadata

        try:
            versions[distribution] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            versions[distribution] = "absent"
    return versions[distribution]


def source_digest(root: pathlib.Path | None = None) -> str:
    """SHA-256 of the sources that generate kernels: every module of the kernel packages and
    the key/knob definitions (config.py), whose every line can change a binary; the argument
    table (launch_description.py) is covered by the identity's signature instead. ``root``
    (a package directory) is for tests; the package's own digest is computed once per
    process."""
    if root is None and STATE.source_digest is not None:
        return STATE.source_digest
    base = pathlib.Path(__file__).resolve().parent if root is None else root
    digest = hashlib.sha256()
    for path in sorted([base / "config.py", *(base / "kernels").rglob("*.py")]):
        digest.update(path.relative_to(base).as_posix().encode())
        digest.update(path.read_bytes())
    if root is None:
        STATE.source_digest = digest.hexdigest()
    return digest.hexdigest()


def identity(kernel: str, signature: tuple) -> dict[str, str]:
    """Everything that changes a cached binary. ``kernel`` is the direction plus the full
    kernel key (its arch included); ``signature`` the launch argument slots."""
    return {
        "format": str(FORMAT),
        "package": _version("csa-ops"),
        "dsl": _version("nvidia-cutlass-dsl"),
        "tvm_ffi": _version("apache-tvm-ffi"),
        "machine": platform.machine(),
        "sources": source_digest(),
        "kernel": kernel,
        "signature": repr(signature),
    }


def entry_name(ident: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:40]


# ---------------------------------------------------------------------------------------
# Loading


def _preload_runtime() -> None:
    """Make the DSL runtime's symbols global before dlopen of an entry, which leaves them
    undefined (they are the DSL's CUDA-library loaders). Found on disk, so a load does not
    import the DSL; a layout we do not recognise, or several CUDA variants side by side,
    falls back to the DSL's own lookup."""
    if STATE.runtime_loaded:
        return
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    roots = list(spec.submodule_search_locations or []) if spec else []
    found = [p for root in roots for p in sorted(pathlib.Path(root).glob("*/lib/"
                                                                       "libcute_dsl_runtime.so"))]
    if len(found) != 1:
        from cutlass.cute.runtime import find_runtime_libraries

        found = [pathlib.Path(p) for p in find_runtime_libraries(enable_tvm_ffi=False)]
    for path in found[:1]:
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    STATE.runtime_loaded = True


def preload() -> None:
    """tvm_ffi and the DSL runtime library, what every load of a linked entry needs."""
    import tvm_ffi  # noqa: F401

    _preload_runtime()


def _load_library(path: pathlib.Path) -> Callable[..., Any]:
    if path.suffix == ".so":
        import tvm_ffi

        preload()
        return tvm_ffi.load_module(str(path))[_EXPORTED_NAME]
    from cutlass.cute.runtime import load_module

    return getattr(load_module(str(path), enable_tvm_ffi=True), _EXPORTED_NAME)


def _file_digest(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Rejected(Exception):
    """An entry that exists but must not be loaded (the message says why)."""


def _checked_library(root: pathlib.Path, name: str, ident: dict[str, str]):
    """The entry's library path after the manifest and hash checks, None when there is no
    entry; raises Rejected for a bad one."""
    manifest = root / f"{name}.json"
    if not manifest.exists():
        return None
    try:
        meta = json.loads(manifest.read_text())
        library = root / meta["library"]
        if meta.get("identity") != ident:
            raise Rejected("built for another configuration or version")
        if pathlib.Path(meta["library"]).name != meta["library"] or not library.exists():
            raise Rejected("library missing")
        if _file_digest(library) != meta.get("sha256"):
            raise Rejected("library does not match its recorded SHA-256 (truncated or corrupt)")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise Rejected(f"unreadable manifest ({error})") from error
    return library


def _read_entry(root: pathlib.Path, name: str, ident: dict[str, str]):
    """The loaded kernel, None when absent; raises Rejected for a bad entry."""
    library = _checked_library(root, name, ident)
    if library is None:
        return None
    try:
        return _load_library(library)
    except Exception as error:
        raise Rejected(f"load failed ({error})") from error


def _discard(root: pathlib.Path, name: str) -> None:
    for path in [root / f"{name}.json", *root.glob(f"{name}.*.so"), *root.glob(f"{name}.*.o")]:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


# ---------------------------------------------------------------------------------------
# Storing


def _linker() -> str | None:
    for candidate in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def _atomic_write(path: pathlib.Path, write: Callable[[pathlib.Path], None]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp_path = pathlib.Path(tmp)
    try:
        write(tmp_path)
        with open(tmp_path, "rb+") as handle:
            os.fsync(handle.fileno())
        os.chmod(tmp_path, 0o644)  # mkstemp's 0600 would hide a shared cache from other users
        os.replace(tmp_path, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()


def _export(compiled: Any, root: pathlib.Path, name: str) -> pathlib.Path:
    """Export ``compiled`` as ``<name>.<digest>.so`` (``.o`` without a linker). The digest
    in the name keeps a rebuilt library from reusing the path of one this process already
    loaded (the dynamic loader would hand back the old one)."""
    with tempfile.TemporaryDirectory(dir=root, prefix=".export-") as tmp:
        obj = pathlib.Path(tmp) / "kernel.o"
        compiled.export_to_c(str(obj), function_name=_EXPORTED_NAME)
        built = obj
        linker = _linker()
        if linker is not None:
            built = pathlib.Path(tmp) / "kernel.so"
            subprocess.run([linker, "-shared", "-o", str(built), str(obj)], check=True,
                           capture_output=True)
        target = root / f"{name}.{_file_digest(built)[:16]}{built.suffix}"
        _atomic_write(target, lambda p: shutil.copyfile(built, p))
        return target


def _store(compiled: Any, root: pathlib.Path, name: str, ident: dict[str, str]) -> None:
    library = _export(compiled, root, name)
    manifest = {"identity": ident, "library": library.name, "sha256": _file_digest(library)}
    _atomic_write(root / f"{name}.json",
                  lambda p: p.write_text(json.dumps(manifest, indent=1, sort_keys=True)))


@contextlib.contextmanager
def _locked(root: pathlib.Path, name: str) -> Iterator[None]:
    with open(root / f"{name}.lock", "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)  # blocks while another process compiles
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def get_or_build(ident: dict[str, str], build: Callable[[], Any], *,
                 root: pathlib.Path | None = None, load: bool = True) -> tuple[Any, bool]:
    """(kernel, built): the cached kernel when a valid entry exists, else ``build()``'s
    export, stored for the next process and loaded from there. ``build`` may return a
    kernel compiled for export only (no in-process engine). kernel is None when the entry
    could not be written or loaded (the caller compiles in memory), and always with
    ``load=False`` (cross-compiling: only makes sure the entry exists)."""
    root = directory() if root is None else root
    root.mkdir(parents=True, exist_ok=True)
    name = entry_name(ident)
    with _locked(root, name):
        try:
            if load:
                kernel = _read_entry(root, name, ident)
                if kernel is not None:
                    return kernel, False
            elif _checked_library(root, name, ident) is not None:
                return None, False
        except Rejected as why:
            warnings.warn(f"csa_ops: discarding kernel cache entry {root / name} ({why}); "
                          f"rebuilding it", RuntimeWarning, stacklevel=3)
            _discard(root, name)
        try:
            _store(build(), root, name, ident)
        except (OSError, subprocess.CalledProcessError) as error:
            warnings.warn(f"csa_ops: could not write kernel cache entry {root / name} "
                          f"({error}); the kernel runs from memory", RuntimeWarning,
                          stacklevel=3)
            return None, True
        if not load:
            return None, True
        # The stored library: the bare TVM-FFI function (the DSL's in-process wrapper
        # re-converts pointer arguments in Python per call), the binary later processes load.
        try:
            return _read_entry(root, name, ident), True
        except Rejected as why:
            warnings.warn(f"csa_ops: kernel cache entry {root / name} failed to load ({why}); "
                          f"the kernel runs from memory", RuntimeWarning, stacklevel=3)
            return None, True
