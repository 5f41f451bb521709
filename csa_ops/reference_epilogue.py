"""The fused epilogue's composition in plain torch: RMSNorm, RoPE, rotation, cache formats.

One source of truth for what the epilogue ops compute on a pooled row (docs/epilogue.md):
the forward and its hand-written backward, the fp64 oracle, row positions, and the byte
encoders and decoders of the cache formats. Every step computes in the accumulation dtype
(fp32; fp64 for fp64 rows) from values of the row dtype and rounds back to it. Nothing here
reads tensor contents on the host, so no function synchronizes a device, and every step is
an exact or IEEE operation that gives the same bits on every device (``divide``, ``sqrt``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache_formats import (  # noqa: F401  (FORMATS, row_bytes: this module's API too)
    BLOCK_COLUMNS,
    DS_MLA_FP8_DIM,
    DS_MLA_HEAD_DIM,
    DS_MLA_ROPE_DIM,
    DS_MLA_ROW_BYTES,
    DS_MLA_SCALE_BYTES,
    E4M3_NAN,
    FORMATS,
    FP4_MAX,
    FP8_MAX,
    SCALE_FLOOR,
    SCALE_TOP,
    UE8M0_NAN,
    row_bytes,
)
from .reference import accumulate_dtype, segment_of

DS_MLA_BLOCK = BLOCK_COLUMNS["fp8_ds_mla"]
BLOCK128, MX_BLOCK = BLOCK_COLUMNS["fp8_block128"], BLOCK_COLUMNS["mxfp4"]
# e2m1 magnitudes by code 0..7; bit 3 of a code is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass(frozen=True)
class EpilogueParams:
    """What the epilogue applies to a pooled row: RMSNorm weight and eps, RoPE tables on the
    last ``rope_dim`` columns (unread when 0), and whether to rotate."""

    norm_weight: torch.Tensor
    eps: float
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    rope_dim: int
    rotate: bool


def divide(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor`` correctly rounded on every device. Written ``x / number``, it is
    not: CUDA's true-division kernel turns a divisor that is a host scalar into a
    multiplication by its rounded reciprocal, which is off by one in the last bit for some x
    (``amax / 448`` among them), while the CPU divides. A divisor tensor of x's shape on
    x's device is divided everywhere."""
    return torch.div(x, torch.full_like(x, divisor))


def row_mean(x: torch.Tensor) -> torch.Tensor:
    """(N, 1) mean over the last dim in a fixed order that no row count or device changes:
    a pairwise tree (column j plus column j + w/2 of the first w columns, w halving from d
    padded with zeros to a power of two), then one IEEE division by d. torch's own
    reductions may pick their order by the tensor's shape, so a row could round differently
    in a decode step than in a prefill."""
    d = x.shape[-1]
    width = 1 << max(d - 1, 0).bit_length()
    total = torch.nn.functional.pad(x, (0, width - d)) if width != d else x
    while width > 1:
        width //= 2
        total = total[:, :width] + total[:, width:]
    return divide(total, d)


