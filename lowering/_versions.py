"""The torch release as (major, minor), for the version gate and the version adapters."""

from __future__ import annotations

import torch


def release(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``version`` (default: the running torch's), e.g. "2.15.0+cu132"."""
    major, minor = (version or torch.__version__).split(".")[:2]
    return int(major), int(minor)
