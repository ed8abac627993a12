"""A Python loop over the batch rows, stacked back, rewritten as the same ops on the whole batch:

    torch.stack([F.log_softmax(zr, -1).gather(-1, tr[:, None]).squeeze(-1) for zr, tr in zip(z, t)])
    torch.stack([torch.logsumexp(row, dim=-1) for row in z])                # TRL's selective_log_softmax
    F.log_softmax(z, -1).gather(-1, t[..., None]).squeeze(-1)               # what they become
    torch.logsumexp(z, dim=-1)

Loops like these save memory in eager (one row's log-softmax at a time) and read each row of the
lm_head's logits separately, so no loss head could stand for them; batched, respell.canonical_log_probs
reads them as the per-token cross-entropy. ``stack(rows, 0)`` where row i is the same expression of
``A[i]`` (``select(A, 0, i)``) for one or more tensors A with len(rows) rows, i = 0, 1, ... in order,
and of tensors every row shares, through ops that act on trailing dims alone (ROW_OPS): the expression
on A itself, its dims counted from the end, is the stack, value for value. Shared operands must not have
more dims than a row (a broadcast would then add the batch dim elsewhere).
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .canon_rules import val
from .respell import fresh_node

aten = torch.ops.aten

# op -> positions of its dim arguments (an int, or a list of ints for logsumexp); each acts on the
# trailing dims named there, or elementwise (broadcasting from the right)
ROW_OPS = {
    aten.log_softmax.int: (1,), aten._log_softmax.default: (1,), aten.softmax.int: (1,),
    aten.gather.default: (1,), aten.unsqueeze.default: (1,), aten.squeeze.dim: (1,),
    aten.logsumexp.default: (1,),
    aten.to.dtype: (), aten.neg.default: (), aten.exp.default: (), aten.log.default: (),
    aten.sub.Tensor: (), aten.add.Tensor: (), aten.mul.Tensor: (), aten.div.Tensor: (),
}


class _Rows:
    """Matches row i's expression against row 0's, collecting the stacked tensors A (leaves)."""

    def __init__(self, count: int):
        self.count, self.leaves, self.shared = count, set(), set()

    def same(self, a, b, i: int) -> bool:
        """b (row i > 0) is a (row 0) with A[0] read as A[i], through the same ops; a node both rows
        read is shared (A[0] read by every row is no row of A: False)."""
        if not isinstance(a, fx.Node) or not isinstance(b, fx.Node):
            return (not isinstance(a, fx.Node) and not isinstance(b, fx.Node) and type(a) is type(b)
                    and (a == b if not isinstance(a, (list, tuple)) else self._same_list(a, b, i)))
        if self._row(a, 0) is not None or self._row(b, i) is not None:
            leaf = self._row(a, 0)
            if leaf is None or leaf is not self._row(b, i):
                return False
            self.leaves.add(leaf)
            return True
        if a is b:  # computed once for every row (no row's select of a stacked tensor: see above)
            self.shared.add(a)
            return True
        if a.op != "call_function" or b.op != "call_function" or a.target != b.target or a.target not in ROW_OPS:
            return False
        if len(a.args) != len(b.args) or a.kwargs.keys() != b.kwargs.keys():
            return False
        return all(self.same(x, y, i) for x, y in zip((*a.args, *a.kwargs.values()), (*b.args, *b.kwargs.values())))

    def _same_list(self, a, b, i: int) -> bool:
        return len(a) == len(b) and all(self.same(x, y, i) for x, y in zip(a, b))

    def _row(self, n: fx.Node, i: int) -> fx.Node | None:
        """A where n is select(A, 0, i) and A has count rows, else None."""
        if not (n.op == "call_function" and n.target == aten.select.int and n.args[1] == 0 and n.args[2] == i):
            return None
        a = val(n.args[0])
        return n.args[0] if a is not None and statically_known_true(a.shape[0] == self.count) else None


ELEMENTWISE = {aten.sub.Tensor, aten.add.Tensor, aten.mul.Tensor, aten.div.Tensor}


def _shared_ok(root: fx.Node, common: set) -> bool:
    """Shared tensors enter only elementwise ops, with at most the rank of the row operand they meet
    (a broadcast against [B, ...] then lines up as against [...])."""
    for m in _nodes(root, common):
        shared = [a for a in m.all_input_nodes if not _per_row(a, common)]
        if not shared:
            continue
        rows = [a for a in m.all_input_nodes if _per_row(a, common)]
        if m.target not in ELEMENTWISE or any(val(a) is None or val(a).dim() > min(val(r).dim() for r in rows)
                                              for a in shared):
            return False
    return True


def _per_row(n: fx.Node, common: set) -> bool:
    """n is a row op or a select of a row, not shared by the rows: part of the per-row expression."""
    return n not in common and n.op == "call_function" and (n.target in ROW_OPS or n.target == aten.select.int)


def _batched(graph: fx.Graph, n, memo: dict, like: fx.Node, common: set):
    """Row 0's expression n rebuilt on the stacked tensors (A[0] -> A), dims counted from the end."""
    if not isinstance(n, fx.Node):
        return [_batched(graph, a, memo, like, common) for a in n] if isinstance(n, (list, tuple)) else n
    if n in memo:
        return memo[n]
    if not _per_row(n, common):
        return n  # shared
    if n.target == aten.select.int:
        memo[n] = n.args[0]
        return n.args[0]
    rank = val(n).dim() if n.target == aten.unsqueeze.default else val(n.args[0]).dim()
    args = [_batched(graph, a, memo, like, common) for a in n.args]
    for pos in ROW_OPS[n.target]:
        dims = args[pos]
        args[pos] = [d - rank if d >= 0 else d for d in dims] if isinstance(dims, list) else (
            dims - rank if dims >= 0 else dims)
    kwargs = {k: _batched(graph, a, memo, like, common) for k, a in n.kwargs.items()}
    memo[n] = fresh_node(graph, n.target, tuple(args), like, kwargs)
    return memo[n]


