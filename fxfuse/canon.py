"""Canonical view of an ATen FX graph for matching: one networkx node per FX node, spellings unified.

Both user graphs and pattern graphs go through ``build_view``, so a pattern written one way matches
the other spellings of the same math (rules below, each exact or within one fp32 rounding). The FX
graph itself is never changed here: a view node only carries a canonical label and literal tuple,
and every matched region is replaced whole by the rewrite.

Rules (user spelling -> canonical label):
  - casts (``to``, ``_to_copy``, ``type_as``) -> ``cast`` with literal "f32" / "low" (bf16, fp16) /
    the dtype; a cast that does not change dtype or device disappears (its users see its input).
  - ``mul(a, a)``, ``square(a)`` -> ``pow(a, 2)``;  ``pow(a, -0.5)`` -> ``rsqrt(a)``;
    ``div(a, sqrt(b))`` -> ``mul(a, rsqrt(b))`` (the sqrt has no other user); ``pow(b, 0.5)`` is a sqrt.
  - pieces of ``chunk`` / ``split`` / ``split_with_sizes`` (their getitems) and ``narrow`` -> the
    ``slice`` of the same range (``x.chunk(2, -1)[1]`` reads as ``x[..., D/2:]``); ``mul(a, -1)`` -> ``neg(a)``.
  - ``div(a, 1 + exp(-b))`` -> ``mul(a, sigmoid(b))`` (SiLU written from its definition);
  - ``reciprocal(sqrt(b))`` (``1.0 / torch.sqrt(b)``) -> ``rsqrt(b)``; a ``mul`` or ``div`` by the literal 1
    that keeps the dtype disappears (Python's ``1.0 / t`` traces as ``reciprocal(t) * 1.0``).
  - ``div(sum(a, dims, keepdim), N)`` or ``mul(sum(...), 1 / N)`` with N the number of summed elements ->
    ``mean(a, dims, keepdim)``.
  - size-dependent literals (dims, slice bounds, reshape targets) are size-relative (shapes.py).
  - ``view``, ``reshape``, ``flatten``, ``unflatten`` and ``reshape_as`` (RoFormer's rotation) -> one
    ``reshape`` of the same merge / split groups: the same values whichever op moved them.
  - ``add`` and ``mul`` are commutative: their two tensor operands match in either order.
  - the logits' way into ``cross_entropy``: casts to fp32 and reshapes to [N, V] that merge leading
    dims (``view(-1, V)``, ``reshape``, ``flatten(0, 1)``), each with no other user, disappear
    (``_logits_chain``): one loss-head spelling matches 2-D and [B, T, V] logits, with or without
    ``.float()``, in either order. The loss head's check requires the [N, V] input it implies.
    On the same way, ``z[..., :V]`` of an lm_head output z padded past the vocabulary and row slices
    (GPT-2's shift ``logits[..., :-1, :]``, with its ``.contiguous()``) read as their input
    (``_logits_slices``); the loss head lowers with the weight's first V rows, and slices the hidden
    states as the logits were.
The recognisers live in canon_rules.py.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import networkx as nx
import torch
import torch.fx as fx

from .canon_rules import (CASTS, SPLITS, _is_divisor_sqrt, _is_logistic_divisor, _is_reciprocal_sqrt,
                          _logistic_exp, _logits_chain, _logits_slices, _negated, _piece_range, _summed_numel,
                          _unscaled, val)
from .mutation import written_storages
from .shapes import RESHAPES, _frac, _neg, _rel_shape, shape_literals

aten = torch.ops.aten

COMMUTATIVE = {aten.add.Tensor, aten.mul.Tensor}
SAME_DATA_RESHAPES = RESHAPES | {aten.flatten.using_ints, aten.unflatten.int, aten.reshape_as.default}


@dataclass
class VNode:
    label: str  # canonical op name, "*" for a pattern placeholder
    lits: tuple  # literal (non-tensor) arguments, canonicalised
    members: tuple  # FX nodes this view node stands for (the last one is its output)


def requires_grad(n) -> bool:
    """Whether n's value depends on an input that requires grad (fake values in the traced graph do
    not carry requires_grad). Placeholders are marked by normalize.to_aten; the rest of the graph
    is marked in one forward pass on first use."""
    if not isinstance(n, fx.Node):
        return False
    if "fxfuse_requires_grad" not in n.meta:
        for m in n.graph.nodes:
            if "fxfuse_requires_grad" in m.meta:
                continue
            v = val(m)
            m.meta["fxfuse_requires_grad"] = (
                m.op == "call_function" and m.target not in (aten.detach.default, aten.alias.default)
                and (v is None or v.is_floating_point() or v.is_complex())
                and any(a.meta.get("fxfuse_requires_grad", False) for a in m.all_input_nodes))
    return n.meta["fxfuse_requires_grad"]


def dtype_class(dt: torch.dtype) -> str:
    if dt == torch.float32:
        return "f32"
    if dt in (torch.bfloat16, torch.float16):
        return "low"
    return str(dt)


def is_noop_cast(n: fx.Node) -> bool:
    src, out = val(n.args[0]), val(n)
    return src is not None and out is not None and src.dtype == out.dtype and src.device == out.device


class _Edge:
    """The literal slot of an argument that is an FX node (an edge of the view graph, not a literal):
    distinct from a None literal, so a pattern literal (eps) never matches a value computed in the
    graph (an unspecialised float under dynamic=True arrives as one)."""

    def __repr__(self):
        return "<node>"


EDGE = _Edge()


def _lit(a):
    """A hashable literal; FX nodes become EDGE (they are edges, not literals)."""
    if isinstance(a, fx.Node):
        return EDGE
    if isinstance(a, (list, tuple)):
        return tuple(_lit(x) for x in a)
    if isinstance(a, torch.SymInt):
        return "symint"
    return a


def _with_defaults(n: fx.Node) -> tuple[list, dict]:
    """Positional args padded with the schema's defaults; kwargs equal to their default dropped, so
    ``rms_norm(x, s, w)`` and ``rms_norm(x, s, w, None)`` read the same."""
    args, kwargs = list(n.args), dict(n.kwargs)
    schema = getattr(n.target, "_schema", None)
    if schema is None:
        return args, kwargs
    for a in schema.arguments[len(args):]:
        if a.kwarg_only or not a.has_default_value():
            break
        args.append(a.default_value)
    for a in schema.arguments:
        if a.kwarg_only and a.name in kwargs and a.has_default_value() and kwargs[a.name] == a.default_value:
            del kwargs[a.name]
    return args, kwargs


def _tensor_args(n: fx.Node) -> list[tuple[str, fx.Node]]:
    """(argument position, input node) of n's FX-node inputs; list elements get "i.j"."""
    out = []
    for i, a in enumerate(n.args):
        if isinstance(a, fx.Node):
            out.append((str(i), a))
        elif isinstance(a, (list, tuple)):
            out += [(f"{i}.{j}", x) for j, x in enumerate(a) if isinstance(x, fx.Node)]
    for k, a in n.kwargs.items():
        if isinstance(a, fx.Node):
            out.append((k, a))
    return out


