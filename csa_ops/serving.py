"""csa::compressor_extend: stateful compression for prefill, chunked prefill and decode.

The op extends per-request state by new THD-packed tokens and emits the rows of the
blocks they complete. It mutates the two state tensors in place and is inference only: an
Autograd kernel refuses gradient requests. CUDA runs a CuTe-DSL kernel of the forward's
family (kernels/window/extend.py for register windows, kernels/streaming/extend.py for
larger ones); every other case runs ``csa_ops.reference_extend``.
The fake lives in ``csa_ops.meta.serving``; ``CompressorState`` owns the state.
"""

from __future__ import annotations

import torch

from . import dispatch, reference_extend, validation
from .reference import accumulate_dtype
from .validation import INT32_MAX, definitely

OP = "csa.compressor_extend"
EXTEND_SCHEMA = (
    "(Tensor kv, Tensor score, Tensor ape, Tensor cu_seqlens, Tensor start_pos, Tensor slots, "
    "Tensor(a!) kv_state, Tensor(b!) score_state, int ratio, int coff, "
    "SymInt? total_comp=None) -> (Tensor, Tensor)"
)


def _fail(message: str, error=ValueError):
    raise error(f"{OP}: {message}")


def _check_tensor(name: str, tensor, kv=None) -> None:
    if not isinstance(tensor, torch.Tensor):
        _fail(f"`{name}` must be a tensor, got {type(tensor).__name__}", TypeError)
    if kv is not None and tensor.device != kv.device:
        _fail(f"`{name}` must be on the device of `kv` ({kv.device}), got {tensor.device}")


def _check_tokens(kv, score, ape, ratio: int, coff: int) -> int:
    with validation.checking(OP):
        width = validation.check_kv(kv, coff)
    if score.shape != kv.shape or score.dtype != kv.dtype:
        _fail(f"`score` must match `kv` ({tuple(kv.shape)}, {kv.dtype}), got "
              f"({tuple(score.shape)}, {score.dtype})")
    if tuple(ape.shape) != (ratio, width):
        _fail(f"`ape` must have shape (ratio, coff*head_dim) = ({ratio}, {width}), "
              f"got {tuple(ape.shape)}")
    if not ape.dtype.is_floating_point:
        _fail(f"`ape` must be a floating-point tensor, got {ape.dtype}")
    if definitely(kv.shape[0] * width > INT32_MAX):
        _fail(f"`kv` has {kv.shape[0] * width} elements, which overflows int32 offsets")
    return width // coff


def _check_requests(cu_seqlens, start_pos, slots, kv) -> int:
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32 or cu_seqlens.shape[0] < 1:
        _fail(f"`cu_seqlens` must be a 1-D int32 tensor (B+1,) with B+1 >= 1, got shape "
              f"{tuple(cu_seqlens.shape)} and {cu_seqlens.dtype}")
    num_requests = cu_seqlens.shape[0] - 1
    for name, tensor in (("start_pos", start_pos), ("slots", slots)):
        _check_tensor(name, tensor, kv)
        if tensor.dim() != 1 or tensor.dtype != torch.int32 or tensor.shape[0] != num_requests:
            _fail(f"`{name}` must be an int32 tensor of shape (B,) = ({num_requests},), got "
                  f"shape {tuple(tensor.shape)} and {tensor.dtype}")
    return num_requests


def _check_state(kv_state, score_state, kv, ratio: int, coff: int, num_requests) -> None:
    width = kv.shape[1]
    for name, state, dtype in (("kv_state", kv_state, kv.dtype),
                               ("score_state", score_state, accumulate_dtype(kv.dtype))):
        _check_tensor(name, state, kv)
        if state.dim() != 3 or tuple(state.shape[1:]) != (coff * ratio, width):
            _fail(f"`{name}` must have shape (num_slots, coff*ratio, coff*head_dim) = "
                  f"(S, {coff * ratio}, {width}), got {tuple(state.shape)}")
        if state.dtype != dtype:
            _fail(f"`{name}` must be {dtype}, got {state.dtype}")
        if not state.is_contiguous():
            _fail(f"`{name}` must be contiguous: it is written in place")
    if score_state.shape[0] != kv_state.shape[0]:
        _fail(f"`score_state` must have the slot count of `kv_state` ({kv_state.shape[0]}), "
              f"got {score_state.shape[0]}")
    if kv_state is score_state:
        _fail("`kv_state` and `score_state` must be different tensors")
    num_slots = kv_state.shape[0]
    # Decided by shapes alone, so checked on every device without a sync.
    if definitely(num_requests > num_slots):
        _fail(f"`slots`: {num_requests} requests cannot have distinct slots among "
              f"{num_slots} (slots out of range or repeated)")


