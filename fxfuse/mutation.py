"""Tensors written in place in an ATen graph, and which nodes see those writes.

normalize turns in-place ops on fresh, unaliased intermediates into their out-of-place twins; the
writes that stay go through a view or to a tensor with other readers (``h[..., :16].mul_(2)``,
``labels[labels == -100] = 0``, a cache's ``copy_``). Two reads of one storage on either side of
such a write see different values. So the canonical view must not read one node as another that
only equals it by value (``x * 1.0`` as ``x``: a copy, not an alias) when either is written, and a
fused op, which reads its inputs once where it is called, must not stand for reads on both sides of
a write (fxfuse/matcher.py).
"""
from __future__ import annotations

import operator
from collections import defaultdict

import torch
import torch.fx as fx


def _returns_view(target) -> bool:
    """An ATen op whose first output aliases its input without writing it (view, slice, transpose,
    split's pieces, ...)."""
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.returns:
        return False
    alias = target._schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def _viewed(n: fx.Node) -> fx.Node | None:
    """The tensor n is a view of (or an in-place op's written input, which n returns), else None."""
    if n.op != "call_function":
        return None
    if n.target is operator.getitem:  # a piece of split / unbind / chunk
        src = n.args[0]
        return src.args[0] if isinstance(src, fx.Node) and _returns_view(src.target) else None
    written = written_args(n)
    if written:
        return written[0]
    return n.args[0] if _returns_view(n.target) and n.args and isinstance(n.args[0], fx.Node) else None


def written_args(n: fx.Node) -> list[fx.Node]:
    """The arguments n writes in place (aten.mul_'s self, copy_'s self, index_put_'s self, out=)."""
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return []
    out = []
    for i, a in enumerate(n.target._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
            if isinstance(v, fx.Node):
                out.append(v)
    return out


def written_storages(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """node -> the in-place writes to its storage (to it, a view of it, or a tensor it views), for
    every node whose storage some op of graph writes; empty when nothing is written in place."""
    base: dict[fx.Node, fx.Node] = {}
    writes: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for n in graph.nodes:
        src = _viewed(n)
        if src is not None:
            base[n] = base.get(src, src)
        for a in written_args(n):
            writes[base.get(a, a)].append(n)
    if not writes:
        return {}
    return {n: writes[base.get(n, n)] for n in graph.nodes if base.get(n, n) in writes}
