"""csa::compressor_extend_store: serving's extend, the epilogue, a cache format, a paged store.

The op runs csa::compressor_extend (the rows each request completes; the state updated in
place), the epilogue of ``csa_ops.reference_epilogue`` at each row's position, encodes the
rows in one cache format and writes them into a paged cache in place. It returns
cu_seqlens_comp. Every device runs this composition (on CUDA through the extend kernels);
it never synchronizes on CUDA, so a decode step can be captured in a CUDA graph. Inference
only. The fake lives in ``csa_ops.meta.epilogue``; docs/epilogue.md has the byte layouts.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from . import dispatch, epilogue, reference_epilogue, reference_extend, row_epilogue, serving
from .reference import segment_of
from .reference_epilogue import FORMATS, EpilogueParams

OP = "csa.compressor_extend_store"
STORE_SCHEMA = (
    "(Tensor kv, Tensor score, Tensor ape, Tensor cu_seqlens, Tensor start_pos, Tensor slots, "
    "Tensor(a!) kv_state, Tensor(b!) score_state, Tensor norm_weight, float eps, Tensor cos, "
    "Tensor sin, int rope_dim, bool rotate, str cache_format, Tensor(c!) cache, "
    "Tensor block_table, int page_size, int ratio, int coff) -> Tensor"
)
QUANTIZED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _fail(message: str, error=ValueError):
    raise error(f"{OP}: {message}")


@contextlib.contextmanager
def _named_errors():
    """The extend op's checks, with errors naming this op (the one the caller called)."""
    try:
        yield
    except (ValueError, TypeError, RuntimeError) as error:
        text = str(error)
        if not text.startswith(serving.OP + ":"):
            raise
        raise type(error)(OP + text[len(serving.OP):]) from None


def _check_format(cache_format, kv, head_dim: int, rope_dim: int) -> None:
    if cache_format not in FORMATS:
        _fail(f"`cache_format` must be one of {', '.join(FORMATS)}, got {cache_format!r}")
    if cache_format == "none":
        return
    if kv.dtype not in QUANTIZED_DTYPES:
        _fail(f"`kv` must be bfloat16, float16 or float32 for cache_format "
              f"{cache_format!r}, got {kv.dtype}")
    if cache_format == "fp8_ds_mla":
        if head_dim != reference_epilogue.DS_MLA_HEAD_DIM:
            _fail(f"cache_format 'fp8_ds_mla' needs head_dim 512 (`kv` of width coff*512), "
                  f"got head_dim={head_dim}")
        if rope_dim != reference_epilogue.DS_MLA_ROPE_DIM:
            _fail(f"`rope_dim` must be 64 for cache_format 'fp8_ds_mla', got {rope_dim}")
        return
    block = (reference_epilogue.BLOCK128 if cache_format == "fp8_block128"
             else reference_epilogue.MX_BLOCK)
    if head_dim % block:
        _fail(f"cache_format {cache_format!r} needs head_dim a multiple of {block}, got "
              f"head_dim={head_dim}")


def expected_cache_shape(cache_format: str, num_pages, page_size: int, head_dim: int) -> tuple:
    """The cache shape of a format (for fp8_ds_mla, the smallest page size in bytes)."""
    if cache_format == "none":
        return (num_pages, page_size, head_dim)
    if cache_format == "fp8_ds_mla":
        return (num_pages, reference_epilogue.ds_mla_page_bytes(page_size))
    return (num_pages, page_size, reference_epilogue.row_bytes(cache_format, head_dim))


