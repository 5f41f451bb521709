"""The certificate of the fast softmax column: when a column pooled through ex2.approx
provably rounds to torch's value or a neighbour of it, the one form both kernel families
test before they keep a fast column.

A fast column computes, over its window's entries k (logit l_k, value v_k, m = max l_k),
    e_k = ex2.approx(RN(l_k * log2(e) - m')),  m' = m * log2(e) + shift,
    out = sum(e_k v_k) / sum(e_k),
and keeps, beside those sums, sum(e_k |v_k|) and sum(|v_k|). The column is certified when
    magnitude * sum(e|v|) + values * sum(|v|) < keep * |sum(e v)|,
which a NaN or an infinity anywhere fails. Host side: the constants, from the fast
path's shape (how deep its sums are) and torch's (how deep its sum is).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
from cutlass import Float32, cute

from . import common as cm

# Below this |l - m| an entry's argument roundings are counted per entry (3 D0 in the
# magnitude coefficient); above it, through the tail bound on p |l - m| (see for_column).
_D0 = 4.0
_U = 2.0**-24  # fp32 unit roundoff


@dataclass(frozen=True)
class Certificate:
    magnitude: float  # on sum(e|v|)
    values: float  # on sum(|v|)
    keep: float  # on |sum(e v)|

    @classmethod
    def for_column(cls, window: int, shift: int, fast_depth: int, torch_depth: int,
                   precision: int) -> Certificate:
        """The constants for a window of `window` entries, e scaled by 2**-shift, fast sums
        with at most `fast_depth` roundings on a path, torch's pooling sum `torch_depth`
        (torch_order.sum_depth), an output type of `precision` significand bits.

        To first order (u = 2**-24) the fast column and torch's lie within
            u (3 sum(p|v||l - m|) + c_S sum(p|v|) + c_O |out|)
        of each other. c_S: per entry, ex2.approx (2**-21) and the rounding of its argument
        (|x| u, x = (l - m) log2(e) - shift) against expf (2 ulp), the division and the
        product (the 14 counts 8 + 4 + 1 and one product; the other product's rounding is
        the first add of a depth below); both sums' depths (each counting its exact first
        add as a rounding). c_O: both denominators' sums (torch's: up to W - 1 roundings),
        the final division and the per-entry errors' weighted mean (sum p|l - m| <= ln W).
        The |l - m| term (the arguments' roundings, both sides) costs no sum of its own:
        entries with |l - m| <= D0 add at most 3 D0 sum(p|v|), the others at most
        3 D0 e**-D0 sum|v| / s (p|l - m| <= e**(l - m) |l - m| / s). ex2.approx.ftz flushes
        e below 2**-126: at most 2**-126 sum|v| on sum(e v). One output step is at least
        2**-p |out| for p significand bits; below it the two cannot round more than one
        step apart. The test asks for half that (2**(p+1)) and 1.25 more for the second
        order: that margin also covers the gradual underflow of products e v below 2**-126
        (at most W**2 2**-150 / s, under the smallest bf16 step)."""
        c_s = 14 + math.log(2) * shift + fast_depth + torch_depth + 3 * _D0
        c_o = window + fast_depth + 16 + 3 * math.log(window) + 0.7 * shift
        scale = 1.25 * 2.0 ** (precision + 1)
        # e is scaled by 2**-shift: the tail's e**(l - m) is 2**shift e.
        keep = 1 - scale * _U * c_o
        assert keep > 0.5, "the certificate is meant for 16-bit outputs"
        return cls(magnitude=scale * _U * c_s,
                   values=scale * (2.0**-126 + 3 * _U * 2.0**-shift * _D0 * math.exp(-_D0)),
                   keep=keep)

    @cute.jit
    def holds(self, total: Float32, magnitude: Float32, values: Float32) -> cutlass.Boolean:
        """The test on a column's sum(e v), sum(e|v|) and sum(|v|)."""
        bound = self.magnitude * magnitude + self.values * values
        return bound < cute.math.absf(total) * self.keep


def scaled_max(m: Float32, shift: int) -> Float32:
    """m' of a column's max m: what every entry's exponent subtracts."""
    return m * cm.LOG2E + shift


@cute.jit
def fast_exp(logit: Float32, m_scaled: Float32) -> Float32:
    """e = ex2.approx(RN(l log2(e) - m')): one pinned rounding, the certificate's (an
    unfused mul would round l log2(e), an error that grows with |l| rather than |l - m|)."""
    return cute.math.exp2(cm.fma_rn(logit, Float32(cm.LOG2E), -m_scaled), fastmath=True)
