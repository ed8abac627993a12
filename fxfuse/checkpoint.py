"""Activation-checkpointed regions inlined into Dynamo's graph, tagged for recomputation.

Dynamo traces ``torch.utils.checkpoint.checkpoint(fn, *args)`` (HF ``gradient_checkpointing_enable``,
torchtitan's per-layer AC, either ``use_reentrant``) as one call of the higher-order op
``tag_activation_checkpoint`` on a subgraph. AOTAutograd lowers that call by tracing the subgraph
with every op tagged ``node.meta["recompute"] = PREFER_RECOMPUTE`` and one ``node.meta["ac_graph_id"]``
per region (increasing in program order); the min-cut partitioner then recomputes each region in
backward instead of saving its activations, and saves the tensors at region boundaries.

fxfuse does the same one step earlier: each region's subgraph is inlined with those two tags, so
patterns inside checkpointed layers match like any others; the re-trace copies both tags onto the
ATen nodes (``torch.fx.traceback`` copies them under ``preserve_node_meta``) and the rewrite copies
them onto the fused calls, which hands AOTAutograd the tagged graph it would have built itself.
Selective checkpointing (a ``context_fn`` policy, run per op while tracing) is not inlined: such a
graph stays unfused (normalize.check_retraceable says why).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx


def _is_checkpoint(n: fx.Node) -> bool:
    return n.op == "call_function" and getattr(n.target, "__name__", "") == "tag_activation_checkpoint"


def _body(root: fx.GraphModule, n: fx.Node) -> fx.GraphModule:
    return getattr(root, n.args[0].target)


def is_plain(root: fx.GraphModule, n: fx.Node) -> bool:
    """A checkpoint call without a selective-checkpointing policy (context_fn)."""
    return "_checkpoint_context_fn" not in _body(root, n).meta


def inline_checkpoints(gm: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """(graph module with every plain checkpoint region inlined and tagged, number of regions).
    gm is not modified: the result is a new GraphModule over a copy of its graph (gm itself when it
    holds no plain checkpoint call), sharing gm's parameters and submodules."""
    if not any(_is_checkpoint(n) and is_plain(gm, n) for n in gm.graph.nodes):
        return gm, 0
    from torch.utils.checkpoint import CheckpointPolicy

    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    root = fx.GraphModule(gm, graph)
    regions = 0
    while True:  # a region inlined may hold a nested one
        calls = [n for n in root.graph.nodes if _is_checkpoint(n) and is_plain(root, n)]
        if not calls:
            break
        for call in calls:
            regions += 1
            body = call.args[0]
            _inline(root, call, regions, CheckpointPolicy.PREFER_RECOMPUTE)
            if not body.users:
                root.graph.erase_node(body)
    # No eliminate_dead_code: at this (torch) level an in-place method whose result is unused
    # (``out.add_(bias)``, gpt-oss's experts) counts as dead to FX, and removing it drops the op
    root.delete_all_unused_submodules()
    root.recompile()
    return root, regions


def _inline(root: fx.GraphModule, call: fx.Node, region: int, policy) -> None:
    """Replace ``call`` (tag_activation_checkpoint(body, *args, **checkpoint kwargs)) by body's nodes."""
    body = _body(root, call)
    args = iter(call.args[1:])
    env: dict[fx.Node, object] = {}
    result = None
    with root.graph.inserting_before(call):
        for bn in body.graph.nodes:
            if bn.op == "placeholder":
                env[bn] = next(args)
            elif bn.op == "output":
                result = fx.node.map_arg(bn.args[0], lambda a: env[a])
            elif bn.op == "get_attr":  # a constant or a nested region's body: carried over to the root
                name, value = f"_ac{region}_{bn.target.replace('.', '_')}", operator.attrgetter(bn.target)(body)
                if isinstance(value, torch.nn.Module):
                    root.add_submodule(name, value)
                else:
                    setattr(root, name, value)
                env[bn] = root.graph.get_attr(name)
                env[bn].meta = dict(bn.meta)
            else:
                new = root.graph.node_copy(bn, lambda a: env[a])
                new.meta["recompute"] = policy
                new.meta["ac_graph_id"] = region
                env[bn] = new
    for user in list(call.users):
        if user.op == "call_function" and user.target is operator.getitem and isinstance(result, (tuple, list)):
            user.replace_all_uses_with(result[user.args[1]])
            root.graph.erase_node(user)
    if call.users:  # the whole output used as one value
        call.replace_all_uses_with(result)
    root.graph.erase_node(call)


SKIP_REPLAY = "skip_fwd_side_effects_in_bwd_under_checkpoint"


def checkpointed_side_effects_break() -> bool:
    """Whether HF models' checkpointed layers break Dynamo's graph: transformers >= 5.25 sets its
    output collector (a context variable) inside the checkpointed forward, a side effect Dynamo
    refuses there ("HOP: Unsafe side effect"), so every such layer runs eagerly, unfused, under any
    backend. Dynamo's own remedy is its config ``skip_fwd_side_effects_in_bwd_under_checkpoint``
    (the side effect runs in forward only, not again in the backward's recompute)."""
    try:
        import transformers
    except ImportError:
        return False
    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    return (major, minor) >= (5, 25)


def remedy_applies() -> bool:
    """The remedy is needed (checkpointed_side_effects_break) and this torch has the setting."""
    return checkpointed_side_effects_break() and hasattr(torch._dynamo.config, SKIP_REPLAY)


def skip_checkpoint_side_effect_replay():
    """A context in which Dynamo traces checkpointed forwards with side effects (the remedy above),
    where this torch has the setting; a no-op context where it does not or none is needed. Not
    applied by the backend itself: it changes what a checkpointed forward's recompute replays, a
    choice the user makes (README, Limits)."""
    import contextlib

    if not remedy_applies():
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(**{SKIP_REPLAY: True})