def sqrt(v: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of fp32 values, the same bits on every device.
    Neither torch function is that: torch.sqrt on the CPU is MKL's, one ulp off for about
    a fifth of fp32 inputs, and CUDA's rsqrt is within 2 ulp. A guess (the fp64 root
    rounded to fp32) is checked exactly against the midpoints to its fp32 neighbours,
    whose squares fp64 holds exactly (25 significant bits), and moved where the root
    lies past one. fp64 values get torch.sqrt (the last bit is the device's)."""
    if v.dtype != torch.float32:
        return torch.sqrt(v)
    wide = v.detach().double()
    root = _nearest_root(wide, torch.sqrt(wide).float())
    if v.requires_grad:
        # The gradient of sqrt (nextafter has none), the value of the rounded root: the two
        # roots are within one step, so their difference and the sum are exact.
        plain = torch.sqrt(v)
        return plain + (root - plain.detach())
    return root


def _nearest_root(wide: torch.Tensor, guess: torch.Tensor) -> torch.Tensor:
    """``guess`` moved to its fp32 neighbour where sqrt(wide) lies past the midpoint
    between them; exact for a guess within one step (no root of an fp32 value is a
    midpoint, so there are no ties)."""
    up = torch.nextafter(guess, torch.full_like(guess, float("inf")))
    down = torch.nextafter(guess, torch.zeros_like(guess))
    above = (guess.double() + up.double()) * 0.5
    below = (guess.double() + down.double()) * 0.5
    root = torch.where(wide > above * above, up, guess)
    return torch.where(wide < below * below, down, root)


def inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """(N, 1) ``1 / sqrt(mean(x^2) + eps)``, eps rounded to x's dtype: the correctly
    rounded square root (``sqrt``), then an IEEE division, so the same bits on every
    device (torch.rsqrt is not: CUDA's is within 2 ulp, the CPU's is this quotient)."""
    v = row_mean(x * x) + eps  # x * x: torch.square is pow(x, 2)
    return torch.div(torch.ones_like(v), sqrt(v))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x * (1 / sqrt(mean(x^2) + eps))) * weight`` over the last dim, in x's dtype."""
    return x * inverse_rms(x, eps) * weight


