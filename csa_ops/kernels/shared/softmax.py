"""The per-column softmax of a register window: the row code that the register-window
family's forward, backward and extend kernels share.

`g` is a kernel's geometry (W window entries, `entries[k][3]` true for entries of block b-1,
V columns per thread, the output dtype, its certificate). A column is given by
logit(k) and value(k), the fp32 logit and value of window entry k; `first` marks a
segment's first block, whose entries of block b-1 are the reference's constants (logit
-inf, value 0). Everything here is traced inline.
"""

from __future__ import annotations

import math

import cutlass
from cutlass import Float32, cute

from . import certificate
from . import common as cm


def exponent_shift(window: int) -> int:
    """e = exp(l - m) is kept scaled by 2**-shift so that sum(e * v) over the window cannot
    overflow before max|v| does (each e <= 2**-shift)."""
    return max(0, math.ceil(math.log2(window)))


def window_logits(g, logit, first):
    """(logits, their max) of one column: logit(k) per entry, -inf for block b-1's entries
    of a first block."""
    logits = []
    for k in range(g.W):
        lk = logit(k)
        if g.entries[k][3]:
            lk = cm.pick(first, Float32(float("-inf")), lk)
        logits.append(lk)
    m = logits[0]
    for k in range(1, g.W):
        m = cm.max_nan(m, logits[k])
    return logits, m


def exact_softmax(g, logits, m, value):
    """(probabilities, values) of one column in the reference's exact operation order."""
    rE = cute.make_rmem_tensor((g.W,), Float32)
    rP = cute.make_rmem_tensor((g.W,), Float32)
    for k in range(g.W):
        rE[k] = cm.exp_accurate(cm.sub_rn(logits[k], m))
    s = rE[0]
    for k in range(1, g.W):
        s = cm.add_rn(s, rE[k])
    cm.divide_into(rE, rP, s, g.W)
    p = [rP[k] for k in range(g.W)]
    v = [value(k) for k in range(g.W)]
    return p, v


def pool_exact(g, p, v):
    """Bit for bit torch's eager (kvg * w).sum(dim=1) on CUDA: RN(p_k * v_k) summed in the
    order of torch's reduction kernel."""
    return cm.torch_sum([cm.mul_rn(p[k], v[k]) for k in range(g.W)])


def pool_fast(g, logits, m, value):
    """(output column, certified): sum(e_k * v_k) / sum(e_k) with e_k by ex2.approx
    (certificate.fast_exp): about half the exact path's instructions (the forward is
    issue-bound at every shape). Certified (g.certificate, shared/certificate.py) means the
    result provably rounds to the exact path's output dtype value or a neighbour of it;
    columns that cancel (|out| far below sum(p|v|)), and any NaN or infinity, fail the test
    and take the exact path. Block b-1's entries of a first block (logit -inf, value 0)
    add nothing to any sum."""
    m_scaled = certificate.scaled_max(m, g.shift)
    s = Float32(0.0)
    acc = Float32(0.0)
    mag = Float32(0.0)
    vsum = Float32(0.0)
    for k in range(g.W):
        e = certificate.fast_exp(logits[k], m_scaled)
        v = value(k)
        s = s + e
        acc = acc + e * v
        mag = mag + e * cute.math.absf(v)
        vsum = vsum + cute.math.absf(v)
    return acc / s, g.certificate.holds(acc, mag, vsum)


def column_fast(g, logit, value, first):
    """pool_fast of one column."""
    logits, m = window_logits(g, logit, first)
    return pool_fast(g, logits, m, value)


def column_exact(g, logit, value, first):
    """One column, bit for bit torch's eager region on CUDA."""
    logits, m = window_logits(g, logit, first)
    return pool_exact(g, *exact_softmax(g, logits, m, value))


@cute.jit
def pool_columns(g, rO, fast, exact):
    """rO[i] = output column i in the key's dtype, i < V: fast(i) -> (value, certified)
    where the key takes the fast softmax and its certificate holds, else exact(i) -> value
    (rare under fast_exp: a cancelling column, NaN or infinity). Every kernel whose rows
    pool a register window pools through here, so their bits agree by construction."""
    for i in cutlass.range_constexpr(g.V):
        if cutlass.const_expr(g.fast_exp):
            res, certified = fast(i)
            if not certified:
                res = exact(i)
            rO[i] = g.dtype(res)
        else:
            rO[i] = g.dtype(exact(i))
