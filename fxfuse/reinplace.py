"""Gated-MLP backwards written over buffers the backward graph no longer reads (Inductor only).

``fxfuse::swiglu_backward(grad_out, gate, up)`` returns a fresh (dgate, dup) pair, each [N, I].
Under activation checkpointing gate and up are recomputed in the backward graph and grad_out is
down_proj's input gradient, a matmul output: at the call five [N, I] buffers are alive, and that
is the step's peak (H200, Llama-1B-like, 128 x 2048 tokens: 5 x 4 GiB live there, bench/RESULTS.md).

This pass runs on Inductor's post-grad graphs (``post_grad_custom_post_pass``) and replaces such a
call by its ``*_into`` twin writing each gradient over the input it is computed from, when nothing
reads that input afterwards: dgate over gate, dup over grad_out (three buffers alive, not five;
without checkpointing gate and up are saved tensors, graph inputs, and only dup goes in place).
Each output element is written by the program that reads the input element it overwrites, and
the kernels finish a tile's loads before its stores whenever an output shares an input's storage
(a barrier, kernels/_gated.py). Inductor orders every earlier read of a mutated buffer before the
mutation, but an elementwise read it inlines into a later kernel is read there: such reads keep
the buffer.

The packed backwards (``fxfuse::swiglu_packed_backward``: gate and up as halves or interleaved
columns of one gate_up, Phi-3, GLM, gpt-oss, Inkling 2) write d gate_up over gate_up under the same rule,
through ``*_packed_backward_into`` (dup there need not depend on the up element it overwrites:
the barrier is what orders them).

A buffer may be overwritten when it is fresh storage (an op that returns no alias of its inputs:
not a graph input, not a view of one), when neither it nor any view of it is read after the call
or is a graph output, when every read before the call is a matmul or a fused op (Inductor may inline
an elementwise read into a kernel that runs after the write), and when it has the gradient's shape
and dtype and is contiguous.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import operator

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx.experimental.symbolic_shapes import statically_known_true

log = logging.getLogger("fxfuse")


@functools.cache
def _twins() -> dict:
    """functional backward -> (its *_into op, where the need flags sit in the functional call's
    arguments: the *_into op takes dgate and dup there; None for a packed op, whose *_into twin
    takes the same arguments and writes d gate_up over gate_up)."""
    import fxfuse.kernels.clamped_swiglu  # noqa: F401  (registers the ops)
    import fxfuse.kernels.swiglu  # noqa: F401
    import fxfuse.kernels.swiglu_packed  # noqa: F401

    ops = torch.ops.fxfuse
    return {
        ops.swiglu_backward.default: (ops.swiglu_backward_into.default, 4),
        ops.clamped_swiglu_backward.default: (ops.clamped_swiglu_backward_into.default, 5),
        ops.swiglu_packed_backward.default: (ops.swiglu_packed_backward_into.default, None),
        ops.clamped_swiglu_packed_backward.default: (ops.clamped_swiglu_packed_backward_into.default, None),
        ops.softcapped_swiglu_packed_backward.default: (ops.softcapped_swiglu_packed_backward_into.default, None),
    }


def _aliasing(n: fx.Node) -> bool:
    """n's result may share storage with one of its inputs (a view, reshape, split, getitem of one)."""
    if n.target is operator.getitem:
        return True
    schema = getattr(n.target, "_schema", None)
    return schema is None or any(r.alias_info is not None for r in schema.returns)


def _fresh(n: fx.Node) -> bool:
    """n's result is storage of its own: an op call returning no alias, or an item of one's tuple."""
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        src = n.args[0]
        return isinstance(src, fx.Node) and src.op == "call_function" and not _aliasing(src)
    return not _aliasing(n)


def storage_base(n: fx.Node) -> fx.Node | None:
    """The node whose fresh storage n views, or None (a graph input, a constant, an unknown op)."""
    while isinstance(n, fx.Node) and not _fresh(n):
        if n.op != "call_function" or not n.args or not isinstance(n.args[0], fx.Node):
            return None
        n = n.args[0]
    return n if isinstance(n, fx.Node) else None