def _pairs(x: torch.Tensor, rope_dim: int):
    """(head, even, odd): the columns before the RoPE slice and its interleaved pairs."""
    head = x[:, :x.shape[1] - rope_dim]
    tail = x[:, x.shape[1] - rope_dim:].reshape(x.shape[0], rope_dim // 2, 2)
    return head, tail[..., 0], tail[..., 1]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int,
         transpose: bool = False) -> torch.Tensor:
    """GPT-J RoPE on the last ``rope_dim`` columns: pair i = (x[2i], x[2i+1]) of the slice
    turned by the angle whose (N, rope_dim/2) cos and sin are given; ``transpose`` turns it
    back (the backward). Each output is two products and one add, rounded separately."""
    head, even, odd = _pairs(x, rope_dim)
    if transpose:
        new_even, new_odd = even * cos + odd * sin, odd * cos - even * sin
    else:
        new_even, new_odd = even * cos - odd * sin, even * sin + odd * cos
    tail = torch.stack((new_even, new_odd), dim=-1).reshape(x.shape[0], rope_dim)
    return torch.cat((head, tail), dim=1)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Walsh-Hadamard transform over the last dim (a power of two, Sylvester order:
    H[i, j] = (-1)^popcount(i & j)) times d**-0.5: butterflies of stride 1, 2, 4, ...,
    then one multiply by the scale rounded to x's dtype (a host-scalar factor is rounded
    once and multiplied on every device alike). H is symmetric, so this is its own
    transpose (the backward)."""
    rows, d = x.shape
    stride = 1
    while stride < d:
        pairs = x.reshape(rows, d // (2 * stride), 2, stride)
        low, high = pairs[:, :, 0], pairs[:, :, 1]
        x = torch.stack((low + high, low - high), dim=2).reshape(rows, d)
        stride *= 2
    return x * d**-0.5


def _tables(params: EpilogueParams, positions: torch.Tensor, acc: torch.dtype):
    """cos and sin rows at ``positions``, clamped into the tables: a position outside them
    is an error where checking is free (CPU) and never an access out of bounds elsewhere."""
    index = positions.clamp(0, params.cos.shape[0] - 1)
    return params.cos[index].to(acc), params.sin[index].to(acc)


def epilogue_rows(pooled: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                  params: EpilogueParams) -> torch.Tensor:
    """The epilogue of (N, d) pooled rows in their dtype: RMSNorm, RoPE at ``positions``
    (N,) int64, rotation, each computed in the accumulation dtype from the previous step's
    rounded values and rounded to the row dtype. Rows where ``valid`` is False are exact
    zeros (padding rows carry no data, whatever the norm would make of them)."""
    dtype = pooled.dtype
    acc = accumulate_dtype(dtype)
    x = rms_norm(pooled.to(acc), params.norm_weight.to(acc), params.eps).to(dtype)
    if params.rope_dim:
        cos, sin = _tables(params, positions, acc)
        x = rope(x.to(acc), cos, sin, params.rope_dim).to(dtype)
    if params.rotate:
        x = hadamard(x.to(acc)).to(dtype)
    return torch.where(valid[:, None], x, 0.0)


def epilogue_rows_backward(grad_out: torch.Tensor, pooled: torch.Tensor,
                           positions: torch.Tensor, valid: torch.Tensor,
                           params: EpilogueParams):
    """(grad_pooled in the row dtype, grad_weight in the weight's dtype): the exact gradient
    of ``epilogue_rows``. Every forward rounding to the row dtype rounds the gradient there
    too, as torch autograd of the composition does; grad_weight is a column sum over rows
    in torch's fixed reduction order (no atomics)."""
    dtype = pooled.dtype
    acc = accumulate_dtype(dtype)
    weight = params.norm_weight.to(acc)
    # Padding rows are constants: their incoming gradient is dropped, not propagated.
    g = torch.where(valid[:, None], grad_out.to(acc), 0.0)
    if params.rotate:
        g = hadamard(g).to(dtype).to(acc)
    if params.rope_dim:
        cos, sin = _tables(params, positions, acc)
        g = rope(g, cos, sin, params.rope_dim, transpose=True).to(dtype).to(acc)
    x = pooled.to(acc)
    inv_rms = inverse_rms(x, params.eps)
    normed = x * inv_rms
    grad_weight = torch.where(valid[:, None], g * normed, 0.0).sum(0)
    scaled = g * weight
    # d/dx of x * r(x), r = 1 / sqrt(mean(x^2) + eps): r * (h - x r * mean(x r * h)).
    grad_x = (scaled - normed * row_mean(normed * scaled)) * inv_rms
    grad_x = torch.where(valid[:, None], grad_x, 0.0)
    return grad_x.to(dtype), grad_weight.to(params.norm_weight.dtype)


def training_positions(cu_seqlens_comp: torch.Tensor, position_offset: torch.Tensor | None,
                       rows: int, ratio: int):
    """(positions, valid) of ``rows`` output rows: row b of sequence s sits at
    ``b * ratio + position_offset[s]`` (its block's first token); rows past
    cu_seqlens_comp[-1] are padding (valid False)."""
    cuc = cu_seqlens_comp.long()
    n = torch.arange(rows, device=cuc.device)
    valid = n < cuc[-1]
    num_segments = cuc.numel() - 1
    if num_segments == 0:
        return torch.zeros_like(n), valid
    segment = segment_of(cuc, n)
    positions = (n - cuc[segment]) * ratio
    if position_offset is not None:
        positions = positions + position_offset.long()[segment]
    return positions, valid


def compressor_epilogue_reference(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio: int,
                                  coff: int, params: EpilogueParams, position_offset=None,
                                  total_comp=None) -> torch.Tensor:
    """The training op's composition: csa::compressor's rows (the op itself, so its CUDA
    kernel on CUDA), then ``epilogue_rows``."""
    pooled = torch.ops.csa.compressor.default(kv, score, ape, cu_seqlens, cu_seqlens_comp,
                                              ratio, coff, total_comp)
    return training_rows(pooled, cu_seqlens_comp, position_offset, ratio, params)


def training_rows(pooled, cu_seqlens_comp, position_offset, ratio: int,
                  params: EpilogueParams) -> torch.Tensor:
    """``epilogue_rows`` of csa::compressor's rows at their training positions."""
    positions, valid = training_positions(cu_seqlens_comp, position_offset, pooled.shape[0],
                                          ratio)
    return epilogue_rows(pooled, positions, valid, params)


def training_rows_backward(grad_out, pooled, cu_seqlens_comp, position_offset, ratio: int,
                           params: EpilogueParams):
    """``epilogue_rows_backward`` of csa::compressor's rows at their training positions."""
    positions, valid = training_positions(cu_seqlens_comp, position_offset, pooled.shape[0],
                                          ratio)
    return epilogue_rows_backward(grad_out, pooled, positions, valid, params)


def compressor_epilogue_backward_reference(grad_out, kv, score, ape, cu_seqlens,
                                           cu_seqlens_comp, ratio: int, coff: int,
                                           params: EpilogueParams, position_offset=None,
                                           rows_backward=training_rows_backward):
    """(grad_kv, grad_score, grad_ape, grad_weight) of ``compressor_epilogue_reference``: the
    pooled rows recomputed at grad_out's row count (the forward keeps inputs, not rows; no
    sync), ``rows_backward`` (``training_rows_backward``'s arguments and results; the op
    passes its kernel route), then csa::compressor_backward (its CUDA kernel on CUDA)."""
    rows = grad_out.shape[0]
    pooled = torch.ops.csa.compressor.default(kv, score, ape, cu_seqlens, cu_seqlens_comp,
                                              ratio, coff, rows)
    grad_pooled, grad_weight = rows_backward(grad_out.contiguous(), pooled, cu_seqlens_comp,
                                             position_offset, ratio, params)
    grad_kv, grad_score, grad_ape = torch.ops.csa.compressor_backward.default(
        grad_pooled, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff)
    return grad_kv, grad_score, grad_ape, grad_weight


def compressor_epilogue_oracle(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio: int,
                               coff: int, params: EpilogueParams, position_offset=None,
                               total_comp=None) -> torch.Tensor:
    """fp64 ground truth: the fp64 pooled rows (no rounding) through the fp64 epilogue."""
    from .reference import compressor_oracle

    pooled = compressor_oracle(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff,
                               total_comp)
    positions, valid = training_positions(cu_seqlens_comp, position_offset, pooled.shape[0],
                                          ratio)
    return epilogue_rows(pooled, positions, valid, params)


# ---------------------------------------------------------------------------------------
# Cache formats. Encoders take (N, d) rows and return uint8 bytes per row; decoders return
# fp32 values. A block holding a NaN or an Inf stores the NaN scale (UE8M0 0xFF, fp32 NaN)
# and NaN or zero element codes, so it decodes to NaN, never to clean-looking values.


def bitcast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(N, k) ``t``'s bytes read as ``dtype`` along the last dim (little-endian, as the
    devices torch runs on), for no rows too (an empty tensor's strides refuse a view)."""
    if t.numel() == 0:
        width = t.shape[-1] * t.element_size() // torch.empty(0, dtype=dtype).element_size()
        return torch.empty(*t.shape[:-1], width, dtype=dtype, device=t.device)
    return t.contiguous().view(dtype)


def ceil_log2(v: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(v)) (int32) of positive finite fp32 values, from their bits."""
    mantissa, exponent = torch.frexp(v)  # v = mantissa * 2**exponent, mantissa in [0.5, 1)
    return torch.where(mantissa == 0.5, exponent - 1, exponent)


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """fp32 2**exponent of int32 exponents in [-149, 128] (128: Inf), built from the bits
    (the biased exponent, or one mantissa bit below 2**-126), so it is exact on every
    device: torch.ldexp goes through pow, a device's math library."""
    e = exponent.to(torch.int32)
    normal = (e + 127).clamp(min=0) << 23
    subnormal = torch.ones_like(e) << (e + 149).clamp(0, 22)
    return torch.where(e >= -126, normal, subnormal).view(torch.float32)


def encode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3fn bytes: clamped to +-448 (saturating), then rounded to nearest even."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).to(torch.float32)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Finite fp32 -> e2m1 codes (uint8, 0..15): magnitudes clamped to 6 (saturating), then
    rounded to nearest even onto {0, 0.5, 1, 1.5, 2, 3, 4, 6}; the sign bit is x's (a value
    that rounds to zero keeps it). Each range's grid is uniform and scaling by a power of
    two is exact, so torch.round (half to even) on the scaled magnitude is the rounding."""
    magnitude = x.abs().clamp(max=FP4_MAX)
    code = torch.where(magnitude < 2.0, torch.round(magnitude * 2.0),
                       torch.where(magnitude < 4.0, torch.round(magnitude) + 2.0,
                                   torch.round(magnitude * 0.5) + 4.0))
    return code.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    magnitude = values[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def decode_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes -> fp32 2**(byte - 127); 0xFF is NaN."""
    value = pow2(scale.to(torch.int32) - 127)
    return torch.where(scale == UE8M0_NAN, float("nan"), value)


