"""Row-epilogue kernels, host side: the compile key and the CTA shape. Pure Python, no DSL.

A CTA owns one pooled row of ``head_dim`` columns. Its ``threads`` threads hold ``vec``
columns each, in two layouts: strided (thread t: columns t, t + threads, ...) while the row
is normalized, turned and rotated, because there the pairwise tree of the mean and the
butterflies of the rotation pair column j with j + w/2 (first inside a thread, then across
threads by shuffles); contiguous (thread t: columns [t * vec, (t + 1) * vec)) while it is
encoded, because there a scale block of 32, 64 or 128 columns is a few neighbouring lanes.
"""

from __future__ import annotations

import dataclasses
import math

from ...cache_formats import BLOCK_COLUMNS, DS_MLA_HEAD_DIM, DS_MLA_ROPE_DIM, FORMATS, row_bytes
from ...config import ARCHS, DTYPES, TYPES

WEIGHT_DTYPES = ("float32", "bfloat16", "float16")
MAX_THREADS = 128  # per CTA (one row); wider rows give each thread more columns
MIN_VEC = 4  # columns per thread at least: a 4-byte store of e4m3 codes, 2 bytes of e2m1
# Rows stored in their dtype (format "none") have no codes to store, so a row that MIN_VEC
# columns a thread leaves to one warp takes two at 2 columns a thread: its kernels fused with
# the pooling are latency-bound there. H100, bf16 r4 c2 1x8192 d128 RoPE 64, CUDA-graph
# replay: the fused training forward 6.64 against 7.61 us at one warp, forward+backward 24.8
# against 31.4 with one warp and the backward staged.
MIN_WARPS_UNENCODED = 2


@dataclasses.dataclass(frozen=True)
class EpilogueKey:
    """What changes a row-epilogue kernel's code: the rows' and the norm weight's dtypes,
    head_dim, the RoPE columns, the rotation, the cache format, eps (folded in as an fp32
    constant: a model has one), the target arch and programmatic dependent launch."""

    dtype: str
    weight_dtype: str
    head_dim: int
    rope_dim: int
    rotate: bool
    cache_format: str
    eps: float
    arch: str
    pdl: bool = True
    # The training kernel only: positions get csa::compressor_epilogue's position_offset.
    position_offset: bool = False

    family = "epilogue"  # the kernel package (kernels.families.KERNELS)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES or self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"EpilogueKey: dtype must be one of {DTYPES} and weight_dtype "
                             f"one of {WEIGHT_DTYPES}, got {self.dtype!r}, "
                             f"{self.weight_dtype!r}")
        if self.arch not in ARCHS or self.cache_format not in FORMATS:
            raise ValueError(f"EpilogueKey: arch must be one of {ARCHS} and cache_format one "
                             f"of {FORMATS}, got {self.arch!r}, {self.cache_format!r}")
        if not (math.isfinite(self.eps) and self.eps >= 0):
            raise ValueError(f"EpilogueKey.eps must be finite and >= 0, got {self.eps!r}")

    @property
    def threads(self) -> int:
        threads = min(MAX_THREADS, self.head_dim // MIN_VEC)
        if self.cache_format == "none" and self.head_dim // 2 >= 32 * MIN_WARPS_UNENCODED:
            threads = max(threads, 32 * MIN_WARPS_UNENCODED)
        return threads

    @property
    def vec(self) -> int:
        return self.head_dim // self.threads

    @property
    def elem_bytes(self) -> int:
        return TYPES[self.dtype].bytes

    @property
    def align_bytes(self) -> int:
        """Base alignment assumed of the rows (and of a "none" cache): whole rows of vec."""
        return self.vec * self.elem_bytes

    @property
    def cache_dtype(self) -> str:
        return self.dtype if self.cache_format == "none" else "uint8"


def configure(dtype: str, weight_dtype: str, head_dim: int, rope_dim: int, rotate: bool,
              cache_format: str, eps: float, arch: str,
              position_offset: bool = False) -> EpilogueKey:
    """The key of a call's epilogue (the training kernel's: cache_format "none")."""
    return EpilogueKey(dtype, weight_dtype, head_dim, rope_dim, bool(rotate), cache_format,
                       float(eps), arch, position_offset=bool(position_offset))


def supports(key: EpilogueKey) -> bool:
    """Power-of-two rows of 16 to 4096 columns (the mean's tree needs no padding then), RoPE
    on whole column pairs, and what each format needs (the op checks the same)."""
    d = key.head_dim
    if d < 16 or d > 4096 or d & (d - 1) or key.rope_dim % 2 or not 0 <= key.rope_dim <= d:
        return False
    if key.cache_format == "fp8_ds_mla":
        return d == DS_MLA_HEAD_DIM and key.rope_dim == DS_MLA_ROPE_DIM
    block = BLOCK_COLUMNS.get(key.cache_format)
    if block is None:
        return True
    # A block is whole lanes of one warp in the contiguous layout, and every row starts
    # where the thread's widest store (its codes) is aligned.
    code_bytes = key.vec // 2 if key.cache_format == "mxfp4" else key.vec
    return (d % block == 0 and block % key.vec == 0 and block // key.vec <= 32
            and row_bytes(key.cache_format, d) % code_bytes == 0)
