"""The fast softmax column's certificate (csa_ops/kernels/shared/certificate.py), checked on
the CPU against an emulation of the register-window forward's two paths.

The fast path is emulated operation by operation as the kernel runs it, with ex2.approx's
error taken at its documented worst case (a relative 2**-21, either sign, per entry) and its
flush of results below 2**-126; the exact path is torch's order (expf, a sequential
denominator, one division and one product per entry, four accumulators). Wherever the
certificate holds, the two outputs must round to the same bf16 value or to neighbours;
columns cancelling across the certificate's threshold exercise both outcomes.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_within_one_step, ulp

from csa_ops.config import TYPES
from csa_ops.kernels.shared import certificate, torch_order
from csa_ops.kernels.shared.softmax import exponent_shift

F32 = torch.float32
F64 = torch.float64
LOG2E_F32 = torch.tensor(certificate.cm.LOG2E, dtype=F32).double()


def _f32(x: torch.Tensor) -> torch.Tensor:
    """Round an fp64 value to fp32 (an fp32 operation computed exactly in fp64 first)."""
    return x.to(F32).double()


def _fast_column(logits, values, shift, gen):
    """(sum(e v), sum(e|v|), sum|v|, out) of the fast path, entries in order."""
    m = logits.max(dim=1).values
    m_scaled = _f32(m * LOG2E_F32 + shift)
    rows = logits.shape[0]
    s = acc = mag = vsum = torch.zeros(rows, dtype=F64)
    for k in range(logits.shape[1]):
        x = _f32(logits[:, k] * LOG2E_F32 - m_scaled)  # the pinned FMA
        sign = torch.where(torch.rand(rows, generator=gen, dtype=F64) < 0.5, -1.0, 1.0)
        e = _f32(torch.exp2(x) * (1 + sign * 2.0**-21))
        e = torch.where(e < 2.0**-126, 0.0, e)  # ex2.approx.ftz
        v = values[:, k]
        s = _f32(s + e)
        acc = _f32(acc + e * v)  # contracted or not: the FMA is the tighter one
        mag = _f32(mag + e * v.abs())
        vsum = _f32(vsum + v.abs())
    return acc, mag, vsum, _f32(acc / s)


def _exact_column(logits, values):
    """torch's order: p_k = expf(l_k - m) / sum, then four accumulators of RN(p_k v_k)."""
    m = logits.max(dim=1).values
    e = torch.exp(_f32(logits - m[:, None]).to(F32)).double()
    s = e[:, 0]
    for k in range(1, e.shape[1]):
        s = _f32(s + e[:, k])
    p = _f32(e / s[:, None])
    acc = [torch.zeros_like(s) for _ in range(torch_order.ACCUMULATORS)]
    for k in range(e.shape[1]):
        a = k % torch_order.ACCUMULATORS
        acc[a] = _f32(acc[a] + _f32(p[:, k] * values[:, k]))
    total = acc[0]
    for a in acc[1:]:
        total = _f32(total + a)
    return total


def _cancelling_columns(rows, window, logit_range, gen):
    """(logits, bf16 values, degree): each column's entry of the largest logit gets the
    value that makes |out| / sum(p|v|) the degree, log-uniform in [1e-5, 1], before its
    rounding to bf16 like every other value."""
    logits = _f32(-logit_range * torch.rand(rows, window, generator=gen, dtype=F64))
    values = torch.randn(rows, window, generator=gen, dtype=F64).to(torch.bfloat16).double()
    p = torch.softmax(logits, dim=1)
    top = p.argmax(dim=1, keepdim=True)
    others = torch.ones_like(p).scatter_(1, top, 0.0)
    partial = (others * p * values).sum(1)
    mag = (others * p * values.abs()).sum(1)
    degree = 10.0 ** (-5 + 5 * torch.rand(rows, generator=gen, dtype=F64))
    chosen = (degree * mag - partial) / p.gather(1, top)[:, 0]
    values.scatter_(1, top, chosen.to(torch.bfloat16).double()[:, None])
    return logits, values, degree


@pytest.mark.parametrize("window", (2, 4, 8, 16, 32))
@pytest.mark.parametrize("logit_range", (1.0, 30.0))
def test_certified_columns_round_within_one_step(window, logit_range):
    gen = torch.Generator().manual_seed(window * 100 + int(logit_range))
    shift = exponent_shift(window)
    cert = certificate.Certificate.for_column(
        window, shift, window, torch_order.sum_depth(window, 128),
        TYPES["bfloat16"].precision)
    logits, values, degree = _cancelling_columns(200_000, window, logit_range, gen)
    acc, mag, vsum, fast = _fast_column(logits, values, shift, gen)
    exact = _exact_column(logits, values)
    bound = _f32(_f32(cert.magnitude * mag) + _f32(cert.values * vsum))
    holds = bound < _f32(acc.abs() * cert.keep)
    fast, exact = fast.to(torch.bfloat16), exact.to(torch.bfloat16)
    assert_within_one_step(fast[holds], exact[holds], f"certified columns, window {window}")
    # Not vacuous: the test reaches certified columns a step apart, uncertified ones further
    # apart and, over narrow logit ranges, certifies columns that barely cancel. (Over wide
    # ones a column whose weight sits on few entries fails more often: its sum(|v|) term
    # counts every value.)
    beyond = (fast.double() - exact.double()).abs() > ulp(
        torch.maximum(fast.double().abs(), exact.double().abs()), torch.bfloat16)
    assert bool(beyond.any()) or window <= 4
    assert bool((fast != exact)[holds].any())
    if logit_range <= 1:
        assert holds[degree > 0.1].double().mean() > 0.999


def test_certificate_is_for_16_bit_outputs():
    with pytest.raises(AssertionError, match="16-bit"):
        certificate.Certificate.for_column(8, 3, 8, 5, 24)
