"""The lowering's registration, from the fakes."""

from __future__ import annotations


def register_lowering() -> None:
    # Every trace calls a fake before Inductor lowers or picks its decompositions, so the
    # integration is registered here rather than at ``import csa_ops``: importing Inductor
    # takes seconds, and ``import csa_ops`` must stay within a fraction of ``import torch``.
    from csa_ops import lowering

    lowering.ensure_registered()
