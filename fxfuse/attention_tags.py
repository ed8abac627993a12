"""Causal masks across graphs: a mask input checked once by value, then trusted by every layer.

When a model is split into several graphs (a graph break, FSDP2's per-layer hooks), HF builds the
causal mask in one graph (from position ids it receives, so fxfuse/attention.py cannot evaluate
it at compile time) and every decoder layer's graph receives it as an input. Then:

- a graph that uses a mask input in SDPA is compiled twice: as traced, and with those calls made
  causal (attention.causal_attention with ``assume``);
- at each call, the mask tensor's verdict is looked up in the attribute ``_fxfuse_causal =
  ((Tq, Tk), version, is_causal)`` on the tensor object; when missing or stale (the tensor's
  version counter moved: written in place), the mask is compared with SDPA's causal mask on its
  device, one host sync, and the verdict stored on the tensor. The causal variant runs only on a
  yes; anything else (a padding mask, a user's own mask) runs the graph as traced. HF hands the
  same mask object to every layer, so a step pays one check, in the first layer;
- a graph whose output is a mask proven causal at compile time (attention.causal_outputs) stores
  the yes on it directly.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.fx as fx

from .attention import causal_attention, mask_inputs

TAG = "_fxfuse_causal"
log = logging.getLogger("fxfuse")


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
    """(copy of gm with its SDPA calls on mask inputs made causal, [(input position, (Tq, Tk))], sites)
    or None when gm has no such call (or none could be rewritten)."""
    wanted = mask_inputs(gm)
    if not wanted:
        return None
    graph = fx.Graph()
    mapping: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, mapping))  # node meta is copied (shallow)
    copy = fx.GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):  # Dynamo's sources of lifted constants (to_aten)
        copy._param_name_to_source = gm._param_name_to_source
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for old in placeholders:
        if hasattr(old, "_dynamo_source"):  # read by AOTAutograd for static inputs
            mapping[old]._dynamo_source = old._dynamo_source
    done, _ = causal_attention(copy, assume={mapping[p]: size for p, size in wanted.items()})
    used = {n for s in done for n in s.nodes}
    checks = [(placeholders.index(p), size) for p, size in wanted.items() if mapping[p].name in used]
    if not checks:
        return None
    return copy, checks, done


def dispatch(causal, traced, checks: list[tuple[int, tuple[int, int]]], graph_name: str):
    """Run causal(*args) when every checked input is a causal mask of its size, else traced(*args)."""
    warned = []

    def run(*args):
        if all(is_causal_mask(args[i], size) for i, size in checks):
            return causal(*args)
        if not warned:
            warned.append(True)
            log.info("fxfuse: %s got a mask input that is not causal: ran it with the mask", graph_name)
        return traced(*args)

    return run
