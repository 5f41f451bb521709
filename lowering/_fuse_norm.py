"""The opt-in rewrite of csa::compressor followed by an RMSNorm into the fused op.

With ``csa_ops.lowering.fuse_rms_norm = True`` a graph pass before autograd (Inductor's
``pre_grad_custom_pass``) finds the pooled rows of a ``csa::compressor`` call whose only use
is an RMSNorm over the row (``torch.nn.functional.rms_norm``, ``nn.RMSNorm``, or the
explicit ``y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * weight``) and replaces
both with one ``csa::compressor_epilogue`` call (no RoPE, no rotation), whose backward op
then replaces theirs. The result follows the fused op's numerics contract, not eager's bits
of the two steps. Anything else is left as it is: a weightless norm, a norm over other
dimensions, rows used elsewhere, a norm whose output dtype differs from the rows'.
"""

from __future__ import annotations

import hashlib
import math
import operator
from pathlib import Path

import torch
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

from csa_ops.epilogue import NORM_WEIGHT_DTYPES

COMPRESSOR_TARGETS = (torch.ops.csa.compressor, torch.ops.csa.compressor.default)
FUSED = torch.ops.csa.compressor_epilogue.default
COMPRESSOR_ARGS = ("kv", "score", "ape", "cu_seqlens", "cu_seqlens_comp", "ratio", "coff",
                   "total_comp")
RMS_NORM_TARGETS = (torch.rms_norm, torch.nn.functional.rms_norm)
# The explicit form's steps, as Dynamo records them (a method call or a function).
_FUNCTIONS = {"pow": (torch.pow, operator.pow), "mul": (torch.mul, operator.mul),
              "add": (torch.add, operator.add), "mean": (torch.mean,),
              "rsqrt": (torch.rsqrt,), "square": (torch.square,)}
_ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _value(node):
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None


def _is(node, kind: str) -> bool:
    if not isinstance(node, torch.fx.Node):
        return False
    return ((node.op == "call_method" and node.target == kind)
            or (node.op == "call_function" and node.target in _FUNCTIONS[kind]))


def _compressor_args(node) -> dict | None:
    if node.op != "call_function" or node.target not in COMPRESSOR_TARGETS:
        return None
    named = dict(zip(COMPRESSOR_ARGS, node.args))
    named.update(node.kwargs)
    named.setdefault("total_comp", None)
    return named


def _other(node, known):
    """The argument of a binary node that is not ``known`` (None unless exactly one is)."""
    a, b = node.args[:2]
    if a is known and b is not known:
        return b
    if b is known and a is not known:
        return a
    return None


def _squares(node, rows) -> bool:
    if _is(node, "pow"):
        return node.args[0] is rows and node.args[1] in (2, 2.0)
    if _is(node, "mul"):
        return node.args[0] is rows and node.args[1] is rows
    return _is(node, "square") and node.args[0] is rows


def _row_mean(node, squares) -> bool:
    if not _is(node, "mean") or node.args[0] is not squares:
        return False
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    dims = tuple(dim) if isinstance(dim, (list, tuple)) else (dim,)
    return keepdim is True and dims in ((-1,), (1,))


def _explicit_norm(rows):
    """(output node, weight node, eps) of ``rows * rsqrt(mean(rows^2) + eps) * weight``."""
    users = list(rows.users)
    for squares in users:
        if not _squares(squares, rows) or len(squares.users) != 1:
            continue
        (mean,) = squares.users
        if not _row_mean(mean, squares) or len(mean.users) != 1:
            continue
        (shifted,) = mean.users
        eps = _other(shifted, mean) if _is(shifted, "add") else None
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or len(shifted.users) != 1:
            continue
        (inverse,) = shifted.users
        if not _is(inverse, "rsqrt") or len(inverse.users) != 1:
            continue
        (normed,) = inverse.users
        if not _is(normed, "mul") or _other(normed, inverse) is not rows:
            continue
        if set(users) != {squares, normed} or len(normed.users) != 1:
            continue
        (scaled,) = normed.users
        weight = _other(scaled, normed) if _is(scaled, "mul") else None
        if isinstance(weight, torch.fx.Node):
            return scaled, weight, float(eps)
    return None