def _family(base: fx.Node) -> set[fx.Node]:
    """base and every node that may alias it (views of views, items of a split)."""
    seen, todo = {base}, [base]
    while todo:
        for user in todo.pop().users:
            if user not in seen and user.op == "call_function" and _aliasing(user):
                seen.add(user)
                todo.append(user)
    return seen


def _contiguous(t: torch.Tensor) -> bool:
    expected = 1
    for size, stride in reversed(list(zip(t.shape, t.stride()))):
        if not statically_known_true(size == 1) and not statically_known_true(stride == expected):
            return False
        expected = expected * size
    return True


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dim() == b.dim() and all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape))


def overwritable(target: fx.Node, call: fx.Node, others: list, grad: torch.Tensor, order: dict) -> bool:
    """target (an argument of call) may hold call's gradient grad: see the module docstring.
    others: call's other tensor arguments, which must not share target's storage."""
    val = target.meta.get("val")
    base = storage_base(target)
    if base is None or not isinstance(val, torch.Tensor) or not isinstance(grad, torch.Tensor):
        return False
    if val.dtype != grad.dtype or val.device != grad.device or not _same_shape(val, grad) or not _contiguous(val):
        return False
    family = _family(base)
    if any(o in family for o in others):
        return False
    here = order[call]
    return all(u is call or u in family or (order.get(u, here + 1) < here and _runs_in_place(u))
               for m in family for u in m.users)


def _runs_in_place(reader: fx.Node) -> bool:
    """reader reads its inputs where it stands in Inductor's schedule: a matmul or a fused op (an extern
    kernel), not an elementwise op or reduction that Inductor may inline into a later kernel, which then
    reads the buffer after the in-place write (0.1 * dh of a skip term beside the gated MLP read dup)."""
    return reader.op == "call_function" and (reader.target in _EXTERN_READERS or (
        isinstance(reader.target, torch._ops.OpOverload) and reader.target.namespace == "fxfuse"))


_aten = torch.ops.aten
_EXTERN_READERS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}


def _fresh_gradient(graph: fx.Graph, like: fx.Node, need: bool, val) -> fx.Node:
    """What the functional op would return for a gradient not placed over an input: a contiguous
    [..., I] like its input (gate for dgate, up for dup: their dtypes may differ), or [0] when not
    asked for."""
    g = like.meta["val"]
    if need:
        d = graph.call_function(torch.ops.aten.empty_like.default, (like,), {"memory_format": torch.contiguous_format})
    else:
        d = graph.call_function(torch.ops.aten.empty.memory_format, ([0],), {"dtype": g.dtype, "device": g.device})
    d.meta["val"] = val
    return d


def _call_into(graph: fx.Graph, call: fx.Node, into, args: tuple) -> fx.Node:
    """into(*args) inserted before call, with call's metadata (a mutating op: no value)."""
    with graph.inserting_before(call):
        new = graph.call_function(into, args, dict(call.kwargs))
    new.meta = {**call.meta, "val": None}
    if "eager_input_vals" in call.meta:  # Inductor pins the call's input layouts to these
        new.meta["eager_input_vals"] = (
            tuple(a.meta["val"] if isinstance(a, fx.Node) else a for a in new.args), dict(new.kwargs))
    return new