def _dims_known(n: fx.Node, common: set) -> bool:
    """Each row op's dim arguments are plain ints (positive ones are made negative from the row's rank)."""
    for m in _nodes(n, common):
        for pos in ROW_OPS.get(m.target, ()):
            d = m.args[pos] if pos < len(m.args) else None
            if not (isinstance(d, int) or (isinstance(d, list) and all(isinstance(x, int) for x in d))):
                return False
    return True


def _nodes(root: fx.Node, common: set) -> list[fx.Node]:
    """The row ops of an expression (not its selects or shared operands)."""
    out, stack = [], [root]
    while stack:
        n = stack.pop()
        if _per_row(n, common) and n.target != aten.select.int and n not in out:
            out.append(n)
            stack.extend(n.all_input_nodes)
    return out


def canonical_unstack(graph: fx.Graph) -> None:
    """The rewrite of the module doc, on every stack of per-row expressions."""
    graph_before = set(graph.nodes)
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target != aten.stack.default or (n.args[1:] or (0,))[0] != 0:
            continue
        rows = n.args[0]
        if len(rows) < 2 or not all(isinstance(r, fx.Node) for r in rows):
            continue
        match = _Rows(len(rows))
        if not all(match.same(rows[0], r, i) for i, r in enumerate(rows) if i):
            continue
        common = match.shared
        if not (match.leaves and _dims_known(rows[0], common) and _shared_ok(rows[0], common)):
            continue
        memo: dict = {}
        with graph.inserting_before(n):
            out = _batched(graph, rows[0], memo, n, common)
        got, want = val(out).shape, val(n).shape
        if len(got) != len(want) or not all(statically_known_true(a == b) for a, b in zip(got, want)):
            for m in reversed([m for m in memo.values() if m.op == "call_function" and m not in graph_before]):
                graph.erase_node(m)
            continue
        ops = {m for r in rows for m in _nodes(r, common)}
        per_row = ops | {a for m in ops for a in m.all_input_nodes if _per_row(a, common)}
        n.replace_all_uses_with(out)
        graph.erase_node(n)
        for m in reversed(list(graph.nodes)):  # the rows' own nodes, where nothing else reads them
            if m in per_row and not m.users:
                graph.erase_node(m)
