"""Spellings unified by rewriting the ATen graph into another op of the same values (model graphs and
pattern traces alike, like the rest of normalize.canonical_ops), where a canonical-view label cannot
express them because a shape or an op between the nodes differs.

A reduction without keepdim whose dim comes back later -> the same reduction with keepdim:

    x * torch.rsqrt(x.pow(2).mean(-1) + eps).unsqueeze(-1)        # or [..., None], .view(B, T, 1)
    x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)          # what it becomes

``mean`` / ``sum`` over one dim k without keepdim ([..., D] -> [...]), then a chain of pointwise ops
(``+ eps``, ``rsqrt``, ``sqrt``, ``1 / t``, casts), then ``unsqueeze(k)`` or a view / reshape to the
keepdim shape: the reduction keeps dim k and the unsqueeze goes away. The values are the same
(pointwise ops compute element by element whatever the shape), so the patterns, written with
keepdim=True as HF writes them, match both spellings. Only where each node from the reduction to the
unsqueeze has one user (the next), so no other reader sees a shape change, and every other tensor
operand of a pointwise op is 0-dim (a broadcast against [...] would broadcast another way against
[..., 1]).

The negative log-likelihood of a log_softmax -> cross_entropy:

    F.nll_loss(F.log_softmax(z, -1), t, ...)                         # fairseq, many training loops
    F.nll_loss(F.log_softmax(z.float(), -1).transpose(1, 2), t)      # [B, T, V] -> class dim second
    F.nll_loss(F.log_softmax(z, -1).view(-1, V), t.view(-1))         # [B, T, V] -> [B * T, V]
    F.cross_entropy(z, t, ...)                                       # what it becomes

ATen's cross_entropy_loss is that composition (log_softmax over the class dim, then nll_loss_nd,
with the same weight / reduction / ignore_index arguments), so the values and gradients are eager's
own. ``log_softmax(z, d, dtype=...)`` casts z first (an ``aten.to`` node). Only where the log_softmax
(and the transpose) is read by the nll_loss alone, and the softmax dim is nll_loss's class dim
(dim 1, or 0 for a 1-D input) once the transpose is applied; a view / reshape between them
(``.view(-1, V)``) keeps the softmax's last dim and its size as nll_loss's class dim.

The log-probability of each taken token, read off a log_softmax or a logsumexp -> minus the per-token
cross-entropy:

    F.log_softmax(z, -1).gather(-1, t.unsqueeze(-1)).squeeze(-1)              # verl, RL per-token logps
    z.gather(-1, t.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, -1)         # TRL's selective_log_softmax
    (a loop over the batch rows of either, stacked, is batched first: fxfuse/unstack.py)
    -F.cross_entropy(z.flatten(0, -2), t.flatten(), reduction="none",         # what they become (in the
                     ignore_index=NO_CLASS).view_as(...)                       # gather's / the sub's shape)

log_softmax(z)[t] = z[t] - logsumexp(z) = -cross_entropy(z, t) for one row, so the values are eager's
within one rounding (the cross_entropy rounds once where the spellings round the log-probs and their
difference) and the gradients are the same math. Eager gather raises on an index outside [0, V); so
does cross_entropy, whose ignore_index NO_CLASS (int64's least value) no index takes. Only where the
gather is over the last dim with an index [..., 1] (one token per row; gather reads the first rows
where the index has fewer, so the logits are sliced to its sizes unless they are known equal), and
each node replaced (the log_softmax; the gather, its squeeze, the logsumexp) is read by the next alone.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .canon_rules import CASTS, fake_call, val
from .shapes import RESHAPES

aten = torch.ops.aten
REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList}
NO_CLASS = torch.iinfo(torch.int64).min  # the ignore_index of a gathered log-prob: no index is ignored


def _reduced_dim(r: fx.Node) -> int | None:
    """k when r reduces its input over the one dim k (normalised) without keepdim, else None."""
    if r.op != "call_function" or r.target not in REDUCTIONS or len(r.args) < 2:
        return None
    keepdim = r.args[2] if len(r.args) > 2 else r.kwargs.get("keepdim", False)
    x, dims = val(r.args[0]), r.args[1]
    if keepdim or not isinstance(x, torch.Tensor) or not isinstance(dims, (list, tuple)) or len(dims) != 1:
        return None
    return dims[0] % x.dim() if x.dim() else None


def _carrier(n: fx.Node) -> fx.Node | None:
    """The one tensor operand of a pointwise op (or cast) n that has n's shape, where every other tensor
    operand is 0-dim (a cast's dtype reference aside); else None."""
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return None
    out = val(n)
    if n.target in CASTS:
        return n.args[0] if isinstance(n.args[0], fx.Node) else None
    if torch.Tag.pointwise not in n.target.tags or not isinstance(out, torch.Tensor):
        return None
    tensors = [a for a in (*n.args, *n.kwargs.values()) if isinstance(val(a), torch.Tensor)]
    big = [a for a in tensors if val(a).dim() > 0]
    return big[0] if len(big) == 1 and val(big[0]).dim() == out.dim() else None


def _restores(u: fx.Node, k: int, x: torch.Tensor) -> bool:
    """u re-inserts dim k of x's shape as size 1 into its input (the reduction's result, shape x
    without dim k): ``unsqueeze(k)``, or a view / reshape to that keepdim shape."""
    if u.op != "call_function":
        return False
    if u.target == aten.unsqueeze.default:
        return u.args[1] % x.dim() == k
    out = val(u)
    if u.target not in RESHAPES or not isinstance(out, torch.Tensor) or out.dim() != x.dim():
        return False
    want = [1 if i == k else s for i, s in enumerate(x.shape)]
    return all(statically_known_true(a == b) for a, b in zip(out.shape, want))


def _chain(u: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """(reduction, pointwise nodes from it to u's input) when u restores the reduced dim, else None."""
    chain, cur = [], u.args[0] if u.args else None
    while isinstance(cur, fx.Node) and len(cur.users) == 1:
        k = _reduced_dim(cur)
        if k is not None:
            return (cur, chain[::-1]) if _restores(u, k, val(cur.args[0])) else None
        nxt = _carrier(cur)
        if nxt is None:
            return None
        chain.append(cur)
        cur = nxt
    return None


def _recompute(n: fx.Node) -> None:
    """n's fake value from its (changed) arguments'."""
    n.meta["val"] = fake_call(n.target, n)
    n.meta.pop("tensor_meta", None)


def canonical_keepdim(graph: fx.Graph) -> None:
    """The keepdim rewrite of the module doc, on every unsqueeze / reshape it applies to."""
    for u in list(graph.nodes):
        if u.op != "call_function" or u.target not in (aten.unsqueeze.default, *RESHAPES):
            continue
        found = _chain(u)
        if found is None:
            continue
        r, chain = found
        r.args = (r.args[0], r.args[1], True, *r.args[3:])
        r.kwargs = {k: v for k, v in r.kwargs.items() if k != "keepdim"}
        for n in (r, *chain):
            _recompute(n)
        u.replace_all_uses_with(chain[-1] if chain else r)
        graph.erase_node(u)


def _softmax_of(lp: fx.Node, class_dim: int) -> tuple[fx.Node, fx.Node | None] | None:
    """(log_softmax node, layout node or None) when lp is log_softmax(z, d) over class_dim, or one
    layout op of such a log_softmax that commutes with it: a transpose that moves d to class_dim, or a
    view / reshape that keeps d as the last dim with its size when class_dim is the last dim
    (``.view(-1, V)``); each read once."""
    layout = None
    if lp.op == "call_function" and len(lp.users) == 1 and lp.target in (aten.transpose.int, *RESHAPES):
        layout, lp = lp, lp.args[0]
    if not (isinstance(lp, fx.Node) and lp.op == "call_function" and lp.target == aten.log_softmax.int
            and len(lp.users) == 1 and isinstance(val(lp), torch.Tensor)):
        return None
    d = lp.args[1] % val(lp).dim()
    if layout is None:
        return (lp, None) if d == class_dim else None
    out = val(layout)
    if layout.target == aten.transpose.int:
        a, b = (i % out.dim() for i in layout.args[1:3])
        return (lp, layout) if {d, class_dim} == {a, b} or (d == class_dim and d not in (a, b)) else None
    last = val(lp).dim() - 1
    keeps_last = class_dim == out.dim() - 1 and statically_known_true(out.shape[-1] == val(lp).shape[-1])
    return (lp, layout) if d == last and keeps_last else None


def canonical_nll(graph: fx.Graph) -> None:
    """The cross-entropy rewrite of the module doc, on every nll_loss of a log_softmax."""
    for nll in list(graph.nodes):
        if nll.op != "call_function" or nll.target != aten.nll_loss_nd.default:
            continue
        lp = nll.args[0]
        rank = val(lp).dim() if isinstance(val(lp), torch.Tensor) else 0
        found = _softmax_of(lp, 1 if rank > 1 else 0) if rank else None
        if found is None:
            continue
        softmax, layout = found
        with graph.inserting_before(nll):
            z = softmax.args[0]
            dtype = softmax.args[2] if len(softmax.args) > 2 else softmax.kwargs.get("dtype")
            if dtype is not None:
                z = fresh_node(graph, aten.to.dtype, (z, dtype), softmax)
            if layout is not None:  # the same transpose / reshape, before the softmax instead of after; a
                # view becomes a reshape: z may have strides no view of it can take where the softmax's
                # fresh output had
                target = layout.target if layout.target == aten.transpose.int else aten.reshape.default
                z = fresh_node(graph, target, (z, *layout.args[1:]), layout)
            ce = fresh_node(graph, aten.cross_entropy_loss.default, (z, *nll.args[1:]), nll, nll.kwargs)
        nll.replace_all_uses_with(ce)
        for n in (nll, *([layout] if layout is not None else []), softmax):
            graph.erase_node(n)


def fresh_node(graph: fx.Graph, target, args: tuple, like: fx.Node, kwargs: dict | None = None) -> fx.Node:
    """A new node target(*args) with like's metadata (module path, stack trace) and its own value
    (computed in like's fake mode)."""
    n = graph.call_function(target, args, dict(kwargs or {}))
    n.meta.update({k: v for k, v in like.meta.items() if k != "tensor_meta"})
    _recompute(n)
    return n


def _last_dim(n: fx.Node, dim) -> bool:
    v = val(n)
    return isinstance(v, torch.Tensor) and v.dim() >= 2 and isinstance(dim, int) and dim % v.dim() == v.dim() - 1


def _one_token_gather(g) -> tuple[fx.Node, fx.Node] | None:
    """(source, index) where g gathers one entry per row over the last dim: gather(src, -1, index) with
    index [..., 1] (its leading sizes at most src's, as gather requires: see _leading_rows)."""
    if not (isinstance(g, fx.Node) and g.op == "call_function" and g.target == aten.gather.default
            and _last_dim(g.args[0], g.args[1]) and not g.kwargs.get("sparse_grad", False)):
        return None
    src, index = val(g.args[0]), val(g.args[2])
    if not isinstance(index, torch.Tensor) or index.dim() != src.dim() or not statically_known_true(
            index.shape[-1] == 1):
        return None
    return g.args[0], g.args[2]


def _leading_rows(graph: fx.Graph, z: fx.Node, index: fx.Node, like: fx.Node) -> fx.Node:
    """z[:i0, :i1, ...] for index [i0, i1, ..., 1]: the rows gather reads. A no-op where the sizes are
    known equal; under dynamic shapes the token ids' and the logits' row counts are often separate
    symbols (gather does not require them equal), so the slice (a row slice the loss head takes over)
    is written with the index's size."""
    for d, (a, b) in enumerate(zip(val(index).shape[:-1], val(z).shape[:-1])):
        if not statically_known_true(a == b):
            size = a if isinstance(a, int) else fresh_node(graph, aten.sym_size.int, (index, d), like)
            z = fresh_node(graph, aten.slice.Tensor, (z, d, 0, size), like)
    return z


def _squeezed(n: fx.Node) -> fx.Node | None:
    """n's input where n is squeeze(t, -1) of its last dim, else None."""
    if n.op != "call_function" or n.target not in (aten.squeeze.dim, aten.squeeze.dims):
        return None
    dims = n.args[1] if n.target == aten.squeeze.dim else (n.args[1][0] if len(n.args[1]) == 1 else None)
    return n.args[0] if _last_dim(n.args[0], dims) else None


def _minus_ce(graph: fx.Graph, z: fx.Node, index: fx.Node, like: fx.Node, squeeze: bool) -> fx.Node:
    """-cross_entropy(z, index, reduction="none") per row, in index's shape [..., 1] (or squeezed)."""
    rows = fresh_node(graph, aten.flatten.using_ints, (_leading_rows(graph, z, index, like), 0, -2), like)
    target = fresh_node(graph, aten.flatten.using_ints, (index,), like)
    ce = fresh_node(graph, aten.cross_entropy_loss.default, (rows, target, None, 0, NO_CLASS, 0.0), like)
    out = fresh_node(graph, aten.view_as.default, (fresh_node(graph, aten.neg.default, (ce,), like), index), like)
    return fresh_node(graph, aten.squeeze.dim, (out, -1), like) if squeeze else out


def _log_softmax_gather(n: fx.Node):
    """(z, index, softmax dtype, erased nodes) where n is log_softmax(z, -1).gather(-1, index)."""
    found = _one_token_gather(n)
    if found is None:
        return None
    lp, index = found
    if not (lp.op == "call_function" and lp.target == aten.log_softmax.int and len(lp.users) == 1
            and _last_dim(lp, lp.args[1])):
        return None
    dtype = lp.args[2] if len(lp.args) > 2 else lp.kwargs.get("dtype")
    return lp.args[0], index, dtype, (n, lp)


def _gather_minus_logsumexp(n: fx.Node):
    """(z, index, None, erased nodes) where n is z.gather(-1, index) - logsumexp(z, -1), with the
    gather squeezed or the logsumexp keepdim."""
    if n.op != "call_function" or n.target != aten.sub.Tensor or len(n.args) != 2 or n.kwargs:
        return None
    a, lse = n.args
    if not (isinstance(a, fx.Node) and isinstance(lse, fx.Node) and lse.op == "call_function"
            and lse.target == aten.logsumexp.default and len(lse.users) == 1 and len(a.users) == 1
            and len(lse.args[1]) == 1 and _last_dim(lse.args[0], lse.args[1][0])):
        return None
    keepdim = lse.args[2] if len(lse.args) > 2 else lse.kwargs.get("keepdim", False)
    g = a if keepdim else _squeezed(a)
    found = _one_token_gather(g) if isinstance(g, fx.Node) and (g is a or len(g.users) == 1) else None
    if found is None or found[0] is not lse.args[0]:
        return None
    return found[0], found[1], None, tuple(dict.fromkeys((n, a, g, lse)))


def canonical_log_probs(graph: fx.Graph) -> None:
    """The per-token log-prob rewrite of the module doc."""
    for n in list(graph.nodes):
        if n.op != "call_function":
            continue
        found = _log_softmax_gather(n) or _gather_minus_logsumexp(n)
        if found is None:
            continue
        z, index, dtype, erased = found
        with graph.inserting_before(n):
            if dtype is not None:
                z = fresh_node(graph, aten.to.dtype, (z, dtype), n)
            out = _minus_ce(graph, z, index, n, squeeze=val(n).dim() < val(index).dim())
        n.replace_all_uses_with(out)
        for e in erased:
            graph.erase_node(e)
