"""The cache formats' element encodings on the device, bit for bit those of
csa_ops.reference_epilogue: e4m3 (saturating, round to nearest even, by the hardware
conversion), e2m1 codes, UE8M0 exponents and powers of two from the bits, and the absolute
value as a bit operation (no NaN-dropping compare)."""

from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, Int64, Uint8, Uint32, cute

from ...cache_formats import FP4_MAX, FP8_MAX
from . import common as cm

MAGNITUDE, INF_BITS = 0x7FFFFFFF, 0x7F800000
_ROUND_INTEGER = 2.0**23  # y + 2**23 - 2**23 rounds 0 <= y < 2**22 to an integer, half even


@cute.jit
def abs_bits(x: Float32) -> Float32:
    return (x.bitcast(Uint32) & Uint32(MAGNITUDE)).bitcast(Float32)


@cute.jit
def scale_exponent(magnitude_bits: Uint32, top_exponent: int, top_mantissa: int) -> Int32:
    """ceil(log2(x / top)) of the quotient rounded to fp32, from the bits of a positive
    normal x: no division (cache_formats.top_parts has the rule and why it is exact)."""
    exponent = Int32(magnitude_bits >> 23) - (127 + top_exponent)
    if (magnitude_bits & Uint32(0x7FFFFF)) > Uint32(top_mantissa):
        exponent = exponent + 1
    return exponent


@cute.jit
def pow2(exponent: Int32) -> Float32:
    """2**exponent for a normal result, built from the bits (exact)."""
    return (Uint32(exponent + 127) << 23).bitcast(Float32)


@cute.jit
def round_integer(y: Float32) -> Float32:
    return cm.sub_rn(cm.add_rn(y, Float32(_ROUND_INTEGER)), Float32(_ROUND_INTEGER))


@cute.jit
def store_byte(base: cute.Pointer, offset: Int64, value: Uint8):
    cute.make_tensor(base + offset, 1)[0] = value


@cute.jit
def e2m1(x: Float32) -> Int32:
    """The e2m1 code (0..15) of a finite value: magnitude clamped to 6, rounded half even
    onto {0, 0.5, 1, 1.5, 2, 3, 4, 6}; bit 3 is x's sign."""
    m = cute.arch.fmin(abs_bits(x), Float32(FP4_MAX))
    code = Float32(0.0)
    if m < Float32(2.0):
        code = round_integer(cm.mul_rn(m, Float32(2.0)))
    elif m < Float32(4.0):
        code = cm.add_rn(round_integer(m), Float32(2.0))
    else:
        code = cm.add_rn(round_integer(cm.mul_rn(m, Float32(0.5))), Float32(4.0))
    return Int32(code) | Int32((x.bitcast(Uint32) >> 31) << 3)


@cute.jit
def e4m3(x: Float32) -> Uint8:
    """The e4m3fn byte of a finite value clamped to +-448, rounded to nearest even."""
    clamped = cute.arch.fmax(cute.arch.fmin(x, Float32(FP8_MAX)), Float32(-FP8_MAX))
    return cutlass.Float8E4M3FN(clamped).bitcast(Uint8)
