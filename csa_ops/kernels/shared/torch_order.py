"""The operation order of torch's CUDA eager region (the numerics comparator) for one forward
column.

`w = torch.softmax(sg, dim=1)` and `(kvg * w).sum(dim=1)` over `(rows, W, d)` fp32 tensors
run, on CUDA, `cunn_SpatialSoftMaxForward` and `reduce_kernel` (ATen's SoftMax.cu and
Reduce.cuh). Their launch configuration, and with it the order of every fp32 add, follows
from W and d alone (for W <= 256, where the reduction never splits across CTAs, and at
least min_rows(d) rows; bench/probe_torch_order.py checked it on the H200, torch 2.11). Both are
"chains and a tree": chain c sums the terms k = c, c + stride, c + 2 stride, ... from +0 in
that order, then a fixed tree combines the chains.

- softmax: `softmax_chains(W, d)` chains of stride that many (cunn_SpatialSoftMax_getBlockSize's
  dim_threads: more than one only for d <= 64 and W >= 64), met by a halving tree
  (spatialBlockReduceX: chain c += chain c + h for h = chains/2, ..., 1); then
  p_k = expf(l_k - m) / sum, one IEEE division per entry.
- sum: `sum_split(W, d)` threads H split k (block.y; 1 = no split). Each thread keeps four
  accumulators (vt0 = 4), so accumulator a of thread y sums k = y + H a + 4 H m in m
  order; V_y = ((A_y0 + A_y1) + A_y2) + A_y3; the V_y meet in a halving tree
  (block_y_reduce). The products kv_k * p_k are rounded to fp32 first (a separate mul).

The streaming kernels' exact columns (kernels/streaming/kernels.py) read the two configuration
functions; `forward` spells the same order out in elementwise torch ops (tests, and
bench/probe_torch_order.py, check it against torch's own kernels on the device).
"""

from __future__ import annotations

# Beyond these the exact column's warp layout does not hold (and for W > 256 the sum may
# split across CTAs); such configurations keep the fast forward without parity.
MAX_WINDOW = 256
MAX_SUM_SPLIT = 16
ACCUMULATORS = 4  # reduce_kernel's vt0: accumulators per thread


def _output_vec(head_dim: int) -> int:
    """reduce_kernel's output vectorization over d (the widest of 4, 2, 1 dividing it)."""
    return 4 if head_dim % 4 == 0 else 2 if head_dim % 2 == 0 else 1


def _last_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def softmax_chains(window: int, head_dim: int) -> int:
    """Threads that share one softmax column (SpatialSoftMax_getBlockSize's dim_threads)."""
    inner = min(head_dim, 1024)
    chains = 1
    if inner <= 64 and window >= 64:
        while inner * chains <= 1024 and chains <= window:
            chains *= 2
        chains //= 2
    return chains


def sum_split(window: int, head_dim: int, rows: int = 1 << 20) -> int:
    """Threads that split one output's W terms (reduce_kernel's block.y), 1 for none, for a
    region of `rows` rows. The block's width covers outputs (rows * d of them, vectorized),
    so the split depends on rows where rows * d / vec < 32: below min_rows(head_dim)."""
    vec = _output_vec(head_dim)
    max_threads = 512 // vec
    dim0 = rows * head_dim // vec
    dim0_pow2 = max_threads if dim0 >= max_threads else _last_pow2(dim0)
    dim1_pow2 = max_threads if window >= max_threads else _last_pow2(window)
    width = min(dim0_pow2, 32)
    height = min(dim1_pow2, max_threads // width)
    # setReduceConfig splits the input across block.y when each thread keeps >= 16 values.
    return height if window >= 16 * height or window >= 256 else 1


def min_rows(head_dim: int) -> int:
    """Rows from which sum_split no longer depends on them. The kernels assume as many: in a
    smaller region (possible for d < 128 only, e.g. one row at d = 64 or 96) torch splits
    its sum differently, so the kernels' exact columns are not torch's bits there, and a
    column the certificate fails is not guaranteed within one step of it (a known limit;
    lifting it needs the split chosen at run time from the row count)."""
    return -(-32 * _output_vec(head_dim) // head_dim)


def sum_depth(window: int, head_dim: int) -> int:
    """Roundings on the longest path of the sum (its error bound's coefficient)."""
    split = sum_split(window, head_dim)
    return -(-window // (ACCUMULATORS * split)) + ACCUMULATORS - 1 + split.bit_length() - 1


def supported(window: int, head_dim: int) -> bool:
    """The exact column can mirror this configuration's order (head_dim 1 softmaxes over
    the last dimension, another kernel)."""
    return (head_dim > 1 and window <= MAX_WINDOW
            and sum_split(window, head_dim) <= MAX_SUM_SPLIT)


def _chains(terms, stride: int) -> list:
    """Chain c < stride: the sum from +0 of terms[:, k] for k = c, c + stride, ..."""
    acc = [terms.new_zeros(terms[:, 0].shape) for _ in range(stride)]
    for k in range(terms.shape[1]):
        acc[k % stride] = acc[k % stride] + terms[:, k]
    return acc


def _halving(parts: list):
    """part c += part c + h for h = len / 2, ..., 1; part 0."""
    parts, h = list(parts), len(parts) // 2
    while h:
        for c in range(h):
            parts[c] = parts[c] + parts[c + h]
        h //= 2
    return parts[0]


def softmax(sg, chains: int | None = None):
    """torch.softmax(sg, dim=1) of (rows, W, d) in the order above, as elementwise torch ops
    (each one IEEE rounding; exp is the device's, expf on CUDA)."""
    chains = chains or softmax_chains(sg.shape[1], sg.shape[2])
    e = (sg - sg.amax(dim=1, keepdim=True)).exp()
    return e / _halving(_chains(e, chains))[:, None]


def window_sum(terms, split: int | None = None):
    """terms.sum(dim=1) of (rows, W, d) in reduce_kernel's order above."""
    split = split or sum_split(terms.shape[1], terms.shape[2], terms.shape[0])
    acc = _chains(terms, ACCUMULATORS * split)  # thread y's accumulator a: chain y + split a
    threads = []
    for y in range(split):
        total = acc[y]
        for a in range(1, ACCUMULATORS):
            total = total + acc[y + split * a]
        threads.append(total)
    return _halving(threads)


def forward(sg, kvg):
    """(kvg * torch.softmax(sg, dim=1)).sum(dim=1), the eager region's fp32 output."""
    return window_sum(kvg * softmax(sg))
