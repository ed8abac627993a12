"""Replace each accepted match by one call of its fused op, pattern by pattern; build the report."""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from .canon import CASTS, is_noop_cast, val
from .matcher import GraphMatcher, Match
from .pattern import Pattern
from .report import Report, Site, module_path, source_line

_CARRIED_META = ("nn_module_stack", "stack_trace", "source_fn_stack", "val", "tensor_meta")


def _site(pattern: str, anchor: fx.Node, variant: str, **kw) -> Site:
    return Site(pattern=pattern, module=module_path(anchor), source=source_line(anchor), variant=variant, **kw)


def _hint(s) -> int:
    """A size's value at the example inputs, without guarding on it (no specialisation)."""
    if isinstance(s, torch.SymInt):
        hint = s.node.hint
        return int(hint) if hint is not None else 0
    return int(s)


def saved_bytes(m: Match) -> tuple[int, list[str]]:
    """Intermediates inside the match that the fused op no longer writes: bytes per call, and which."""
    total, names = 0, []
    for n in sorted(m.region, key=lambda n: n.name):
        v = val(n)
        if n is m.anchor or v is None or n.target is torch.ops.aten.view.default or (
                n.target in CASTS and is_noop_cast(n)):
            continue
        total += math.prod(_hint(s) for s in v.shape) * v.element_size()
        names.append(f"{n.name}:{str(v.dtype).removeprefix('torch.')}{list(v.shape)}")
    return total, names


def _describe(m: Match) -> str:
    b, names = saved_bytes(m)
    return f"{len(names)} tensors, {b / 2**10:.1f} KiB/call"


def rewrite(gm: fx.GraphModule, patterns: list[Pattern]) -> Report:
    """Fuse every accepted match of each pattern in gm (in place); report what happened."""
    report = Report(graphs=1)
    for pattern in patterns:
        matches, misses = GraphMatcher(gm.graph).find(pattern, claimed=set())
        for m in matches:
            before = set(gm.graph.nodes)
            try:
                with gm.graph.inserting_before(m.anchor):
                    new = pattern.lower(m, gm.graph)
            except Exception as e:  # fail safe: the site stays unfused, the compile goes on
                for n in reversed(list(gm.graph.nodes)):
                    if n not in before:
                        gm.graph.erase_node(n)
                report.unmatched.append(_site(pattern.name, m.anchor, m.variant.name,
                                              reason=f"lowering failed: {type(e).__name__}: {e}"))
                continue
            for k in _CARRIED_META:
                if k in m.anchor.meta:
                    new.meta[k] = m.anchor.meta[k]
            report.matched.append(_site(pattern.name, m.anchor, m.variant.name, saved=_describe(m), saved_tensors=saved_bytes(m)[1],
                                        nodes=sorted(n.name for n in m.region)))
            m.anchor.replace_all_uses_with(new)
        for mi in misses:
            report.unmatched.append(_site(pattern.name, mi.anchor, mi.variant, reason=mi.reason,
                                          nodes=[mi.anchor.name]))
        gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return report