def _check_cache(cache_format: str, cache, kv, head_dim: int, page_size) -> None:
    epilogue.check_tensor(OP, "cache", cache, kv)
    epilogue.check_int(OP, "page_size", page_size)
    if page_size < 1:
        _fail(f"`page_size` must be >= 1, got {page_size}")
    dtype = kv.dtype if cache_format == "none" else torch.uint8
    if cache.dtype != dtype:
        _fail(f"`cache` must be {dtype} for cache_format {cache_format!r}, got {cache.dtype}")
    want = expected_cache_shape(cache_format, "num_pages", page_size, head_dim)
    if cache_format == "fp8_ds_mla":
        if cache.dim() != 2 or cache.shape[1] < want[1]:
            _fail(f"`cache` must be (num_pages, page_bytes) with page_bytes >= {want[1]} "
                  f"({page_size} rows of 576 bytes and 8 scale bytes, rounded up to a "
                  f"multiple of 576), got {tuple(cache.shape)}")
    elif cache.dim() != 3 or tuple(cache.shape[1:]) != want[1:]:
        _fail(f"`cache` must have shape {want} for cache_format {cache_format!r}, got "
              f"{tuple(cache.shape)}")
    if not cache.is_contiguous():
        _fail("`cache` must be contiguous: it is written in place")


def check_arguments(kv, score, ape, cu_seqlens, start_pos, slots, kv_state, score_state,
                    norm_weight, eps, cos, sin, rope_dim, rotate, cache_format, cache,
                    block_table, page_size, ratio, coff) -> None:
    """Everything metadata decides (runs on fake tensors, never syncs)."""
    with _named_errors():
        serving.check_arguments(kv, score, ape, cu_seqlens, start_pos, slots, kv_state,
                                score_state, ratio, coff)
    head_dim = kv.shape[1] // coff
    for name, table in (("cos", cos), ("sin", sin)):
        epilogue.check_tensor(OP, name, table, kv)
    epilogue.check_epilogue(OP, kv, head_dim, norm_weight, eps, cos, sin, rope_dim, rotate)
    _check_format(cache_format, kv, head_dim, rope_dim)
    _check_cache(cache_format, cache, kv, head_dim, page_size)
    epilogue.check_tensor(OP, "block_table", block_table, kv)
    if (block_table.dim() != 2 or block_table.dtype != torch.int32
            or block_table.shape[0] != start_pos.shape[0]):
        _fail(f"`block_table` must be an int32 tensor of shape (B, pages per request) with "
              f"B = {start_pos.shape[0]}, got shape {tuple(block_table.shape)} and "
              f"{block_table.dtype}")


@dataclass(frozen=True)
class _Targets:
    """Per output row (N,) int64: its position, cache page and slot in the page; ``writes``
    (bool): an emitted row of a valid request whose block-table entry is in range."""

    position: torch.Tensor
    page: torch.Tensor
    slot: torch.Tensor
    emitted: torch.Tensor
    in_table: torch.Tensor

    @property
    def writes(self) -> torch.Tensor:
        return self.emitted & self.in_table


def _targets(cu_seqlens_comp, start_pos, valid, block_table, rows: int, ratio: int,
             page_size: int, num_pages: int) -> _Targets:
    """Row n of request i is its compressed row q = start_pos[i] // ratio + n - cuc[i]:
    position q * ratio, cache row block_table[i, q // page_size] * page_size +
    q % page_size. Indices are clamped, so nothing here reads out of bounds."""
    cuc = cu_seqlens_comp.long()
    n = torch.arange(rows, device=cuc.device)
    request = segment_of(cuc, n)
    q = start_pos.long().clamp(min=0)[request] // ratio + n - cuc[request]
    column = q // page_size
    width = block_table.shape[1]
    page = block_table[request, column.clamp(0, max(width - 1, 0))].long() if width else (
        torch.zeros_like(n))
    in_table = (column < width) & (page >= 0) & (page < num_pages)
    emitted = (n < cuc[-1]) & valid[request]
    return _Targets(q * ratio, page, q % page_size, emitted, in_table)