def check_arguments(kv, score, ape, cu_seqlens, start_pos, slots, kv_state, score_state,
                    ratio, coff, total_comp=None) -> None:
    """Everything that metadata alone decides (runs on fake tensors, never syncs)."""
    for name, tensor in (("kv", kv), ("score", score), ("ape", ape), ("cu_seqlens", cu_seqlens)):
        _check_tensor(name, tensor, kv if name != "kv" else None)
    with validation.checking(OP):
        validation.check_ratio_coff(ratio, coff)
    head_dim = _check_tokens(kv, score, ape, ratio, coff)
    num_requests = _check_requests(cu_seqlens, start_pos, slots, kv)
    _check_state(kv_state, score_state, kv, ratio, coff, num_requests)
    if total_comp is not None:
        if definitely(total_comp < 0):
            _fail(f"`total_comp` must be >= 0 or None, got {total_comp}")
        if definitely(total_comp * head_dim > INT32_MAX):
            _fail(f"`total_comp` * head_dim = {total_comp * head_dim} overflows int32 offsets")


def _check_slots(slots: list, num_slots: int) -> None:
    seen = {}
    for i, slot in enumerate(slots):
        if not 0 <= slot < num_slots:
            _fail(f"`slots[{i}]` = {slot} is out of range [0, {num_slots})")
        if slot in seen:
            _fail(f"`slots` must be distinct: slot {slot} appears at {seen[slot]} and {i}")
        seen[slot] = i


def check_contents(cu_seqlens, start_pos, slots, num_tokens: int, num_slots: int, ratio: int,
                   total_comp=None) -> None:
    """Content checks (host-side tensors only, so free)."""
    cu, starts = cu_seqlens.tolist(), start_pos.tolist()
    if cu[0] != 0:
        _fail(f"`cu_seqlens[0]` must be 0, got {cu[0]}")
    if cu[-1] > num_tokens:
        _fail(f"`cu_seqlens[-1]` = {cu[-1]} exceeds the number of tokens T = {num_tokens}")
    rows = 0
    for i, start in enumerate(starts):
        length = cu[i + 1] - cu[i]
        if length < 0:
            _fail(f"`cu_seqlens` must be non-decreasing, got {cu[i]} then {cu[i + 1]} at {i}")
        if start < 0:
            _fail(f"`start_pos[{i}]` must be >= 0, got {start}")
        if start + length > INT32_MAX:
            _fail(f"`start_pos[{i}]` + new tokens = {start + length} overflows int32 positions")
        rows += (start + length) // ratio - start // ratio
    _check_slots(slots.tolist(), num_slots)
    if total_comp is not None and total_comp < rows:
        _fail(f"`total_comp` = {total_comp} is smaller than the true row count {rows}")


_LIB = torch.library.Library("csa", "FRAGMENT")
_LIB.define("compressor_extend" + EXTEND_SCHEMA, tags=(torch.Tag.pt2_compliant_tag,))


def _compressor_extend(kv, score, ape, cu_seqlens, start_pos, slots, kv_state, score_state,
                       ratio, coff, total_comp=None):
    check_arguments(kv, score, ape, cu_seqlens, start_pos, slots, kv_state, score_state, ratio,
                    coff, total_comp)
    if kv.device.type == "cpu":
        check_contents(cu_seqlens, start_pos, slots, kv.shape[0], kv_state.shape[0], ratio,
                       total_comp)
    kv, score, ape = (t.contiguous() for t in (kv, score, ape))
    return reference_extend.compressor_extend_reference(
        kv, score, ape, cu_seqlens, start_pos, slots, kv_state, score_state, ratio, coff,
        total_comp)


# Metadata signature of a CUDA call -> its prepared call (see dispatch.signature).
_PREPARED = dispatch.PreparedCalls()


def _kernel_extent(problem, rows: int, kv, kv_state) -> int:
    """The largest element index that must fit the extend kernel's int32 indexing: the
    streaming family indexes output rows, tokens and state entries in int32. Register
    windows form 64-bit offsets; their output rows are counted too, which sends only calls
    of more than 2**31 output elements to the reference."""
    extent = rows * problem.key.head_dim
    if problem.key.family == "streaming":
        extent = max(extent, kv.numel(), kv_state.numel())
    return extent


