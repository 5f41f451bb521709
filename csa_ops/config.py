"""Launch configuration of the compressor kernels: element types, compile keys, launch knobs.

A `KernelKey` names everything that changes generated code: family, ratio, coff, head_dim,
dtype, target arch, and the family's typed launch knobs (`WindowKnobs`, `StreamingKnobs`).
Keys are pure data: the same key compiles to the same kernel on any machine, and `repr(key)`
spells out every knob, defaults included. Each family's heuristics live in its plan module
(csa_ops/kernels/<family>/plan.py). Neither torch nor the DSL is imported here.
"""

from __future__ import annotations

import dataclasses
import enum


class Direction(str, enum.Enum):
    """What a kernel computes: csa::compressor's forward or backward, or csa::compressor_extend
    (compiled from the forward's key, whose knobs fix a row's bits). Members equal their
    short names ("fwd", "bwd", "ext"), which kernel-cache identities and labels spell."""

    FORWARD = "fwd"
    BACKWARD = "bwd"
    EXTEND = "ext"
    # The row epilogue (kernels/epilogue/, an EpilogueKey): csa::compressor_extend_store's
    # (the extend kernel's rows normalized, turned, encoded and stored into a paged cache)
    # and csa::compressor_epilogue's forward (csa::compressor's rows, packed) and backward
    # (the pooled rows' gradient and grad_weight's partial sums).
    STORE = "store"
    EPILOGUE = "epi"
    EPILOGUE_BACKWARD = "epib"
    # csa::compressor_extend_store's decode step in one kernel (an ExtendStoreKey): the
    # extend kernel's state update and rows, each row through the store's epilogue.
    EXTEND_STORE = "exst"
    # ... and a split call's second launch (a RowsStoreKey), beside the first (an
    # ExtendStoreKey of its head rows): its other rows, each through the store's epilogue.
    ROWS_STORE = "rost"
    # csa::compressor_epilogue's forward in one kernel (a ForwardEpilogueKey): the forward
    # kernel's rows, each through the training epilogue where it is pooled.
    FORWARD_EPILOGUE = "fepi"
    # ... and its backward (a BackwardEpilogueKey): each row pooled again, its gradient
    # through the epilogue and then through the softmax, in one kernel.
    BACKWARD_EPILOGUE = "bepi"

    @classmethod
    def of(cls, backward: bool) -> Direction:
        """csa::compressor's backward where `backward`, else its forward."""
        return cls.BACKWARD if backward else cls.FORWARD

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class _KnobEnum(enum.IntEnum):
    """An integer knob's named values; repr names the value, so keys read as their meaning."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class Part(_KnobEnum):
    """Which work items of a csa::compressor_extend call one launch runs: the whole call, or
    a split call's requests' items (each request's state and state-reading rows) or its row
    items (every other output row), launched beside each other."""

    WHOLE = 0
    REQUESTS = 1
    ROWS = 2


class Parity(_KnobEnum):
    """The streaming forward's columns in torch's CUDA order: never (the fast softmax alone,
    within one output rounding step except on rare cancelling columns), where the fast
    softmax cannot certify one rounding step of it (the default), or always (tests)."""

    NEVER = 0
    UNCERTIFIED = 1
    ALWAYS = 2


@dataclasses.dataclass(frozen=True)
class DType:
    """An element type. `name` is torch's attribute (getattr(torch, name)), `dsl` the DSL's
    (getattr(cutlass, dsl)); `precision` counts significand bits, the implicit one included
    (value bits for an integer type)."""

    name: str
    dsl: str
    bytes: int
    precision: int


# Every element type a kernel argument has: the key's dtype, fp32 (ape, grad_ape, workspace)
# int32 (cu_seqlens, cu_seqlens_comp) and uint8 (quantized caches).
TYPES = {t.name: t for t in (
    DType("bfloat16", "BFloat16", 2, 8),
    DType("float16", "Float16", 2, 11),
    DType("float32", "Float32", 4, 24),
    DType("int32", "Int32", 4, 31),
    DType("uint8", "Uint8", 1, 8),
)}
DTYPES = ("bfloat16", "float16", "float32")  # what kv / score (a key's dtype) may be
ARCHS = ("sm_90a", "sm_100a")

# The row-capacity assertion: a call with more rows than its output holds (a static
# total_comp below the true count) stops with a device-side assertion on CUDA (the kernels
# print it and trap; the torch paths use torch's own), never dropping rows without a word.
CAPACITY_CAUSE = "a static total_comp below the true row count"
CAPACITY_MESSAGE = ("csa_ops: cu_seqlens_comp[-1] exceeds the output rows of the call "
                    f"({CAPACITY_CAUSE})")


class _Knobs:
    """Type checks shared by the knob classes: flags are bools (0 and 1 accepted and stored
    as bools, so equal knobs have equal reprs), everything else an int."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, field.name)
            kind = _ENUM_KNOBS.get(field.type)
            if kind is not None:
                if value not in set(kind) or isinstance(value, (bool, float)):
                    raise ValueError(f"{type(self).__name__}.{field.name} must be one of "
                                     f"{[int(v) for v in kind]}, got {value!r}")
                object.__setattr__(self, field.name, kind(value))
            elif field.type in ("bool", bool):
                if value not in (0, 1) or isinstance(value, float):
                    raise ValueError(f"{type(self).__name__}.{field.name} must be a bool, "
                                     f"got {value!r}")
                object.__setattr__(self, field.name, bool(value))
            elif not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{type(self).__name__}.{field.name} must be an int, "
                                 f"got {value!r}")
        if self.lane_requests and self.part is Part.WHOLE:
            raise ValueError(f"{type(self).__name__}.lane_requests needs a split call "
                             "(part REQUESTS or ROWS)")


