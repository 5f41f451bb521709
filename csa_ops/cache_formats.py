"""The serving cache formats' facts, one statement for the torch encoders
(csa_ops.reference_epilogue) and the row-epilogue kernels (csa_ops/kernels/epilogue/).
Neither torch nor the DSL is imported here. docs/epilogue.md has the byte layouts."""

from __future__ import annotations

import math

FORMATS = ("none", "fp8_ds_mla", "fp8_block128", "mxfp4")
FP8_MAX = 448.0  # e4m3fn's largest finite value
FP4_MAX = 6.0  # e2m1's
E4M3_NAN, UE8M0_NAN = 0x7F, 0xFF
# Columns of a scale block, by format (fp8_ds_mla: of its quantized columns).
BLOCK_COLUMNS = {"fp8_ds_mla": 64, "fp8_block128": 128, "mxfp4": 32}
# Power-of-two scales 2**ceil(log2(max(amax, floor) / top)): the floor and the top by format.
SCALE_FLOOR = {"fp8_ds_mla": 1e-4, "mxfp4": FP4_MAX * 2.0**-126}
SCALE_TOP = {"fp8_ds_mla": FP8_MAX, "mxfp4": FP4_MAX}
# fp8_ds_mla (the FlashMLA page): 448 e4m3 columns, then the 64 RoPE columns as bf16; per
# page its rows, then each row's 7 UE8M0 bytes and one zero byte.
DS_MLA_HEAD_DIM, DS_MLA_ROPE_DIM = 512, 64
DS_MLA_FP8_DIM = DS_MLA_HEAD_DIM - DS_MLA_ROPE_DIM  # 448 columns in 7 blocks of 64
DS_MLA_ROW_BYTES = DS_MLA_FP8_DIM + 2 * DS_MLA_ROPE_DIM  # 576
DS_MLA_SCALE_BYTES = 8


def row_bytes(cache_format: str, head_dim: int) -> int:
    """Bytes of one cache row of fp8_block128 (codes, then an fp32 scale per 128 columns)
    or mxfp4 (packed pairs, then a UE8M0 scale per 32 columns)."""
    if cache_format == "fp8_block128":
        return head_dim + 4 * (head_dim // BLOCK_COLUMNS["fp8_block128"])
    return head_dim // 2 + head_dim // BLOCK_COLUMNS["mxfp4"]


def top_parts(top: float) -> tuple[int, int]:
    """(t, g) of a scale top written 2**t * (1 + g / 2**23): what an exponent
    ceil(log2(x / top)) of an fp32 x = 2**E * (1 + m / 2**23) needs, E - t, plus one where
    m > g. That is the exponent of the quotient rounded to fp32 too, since no fp32 value lies
    strictly between top * 2**e and top * 2**e * (1 + 2**-24), the largest quotient that
    still rounds to 2**e (checked against the division for every positive fp32 x)."""
    mantissa, exponent = math.frexp(top)  # top = mantissa * 2**exponent, mantissa in [0.5, 1)
    return exponent - 1, int((2 * mantissa - 1) * 2**23)
