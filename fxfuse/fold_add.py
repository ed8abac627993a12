"""The residual stream's gradient add, folded into the fused RMSNorm backward (Inductor post-grad pass).

In a pre-norm block ``h = x + f(norm(x))`` the backward adds norm's input gradient to the gradient
that reaches x along the residual stream:

    dx, dw = fxfuse.rms_norm_backward(dy, x, w, ...)      dx [M, D]
    dh = aten.add(dx, d_residual)                          or add(d_residual, dx)

Inductor cannot fuse an add into a custom op, so it ran as a kernel of its own, reading dx and
d_residual and writing dh (H100, Llama-3.2-1B-like, 4 x 2048 tokens: 2.2 ms of a 138 ms step,
bench/RESULTS.md 2026-12-06). ``fxfuse.rms_norm_backward_add(dy, x, w, d_residual, ...)`` returns
(dh, dw) from the backward's own pass: it reads d_residual where it would have written dx, so the
add kernel's read of dx and write of dh go away. The kernel rounds as eager's add, so dh is
bit-identical to the unfolded graph's.

Folded when the add is ``aten.add.Tensor`` without alpha and dx's only user, dx, the other operand
and the sum have one shape and dtype (no broadcast, no promotion) and the sum is contiguous (as the
op's output); the new call replaces the add, so every user of dw must come after the add. Otherwise the add stays as it was: a final
norm's dx, which also feeds the last block's matmul backward, is the usual case.
"""
from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx

log = logging.getLogger("fxfuse")


def _targets():
    from fxfuse.kernels.rms_norm import rms_norm_backward, rms_norm_backward_add  # registers the ops

    return rms_norm_backward, rms_norm_backward_add


def _same(*nodes: fx.Node) -> bool:
    """One dtype and shape (symbolic sizes: equal for every value of the symbols) for all nodes, and
    the last (the add) contiguous, as the op's output is: its recorded value stays the new one's."""
    from .reinplace import _contiguous, _same_shape

    vals = [n.meta.get("val") if isinstance(n, fx.Node) else None for n in nodes]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return False
    return all(v.dtype == vals[0].dtype and _same_shape(v, vals[0]) for v in vals) and _contiguous(vals[-1])


def _meta(node: fx.Node, **extra) -> dict:
    """node's meta for a node replacing it, without eager_input_vals: Inductor would lay out the new
    call's inputs after the old call's recorded ones (other arguments: it asserts)."""
    return {**{k: v for k, v in node.meta.items() if k != "eager_input_vals"}, **extra}


def _fold(graph: fx.Graph, call: fx.Node, into, order: dict) -> bool:
    # dy, x, w, eps, offset, compute_dw[, eager_rounding]: positional, as autograd calls it (the
    # trace drops eager_rounding=False, its default)
    if len(call.args) not in (6, 7) or call.kwargs:
        return False
    outs = {u.args[1]: u for u in call.users if u.target is operator.getitem}
    if len(outs) != len(call.users) or 0 not in outs or len(outs[0].users) != 1:
        return False
    dx, dw = outs[0], outs.get(1)
    add = next(iter(dx.users))
    if add.target is not torch.ops.aten.add.Tensor or add.kwargs or len(add.args) != 2 or add.args[0] is add.args[1]:
        return False
    other = add.args[1] if add.args[0] is dx else add.args[0]
    if not isinstance(other, fx.Node) or not _same(dx, other, add):
        return False
    if dw is not None and any(order.get(u, -1) < order[add] for u in dw.users):
        return False
    dy, x, w, *flags = call.args
    with graph.inserting_before(add):
        new = graph.call_function(into, (dy, x, w, other, *flags))
        new.meta = _meta(call, val=(add.meta["val"], call.meta["val"][1]))
        total = graph.call_function(operator.getitem, (new, 0))
        total.meta = _meta(add)
        grad_w = graph.call_function(operator.getitem, (new, 1))
        grad_w.meta = _meta(dw) if dw is not None else {"val": call.meta["val"][1]}
    add.replace_all_uses_with(total)
    if dw is not None:
        dw.replace_all_uses_with(grad_w)
    for n in (add, dx, dw, call):
        if n is not None:
            graph.erase_node(n)
    if not grad_w.users:
        graph.erase_node(grad_w)
    return True


def fold_residual_adds(graph: fx.Graph) -> int:
    """Rewrite every foldable rms_norm_backward + add pair (module doc); returns how many."""
    bwd, into = _targets()
    calls = [n for n in graph.nodes if n.op == "call_function" and n.target is bwd]
    if not calls:
        return 0
    order = {n: i for i, n in enumerate(graph.nodes)}
    folded = sum(_fold(graph, call, into, order) for call in calls)
    if folded:
        log.debug("fxfuse.fold_add: %d residual-gradient adds folded into the RMSNorm backward", folded)
        from torch._dynamo.utils import counters

        counters["fxfuse"]["residual_adds_folded"] += folded
    return folded
