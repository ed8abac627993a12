"""Causal masks checked at run time: masks fxfuse/attention.py cannot evaluate at compile time.

A mask that depends on graph inputs (position ids, an all-ones attention_mask, a mask built in an
earlier graph: graph breaks, FSDP2's per-layer graphs) or on symbolic sizes (dynamic shapes) may
still be the causal mask at run time. Such a graph (attention.checkable_masks) is compiled twice:
as traced, and with those SDPA calls made causal (attention.causal_attention with ``assume``).
At each call the masks are computed from the call's inputs by the ops that make them (the same
ops the traced graph runs; no gradient involved) and compared with SDPA's causal mask on their
device, one host sync; the causal variant runs only if every one is causal, else the graph as
traced (a padding mask, a user's own mask). The verdict is stored on the mask tensor
(``_fxfuse_causal = ((Tq, Tk), version, is_causal)``) and reused while its version counter stays:
HF hands one mask object to every layer's graph, so a split model pays one comparison per step.
A graph whose output is a mask proven causal at compile time (attention.causal_outputs) stores
the yes on it directly.
"""
from __future__ import annotations

import collections
import functools
import logging

import torch
import torch.fx as fx

from .attention import causal_attention, checkable_masks

TAG = "_fxfuse_causal"
log = logging.getLogger("fxfuse")
# calls of checked graphs since the process started, by the variant that ran: "causal" or "traced"
RUNS: collections.Counter = collections.Counter()


@functools.lru_cache(maxsize=8)  # a few lengths in flight; each is a [Tq, Tk] bool tensor on the device
def _causal(tq: int, tk: int, device: torch.device) -> torch.Tensor:
    return torch.ones(tq, tk, dtype=torch.bool, device=device).tril()


def tag_outputs(compiled, tags: list[tuple[int, tuple[int, int]]]):
    """compiled(*args) with a causal verdict stored on the outputs at the given positions."""
    if not tags:
        return compiled

    def run(*args):
        out = compiled(*args)
        for i, size in tags:
            setattr(out[i], TAG, (size, out[i]._version, True))
        return out

    return run


def is_causal_mask(mask: torch.Tensor, size: tuple[int, int]) -> bool:
    """Whether mask [..., Tq, Tk] equals SDPA's causal mask at every leading index (bool: True where
    allowed; float: 0 where allowed, -inf or the dtype's min where not). Cached on the tensor."""
    tag = getattr(mask, TAG, None)
    if tag is not None and tag[0] == size and tag[1] == mask._version:
        return tag[2]
    causal = _causal(*size, mask.device)
    with torch.no_grad():
        if mask.dtype == torch.bool:
            ok = (mask == causal).all()
        else:
            blocked = (mask == float("-inf")) | (mask == torch.finfo(mask.dtype).min)
            ok = ((mask == 0) | blocked).all() & (blocked != causal).all()
        verdict = bool(ok)  # the one host sync
    setattr(mask, TAG, (size, mask._version, verdict))
    return verdict


def causal_variant(gm: fx.GraphModule):
    """(copy of gm with its SDPA calls on checkable masks made causal, masks(*args) -> the masks to
    compare, sites) or None when gm has no such call (or none could be rewritten)."""
    wanted = checkable_masks(gm)
    if not wanted:
        return None
    graph = fx.Graph()
    mapping: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, mapping))  # node meta is copied (shallow)
    copy = fx.GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):  # Dynamo's sources of lifted constants (to_aten)
        copy._param_name_to_source = gm._param_name_to_source
    for old in gm.graph.nodes:
        if old.op == "placeholder" and hasattr(old, "_dynamo_source"):  # read by AOTAutograd
            mapping[old]._dynamo_source = old._dynamo_source
    done, _ = causal_attention(copy, assume={mapping[m] for m in wanted})
    used = {n for s in done for n in s.nodes}
    masks = [m for m in wanted if mapping[m].name in used]
    if not masks:
        return None
    return copy, _mask_program(gm, {m: wanted[m] for m in masks}), done


def _mask_program(gm: fx.GraphModule, masks: dict) -> fx.GraphModule:
    """A GraphModule taking gm's inputs and returning the masks, from the nodes that compute them."""
    needed = {n for cone in masks.values() for n in cone} | set(masks)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder" or n in needed:
            env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[m] for m in masks))
    return fx.GraphModule(gm, graph)


def dispatch(causal, traced, masks, graph_name: str):
    """Run causal(*args) when every mask masks(*args) computes is the causal mask, else traced(*args)."""
    warned = []

    def run(*args):
        try:
            with torch.no_grad():
                values = masks(*args)
            causal_now = all(is_causal_mask(m, tuple(m.shape[-2:])) for m in values)
        except Exception as e:  # fail safe: the traced graph runs (and raises if the inputs are bad)
            log.warning("fxfuse: %s: computing its masks for the causal check failed (%s: %s)",
                        graph_name, type(e).__name__, e)
            causal_now = False
        RUNS["causal" if causal_now else "traced"] += 1
        if causal_now:
            return causal(*args)
        if not warned:
            warned.append(True)
            log.info("fxfuse: %s got a mask input that is not causal: ran it with the mask", graph_name)
        return traced(*args)

    return run