def _pow2_blocks(x: torch.Tensor, block: int, floor: float, top: float):
    """(scaled values, UE8M0 bytes, finite) of (N, k*block) fp32 values in blocks of
    ``block``: scale 2**ceil(log2(max(amax, floor) / top)), the quotient rounded to fp32."""
    blocks = x.reshape(x.shape[0], x.shape[1] // block, block)
    amax = blocks.abs().amax(-1)
    finite = torch.isfinite(amax)
    exponent = torch.where(finite, ceil_log2(divide(amax.clamp(min=floor), top)), 0)
    scaled = blocks * pow2(-exponent)[..., None]  # exact: a power of two in range
    scale = torch.where(finite, exponent + 127, UE8M0_NAN).to(torch.uint8)
    return scaled, scale, finite


def encode_fp8_ds_mla(rows: torch.Tensor):
    """(N, 512) rows -> ((N, 576) row bytes, (N, 8) scale bytes): columns [0, 448) as e4m3
    in 7 blocks of 64 with UE8M0 scales (floor 1e-4), then the 64 RoPE columns as bf16."""
    x = rows[:, :DS_MLA_FP8_DIM].to(torch.float32)
    scaled, scale, finite = _pow2_blocks(x, DS_MLA_BLOCK, SCALE_FLOOR["fp8_ds_mla"],
                                         SCALE_TOP["fp8_ds_mla"])
    codes = torch.where(finite[..., None], encode_e4m3(scaled), E4M3_NAN)
    rope_bytes = bitcast(rows[:, DS_MLA_FP8_DIM:].to(torch.bfloat16), torch.uint8)
    data = torch.cat((codes.reshape(rows.shape[0], DS_MLA_FP8_DIM), rope_bytes), dim=1)
    scales = torch.cat((scale, scale.new_zeros(rows.shape[0], 1)), dim=1)
    return data, scales


def decode_fp8_ds_mla(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    codes = data[:, :DS_MLA_FP8_DIM].reshape(data.shape[0], DS_MLA_FP8_DIM // DS_MLA_BLOCK,
                                             DS_MLA_BLOCK)
    values = decode_e4m3(codes) * decode_ue8m0(scales[:, :-1])[..., None]
    rope_part = bitcast(data[:, DS_MLA_FP8_DIM:], torch.bfloat16).to(torch.float32)
    return torch.cat((values.reshape(data.shape[0], DS_MLA_FP8_DIM), rope_part), dim=1)


def encode_fp8_block128(rows: torch.Tensor) -> torch.Tensor:
    """(N, d) rows -> (N, d + 4*d/128) bytes: e4m3 codes of x / scale, then the fp32 scales
    amax / 448 of each 128 values (little-endian). A block whose scale is 0 (amax zero, or
    so small that amax / 448 underflows) stores zero codes and scale 0: it decodes to
    exact zeros."""
    x = rows.to(torch.float32)
    blocks = x.reshape(x.shape[0], x.shape[1] // BLOCK128, BLOCK128)
    scale = divide(blocks.abs().amax(-1), FP8_MAX)
    finite = torch.isfinite(scale)
    usable = (finite & (scale > 0))[..., None]
    codes = encode_e4m3(blocks / torch.where(usable, scale[..., None], 1.0))
    codes = torch.where(usable, codes, torch.where(finite[..., None], 0, E4M3_NAN))
    scale = torch.where(finite, scale, float("nan"))
    return torch.cat((codes.reshape(x.shape).to(torch.uint8),
                      bitcast(scale, torch.uint8)), dim=1)


def decode_fp8_block128(data: torch.Tensor) -> torch.Tensor:
    d = data.shape[1] * BLOCK128 // (BLOCK128 + 4)
    codes = data[:, :d].reshape(data.shape[0], d // BLOCK128, BLOCK128)
    scale = bitcast(data[:, d:], torch.float32)
    return (decode_e4m3(codes) * scale[..., None]).reshape(data.shape[0], d)


def encode_mxfp4(rows: torch.Tensor) -> torch.Tensor:
    """(N, d) rows -> (N, d/2 + d/32) bytes: e2m1 codes two per byte (low nibble first) of
    x / scale, then one UE8M0 scale 2**ceil(log2(max(amax, 6*2**-126) / 6)) per 32 values.
    A block holding a NaN or an Inf stores zero codes and the NaN scale."""
    x = rows.to(torch.float32)
    scaled, scale, finite = _pow2_blocks(x, MX_BLOCK, SCALE_FLOOR["mxfp4"], SCALE_TOP["mxfp4"])
    codes = torch.where(finite[..., None], encode_e2m1(torch.where(finite[..., None], scaled,
                                                                   0.0)), 0)
    codes = codes.reshape(x.shape)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return torch.cat((packed, scale), dim=1)


def decode_mxfp4(data: torch.Tensor) -> torch.Tensor:
    d = data.shape[1] * MX_BLOCK // (MX_BLOCK // 2 + 1)
    packed = data[:, :d // 2]
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(data.shape[0], d // MX_BLOCK,
                                                                    MX_BLOCK)
    scale = decode_ue8m0(data[:, d // 2:])
    return (decode_e2m1(codes) * scale[..., None]).reshape(data.shape[0], d)


def ds_mla_page_bytes(page_size: int) -> int:
    """Bytes of an fp8_ds_mla page of ``page_size`` rows (576 bytes each, then 8 scale bytes
    each), rounded up to a multiple of 576."""
    used = page_size * (DS_MLA_ROW_BYTES + DS_MLA_SCALE_BYTES)
    return -(-used // DS_MLA_ROW_BYTES) * DS_MLA_ROW_BYTES


def ds_mla_views(cache: torch.Tensor, page_size: int):
    """(data, scales) views (num_pages, page_size, 576) and (num_pages, page_size, 8) of an
    fp8_ds_mla cache (num_pages, page_bytes): rows first, then their scales."""
    num_pages = cache.shape[0]
    rows_end = page_size * DS_MLA_ROW_BYTES
    data = cache[:, :rows_end].view(num_pages, page_size, DS_MLA_ROW_BYTES)
    scales_end = rows_end + page_size * DS_MLA_SCALE_BYTES
    scales = cache[:, rows_end:scales_end].view(num_pages, page_size, DS_MLA_SCALE_BYTES)
    return data, scales


def encode_rows(rows: torch.Tensor, cache_format: str):
    """Per format, the tensors one cache row is made of: (rows,) for none, (data, scales)
    for fp8_ds_mla, (bytes,) otherwise."""
    if cache_format == "none":
        return (rows,)
    if cache_format == "fp8_ds_mla":
        return encode_fp8_ds_mla(rows)
    if cache_format == "fp8_block128":
        return (encode_fp8_block128(rows),)
    return (encode_mxfp4(rows),)


def dequantize_cache(cache: torch.Tensor, cache_format: str, page_size: int) -> torch.Tensor:
    """Every cache row, (num_pages * page_size, d): cache row ``page * page_size + slot``
    in the cache's dtype for none, as fp32 values for the quantized formats."""
    if cache_format == "none":
        return cache.reshape(-1, cache.shape[-1])
    if cache_format == "fp8_ds_mla":
        data, scales = ds_mla_views(cache, page_size)
        return decode_fp8_ds_mla(data.reshape(-1, DS_MLA_ROW_BYTES),
                                 scales.reshape(-1, DS_MLA_SCALE_BYTES))
    flat = cache.reshape(-1, cache.shape[-1])
    return decode_fp8_block128(flat) if cache_format == "fp8_block128" else decode_mxfp4(flat)
