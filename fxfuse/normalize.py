"""Dynamo's torch-IR graph -> one canonical ATen level (make_fx, pre_dispatch=True).

pre_dispatch keeps ``aten.linear``, ``aten.silu``, ``aten.cross_entropy_loss``, ``aten.rms_norm``,
``aten.to.dtype`` and autocast enter/exit nodes, so patterns are written against the ops people call
and autocast stays a region, not casts baked into every op. Node metadata (module path, stack trace)
is carried through by interpreting the graph node by node under ``preserve_node_meta``.

Six spellings are unified on the ATen graph itself (model graphs and pattern traces alike, so one
pattern matches both): torch's alias ops that pre-dispatch keeps (``torch.multiply``, ``divide``,
``clip``, ``concat``, ...) become the op they stand for, an in-place op on a fresh intermediate
(``F.silu(g, inplace=True)``, ``a.mul_(u)``) becomes its out-of-place twin, a cast repeated on the same
tensor becomes one, ``x @ w.t()`` becomes ``aten.linear``, a mean or sum without keepdim whose dim an
unsqueeze puts back (``rsqrt(x.pow(2).mean(-1) + eps)[..., None]``) keeps it, and ``nll_loss`` of a
``log_softmax`` becomes ``cross_entropy`` (respell.py).
"""
from __future__ import annotations

import functools

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch._guards import TracingContext, detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from . import opaque
from .canon_rules import CASTS, fake_call
from .checkpoint import inline_checkpoints
from .respell import canonical_keepdim, canonical_log_probs, canonical_nll
from .unstack import canonical_unstack


def _fakify(gm: fx.GraphModule, example_inputs, fake_mode):
    """Fake copies of the real example inputs in Dynamo's fake mode, with Dynamo's symbolic sizes.
    An unspecialised Python float (dynamic=True) arrives as a 0-d tensor that the graph reads with
    .item(): its fake copy gets the SymFloat Dynamo traced (item_memo), or make_fx cannot read it."""
    ctx = TracingContext.try_get()
    contexts = ctx.tensor_to_context if ctx is not None else {}
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = []
    for i, x in enumerate(example_inputs):
        dynamo_val = phs[i].meta.get("example_value") if i < len(phs) else None
        if isinstance(x, torch.Tensor) and not isinstance(x, torch._subclasses.FakeTensor):
            # the placeholder's source names any size symbol this creates (Dynamo's guards need one)
            source = getattr(phs[i], "_dynamo_source", None) if i < len(phs) else None
            fake = fake_mode.from_tensor(x, symbolic_context=contexts.get(x), source=source)
            if getattr(dynamo_val, "item_memo", None) is not None and fake.item_memo is None:
                fake.item_memo = dynamo_val.item_memo
            out.append(fake)
        else:
            out.append(x)
    return out


class _Retrace(opaque.Interpreter):
    """Runs Dynamo's graph under make_fx. ``p.data`` (Dynamo's ``_get_data_attr``) is no ATen op, so
    make_fx would bake its fake result into the graph as a constant (a crash at run time, or a
    failed compile when the model mutates it, as Gemma 3n's ``coefs.weight.data.clamp_()``); it is
    traced as ``aten.detach``: the same storage, no gradient, as torch.compile's own AOTAutograd does."""

    def run_node(self, n: fx.Node):
        if n.op == "call_function" and n.target is torch._C._autograd._get_data_attr:
            return torch.ops.aten.detach.default(self.env[n.args[0]])
        return super().run_node(n)


class Unsupported(RuntimeError):
    """Dynamo's graph holds something the re-trace cannot reproduce faithfully."""


def eliminate_dead_code(graph: fx.Graph) -> None:
    """graph.eliminate_dead_code() on graph alone. torch's descends into the subgraphs a get_attr
    reads (a kept autograd.Function's forward and backward, opaque.py) where, at Dynamo's torch
    level, an in-place method whose result goes unused (PhiMoE's ``grad.scatter_add_(...)``) counts
    as dead: it would be erased, silently changing that backward."""
    for node in reversed(graph.nodes):
        if not node.users and not node.is_impure():
            graph.erase_node(node)