def _check_contents(kv, cu_seqlens, start_pos, slots, kv_state, cos, rope_dim, block_table,
                    ratio: int, page_size: int, num_pages: int) -> None:
    """Content checks (host tensors), all before the call writes anything."""
    with _named_errors():
        serving.check_contents(cu_seqlens, start_pos, slots, kv.shape[0], kv_state.shape[0],
                               ratio)
    if start_pos.shape[0] == 0:
        return
    counts = reference_extend.rows_of_requests(cu_seqlens, start_pos, ratio)
    cuc = torch.cat((counts.new_zeros(1), counts.cumsum(0)))
    valid = torch.ones(start_pos.shape[0], dtype=torch.bool)
    t = _targets(cuc, start_pos, valid, block_table, int(cuc[-1]), ratio, page_size, num_pages)
    request = segment_of(cuc, torch.arange(int(cuc[-1])))
    for n in (~t.in_table).nonzero().flatten().tolist():
        i, q = int(request[n]), int(t.position[n]) // ratio
        column = q // page_size
        if column >= block_table.shape[1]:
            _fail(f"`block_table` has {block_table.shape[1]} pages per request, but request "
                  f"{i}'s compressed row {q} needs page {column} (page_size {page_size})")
        _fail(f"`block_table[{i}, {column}]` = {int(block_table[i, column])} is out of range "
              f"[0, {num_pages}) (cache pages)")
    if rope_dim and t.position.numel() and int(t.position.max()) >= cos.shape[0]:
        n = int(t.position.argmax())
        _fail(f"`cos`/`sin` hold {cos.shape[0]} positions, but request {int(request[n])}'s "
              f"compressed row {int(t.position[n]) // ratio} sits at position "
              f"{int(t.position[n])}")


def _write(view: torch.Tensor, t: _Targets, values: torch.Tensor) -> None:
    """view[page[n], slot[n]] = values[n] where ``t.writes``, no other entry touched, and no
    host sync: a row that must not write is sent to the first writing row's target with that
    row's value (or, if no row writes, to entry (0, 0) with its own content), so every index
    that repeats carries one value and the scatter's order among repeats does not matter.
    The first writing row is picked with a one-element index tensor: indexing with a 0-dim
    tensor reads it on the host (a sync on CUDA)."""
    if values.shape[0] == 0 or view.shape[0] == 0:
        return
    writes = t.writes
    first = writes.to(torch.int32).argmax().view(1)
    any_writes = writes.index_select(0, first)  # (1,)
    fallback_page = torch.where(any_writes, t.page.index_select(0, first), 0)
    fallback_slot = torch.where(any_writes, t.slot.index_select(0, first), 0)
    row_shape = (1, *([1] * (values.dim() - 1)))
    fallback_value = torch.where(any_writes.view(row_shape), values.index_select(0, first),
                                 view[0, 0].unsqueeze(0))
    page = torch.where(writes, t.page, fallback_page)
    slot = torch.where(writes, t.slot, fallback_slot)
    mask = writes.view(-1, *row_shape[1:])
    view.index_put_((page, slot), torch.where(mask, values, fallback_value))


def _store(cache_format: str, cache, rows, t: _Targets, page_size: int) -> None:
    encoded = reference_epilogue.encode_rows(rows, cache_format)
    if cache_format == "fp8_ds_mla":
        views = reference_epilogue.ds_mla_views(cache, page_size)
    else:
        views = (cache,)
    for view, values in zip(views, encoded):
        _write(view, t, values)


def _row_capacity(kv, cu_seqlens, start_pos, ratio: int, exact: bool) -> int:
    """Rows for the extend call: the true count where reading it is free (CPU), else a
    bound from shapes alone (no sync): a request of L new tokens completes at most
    ceil(L / ratio) blocks, and all of them hold at most T tokens."""
    if start_pos.shape[0] == 0:
        return 0
    if exact:
        return int(reference_extend.rows_of_requests(cu_seqlens, start_pos, ratio).sum())
    return (kv.shape[0] + start_pos.shape[0] * (ratio - 1)) // ratio


# Metadata signatures that passed check_arguments (see _check_once).
_CHECKED = dispatch.PreparedCalls()


