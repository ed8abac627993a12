"""Higher-order ops carried through the re-trace unchanged.

A custom ``torch.autograd.Function`` (Dynamo's ``autograd_function_apply``), flex attention,
selective activation checkpointing (``tag_activation_checkpoint`` with a ``context_fn`` policy),
``invoke_subgraph`` and ``associative_scan`` (HF Mamba's selective scan on CUDA) reach the backend
as one call of a higher-order op on subgraphs. Re-tracing such a call with make_fx would run its
forward and drop what makes it special: the Function's backward, the checkpoint policy. So the
re-trace sees a stand-in instead, one call of the opaque op ``fxfuse::hop(tensors, sym_ints, key)``,
whose fake impl runs the real higher-order op on fake inputs for the output shapes. Right after the
re-trace each stand-in is swapped back for the original call (its subgraphs copied onto the new
graph module), so the matcher sees an op it does not know (a fused pattern never swallows it, and an
intermediate it reads counts as escaping) and AOTAutograd lowers the call as it would have in
Dynamo's own graph. Nothing inside the call is fused.

A ``torch.vmap`` call reaches the backend inlined: the nodes between ``_vmap_increment_nesting`` and
its ``_vmap_decrement_nesting``, with ``_add_batch_dim`` / ``_remove_batch_dim`` at the edges
(transformers' attention masks with custom mask functions, as Gemma 3 / 4 build for image tokens;
flex attention's create_block_mask). The pre-dispatch re-trace sees the batched tensors inside as
plain ones and bakes them into constants, so ``outline_vmaps`` first moves each outermost region
into a submodule called through a ``VmapRegion``: kept as above, and at its place after the
re-trace AOTAutograd traces through the region, functorch and all, as it does Dynamo's own graph.

Any other higher-order op still leaves the whole graph unfused (normalize.check_retraceable).
"""
from __future__ import annotations

import itertools
import operator
from typing import List

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

# Higher-order ops whose call is functional (no input mutation, tensor or flat tuple of tensors
# out) and whose fake run gives their outputs' metadata.
KEPT = ("autograd_function_apply", "flex_attention", "tag_activation_checkpoint", "invoke_subgraph",
        "associative_scan")  # Mamba's selective scan on CUDA (pointwise mode)

_CALLS: dict[int, tuple] = {}  # key -> (op, args/kwargs spec, leaf kinds, constant leaves) during a re-trace
_keys = itertools.count()


# typing.List, not list[...]: torch 2.6's schema inference knows only the typing aliases
@torch.library.custom_op("fxfuse::hop", mutates_args=())
def hop(tensors: List[torch.Tensor], sym_ints: List[int], key: int) -> List[torch.Tensor]:
    """Stand-in for a higher-order op call during the re-trace; never runs."""
    raise RuntimeError("fxfuse::hop is a re-trace stand-in and was not swapped back for its call")


@hop.register_fake
def _(tensors, sym_ints, key):
    out = _call(key, tensors, sym_ints)
    return [t.clone() for t in pytree.tree_leaves(out)]  # an op's outputs may not alias its inputs


class VmapRegion:
    """Calls an outlined torch.vmap region (outline_vmaps): its graph module on the region's inputs,
    a tuple of the region's outputs. Its stand-in's outputs during the re-trace are new tensors shaped
    as Dynamo's fake outputs of the region (examples, in the re-trace's own fake mode): running
    functorch inside a fake kernel would see its batched tensors as plain ones, as make_fx does."""

    __name__ = "vmap"

    def __init__(self, gm: fx.GraphModule, examples: tuple):
        self.gm, self.examples = gm, examples

    def __call__(self, *args):
        return tuple(self.gm(*args))

    def fake_outputs(self) -> tuple:
        return tuple(torch.empty_strided(e.shape, e.stride(), dtype=e.dtype, device=e.device) for e in self.examples)


def is_kept(n: fx.Node) -> bool:
    return n.op == "call_function" and (isinstance(n.target, VmapRegion) or (
        isinstance(n.target, torch._ops.HigherOrderOperator) and n.target.__name__ in KEPT))


def _functorch_call(n: fx.Node) -> str:
    return getattr(n.target, "__name__", "") if n.op == "call_function" else ""


def enters_vmap(n: fx.Node) -> bool:
    """n opens a torch.vmap region (Dynamo inlines vmap between these and their decrements)."""
    return _functorch_call(n) == "_vmap_increment_nesting"


def _vmap_regions(graph: fx.Graph) -> list[list[fx.Node]]:
    """The nodes of each outermost vmap region, increment to decrement, in graph order."""
    regions, depth, start = [], 0, None
    nodes = list(graph.nodes)
    for i, n in enumerate(nodes):
        if enters_vmap(n):
            start = i if depth == 0 else start
            depth += 1
        elif _functorch_call(n) == "_vmap_decrement_nesting" and depth:
            depth -= 1
            if depth == 0:
                regions.append(nodes[start:i + 1])
    return regions


