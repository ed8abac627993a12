"""The adds around a pre-norm block's norm, folded into the fused RMSNorm backward (Inductor post-grad pass).

In a pre-norm block ``h = x + f(norm(x))`` the norm's output feeds several matmuls (q, k, v; gate,
up) and its input also runs along the residual stream, so its backward sits between two adds:

    dy = aten.add(aten.add(dq_in, dk_in), dv_in)           [M, D] each: the branch gradients' sum
    dx, dw = fxfuse.rms_norm_backward(dy, x, w, ...)
    dh = aten.add(dx, d_residual)                          or add(d_residual, dx)

Inductor cannot fuse an add into a custom op, so each ran as a kernel of its own (H100,
Llama-3.2-1B-like, 4 x 2048 tokens: the residual adds 2.2 ms of a 138 ms step, the dy sums 1.2 ms;
bench/RESULTS.md 2026-12-06). ``fxfuse.rms_norm_backward_add(dq_in, x, w, d_residual, ..., dk_in,
dv_in)`` returns (dh, dw) from the backward's own pass: it sums dy's addends as it loads them and
reads d_residual where it would have written dx, so the sum kernel's write of dy and the norm's read
of it, and the add kernel's read of dx and write of dh, go away. Each add is rounded once to its
dtype in eager's order ((a + b) + c), so the results are bit-identical to the unfolded graph's eager
adds (Inductor's own fused three-way add keeps a + b in fp32: one rounding fewer than eager).

The residual add folds when it is ``aten.add.Tensor`` without alpha and dx's only user, dx, the other
operand and the sum have one shape and dtype (no broadcast, no promotion) and the sum is contiguous
(as the op's output); the new call replaces the add, so every user of dw must come after it. A final
norm's dx, which also feeds the last block's matmul backward, keeps its add. The dy sum folds when
dy is such an add of two tensors, or of one and such an add of two, each add read by the next alone
and every addend contiguous; otherwise dy stays as computed.
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


def _add_of_two(node) -> bool:
    """node is aten.add.Tensor(a, b) of two distinct tensors, without alpha."""
    return (isinstance(node, fx.Node) and node.target is torch.ops.aten.add.Tensor and not node.kwargs
            and len(node.args) == 2 and node.args[0] is not node.args[1])


def _plain_add(node, user: fx.Node) -> bool:
    """node is an _add_of_two read by user alone, with a, b and the sum of one shape and dtype and
    all three contiguous (the kernel reads each addend as rows)."""
    from .reinplace import _contiguous

    if not _add_of_two(node) or list(node.users) != [user]:
        return False
    a, b = node.args
    return isinstance(a, fx.Node) and isinstance(b, fx.Node) and _same(a, b, node) and _contiguous(a.meta["val"]) \
        and _contiguous(b.meta["val"])


def _dy_parts(call: fx.Node) -> tuple[list, list]:
    """(dy's addends in eager's order, the add nodes that sum them, outermost first) when the gradient
    reaching the norm is a sum of branch gradients: add(a, b) -> [a, b]; add(add(a, b), c) or
    add(c, add(a, b)) -> [a, b, c], rounded as (a + b) + c. ([], []) when dy is no such sum."""
    dy = call.args[0]
    if not _plain_add(dy, call):
        return [], []
    a, b = dy.args
    for inner, other in ((a, b), (b, a)):
        if _plain_add(inner, dy):
            return [*inner.args, other], [dy, inner]
    return [a, b], [dy]


def _residual_add(call: fx.Node, dx: fx.Node | None, dw: fx.Node | None, order: dict):
    """(the add of dx and the residual stream's gradient, that gradient) when it folds, else (None, None)."""
    if dx is None or len(dx.users) != 1:
        return None, None
    add = next(iter(dx.users))
    if not _add_of_two(add):
        return None, None
    other = add.args[1] if add.args[0] is dx else add.args[0]
    if not isinstance(other, fx.Node) or not _same(dx, other, add):
        return None, None
    if dw is not None and any(order.get(u, -1) < order[add] for u in dw.users):
        return None, None
    return add, other


def _nbytes(node: fx.Node | None) -> int:
    """Bytes of node's tensor at static shapes (0 for None or symbolic sizes)."""
    val = node.meta.get("val") if node is not None else None
    if not isinstance(val, torch.Tensor) or not all(isinstance(n, int) for n in val.shape):
        return 0
    return val.numel() * val.element_size()


def _fold(graph: fx.Graph, call: fx.Node, into, order: dict) -> tuple[int, int, int]:
    """Fold call's residual add and dy sum (each where it applies); (residual adds, dy sums, bytes no
    longer written: dx where the residual add folds, the summed dy where the sum does)."""
    # dy, x, w, eps, offset, compute_dw[, eager_rounding]: positional, as autograd calls it (the
    # trace drops eager_rounding=False, its default)
    if len(call.args) not in (6, 7) or call.kwargs:
        return 0, 0, 0
    outs = {u.args[1]: u for u in call.users if u.target is operator.getitem}
    if len(outs) != len(call.users):
        return 0, 0, 0
    dx, dw = outs.get(0), outs.get(1)
    add, residual = _residual_add(call, dx, dw, order)
    parts, sums = _dy_parts(call)
    if add is None and not parts:
        return 0, 0, 0
    unwritten = (_nbytes(dx) if add is not None else 0) + (_nbytes(call.args[0]) if parts else 0)
    dy, x, w, eps, offset, compute_dw, *rounding = call.args
    dys = parts or [dy]
    args = (dys[0], x, w, residual, eps, offset, compute_dw, rounding[0] if rounding else False,
            *dys[1:], *[None] * (3 - len(dys)))
    with graph.inserting_before(add if add is not None else call):
        new = graph.call_function(into, args)
        first = add.meta["val"] if add is not None else call.meta["val"][0]
        new.meta = _meta(call, val=(first, call.meta["val"][1]))
        outputs = [graph.call_function(operator.getitem, (new, i)) for i in (0, 1)]
    outputs[0].meta = _meta(add) if add is not None else (_meta(dx) if dx is not None else {"val": first})
    outputs[1].meta = _meta(dw) if dw is not None else {"val": call.meta["val"][1]}
    for old, out in ((add if add is not None else dx, outputs[0]), (dw, outputs[1])):
        if old is not None:
            old.replace_all_uses_with(out)
    for n in [add, dx, dw, call, *sums]:
        if n is not None:
            graph.erase_node(n)
    for out in outputs:
        if not out.users:
            graph.erase_node(out)
    return int(add is not None), int(bool(parts)), unwritten


def fold_adds(graph: fx.Graph) -> tuple[int, int]:
    """Fold every foldable residual-gradient add and dy sum into the RMSNorm backward (module doc);
    returns (residual adds, dy sums) folded. Counted in ``counters["fxfuse"]``: residual_adds_folded,
    gradient_sums_folded, fold_bytes_unwritten (per run of the graph, static shapes only)."""
    bwd, into = _targets()
    calls = [n for n in graph.nodes if n.op == "call_function" and n.target is bwd]
    if not calls:
        return 0, 0
    order = {n: i for i, n in enumerate(graph.nodes)}
    residual, sums, unwritten = (sum(f) for f in zip(*[_fold(graph, call, into, order) for call in calls]))
    if residual or sums:
        log.debug("fxfuse.fold_add: folded into the RMSNorm backward: %d residual-gradient adds, %d sums of "
                  "branch gradients (%d bytes no longer written)", residual, sums, unwritten)
        from torch._dynamo.utils import counters

        counters["fxfuse"]["residual_adds_folded"] += residual
        counters["fxfuse"]["gradient_sums_folded"] += sums
        counters["fxfuse"]["fold_bytes_unwritten"] += unwritten
    return residual, sums