def _library_norm(rows):
    """(output node, weight node, eps) of ``rms_norm(rows, (d,), weight, eps)``."""
    if len(rows.users) != 1:
        return None
    (norm,) = rows.users
    if norm.op != "call_function" or norm.target not in RMS_NORM_TARGETS:
        return None
    names = ("input", "normalized_shape", "weight", "eps")
    named = {**dict(zip(names, norm.args)), **norm.kwargs}
    shape, weight, eps = named.get("normalized_shape"), named.get("weight"), named.get("eps")
    value = _value(rows)
    if named.get("input") is not rows or not isinstance(weight, torch.fx.Node):
        return None
    if not isinstance(shape, (list, tuple)) or len(shape) != 1 or value is None \
            or shape[0] != value.shape[-1]:
        return None
    if eps is None:  # rms_norm's default
        eps = torch.finfo(value.dtype).eps
    return (norm, weight, float(eps)) if isinstance(eps, (int, float)) else None


def _fusable(rows, norm, weight, eps) -> bool:
    """The fused op takes these arguments and computes what the norm does: 2-D rows, a
    (d,) weight of a dtype it takes on the rows' device, eps >= 0, and the norm's output in
    the rows' dtype and shape."""
    row, out, w = _value(rows), _value(norm), _value(weight)
    if not all(isinstance(t, torch.Tensor) for t in (row, out, w)):
        return False
    weights = NORM_WEIGHT_DTYPES + ((torch.float64,) if row.dtype == torch.float64 else ())
    return (row.dim() == 2 and row.dtype in _ROW_DTYPES and w.dtype in weights
            and tuple(w.shape) == (row.shape[1],) and w.device == row.device
            and math.isfinite(eps) and eps >= 0
            and out.dtype == row.dtype and tuple(out.shape) == tuple(row.shape))


def fuse(graph: torch.fx.Graph) -> int:
    """Rewrites every fusable compressor + RMSNorm pair of ``graph``; returns how many."""
    fused = 0
    for rows in list(graph.nodes):
        args = _compressor_args(rows)
        if args is None:
            continue
        found = _library_norm(rows) or _explicit_norm(rows)
        if found is None or not _fusable(rows, *found):
            continue
        norm, weight, eps = found
        with graph.inserting_before(norm):
            node = graph.call_function(FUSED, (
                *(args[name] for name in COMPRESSOR_ARGS[:7]), weight, eps, None, None, 0,
                None, False, args["total_comp"]))
        node.meta = dict(norm.meta)
        norm.replace_all_uses_with(node)
        # The norm's steps, then the pooled rows, each once nothing uses it any more.
        pending = [norm]
        while pending:
            step = pending.pop()
            if step is rows or step.users:
                continue
            inputs = [a for a in step.all_input_nodes if a is not weight]
            graph.erase_node(step)
            pending.extend(inputs)
        if not rows.users:
            graph.erase_node(rows)
        fused += 1
    return fused


_DIGEST = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


class FuseRmsNorm(CustomGraphPass):
    """The rewrite as Inductor's pre-grad custom pass; ``then`` is the pass it replaced (a
    user's), run after it."""

    def __init__(self, then=None) -> None:
        self.then = then

    def __call__(self, graph: torch.fx.Graph) -> None:
        if fuse(graph):
            graph.lint()
        if self.then is not None:
            self.then(graph)

    def uuid(self):
        then = self.then.uuid() if hasattr(self.then, "uuid") else repr(self.then)
        return f"csa_ops.fuse_rms_norm-{_DIGEST}-{then}"


def install(enabled: bool) -> None:
    """Puts the pass in front of any other pre-grad custom pass, or takes it out."""
    current = inductor_config.pre_grad_custom_pass
    ours = current if isinstance(current, FuseRmsNorm) else None
    if enabled and ours is None:
        inductor_config.pre_grad_custom_pass = FuseRmsNorm(current)
    elif not enabled and ours is not None:
        inductor_config.pre_grad_custom_pass = ours.then