def outline_vmaps(gm: fx.GraphModule) -> fx.GraphModule:
    """gm with each outermost vmap region replaced by one call of a VmapRegion on the region's inputs,
    its outputs read by getitem. gm is not modified: the result is a new GraphModule over a copy of
    its graph (gm itself when it holds no region), sharing gm's parameters and submodules."""
    if not any(enters_vmap(n) for n in gm.graph.nodes):
        return gm
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    root = fx.GraphModule(gm, graph)
    for region in _vmap_regions(graph):
        inside = set(region)
        inputs = list(dict.fromkeys(a for n in region for a in n.all_input_nodes if a not in inside))
        outputs = [n for n in region if any(u not in inside for u in n.users)]
        body = fx.Graph()
        env = {}
        for a in inputs:
            env[a] = body.placeholder(a.name)
            env[a].meta.update(a.meta)
        for n in region:
            env[n] = body.node_copy(n, lambda a: env[a])
        body.output(tuple(env[o] for o in outputs))
        examples = tuple(o.meta.get("example_value") for o in outputs)
        with graph.inserting_before(region[0]):
            call = graph.call_function(VmapRegion(fx.GraphModule(root, body), examples), tuple(inputs))
            call.meta.update({k: v for k, v in region[0].meta.items() if k != "example_value"})
            call.meta["example_value"] = examples
            for i, o in enumerate(outputs):
                item = graph.call_function(operator.getitem, (call, i))
                item.meta.update(o.meta)
                o.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
        for n in reversed(region):
            graph.erase_node(n)
    root.recompile()
    return root


def describe(n: fx.Node) -> str:
    from .report import module_path, source_line

    what = ("selective activation checkpointing" if n.target.__name__ == "tag_activation_checkpoint"
            else "torch.vmap" if isinstance(n.target, VmapRegion) else n.target.__name__)
    where = module_path(n) or "(root)"
    src = source_line(n)
    return f"{what} ({n.name}) at {where}{' ' + src if src else ''}: kept as written, nothing inside it fused"


def unsupported_output(n: fx.Node) -> str | None:
    """Why n's call cannot stand in as fxfuse::hop (its outputs are not a tensor or a flat tuple
    or list of tensors), or None."""
    val = n.meta.get("example_value")
    if isinstance(val, torch.Tensor):
        return None
    if isinstance(val, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in val):
        return None
    return f"higher-order op {n.target.__name__} ({n.name}) returns {type(val).__name__}, not tensors"


def _kind(leaf) -> str:
    if isinstance(leaf, torch.Tensor):
        return "tensor"
    if isinstance(leaf, torch.SymInt):
        return "sym_int"
    if isinstance(leaf, (torch.SymFloat, torch.SymBool)):
        raise NotImplementedError(f"a {type(leaf).__name__} argument of a higher-order op")
    return "const"


def _rebuild(key: int, tensors, sym_ints, const=lambda i, c: c):
    """(op, args, kwargs) of the call behind key, with tensors and sym_ints in their places and
    const(i, c) for each constant leaf c at leaf index i."""
    op, spec, kinds, consts = _CALLS[key]
    ts, ss = iter(tensors), iter(sym_ints)
    leaves = [next(ts) if k == "tensor" else next(ss) if k == "sym_int" else const(i, c)
              for i, (k, c) in enumerate(zip(kinds, consts))]
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    return op, args, kwargs


def _call(key: int, tensors, sym_ints):
    op, args, kwargs = _rebuild(key, tensors, sym_ints)
    return op.fake_outputs() if isinstance(op, VmapRegion) else op(*args, **kwargs)


class Interpreter(fx.Interpreter):
    """fx.Interpreter that runs each kept higher-order op call as one fxfuse::hop call."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.originals: dict[int, fx.Node] = {}  # key of each stand-in -> the call it stands for

    def run_node(self, n: fx.Node):
        if not is_kept(n):
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        kinds = [_kind(v) for v in leaves]
        key = next(_keys)
        _CALLS[key] = (n.target, spec, kinds, [v if k == "const" else None for v, k in zip(leaves, kinds)])
        self.originals[key] = n
        out = hop([v for v, k in zip(leaves, kinds) if k == "tensor"],
                  [v for v, k in zip(leaves, kinds) if k == "sym_int"], key)
        val = n.meta["example_value"]
        return out[0] if isinstance(val, torch.Tensor) else type(val)(out)


def restore(gm: fx.GraphModule, originals: dict[int, fx.Node]) -> None:
    """Swap each fxfuse::hop stand-in in gm for the call it stands for (originals: key -> node of
    Dynamo's graph, from Interpreter.originals); the call's subgraph modules are copied onto gm."""
    graph = gm.graph
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not torch.ops.fxfuse.hop.default:
            continue
        tensors, sym_ints, key = n.args
        original = originals[key]

        def subgraph(i, c):  # a subgraph module becomes a get_attr on gm
            if not isinstance(c, torch.nn.Module):
                return c
            name = f"fxfuse_{original.name}_{i}"  # Dynamo's node names: unique, stable across runs
            gm.add_submodule(name, c)
            return graph.get_attr(name)

        with graph.inserting_before(n):
            op, args, kwargs = _rebuild(key, tensors, sym_ints, subgraph)
            call = graph.call_function(op, tuple(args), kwargs)
        call.meta.update({k: v for k, v in original.meta.items() if k != "val"})
        vals = n.meta.get("val")
        single = isinstance(original.meta["example_value"], torch.Tensor)
        if vals is not None:
            call.meta["val"] = vals[0] if single else tuple(vals)
        if single:  # the stand-in's only output is read through getitem(n, 0)
            for user in list(n.users):
                user.replace_all_uses_with(call)
                graph.erase_node(user)
        else:
            n.replace_all_uses_with(call)
        graph.erase_node(n)
    gm.recompile()


def forget(originals: dict[int, fx.Node]) -> None:
    for key in originals:
        _CALLS.pop(key, None)
