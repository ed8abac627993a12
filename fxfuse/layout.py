"""Views traced against eager's layouts become reshapes in rewritten graphs.

The re-trace (normalize.py) records layout-dependent no-ops away: ``.contiguous()`` of a tensor
that is contiguous at trace time leaves no node, and ``reshape`` of a viewable tensor becomes
``view``. A rewrite can change a layout: a fused op returns another layout than the elementwise
ops it replaces (RMSNorm's output is contiguous, eager's math keeps a transposed input's layout),
and an SDPA call made ``is_causal`` / ``enable_gqa`` may run another backend whose output layout
differs. A ``view`` after it then fails in the inner compiler (with ``inner="eager"``: at run time),
as HF Dory's ``attn_output.transpose(1, 2).contiguous()`` then ``.view(B, T, -1)`` did on CUDA.

``aten.reshape`` is the same view wherever the layout allows one and copies only where it does
not, which is what the dropped ``.contiguous()`` did in eager. A view whose tensor is mutated in
place through any alias stays a view: a copy would lose the aliasing the mutation relies on.
"""
from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten


def _mutated_args(n: fx.Node) -> list:
    """The nodes n's op writes in place (arguments its schema marks as written)."""
    schema = getattr(n.target, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
            out.extend(v if isinstance(v, (list, tuple)) else [v])
    return [v for v in out if isinstance(v, fx.Node)]


def relax_views(gm: fx.GraphModule) -> int:
    """Turn gm's ``aten.view`` calls into ``aten.reshape`` where no alias of their tensor is
    mutated in place; the number turned. Same values and, where the layout allows, no copy.
    Aliases are grouped by the storage they view (fxfuse.reinplace.storage_base: an unknown op may
    alias, and every graph input shares the group None)."""
    from .reinplace import storage_base

    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    mutated = {storage_base(m) for n in calls for m in _mutated_args(n)}
    turned = 0
    for n in calls:
        if n.target is aten.view.default and storage_base(n) not in mutated:
            n.target = aten.reshape.default
            turned += 1
    if turned:
        gm.recompile()
    return turned