def build_view(graph: fx.Graph, written: dict | None = None
               ) -> tuple[nx.MultiDiGraph, dict[str, VNode], dict[fx.Node, fx.Node]]:
    """networkx view of graph: nodes keyed by FX node name, edges carry the argument position.
    Also returns the elided no-op casts (cast -> its input). written: mutation.written_storages(graph),
    where the caller has it."""
    g = nx.MultiDiGraph()
    vnodes: dict[str, VNode] = {}
    alias: dict[fx.Node, fx.Node] = {}  # elided cast -> the node its users see
    absorbed: set[fx.Node] = set()  # FX nodes folded into a later view node

    def resolve(n: fx.Node) -> fx.Node:
        while n in alias:
            n = alias[n]
        return n

    nodes = list(graph.nodes)
    written = written_storages(graph) if written is None else written

    def unwritten(n: fx.Node, src: fx.Node) -> bool:
        """n may read as src: reading one as the other is wrong where either is written in place."""
        return not {n, src} & written.keys()

    for n in nodes:
        if n.op == "call_function" and n.target in CASTS and is_noop_cast(n) and unwritten(n, n.args[0]):
            alias[n] = n.args[0]
        if (unscaled := _unscaled(n)) is not None and unwritten(n, unscaled):
            alias[n] = unscaled
        if _is_reciprocal_sqrt(n):
            absorbed.add(n)
        if n.op == "call_function" and n.target in SPLITS and n.users and all(
                _piece_range(u) is not None for u in n.users):
            absorbed.add(n)  # each getitem reads as the slice of its range (_canon)
        if _is_logistic_divisor(n):
            e = _logistic_exp(n)
            absorbed |= {e, e.args[0]}  # exp, neg: folded into the sigmoid the add reads as
        if n.op == "call_function" and n.target == aten.cross_entropy_loss.default:
            chain = _logits_chain(n.args[0])
            for link in chain + _logits_slices(chain[-1].args[0] if chain else n.args[0]):
                if unwritten(link, link.args[0]):
                    alias[link] = link.args[0]
        # sum feeding only div(sum, N) or mul(sum, 1 / N), N its element count, is folded into it (-> mean)
        if _mean_of_sum(n):
            absorbed.add(n.args[0])

    for n in nodes:
        if n in alias or n in absorbed or n.op == "output":
            continue
        label, lits, edges, members = _canon(n, absorbed)
        vnodes[n.name] = VNode(label, lits, tuple(members))
        g.add_node(n.name)
        for pos, src in edges:
            src = resolve(src)
            g.add_edge(src.name, n.name, pos="c" if label in COMMUTATIVE_LABELS else pos)
    return g, vnodes, alias