def _prepare_cuda(signature, args, ratio: int, coff: int, rows: int, total_comp):
    """The prepared call of a validated signature: the kernel where one runs it (the
    reference for a call whose state tensors it cannot take), else the reference."""
    check_arguments(*args, ratio, coff, total_comp)
    kv, _, _, _, start_pos, _, kv_state, _ = args
    host = dispatch.launch_path(_PREPARED)
    problem = host.extend_problem(kv, ratio, coff, start_pos.shape[0])

    def reference(*tensors):
        kv, score, ape = (t.contiguous() for t in tensors[:3])
        out, cu_seqlens_comp = reference_extend.compressor_extend_reference(
            kv, score, ape, *tensors[3:], ratio, coff, total_comp)
        if total_comp is not None:
            dispatch.assert_rows_fit(cu_seqlens_comp, total_comp)
        return out, cu_seqlens_comp

    if problem is None or _kernel_extent(problem, rows, kv, kv_state) > INT32_MAX:
        return _PREPARED.remember(signature, reference)
    kernel = host.prepare_extend(problem, kv.shape[0], rows, start_pos.shape[0],
                                 kv_state.shape[0])

    def call(*tensors):
        result = kernel(*tensors)
        return reference(*tensors) if result is None else result

    return _PREPARED.remember(signature, call)


def _compressor_extend_cuda(kv, score, ape, cu_seqlens, start_pos, slots, kv_state,
                            score_state, ratio, coff, total_comp=None):
    args = (kv, score, ape, cu_seqlens, start_pos, slots, kv_state, score_state)
    rows = total_comp
    if rows is None:  # the documented host sync of the None form (validation first)
        check_arguments(*args, ratio, coff)
        rows = int(reference_extend.rows_of_requests(cu_seqlens, start_pos, ratio).sum())
    signature = dispatch.signature(args, ratio, coff, rows, total_comp is None)
    call = _PREPARED.get(signature) or _prepare_cuda(signature, args, ratio, coff, rows,
                                                     total_comp)
    # What the signature leaves out: the state's layout and identity, both written in place.
    if kv_state is score_state or not (kv_state.is_contiguous() and score_state.is_contiguous()):
        check_arguments(*args, ratio, coff, total_comp)
    return call(*args)


# CompositeExplicitAutograd: the vectorized reference serves every device; CUDA has a kernel.
_LIB.impl("compressor_extend", _compressor_extend, "CompositeExplicitAutograd")
_LIB.impl("compressor_extend", _compressor_extend_cuda, "CUDA")
_LIB.impl("compressor_extend", dispatch.inference_only("compressor_extend",
                                                       _compressor_extend_cuda),
          "Autograd", with_keyset=True)


def compressor_extend(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor,
                      cu_seqlens: torch.Tensor, start_pos: torch.Tensor, slots: torch.Tensor,
                      kv_state: torch.Tensor, score_state: torch.Tensor, *, ratio: int,
                      coff: int, total_comp: int | None = None):
    """Extend each request's state by its new tokens; return ``(out, cu_seqlens_comp)``.

    ``kv``/``score`` ``(T, coff*d)`` hold the new tokens THD-packed by ``cu_seqlens``;
    request ``i`` has consumed ``start_pos[i]`` tokens before and keeps its state in slot
    ``slots[i]`` of ``kv_state`` (kv's dtype) and ``score_state`` (fp32 logits
    ``score + ape``; fp64 for fp64 kv), both ``(S, coff*ratio, coff*d)``. A request with
    ``start_pos == 0`` reads nothing from its slot (no reset needed). Rows of every block
    completed by the new tokens come out packed per request in batch order, offsets in
    ``cu_seqlens_comp`` (B+1,) int32. ``total_comp=None`` returns exactly the true row count
    (a host sync on CUDA); an int is a static capacity (padding rows exact zeros, no sync).

    Numerics (bitwise run-to-run deterministic everywhere): on CUDA, a CuTe-DSL kernel of
    the forward's family pools each row with the forward kernel's own row code and flags
    (register windows ``coff * ratio <= 32``, which hold the production CSA configurations,
    and the streaming family's larger windows, e.g. ratio 128), so every row is
    bit-identical to the row the CUDA ``csa::compressor`` computes for that block over the
    whole sequence. Everything else runs the reference, whose rows are bit-identical to
    ``csa_ops.reference`` on the same device (the CPU ``csa::compressor``): fp64, fp32 at
    windows > 32, other archs, tensors of state whose base breaks the kernel's alignment
    (``kv_state``: kv's vector width, ``score_state``: 16 bytes), and streaming-family
    calls whose tokens or state exceed 2**31 elements. Slots must be distinct and in range
    and positions >= 0: checked on CPU; on CUDA unchecked, and never an access out of
    bounds. There a request whose slot, position or tokens are out of range gets zero rows
    and leaves every slot alone (kernel and reference alike), and the other requests come
    out as in a clean call, except that repeated slots (and in the reference, requests whose
    tokens overlap) leave those slots unspecified. Row offsets that pass int32 saturate at
    ``2**31 - 1``.
    Inference only.
    """
    return torch.ops.csa.compressor_extend(kv, score, ape, cu_seqlens, start_pos, slots,
                                           kv_state, score_state, ratio, coff, total_comp)