def _check_once(cache, args: tuple) -> None:
    """check_arguments(*args), once per metadata signature: its checks are functions of the
    tensors' shapes, dtypes and devices and of the scalars (with their types, so 3.0 is not
    3), and on a decode step they cost more host time than the kernels' launches. The
    layout of ``cache`` (one of args), which the signature leaves out, is checked on every
    call."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    scalars = [(type(a), a) for a in args if not isinstance(a, torch.Tensor)]
    signature = dispatch.signature(tensors, *scalars)
    if signature in _CHECKED and cache.is_contiguous():
        return
    check_arguments(*args)
    _CHECKED.remember(signature, True)


def extend_store(kv, score, ape, cu_seqlens, start_pos, slots, kv_state, score_state,
                 norm_weight, eps, cos, sin, rope_dim, rotate, cache_format, cache,
                 block_table, page_size, ratio, coff, check_contents: bool):
    """The op's composition. ``check_contents`` reads the index tensors on the host (the
    CPU op does); without it, rows whose request is invalid (as csa::compressor_extend
    treats them) or whose block-table entry is out of range are skipped."""
    _check_once(cache, (kv, score, ape, cu_seqlens, start_pos, slots, kv_state, score_state,
                        norm_weight, eps, cos, sin, rope_dim, rotate, cache_format, cache,
                        block_table, page_size, ratio, coff))
    num_pages = cache.shape[0]
    if check_contents:
        _check_contents(kv, cu_seqlens, start_pos, slots, kv_state, cos, rope_dim, block_table,
                        ratio, page_size, num_pages)
    rows = _row_capacity(kv, cu_seqlens, start_pos, ratio, check_contents)
    if not check_contents:  # a decode step's whole stage, in one kernel where one takes it
        cu_seqlens_comp = row_epilogue.launch_extend_store(
            kv, score, ape, cu_seqlens, start_pos, slots, kv_state, score_state, norm_weight,
            eps, cos, sin, rope_dim, rotate, cache_format, cache, block_table, page_size, ratio,
            coff, rows)
        if cu_seqlens_comp is not None:
            return cu_seqlens_comp
    pooled, cu_seqlens_comp = torch.ops.csa.compressor_extend.default(
        kv, score, ape, cu_seqlens, start_pos, slots, kv_state, score_state, ratio, coff, rows)
    if start_pos.shape[0] == 0:
        return cu_seqlens_comp
    args = (pooled, cu_seqlens_comp, kv.shape[0], cu_seqlens, start_pos, slots,
            kv_state.shape[0], norm_weight, eps, cos, sin, rope_dim, rotate, cache_format,
            cache, block_table, page_size, ratio)
    if check_contents or not row_epilogue.launch_store(*args):
        epilogue_store(*args)
    return cu_seqlens_comp


def epilogue_store(pooled, cu_seqlens_comp, num_tokens: int, cu_seqlens, start_pos, slots,
                   num_slots: int, norm_weight, eps, cos, sin, rope_dim, rotate, cache_format,
                   cache, block_table, page_size, ratio) -> None:
    """The epilogue, the encoding and the paged store of an extend call's pooled rows as
    torch ops (every device; on CUDA, the route of what the row-epilogue kernel does not
    take, and what it is tested against)."""
    valid = reference_extend.valid_requests(cu_seqlens, start_pos, slots, num_tokens,
                                            num_slots)
    t = _targets(cu_seqlens_comp, start_pos, valid, block_table, pooled.shape[0], ratio,
                 page_size, cache.shape[0])
    params = EpilogueParams(norm_weight, float(eps), cos, sin, rope_dim, rotate)
    rows_out = reference_epilogue.epilogue_rows(pooled, t.position, t.emitted, params)
    _store(cache_format, cache, rows_out, t, page_size)


_LIB = torch.library.Library("csa", "FRAGMENT")
_LIB.define("compressor_extend_store" + STORE_SCHEMA, tags=(torch.Tag.pt2_compliant_tag,))


def _compressor_extend_store(kv, *args):
    return extend_store(kv, *args, check_contents=kv.device.type == "cpu")


_LIB.impl("compressor_extend_store", _compressor_extend_store, "CompositeExplicitAutograd")
_LIB.impl("compressor_extend_store",
          dispatch.inference_only("compressor_extend_store", _compressor_extend_store),
          "Autograd", with_keyset=True)


def new_cache(num_pages: int, page_size: int, head_dim: int, cache_format: str,
              dtype: torch.dtype = torch.bfloat16, device=None) -> torch.Tensor:
    """A zeroed cache of ``num_pages`` pages of ``page_size`` rows in ``cache_format``
    (``dtype``: the rows' dtype, for "none")."""
    if cache_format not in FORMATS:
        raise ValueError(f"new_cache: `cache_format` must be one of {', '.join(FORMATS)}, "
                         f"got {cache_format!r}")
    shape = expected_cache_shape(cache_format, num_pages, page_size, head_dim)
    return torch.zeros(shape, dtype=dtype if cache_format == "none" else torch.uint8,
                       device=device)


def dequantize_cache(cache: torch.Tensor, cache_format: str, page_size: int) -> torch.Tensor:
    """The rows a cache holds, ``(num_pages * page_size, head_dim)``, cache row
    ``page * page_size + slot``: as stored (kv's dtype) for "none", decoded to fp32 for the
    quantized formats (a block with the NaN scale decodes to NaN)."""
    if cache_format not in FORMATS:
        raise ValueError(f"dequantize_cache: `cache_format` must be one of "
                         f"{', '.join(FORMATS)}, got {cache_format!r}")
    return reference_epilogue.dequantize_cache(cache, cache_format, page_size)


def dequantize_fp8_ds_mla(cache: torch.Tensor, page_size: int) -> torch.Tensor:
    return dequantize_cache(cache, "fp8_ds_mla", page_size)


def dequantize_fp8_block128(cache: torch.Tensor) -> torch.Tensor:
    return dequantize_cache(cache, "fp8_block128", cache.shape[1])


def dequantize_mxfp4(cache: torch.Tensor) -> torch.Tensor:
    return dequantize_cache(cache, "mxfp4", cache.shape[1])


def compressor_extend_store(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor,
                            cu_seqlens: torch.Tensor, start_pos: torch.Tensor,
                            slots: torch.Tensor, kv_state: torch.Tensor,
                            score_state: torch.Tensor, *, norm_weight: torch.Tensor,
                            cache_format: str, cache: torch.Tensor, block_table: torch.Tensor,
                            page_size: int, ratio: int, coff: int, eps: float = 1e-6,
                            cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                            rope_dim: int = 0, rotate: bool = False) -> torch.Tensor:
    """``csa_ops.compressor_extend``, the epilogue of ``csa_ops.epilogue.compressor_epilogue``
    and a store of each emitted row into a paged ``cache``; returns ``cu_seqlens_comp``.

    Request ``i``'s compressed row ``q`` (counted over its whole sequence) gets position
    ``q * ratio`` for RoPE and goes to cache row ``block_table[i, q // page_size] *
    page_size + q % page_size`` (``block_table`` int32 ``(B, pages per request)``), encoded
    as ``cache_format``: "none" (``(num_pages, page_size, d)`` in kv's dtype),
    "fp8_ds_mla" (d 512, rope_dim 64; uint8 ``(num_pages, page_bytes)``), "fp8_block128"
    or "mxfp4" (uint8 ``(num_pages, page_size, bytes per row)``); ``new_cache`` allocates
    one, ``dequantize_cache`` reads one back, docs/epilogue.md has the byte layouts.
    ``kv_state``, ``score_state`` and ``cache`` are written in place; rows no request
    completes write nothing. ``cos``/``sin`` may be None when rope_dim is 0.

    Bad block-table entries, positions past the RoPE tables, slots and positions are
    errors on CPU, checked before anything is written. On CUDA nothing is checked and
    nothing synchronizes: rows of invalid requests (as csa_ops.compressor_extend treats
    them) and rows whose block-table entry is out of range are not written; positions past
    the tables read the last table row. Rows are bitwise the rows ``compressor_epilogue``
    computes for those blocks over the whole sequences on the same device, whatever the
    chunking; quantized values are the formats' encodings of those rows. Inference only.
    """
    empty = kv.new_empty(0, 0, dtype=torch.float32)
    return torch.ops.csa.compressor_extend_store.default(
        kv, score, ape, cu_seqlens, start_pos, slots, kv_state, score_state, norm_weight, eps,
        empty if cos is None else cos, empty if sin is None else sin, rope_dim, rotate,
        cache_format, cache, block_table, page_size, ratio, coff)