@dataclasses.dataclass(frozen=True)
class WindowKnobs(_Knobs):
    """Launch knobs of the register-window family (kernels/window/)."""

    vec: int  # elements per thread access
    threads: int  # threads per CTA, rounded down to whole rows of column vectors
    pdl: bool = True  # programmatic dependent launch (common.await_upstream)
    # 1-D grid with the column chunk fastest, so CTAs resident together read whole token
    # rows (DRAM pages) instead of one 128-byte chunk of many rows.
    linear: bool = True
    # Forward softmax through ex2.approx and one division per column, certified within one
    # output rounding step (shared/softmax.py); False keeps the reference's operations.
    fast_exp: bool = False
    balance: bool = True  # backward shared memory padded to cap CTAs per SM (kernels/window/)
    min_ctas: int = 0  # CTAs per SM the register allocation must allow (0: compiler's choice)
    # csa::compressor_extend only: one-token requests load their state update before the
    # row scan (kernels/window/extend.py). It costs registers: only the decode-sized key sets it.
    preload_decode: bool = False
    # csa::compressor_extend only: a request's item pools all of its rows and the grid has
    # no row items (kernels/window/extend.py). For calls of one token per request (decode steps),
    # whose rows their requests' items pool anyway: half the CTAs, no batch scan.
    request_rows: bool = False
    # csa::compressor_extend only: WHOLE, one launch does the call; else the call is two
    # launches: REQUESTS, its requests' items (the rows that read the state, the new state),
    # then ROWS, its row items, which start without waiting for the first (PDL) and so run
    # beside it, at the forward's registers per thread.
    part: Part = Part.WHOLE
    # csa::compressor_extend only, split calls of at most 32 requests: each warp of part 2
    # holds the batch in its lanes and finds its rows' requests by shuffles, with no batch
    # scan, barrier or reload (kernels/window/extend.py); else part 2 scans the batch per CTA.
    lane_requests: bool = False