COMMUTATIVE_LABELS = {str(op) for op in COMMUTATIVE}


def _mean_of_sum(n: fx.Node) -> bool:
    """n is ``sum(a, dims) / N`` or ``sum(a, dims) * (1 / N)`` (within one fp32 rounding of 1 / N), N
    the summed element count, and the sum has no other user: a mean."""
    if n.op != "call_function" or n.target not in (aten.div.Tensor, aten.mul.Tensor) or len(n.args) != 2:
        return False
    s, k = n.args
    if not (isinstance(s, fx.Node) and s.target == aten.sum.dim_IntList and len(s.users) == 1
            and isinstance(k, (int, float)) and not isinstance(k, bool)):
        return False
    count = _summed_numel(s)
    if count is None:
        return False
    return k == count if n.target == aten.div.Tensor else math.isclose(k * count, 1.0, rel_tol=2.0 ** -24)


def _canon(n: fx.Node, absorbed: set[fx.Node]):
    """(label, literals, [(pos, input node)], FX members) of one FX node; absorbed: the FX nodes
    build_view folded into their users (a chunk / split whose pieces read as slices, say)."""
    if n.op in ("placeholder", "get_attr"):
        return n.op, (), [], [n]
    if n.op != "call_function":
        return f"{n.op}:{n.target}", (), _tensor_args(n), [n]
    t = n.target
    piece = _piece_range(n)
    if piece is not None and (t == aten.narrow.default or n.args[0] in absorbed):
        x, dim, start, end, size = piece
        lits = (EDGE, dim - val(x).dim(), _frac(start, size, 1), _frac(end, size, 1), 1)
        return str(aten.slice.Tensor), lits, [("0", x)], ([n] if t == aten.narrow.default else [n.args[0], n])
    if t is operator.getitem:
        return "getitem", (n.args[1],), [("0", n.args[0])], [n]
    if t in CASTS:
        out = val(n)
        return "cast", (dtype_class(out.dtype) if out is not None else "?",), [("0", n.args[0])], [n]
    if (negated := _negated(n)) is not None:
        return str(aten.neg.default), (EDGE,), [("0", negated)], [n]
    if (t == aten.mul.Tensor and n.args[0] is n.args[1]) or t == aten.square.default:
        return str(aten.pow.Tensor_Scalar), (EDGE, 2), [("0", n.args[0])], [n]
    if t == aten.pow.Tensor_Scalar and n.args[1] == -0.5:
        return str(aten.rsqrt.default), (EDGE,), [("0", n.args[0])], [n]
    if t == aten.div.Tensor and _is_divisor_sqrt(n.args[1]):
        return str(aten.mul.Tensor), (EDGE, EDGE), [("0", n.args[0]), ("1", n.args[1])], [n]
    if _is_divisor_sqrt(n):
        return str(aten.rsqrt.default), (EDGE,), [("0", n.args[0])], [n]
    if t == aten.add.Tensor and _is_logistic_divisor(n):
        e = _logistic_exp(n)
        return str(aten.sigmoid.default), (EDGE,), [("0", e.args[0].args[0])], [e.args[0], e, n]
    if t == aten.div.Tensor and _is_logistic_divisor(n.args[1]):
        return str(aten.mul.Tensor), (EDGE, EDGE), [("0", n.args[0]), ("1", n.args[1])], [n]
    if t == aten.reciprocal.default and _is_reciprocal_sqrt(n.args[0]):
        return str(aten.rsqrt.default), (EDGE,), [("0", n.args[0].args[0])], [n.args[0], n]
    if _mean_of_sum(n):
        s = n.args[0]
        x = val(s.args[0])
        dims = _neg(s.args[1], x.dim())
        keep = s.args[2] if len(s.args) > 2 else s.kwargs.get("keepdim", False)
        return str(aten.mean.dim), (EDGE, dims, keep), [("0", s.args[0])], [s, n]
    if t in SAME_DATA_RESHAPES and val(n.args[0]) is not None and val(n) is not None:
        groups = _rel_shape(tuple(val(n.args[0]).shape), tuple(val(n).shape))
        return str(aten.reshape.default), (EDGE, groups), [("0", n.args[0])], [n]
    args, kwargs = _with_defaults(n)
    lits = [_lit(a) for a in args] + [(k, _lit(v)) for k, v in sorted(kwargs.items())]
    return str(t), tuple(shape_literals(n, lits)), _tensor_args(n), [n]
