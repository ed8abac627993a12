"""Shape-relative literals for the canonical view, so one traced pattern matches every size.

A pattern is traced once at example sizes; the user's graph has its own. Literals that depend on
sizes are rewritten relative to the tensors they apply to:
  - dims become negative (``mean(x, [2])`` on a rank-3 x reads as ``mean(x, [-1])``);
  - slice bounds become fractions of the sliced dim (``x[..., :D//2]`` reads start 0, end 1/2),
    except in strided slices, whose bounds are offsets (``x[..., 1::2]`` reads start 1, end "end");
  - reshape / view targets become their merge / split groups (``_rel_shape``).
Symbolic sizes are never compared or converted (that would specialise them).
"""
from __future__ import annotations

from fractions import Fraction

import torch

aten = torch.ops.aten

# op -> (index of its dim argument(s), which rank they count against: input, output or list element)
DIM_ARGS = {
    aten.mean.dim: (1, "in"), aten.sum.dim_IntList: (1, "in"), aten.amax.default: (1, "in"),
    aten.select.int: (1, "in"), aten.squeeze.dim: (1, "in"), aten.chunk.default: (2, "in"),
    aten.split.Tensor: (2, "in"), aten.split_with_sizes.default: (2, "in"),
    aten.flatten.using_ints: ((1, 2), "in"), aten.transpose.int: ((1, 2), "in"),
    aten.unsqueeze.default: (1, "out"), aten.stack.default: (1, "out"), aten.cat.default: (1, "list"),
    aten.softmax.int: (1, "in"), aten._softmax.default: (1, "in"), aten.log_softmax.int: (1, "in"),
}
RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def _rank(n, where: str) -> int | None:
    from .canon_rules import val

    src = n if where == "out" else (n.args[0][0] if where == "list" else n.args[0])
    v = val(src)
    return v.dim() if v is not None else None


def _neg(d, rank: int):
    if isinstance(d, int):
        return d - rank if d >= 0 else d
    if isinstance(d, (list, tuple)):
        return tuple(_neg(x, rank) for x in d)
    return d


def _frac(bound, size, step):
    """A slice bound relative to the dim's size: the full size reads "end"; in a strided slice
    (``x[..., 1::2]``) bounds are offsets and stay absolute; else they are fractions of the size
    (``x[..., :D // 2]`` reads 1/2 for every D)."""
    if not isinstance(bound, int) or not isinstance(size, int) or size == 0:
        return bound
    if bound < 0:
        bound += size
    bound = min(max(bound, 0), size)
    if bound == size:
        return "end"
    return bound if step != 1 else Fraction(bound, size)


def _expr(size):
    """A size as a sympy expression (symbolic sizes by their expression: no guard)."""
    import sympy

    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)


def _rel_shape(src, out):
    """A reshape as its groups: the fewest consecutive input dims and output dims with equal element
    counts, each written (number of input dims, output sizes): "=" for a dim kept as it is, else "*"
    per output size but a literal last 1 or 2 (``reshape(..., -1, 2)``).
    [B, T, V] -> [B*T, V] reads ((2, ("*",)), (1, ("=",))); [.., D] -> [.., D/2, 2] ends (1, ("*", 2))."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(out):
        gi, gj = i, j
        a = _expr(src[i]) if i < len(src) else None
        b = _expr(out[j]) if j < len(out) else None
        i, j = i + (a is not None), j + (b is not None)
        a = a if a is not None else 1
        b = b if b is not None else 1
        while a != b:  # grow the side with fewer elements (sizes are positive integers)
            if i < len(src) and (j >= len(out) or _less(a, b)):
                a, i = a * _expr(src[i]), i + 1
            elif j < len(out):
                b, j = b * _expr(out[j]), j + 1
            else:
                return "irregular"
        part = out[gj:j]
        if i - gi == 1 and len(part) == 1:
            desc = ("=",)
        else:  # a split's last size is what code writes literally (reshape(..., -1, 2))
            desc = ("*",) * (len(part) - 1) + ((part[-1],) if part and part[-1] in (1, 2) else ("*",))[: len(part)]
        groups.append((i - gi, desc))
    return tuple(groups)


def _less(a, b) -> bool:
    """a < b for positive size expressions; symbolic ones compare by divisibility (a divides b)."""
    if a.is_Integer and b.is_Integer:
        return a < b
    return (b / a).is_integer is not False and a != b


def shape_literals(n, lits: list) -> list:
    """lits (n's canonical literal arguments) with size-dependent entries made size-relative."""
    from .canon_rules import val

    t = n.target
    if t in DIM_ARGS:
        idx, where = DIM_ARGS[t]
        rank = _rank(n, where)
        if rank is not None:
            for i in (idx if isinstance(idx, tuple) else (idx,)):
                if i < len(lits):
                    lits[i] = _neg(lits[i], rank)
    elif t == aten.slice.Tensor and val(n.args[0]) is not None:
        x = val(n.args[0])
        dim = lits[1] if lits[1] >= 0 else lits[1] + x.dim()
        size = x.shape[dim]
        lits[1] = dim - x.dim()
        step = lits[4] if len(lits) > 4 else 1
        lits[2], lits[3] = _frac(lits[2], size, step), _frac(lits[3], size, step)
    elif t in RESHAPES and val(n.args[0]) is not None and val(n) is not None:
        lits[1] = _rel_shape(tuple(val(n.args[0]).shape), tuple(val(n).shape))
    elif t == aten.rms_norm.default:
        lits[1] = tuple(range(-len(n.args[1]), 0))
    return lits