def _place_pair(graph: fx.Graph, call: fx.Node, into, at: int, order: dict) -> int:
    """(dgate, dup) = call: dgate over gate, dup over grad_out, each where overwritable; returns how
    many gradients were placed."""
    if len(call.args) < at + 2:  # the flags given by keyword: not as fxfuse's autograd calls it
        return 0
    grad_out, gate, up = call.args[:3]
    need = call.args[at:at + 2]
    vals = call.meta.get("val") or (None, None)
    outs = {k: u for u in call.users if u.target is operator.getitem for k in [u.args[1]]}
    if len(outs) != len(call.users):
        return 0
    # dgate over gate, dup over grad_out: each output reads the input it overwrites
    targets = [(gate, [grad_out, up]), (grad_out, [gate, up])]
    over = [need[k] and overwritable(t, call, o, vals[k], order) for k, (t, o) in enumerate(targets)]
    if not any(over):
        return 0
    with graph.inserting_before(call):
        dst = [t if over[k] else _fresh_gradient(graph, (gate, up)[k], need[k], vals[k])
               for k, (t, _) in enumerate(targets)]
    new = _call_into(graph, call, into, (*call.args[:at], *dst, *call.args[at:]))
    for d in (*dst, new):
        order.setdefault(d, order[call])
    for k, user in outs.items():
        user.replace_all_uses_with(dst[k])
        graph.erase_node(user)
    graph.erase_node(call)
    return sum(over)


def _place_packed(graph: fx.Graph, call: fx.Node, into, order: dict) -> int:
    """d gate_up = call: over gate_up (argument 1) when overwritable; returns 1 if placed, else 0."""
    grad_out, gate_up = call.args[:2]
    if not overwritable(gate_up, call, [grad_out], call.meta.get("val"), order):
        return 0
    order[_call_into(graph, call, into, call.args)] = order[call]
    call.replace_all_uses_with(gate_up)
    graph.erase_node(call)
    return 1


def reinplace(graph: fx.Graph) -> int:
    """Rewrite every gated backward call whose gradients can go in place; returns how many
    gradients were placed over an input."""
    twins = _twins()
    calls = [n for n in graph.nodes if n.op == "call_function" and n.target in twins]
    if not calls:
        return 0
    order = {n: i for i, n in enumerate(graph.nodes)}
    placed = 0
    for call in calls:
        into, at = twins[call.target]
        placed += _place_packed(graph, call, into, order) if at is None else _place_pair(graph, call, into, at, order)
    if placed:
        log.debug("fxfuse.reinplace: %d gated-MLP gradients written over dead buffers", placed)
        from torch._dynamo.utils import counters

        counters["fxfuse"]["gradients_in_place"] += placed
    return placed


def post_grad(graph: fx.Graph) -> None:
    """fxfuse's post-grad rewrites: the adds around a norm's backward into it (fxfuse/fold_add.py),
    then the gated-MLP backwards in place."""
    from .fold_add import fold_adds

    fold_adds(graph)
    reinplace(graph)


@functools.cache
def _source_hash() -> str:
    from . import fold_add

    digest = hashlib.sha256()
    for path in (__file__, fold_add.__file__):
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


class ReinplacePass(CustomGraphPass):
    """post_grad as an Inductor custom pass; its uuid (the hash of this file and fold_add.py, read
    once per process) keys Inductor's FX graph cache, so graphs compiled with it stay cacheable."""

    def __call__(self, graph: fx.Graph) -> None:
        post_grad(graph)

    def uuid(self) -> str:
        return _source_hash()


def post_grad_passes(user):
    """The value of Inductor's post_grad_custom_post_pass: fxfuse's pass, then the user's own."""
    if user is None:
        return ReinplacePass()
    try:  # torch versions that take a list of passes
        from torch._inductor.custom_graph_pass import get_custom_graph_passes
    except ImportError:
        return _Chain(user)
    return [ReinplacePass(), *get_custom_graph_passes(user)]


class _Chain(ReinplacePass):
    """reinplace, then one user pass (torch versions without pass lists)."""

    def __init__(self, then):
        self.then = then

    def __call__(self, graph: fx.Graph) -> None:
        post_grad(graph)
        self.then(graph)

    def uuid(self):
        theirs = self.then.uuid() if isinstance(self.then, CustomGraphPass) else None
        return None if theirs is None else (super().uuid(), theirs)  # None: uncached, as their pass alone