@dataclasses.dataclass(frozen=True)
class StreamingKnobs(_Knobs):
    """Launch knobs of the streaming family (kernels/streaming/)."""

    vec: int  # elements per thread access
    cv: int  # column vectors per CTA
    wpc: int  # warps per column vector
    kt: int  # window entries per lane
    stages: int  # shared-memory tiles in the cp.async pipeline
    ctas: int  # CTAs per SM the register allocation must allow
    fast_exp: bool = False  # exp through ex2.approx (within one output rounding step)
    lean: bool = False  # rows whose whole window exists skip the per-entry masks
    pdl: bool = True  # programmatic dependent launch (common.await_upstream)
    # Forward columns in torch's CUDA order (kernels/shared/torch_order.py; see Parity).
    parity: Parity = Parity.NEVER
    # Forward with parity only: the row loop marks the columns to take torch's order (a
    # bit per column in the workspace) and a second launch computes them, every CTA's at
    # once, instead of each in its row (the same bits; kernels/streaming/exact.py).
    deferred: bool = False
    # csa::compressor_extend only, as WindowKnobs.part; ROWS is every other output row
    # (padding and invalid requests' rows: zeros), through the forward's pipelined row loop,
    # beside the requests' launch.
    part: Part = Part.WHOLE
    # Split calls of at most 32 requests: each warp of part 2 holds the batch in its lanes
    # and its row groups take the rows part 1 does not pool in order, evenly (no gaps where
    # part 1's rows lie); else part 2 scans the batch per CTA and strides over all rows.
    lane_requests: bool = False

    @property
    def threads(self) -> int:
        return 32 * self.cv * self.wpc


KNOBS = {"window": WindowKnobs, "streaming": StreamingKnobs}
# Knob fields of enum type, by their annotation (a string: annotations are postponed).
_ENUM_KNOBS = {"Part": Part, "Parity": Parity}


@dataclasses.dataclass(frozen=True)
class KernelKey:
    """Compile key: the problem's static extents and dtype, the target, the family's knobs."""

    family: str
    ratio: int
    coff: int
    head_dim: int
    dtype: str
    arch: str
    knobs: WindowKnobs | StreamingKnobs

    def __post_init__(self) -> None:
        if self.family not in KNOBS:
            raise ValueError(f"KernelKey.family must be one of {tuple(KNOBS)}, "
                             f"got {self.family!r}")
        if type(self.knobs) is not KNOBS[self.family]:
            raise ValueError(f"KernelKey.knobs of family {self.family!r} must be "
                             f"{KNOBS[self.family].__name__}, got {self.knobs!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"KernelKey.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.arch not in ARCHS:
            raise ValueError(f"KernelKey.arch must be one of {ARCHS}, got {self.arch!r}")
        if self.ratio < 1 or self.coff not in (1, 2) or self.head_dim < 1:
            raise ValueError(
                f"KernelKey needs ratio >= 1, coff in (1, 2), head_dim >= 1; got ratio="
                f"{self.ratio}, coff={self.coff}, head_dim={self.head_dim}"
            )
        vec = self.knobs.vec
        if vec < 1 or self.head_dim % vec:
            raise ValueError(f"KernelKey: vec={vec} must divide head_dim={self.head_dim}")

    @property
    def window(self) -> int:
        return self.coff * self.ratio

    @property
    def elem_bytes(self) -> int:
        return TYPES[self.dtype].bytes

    @property
    def align_bytes(self) -> int:
        """Base-pointer alignment the kernel assumes for kv/score/out/grad tensors."""
        return self.knobs.vec * self.elem_bytes


def with_knobs(key: KernelKey, **overrides: int) -> KernelKey:
    """`key` with some launch knobs replaced (autotuning, --knobs options); a name that is
    not a knob of the key's family raises ValueError."""
    names = [field.name for field in dataclasses.fields(key.knobs)]
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise ValueError(f"{key.family} kernels have no knob {', '.join(unknown)}; "
                         f"their knobs: {', '.join(names)}")
    return dataclasses.replace(key, knobs=dataclasses.replace(key.knobs, **overrides))


def parse_knobs(text: str) -> dict[str, int]:
    """"pdl=0,linear=0" -> {"pdl": 0, "linear": 0} (names are checked by `with_knobs`)."""
    knobs = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep or not value.strip().lstrip("-").isdigit():
            raise ValueError(f"knob settings are name=integer, got {item!r} in {text!r}")
        knobs[name.strip()] = int(value)
    return knobs


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """Per-call launch shape: CTAs in the grid and fp32 scratch elements the launch needs."""

    grid: int
    workspace: int = 0


def widest_vec(head_dim: int, elem_bytes: int, max_elems: int) -> int:
    """Largest power of two dividing head_dim, at most 16 bytes and at most max_elems."""
    vec = 1
    while (
        head_dim % (vec * 2) == 0 and (vec * 2) * elem_bytes <= 16 and vec * 2 <= max_elems
    ):
        vec *= 2
    return vec
