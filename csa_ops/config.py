"""Launch configuration of the compressor kernels: the frozen compile key and its heuristics.

A `KernelKey` names everything that changes generated code (family, ratio, coff, head_dim,
dtype, target arch) plus the launch knobs a family reads (vector width, CTA size, extras).
Keys are pure data: the same key always compiles to the same kernel on any machine.
"""

from __future__ import annotations

import dataclasses

DTYPES = ("bfloat16", "float16", "float32")
ARCHS = ("sm_90a", "sm_100a")
ELEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# Largest window (coff * ratio) the register-window family keeps in registers; larger
# windows go to the streaming family.
WINDOW_MAX = 32
# Up to this head_dim and window the window family favours threads over vector width (see
# window_key); measured at window 8, wider windows keep the register-lean default.
NARROW_HEAD_DIM = 128
NARROW_WINDOW_MAX = 8


@dataclasses.dataclass(frozen=True)
class KernelKey:
    """Compile key. `vec` elements per thread access, `threads` per CTA, `knobs` extras."""

    family: str
    ratio: int
    coff: int
    head_dim: int
    dtype: str
    arch: str
    vec: int = 1
    threads: int = 128
    knobs: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"KernelKey.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.arch not in ARCHS:
            raise ValueError(f"KernelKey.arch must be one of {ARCHS}, got {self.arch!r}")
        if self.ratio < 1 or self.coff not in (1, 2) or self.head_dim < 1:
            raise ValueError(
                f"KernelKey needs ratio >= 1, coff in (1, 2), head_dim >= 1; got ratio="
                f"{self.ratio}, coff={self.coff}, head_dim={self.head_dim}"
            )
        if self.head_dim % self.vec or self.vec < 1:
            raise ValueError(f"KernelKey.vec={self.vec} must divide head_dim={self.head_dim}")

    @property
    def window(self) -> int:
        return self.coff * self.ratio

    @property
    def elem_bytes(self) -> int:
        return ELEM_BYTES[self.dtype]

    @property
    def align_bytes(self) -> int:
        """Base-pointer alignment the kernel assumes for kv/score/out/grad tensors."""
        return self.vec * self.elem_bytes

    def knob(self, name: str, default: int) -> int:
        return dict(self.knobs).get(name, default)


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """Per-call launch shape: CTAs in the grid and fp32 scratch elements the launch needs."""

    grid: int
    workspace: int = 0


def widest_vec(head_dim: int, elem_bytes: int, max_elems: int) -> int:
    """Largest power of two dividing head_dim, at most 16 bytes and at most max_elems."""
    vec = 1
    while (
        head_dim % (vec * 2) == 0 and (vec * 2) * elem_bytes <= 16 and vec * 2 <= max_elems
    ):
        vec *= 2
    return vec


def window_key(
    ratio: int, coff: int, head_dim: int, dtype: str, arch: str, backward: bool
) -> KernelKey:
    """Heuristic key for the register-window family.

    A thread holds window * vec elements of kv and of score in registers (at most 64 each,
    and the backward's grad_ape partials in shared memory also scale with it), so wide
    windows trade vector width for registers.
    """
    key = _window_shape(ratio, coff, head_dim, dtype, arch, backward)
    return dataclasses.replace(key, knobs=_window_knobs(coff * ratio, head_dim, dtype,
                                                        backward))


def _window_knobs(
    window: int, head_dim: int, dtype: str, backward: bool
) -> tuple[tuple[str, int], ...]:
    if backward:
        # Wide rows: the 2-D grid (column chunk slowest) beat the 1-D one in three H200
        # runs at d512 (3x8192 r4 c2 63.0 against 65.6 us, 1x65536 160.5 against 163.0,
        # 1x8192 24.0 against 25.0); at d128 the 1-D grid won (1x8192 9.9 against 10.2).
        return (("linear", 0),) if head_dim > NARROW_HEAD_DIM else ()
    # The bf16 forward takes the certified fast softmax (kernels/window.py, _output_fast):
    # within one output rounding step, as SPEC 3 allows (H200: 3x8192 d512 r4 c2 30.7
    # against 34.9 us, 142 of 3.1M elements one step off). fp16's 8x finer step would send
    # 8x more columns to the exact fallback, and fp32 has no slack: both stay exact. Short
    # windows over narrow rows are latency-bound, and there the certificate's longer chain
    # costs more than the exact softmax (r4 c1 1x8192 d128: 3.27 against 3.0 us).
    fast = dtype == "bfloat16" and not (window <= 4 and head_dim <= NARROW_HEAD_DIM)
    return (("fast_exp", 1),) if fast else ()


def _window_shape(
    ratio: int, coff: int, head_dim: int, dtype: str, arch: str, backward: bool
) -> KernelKey:
    vec = widest_vec(head_dim, ELEM_BYTES[dtype], max(1, 64 // (coff * ratio)))
    if backward and head_dim > NARROW_HEAD_DIM and coff * ratio <= 4:
        # Windows of 4 leave room for 16-byte accesses (H200, r2 c2 3x8192 d512 bwd sweep:
        # vec 8 / 128 threads 68.4 us, vec 4 / 128 77.0, vec 2 / 256 79.0).
        return KernelKey("window", ratio, coff, head_dim, dtype, arch, vec=vec, threads=128)
    if coff * ratio <= NARROW_WINDOW_MAX and (backward or head_dim <= NARROW_HEAD_DIM):
        # The kernels are latency-bound: trade vector width for threads (and registers for
        # occupancy). H200 sweeps, r4 c2 bf16, every key checked against the reference:
        # 1x8192 d128: vec 8 / 128 threads 12.5 us fwd, 18.5 us bwd; vec 2 / 256: 6.7, 12.5.
        # 3x8192 d512 bwd: vec 8 / 128 87.3 us, vec 4 / 128 65.0, vec 2 / 256 63.8.
        return KernelKey("window", ratio, coff, head_dim, dtype, arch, vec=min(vec, 2),
                         threads=256)
    if coff * ratio <= NARROW_WINDOW_MAX:
        # 3x8192 d512 fwd: vec 8 / 128 threads 39.0 us, vec 4 / 128 36.3, vec 2 / 256 39.0.
        return KernelKey("window", ratio, coff, head_dim, dtype, arch, vec=min(vec, 4),
                         threads=128)
    return KernelKey("window", ratio, coff, head_dim, dtype, arch, vec=vec, threads=128)


def enumerate_window_keys(
    ratio: int, coff: int, head_dim: int, dtype: str, arch: str, backward: bool
):
    """All register-window keys worth timing for one problem (autotuning enumerator)."""
    vmax = widest_vec(head_dim, ELEM_BYTES[dtype], max(1, 64 // (coff * ratio)))
    for vec in (v for v in (1, 2, 4, 8, 16) if v <= vmax):
        for threads in (64, 128, 256):
            key = KernelKey("window", ratio, coff, head_dim, dtype, arch, vec=vec,
                            threads=threads,
                            knobs=_window_knobs(coff * ratio, head_dim, dtype, backward))
            yield key
            if backward and threads == 128:
                yield dataclasses.replace(key, knobs=(*key.knobs, ("min_ctas", 3)))