def check_retraceable(gm: fx.GraphModule) -> None:
    """Higher-order ops carry backward rules or recomputation policies that a plain re-trace would
    drop, silently losing gradients (seen with Bloom's GeLU autograd.Function). Those in
    opaque.KEPT pass through the re-trace as they are (opaque.py); a graph holding any other stays
    unfused. Plain activation checkpointing is inlined with its recompute tags before this check
    (checkpoint.py)."""
    for n in gm.graph.nodes:
        if opaque.enters_vmap(n):
            # outline_vmaps moves every whole region into a call: one left is unbalanced
            raise Unsupported(f"torch.vmap ({n.name}): its batched tensors do not survive the re-trace")
        if n.op == "call_function" and (opaque.is_kept(n) or isinstance(n.target, torch._ops.HigherOrderOperator)):
            why = opaque.unsupported_output(n) if opaque.is_kept(n) else (
                f"higher-order op {n.target.__name__} ({n.name}) would lose its backward or "
                "recomputation in the re-trace")
            if why:
                raise Unsupported(why)


def _transposed_2d(n) -> fx.Node | None:
    """w when n is w.t(), w.T, w.transpose(0, 1) (either order, or -1/-2) or w.permute(1, 0) of a
    2-D w."""
    aten = torch.ops.aten
    if not isinstance(n, fx.Node) or n.op != "call_function":
        return None
    w = n.args[0] if n.args else None
    val = w.meta.get("val") if isinstance(w, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() != 2:
        return None
    if n.target in (aten.t.default, aten.numpy_T.default):
        return w
    if n.target == aten.transpose.int and {d % 2 for d in n.args[1:3]} == {0, 1}:
        return w
    if n.target == aten.permute.default and [d % 2 for d in n.args[1]] == [1, 0]:
        return w
    return None


def canonical_linear(graph: fx.Graph) -> None:
    """``x @ w.t()`` (aten.matmul on a transposed 2-D w) -> ``aten.linear(x, w)``, which computes it
    the same way (ATen's linear without bias is that matmul), so a pattern written with F.linear
    also matches heads written as a matmul. Applied to pattern traces and model graphs alike."""
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target != torch.ops.aten.matmul.default:
            continue
        w = _transposed_2d(n.args[1])
        x = n.args[0]
        xval = x.meta.get("val") if isinstance(x, fx.Node) else None
        if w is None or not isinstance(xval, torch.Tensor) or xval.dim() < 2:
            continue
        with graph.inserting_before(n):
            linear = graph.call_function(torch.ops.aten.linear.default, (x, w))
        linear.meta.update(n.meta)
        n.replace_all_uses_with(linear)
        graph.erase_node(n)
    eliminate_dead_code(graph)


# torch's alias ops that pre-dispatch tracing keeps (CompositeImplicitAutograd redirects with the same
# arguments) -> the op each stands for; an overload missing from the map keeps its own name.
_ALIASES = {
    "multiply": "mul", "divide": "div", "true_divide": "div", "subtract": "sub", "negative": "neg",
    "absolute": "abs", "clip": "clamp", "concat": "cat", "concatenate": "cat", "special_expit": "sigmoid",
    "swapaxes": "transpose", "swapdims": "transpose",
}
_OVERLOADS = {"swapaxes.default": "int", "swapdims.default": "int"}


@functools.cache
def _unaliased(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The op ``op`` is an alias of, when its arguments are the same (names aside), else None."""
    name = _ALIASES.get(op._opname) if op.namespace == "aten" else None
    if name is None:
        return None
    overload = _OVERLOADS.get(f"{op._opname}.{op._overloadname}", op._overloadname)
    target = getattr(getattr(torch.ops.aten, name), overload, None)
    if target is None:
        return None
    types = [(a.type, a.kwarg_only) for a in op._schema.arguments]
    return target if types == [(a.type, a.kwarg_only) for a in target._schema.arguments] else None


def canonical_aliases(graph: fx.Graph) -> None:
    """``aten.multiply(a, b)`` -> ``aten.mul(a, b)`` and the other aliases in ``_ALIASES``: the same
    computation under the name the patterns are traced with (Gemma 3n spells its gate
    ``torch.multiply``)."""
    for n in graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            target = _unaliased(n.target)
            if target is not None:
                n.target = target


def _aliases(op) -> bool:
    """op returns (a view of, or the mutated) one of its inputs."""
    return any(r.alias_info is not None for r in op._schema.returns)


# in-place ops whose out-of-place twins autocast leaves alone: in an autocast region another op's twin
# may be cast (h.exp_() keeps bf16 where autocast runs exp in fp32)
_AUTOCAST_NEUTRAL = ("mul_", "add_", "sub_", "silu_", "gelu_", "relu_", "sigmoid_", "tanh_")

# in-place ops that change the written tensor's storage or size, not just its values (set_ makes it an
# alias of its source): no out-of-place twin computes the same thing
_STORAGE_WRITES = ("set_", "resize_", "resize_as_", "resize_as_sparse_")


@functools.cache
def _functional(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """``aten.silu_.default`` -> ``aten.silu.default``: the out-of-place twin of an ATen op that writes
    its first argument only (and returns it), with the same arguments; else None."""
    args = op._schema.arguments
    if (op.namespace != "aten" or not op._opname.endswith("_") or not args or op._opname in _STORAGE_WRITES
            or torch.Tag.nondeterministic_seeded in op.tags):
        return None  # random ops (exponential_, uniform_) stay as written
    writes = [a.alias_info is not None and a.alias_info.is_write for a in args]
    if not writes[0] or any(writes[1:]):
        return None
    target = getattr(getattr(torch.ops.aten, op._opname[:-1], None), op._overloadname, None)
    if target is None or _aliases(target):
        return None
    return target if [a.type for a in args] == [a.type for a in target._schema.arguments] else None


def _fresh(n) -> bool:
    """n is a tensor this graph computed with an op that returns a new one (no input, view or alias)."""
    return (isinstance(n, fx.Node) and n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and not _aliases(n.target))


def _readers_allow(self_: fx.Node, write: fx.Node, later: list[fx.Node]) -> bool:
    """Every other reader of self_ is an ATen op returning a new tensor, the graph's output, or a later
    in-place op on self_ with an out-of-place twin: no view or alias of self_ would miss the write."""
    def ok(u):
        if u.op == "output":
            return True
        if u.op != "call_function" or not isinstance(u.target, torch._ops.OpOverload):
            return False
        return not _aliases(u.target) or (u in later and u.args[0] is self_ and _functional(u.target) is not None)

    return all(ok(u) for u in self_.users if u is not write)


def _out_of_place_val(functional, n: fx.Node):
    """functional's fake result on n's arguments, or None where the write stays as written: an argument
    without a value, or a list of tensors among them (``index_put_``'s indices: a partial write, whose
    out-of-place form copies the whole tensor, and no pattern reads one)."""
    try:
        return fake_call(functional, n, lists=False)
    except Exception:
        return None


def canonical_inplace(graph: fx.Graph) -> None:
    """``F.silu(g, inplace=True) * u``, ``a = F.silu(g); a.mul_(u)`` -> their out-of-place forms, where
    the written tensor is a fresh intermediate that nothing else aliases: readers after the write read
    the new node instead, readers before it keep the old one, so every reader sees the value it saw
    (patterns are traced out of place). Kept as written: a write to an input, a parameter, a buffer or
    a view; a tensor with a view taken of it; a write that would change its dtype (``a.mul_(b)`` keeps
    a's dtype where ``a * b`` promotes); a write under no_grad; in an autocast region, a write other than
    the _AUTOCAST_NEUTRAL ones."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    grad_on, autocast = True, 0
    for n in list(graph.nodes):
        if n.op == "call_function" and n.target is torch._C._set_grad_enabled:
            grad_on = bool(n.args[0])
        elif n.op == "call_function" and n.target is torch.amp.autocast_mode._enter_autocast:
            autocast += 1
        elif n.op == "call_function" and n.target is torch.amp.autocast_mode._exit_autocast:
            autocast -= 1
        # under no_grad a write to a tensor that requires grad stays out of its autograd history; out of
        # place its result would have none at all, cutting the gradient of every later reader
        if not grad_on or n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        if autocast and n.target._opname not in _AUTOCAST_NEUTRAL:
            continue
        functional = _functional(n.target)
        if functional is None or not n.args or not _fresh(n.args[0]) or not isinstance(n.meta.get("val"), torch.Tensor):
            continue
        self_ = n.args[0]
        later = [u for u in self_.users if u is not n and order.get(u, len(order)) > order[n]]
        out = _out_of_place_val(functional, n) if _readers_allow(self_, n, later) else None
        if not isinstance(out, torch.Tensor) or (out.dtype, out.shape) != (n.meta["val"].dtype, n.meta["val"].shape):
            continue
        with graph.inserting_before(n):
            new = graph.call_function(functional, n.args, n.kwargs)
        new.meta.update(n.meta)
        new.meta["val"] = out
        order[new] = order[n]
        n.replace_all_uses_with(new)
        for u in later:
            u.replace_input_with(self_, new)
        graph.erase_node(n)


def _pure(n: fx.Node) -> bool:
    """n is an ATen op that writes none of its arguments (nor any global state a cast would read)."""
    return n.op in ("placeholder", "get_attr") or (
        n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
        and not any(a.alias_info is not None and a.alias_info.is_write for a in n.target._schema.arguments))


def canonical_casts(graph: fx.Graph) -> None:
    """A cast repeated on the same tensor -> the first one: ModernBERT's rotation reads ``q.float()``
    twice (``q.float() * cos + rotate_half(q.float()) * sin``), one x to the patterns; in fp32 both are
    no-ops and it matched already. Only where every node between the two is a pure ATen op: no in-place
    write (to x or a tensor x views) and no grad-mode switch lies between them."""
    seen: dict[tuple, fx.Node] = {}
    for n in list(graph.nodes):
        if not _pure(n):
            seen.clear()
        elif n.op == "call_function" and n.target in CASTS:
            key = (n.target, n.args, tuple(sorted(n.kwargs.items())))
            try:
                first = seen.setdefault(key, n)
            except TypeError:  # an unhashable argument (a list of nodes): leave it
                continue
            if first is not n:
                n.replace_all_uses_with(first)
                graph.erase_node(n)


def canonical_ops(graph: fx.Graph) -> None:
    """The spelling unifications of the module doc, applied to model graphs and pattern traces."""
    canonical_aliases(graph)
    canonical_inplace(graph)
    canonical_casts(graph)
    canonical_linear(graph)
    canonical_keepdim(graph)
    canonical_nll(graph)
    canonical_unstack(graph)
    canonical_log_probs(graph)


def to_aten(gm: fx.GraphModule, example_inputs) -> fx.GraphModule:
    """Re-trace Dynamo's graph to pre-dispatch ATen; keeps Dynamo's graph and placeholder metadata.
    Activation-checkpointed regions are inlined with their recompute tags first (checkpoint.py)."""
    source, _ = inline_checkpoints(gm)
    source = opaque.outline_vmaps(source)
    check_retraceable(source)
    fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
    fakes = _fakify(gm, example_inputs, fake_mode)

    interp = _Retrace(source)
    try:
        with fake_mode, fx_traceback.preserve_node_meta():
            aten_gm = make_fx(interp.run, pre_dispatch=True)(*fakes)
        opaque.restore(aten_gm, interp.originals)
    finally:
        opaque.forget(interp.originals)
    canonical_ops(aten_gm.graph)  # also removes make_fx's dead aten.detach nodes
    aten_gm.recompile()
    aten_gm.meta["fxfuse_opaque"] = [opaque.describe(n) for n in interp.originals.values()]
    aten_gm.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        # tensor constants the re-trace lifted (a KV cache's initial tensors) need a source too
        from torch._dynamo.source import ConstantSource

        sources = dict(gm._param_name_to_source)
        for name, _ in [*aten_gm.named_parameters(), *aten_gm.named_buffers()]:
            sources.setdefault(name, ConstantSource(name))
        aten_gm._param_name_to_source = sources
    old = [n for n in gm.graph.nodes if n.op == "placeholder"]
    new = [n for n in aten_gm.graph.nodes if n.op == "placeholder"]
    grad_on = torch.is_grad_enabled()
    for n, x in zip(new, example_inputs):
        n.meta["fxfuse_requires_grad"] = grad_on and isinstance(x, torch.Tensor) and x.requires_grad
    for o, n in zip(old, new):
        for k, v in o.meta.items():
            n.meta.setdefault(k, v)
        if hasattr(o, "_dynamo_source"):  # a node attribute, read by AOTAutograd for static inputs
            n._dynamo_source = o._dynamo_source
    return aten_gm
