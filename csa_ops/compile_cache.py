"""Compiled kernels by (direction, key): from memory, else the persistent disk cache
(csa_ops.kernel_cache), else a compile. Compiles are pure functions of the key, so
`arch="sm_100a"` cross-compiles on a machine without that GPU (or without any GPU); the DSL
is imported only when a kernel must be compiled."""

from __future__ import annotations

import threading
from typing import Any

import torch

from . import kernel_cache
from .config import Direction, KernelKey
from .kernels import families
from .launch_description import launch_signature


def _entry(direction: Direction, key: KernelKey):
    return families.launch_entry(direction, key)


def ptx(direction: Direction, key: KernelKey) -> str:
    """PTX of one direction of ``key`` (numerics audits and hash checks)."""
    from .kernels.shared import entry

    return entry.ptx(_entry(direction, key), key.arch, launch_signature(direction, key))


def compile_kernel(direction: Direction, key: KernelKey, engine: bool = True) -> Any:
    """JIT one direction of ``key`` as a TVM-FFI function; without ``engine`` the result is
    only good for export (the disk cache loads what it exports)."""
    from .kernels.shared import entry

    return entry.compile_entry(_entry(direction, key), key.arch,
                               launch_signature(direction, key), tvm_ffi=True, engine=engine)


def identity(direction: Direction, key: KernelKey) -> dict[str, str]:
    """The disk-cache identity of one compiled kernel (see kernel_cache.identity)."""
    return kernel_cache.identity(f"{direction} {key!r}", launch_signature(direction, key))


class CompileCache:
    """Kernels by (direction, key). One lock for all keys, not one per key: the DSL's
    compiler keeps per-process session state, and two threads compiling different kernels
    at once fail inside it (nvidia-cutlass-dsl 4.8.1: "Please start a session before
    accessing session data")."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[Direction, KernelKey], Any] = {}
        self.hits = self.misses = self.disk_loads = 0

    def get(self, direction: Direction, key: KernelKey) -> Any:
        direction = Direction(direction)
        kernel = self._entries.get((direction, key))
        if kernel is not None:
            self.hits += 1
            return kernel
        with self._lock:
            kernel = self._entries.get((direction, key))
            if kernel is None:
                kernel = self._entries[(direction, key)] = self._build(direction, key)
            else:
                self.hits += 1
        return kernel

    def ready(self, direction: Direction, key: KernelKey) -> bool:
        """Whether get(direction, key) returns a kernel now: one in memory or in the disk
        cache, or one it may compile (no CUDA graph capture is active). Loads it."""
        if (Direction(direction), key) in self._entries:
            return True
        if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            return True
        try:
            self.get(direction, key)
        except RuntimeError:
            return False
        return True

    def _build(self, direction: Direction, key: KernelKey) -> Any:
        kernel = None
        if kernel_cache.enabled():
            # Compiled for export only: the kernel comes back loaded from the cache entry.
            kernel, built = kernel_cache.get_or_build(
                identity(direction, key), lambda: self._compile_now(direction, key, False))
            self.disk_loads += not built
        if kernel is None:  # no cache, or its entry could not be written or loaded
            kernel = self._compile_now(direction, key)
        return kernel

    def _compile_now(self, direction: Direction, key: KernelKey, engine: bool = True) -> Any:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            if key.family == "epilogue":  # both row-epilogue directions (an EpilogueKey)
                entry = ("precompile_store" if direction is Direction.STORE
                         else "precompile_epilogue")
                raise RuntimeError(
                    f"csa_ops: the row-epilogue kernel for {key} is not compiled and a CUDA "
                    f"graph capture is active, where JIT is not allowed. Make a csa_ops."
                    f"{entry}(...) call for its epilogue (or the same call once eagerly) "
                    f"before capturing.")
            if direction in (Direction.EXTEND_STORE, Direction.ROWS_STORE):
                x, e = key.pooling, key.epilogue  # an ExtendStoreKey, a RowsStoreKey
                raise RuntimeError(
                    f"csa_ops: the fused store kernel for {key} is not compiled and a "
                    f"CUDA graph capture is active, where JIT is not allowed. Call csa_ops."
                    f"precompile_store({x.head_dim}, {e.cache_format!r}, {e.rope_dim}, "
                    f"{e.rotate}, {e.eps}, torch.{e.dtype}, torch.{e.weight_dtype}, "
                    f"ratio={x.ratio}, coff={x.coff}) before capturing.")
            if direction in (Direction.FORWARD_EPILOGUE, Direction.BACKWARD_EPILOGUE):
                f, e = key.pooling, key.epilogue  # a ForwardEpilogueKey, BackwardEpilogueKey
                raise RuntimeError(
                    f"csa_ops: the fused training {direction} kernel for {key} is not compiled "
                    f"and a CUDA graph capture is active, where JIT is not allowed. Call "
                    f"csa_ops.precompile_epilogue({f.head_dim}, {e.rope_dim}, {e.rotate}, "
                    f"{e.eps}, torch.{e.dtype}, torch.{e.weight_dtype}, position_offset="
                    f"{e.position_offset}, ratio={f.ratio}, coff={f.coff}) before capturing.")
            # csa::compressor's directions and csa::compressor_extend's kernels each have
            # their own precompile entry.
            entry = "precompile_extend" if direction is Direction.EXTEND else "precompile"
            raise RuntimeError(
                f"csa_ops: the {direction} kernel for {key} is not compiled and a CUDA graph "
                f"capture is active, where JIT is not allowed. Call csa_ops.{entry}("
                f"ratio={key.ratio}, head_dim={key.head_dim}, coff={key.coff}, dtype=torch."
                f"{key.dtype}) (or make the same call once eagerly) before capturing."
            )
        self.misses += 1
        return compile_kernel(direction, key, engine)

    def export(self, direction: Direction, key: KernelKey, root) -> bool:
        """Make sure the disk cache under ``root`` holds this kernel (cross-compiling:
        nothing is loaded); True when it had to be compiled."""
        direction = Direction(direction)
        with self._lock:
            _, built = kernel_cache.get_or_build(
                identity(direction, key), lambda: self._compile_now(direction, key, False),
                root=root, load=False)
        return built

    def info(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "disk_loads": self.disk_loads,
                "size": len(self._entries)}

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = self.disk_loads = 0
