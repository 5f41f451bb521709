"""The one lowering policy: which path Inductor takes for a csa::compressor call.

``mode`` is "auto" (default), "extern" (always call the opaque op) or "generate" (always emit
Inductor kernels); the environment variable CSA_OPS_LOWERING sets the initial value.
"auto" calls the hand-written CUDA kernel wherever ``csa_ops.host`` supports the
configuration and generates everywhere else: eager runs that kernel, and compiling must not
change the op's numerics (users compare compiled against eager bitwise), which generated code
cannot promise where the kernel runs. Changing the mode retags Inductor's on-disk caches and
resets torch.compile's in-process caches, so no code generated under another mode is reused.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
from pathlib import Path

import torch

MODES = ("auto", "extern", "generate")
ENV = "CSA_OPS_LOWERING"
FUSE_RMS_NORM_ENV = "CSA_OPS_FUSE_RMSNORM"

_USER_TAG = torch.compiler.config.cache_key_tag
_state = {"mode": "auto", "fuse_rms_norm": False}


def _source_digest() -> str:
    """Hash of this package's sources, so an edited lowering never reuses cached code."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


_DIGEST = _source_digest()


def _package_version() -> str:
    try:
        return importlib.metadata.version("csa-ops")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def cache_tag(mode: str) -> str:
    return f"csa_ops-{_package_version()}-{_DIGEST}-{mode}"


def _validated(value) -> str:
    if value not in MODES:
        raise ValueError(f"csa_ops.lowering.mode must be one of {MODES}, got {value!r}")
    return value


def _apply_tag(mode: str) -> None:
    ours = cache_tag(mode)
    torch.compiler.config.cache_key_tag = f"{_USER_TAG}|{ours}" if _USER_TAG else ours


def get_mode() -> str:
    return _state["mode"]


def set_mode(value: str) -> None:
    """Set the policy; compiled code from the previous mode is discarded."""
    value = _validated(value)
    if value == _state["mode"]:
        return
    _state["mode"] = value
    _apply_tag(value)
    # Dynamo does not guard on this policy: drop frames compiled under the old one.
    torch.compiler.reset()


def get_fuse_rms_norm() -> bool:
    return _state["fuse_rms_norm"]


def set_fuse_rms_norm(value: bool) -> None:
    """Whether torch.compile rewrites csa::compressor followed by an RMSNorm into
    csa::compressor_epilogue (lowering/_fuse_norm.py); frames compiled before are dropped."""
    if not isinstance(value, bool):
        raise ValueError(f"csa_ops.lowering.fuse_rms_norm must be a bool, got {value!r}")
    changed = value != _state["fuse_rms_norm"]
    _apply_fuse_rms_norm(value)
    if changed:
        torch.compiler.reset()  # Dynamo does not guard on it either


def _apply_fuse_rms_norm(value: bool) -> None:
    from . import _fuse_norm

    _fuse_norm.install(value)
    _state["fuse_rms_norm"] = value


def init_from_env() -> None:
    fuse = os.environ.get(FUSE_RMS_NORM_ENV, "0").strip()
    if fuse not in ("", "0", "1"):
        raise ValueError(f"environment variable {FUSE_RMS_NORM_ENV}: must be 0 or 1, got "
                         f"{fuse!r}")
    if fuse == "1":
        # No reset: this runs at registration, which can be inside a trace's first fake.
        _apply_fuse_rms_norm(True)
    raw = os.environ.get(ENV, "auto").strip().lower() or "auto"
    try:
        _state["mode"] = _validated(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {ENV}: {exc}") from None
    _apply_tag(_state["mode"])


# ---------------------------------------------------------------------------------------
# The decision


def extern_kernel_supports(device: torch.device, dtype: torch.dtype, ratio: int, coff: int,
                           head_dim: int) -> bool:
    """Whether the CuTe-DSL kernels run this configuration (metadata only, no tensors);
    csa_ops.host is imported lazily because it pulls in cutlass."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        from csa_ops import host
    except ImportError:
        return False
    return host.supports_config(device, dtype, ratio, coff, head_dim)


def choose(direction: str, device: torch.device, dtype: torch.dtype, ratio: int, coff: int,
           head_dim, num_tokens: int | None = None) -> str:
    """"extern" or "generate" for one call of ``direction`` ("fwd"/"bwd").

    head_dim may be a callable returning the int (it can cost a shape guard, so it is only
    evaluated when the answer depends on it). num_tokens, the static token count (None when
    dynamic), is accepted for rules that depend on size; the current rule does not."""
    mode = _state["mode"]
    if mode != "auto":
        return mode
    if device.type != "cuda":
        return "generate"
    hd = head_dim() if callable(head_dim) else head_dim
    return "extern" if extern_kernel_supports(device, dtype, ratio, coff, hd) else "generate"