class CompressorState:
    """The per-slot state of ``csa::compressor_extend`` for ``num_slots`` requests.

    ``kv`` (kv's dtype) and ``score`` (fp32 logits, fp64 for fp64 kv) are
    ``(num_slots, coff*ratio, coff*head_dim)``, every slot in the initial state.
    """

    def __init__(self, num_slots: int, ratio: int, coff: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16, device=None):
        with validation.checking(OP):
            validation.check_ratio_coff(ratio, coff)
        shape = (num_slots, coff * ratio, coff * head_dim)
        self.ratio, self.coff, self.head_dim = ratio, coff, head_dim
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.score = torch.full(shape, float("-inf"), dtype=accumulate_dtype(dtype),
                                device=device)

    @property
    def num_slots(self) -> int:
        return self.kv.shape[0]

    def reset(self, slots=None) -> None:
        """Put ``slots`` (ints or a tensor; None = all) back in the initial state: values 0,
        logits -inf. Fixed-shape in-place fills: given a tensor on the state's device (or
        None), it can sit inside a CUDA graph."""
        if slots is None:
            self.kv.zero_()
            self.score.fill_(float("-inf"))
            return
        index = self._slot_index(slots, "reset", "slots")
        self.kv.index_fill_(0, index, 0.0)
        self.score.index_fill_(0, index, float("-inf"))

    def copy_slots(self, src, dst) -> None:
        """Give slots ``dst`` the state of slots ``src``, pair by pair (ints or tensors of
        equal length; ``dst`` distinct, ``src`` may repeat): a prompt's state forked for
        parallel samples, or a request moved to another slot. A slot in both is read before
        it is written, so ``copy_slots([a, b], [b, a])`` swaps two slots. Fixed-shape
        gathers and scatters: given tensors on the state's device, it can sit inside a CUDA
        graph."""
        src_index = self._slot_index(src, "copy_slots", "src")
        dst_index = self._slot_index(dst, "copy_slots", "dst")
        if src_index.numel() != dst_index.numel():
            raise ValueError(f"CompressorState.copy_slots: `src` and `dst` must pair up, got "
                             f"{src_index.numel()} and {dst_index.numel()} slots")
        if _on_host(dst) and dst_index.unique().numel() != dst_index.numel():
            raise ValueError("CompressorState.copy_slots: `dst` must not repeat a slot (which "
                             "copy would it keep?)")
        for state in (self.kv, self.score):
            state.index_copy_(0, dst_index, state.index_select(0, src_index))

    def _slot_index(self, slots, method: str, name: str) -> torch.Tensor:
        """``slots`` as an int64 index of this state's slots on its device. Values on the
        host (ints, CPU tensors) are checked here. A device tensor's are not read (that
        would sync, and no CUDA graph could hold the call): a negative one is moved out of
        range, so that torch's device-side index assertion stops it where indexing would
        otherwise wrap it to a slot counted from the end."""
        where = f"CompressorState.{method}: `{name}`"
        index = slots if isinstance(slots, torch.Tensor) else torch.as_tensor(slots)
        if index.numel() == 0:  # [] reads as fp32
            index = index.long()
        if index.dtype not in (torch.int32, torch.int64) or index.dim() > 1:
            raise TypeError(f"{where} must be slot numbers: ints or a 1-D int32/int64 "
                            f"tensor, got {index.dtype} of shape {tuple(index.shape)}")
        index = index.reshape(-1).long()
        if _on_host(slots):
            outside = index[(index < 0) | (index >= self.num_slots)]
            if outside.numel():
                raise ValueError(f"{where} holds slot {int(outside[0])}, outside the state's "
                                 f"[0, {self.num_slots})")
            return index.to(self.kv.device)
        if index.device != self.kv.device:
            raise ValueError(f"{where} must be on the state's device ({self.kv.device}) or "
                             f"the CPU, got {index.device}")
        return index.masked_fill(index < 0, self.num_slots)

    def extend(self, kv, score, ape, cu_seqlens, start_pos, slots, total_comp=None):
        """``compressor_extend`` on this state."""
        return compressor_extend(kv, score, ape, cu_seqlens, start_pos, slots, self.kv,
                                 self.score, ratio=self.ratio, coff=self.coff,
                                 total_comp=total_comp)


def _on_host(slots) -> bool:
    """Whether the values of ``slots`` (ints or a tensor) can be read without a device sync."""
    return not isinstance(slots, torch.Tensor) or slots.device.type == "cpu"
