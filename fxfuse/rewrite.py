"""Replace each accepted match by one call of its fused op, pattern by pattern; build the report."""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from .canon import CASTS, is_noop_cast, val
from .matcher import GraphMatcher, Match
from .normalize import eliminate_dead_code
from .options import Options
from .pattern import Pattern
from .report import Report, Site, module_path, source_line

aten = torch.ops.aten

_CARRIED_META = ("nn_module_stack", "stack_trace", "source_fn_stack", "val", "tensor_meta")


def _site(pattern: str, anchor: fx.Node, variant: str, **kw) -> Site:
    return Site(pattern=pattern, module=module_path(anchor), source=source_line(anchor), variant=variant, **kw)


def _hint(s) -> int:
    """A size's value at the example inputs, without guarding on it (no specialisation)."""
    if isinstance(s, torch.SymInt):
        hint = s.node.hint
        return int(hint) if hint is not None else 0
    return int(s)


def example_shape(v: torch.Tensor) -> list[int]:
    """v's shape at the example inputs (symbolic sizes of a dynamic graph at their hints)."""
    return [_hint(s) for s in v.shape]


def bytes_of(v: torch.Tensor) -> int:
    return math.prod(example_shape(v)) * v.element_size()


def tensor_desc(n: fx.Node, v: torch.Tensor) -> str:
    """'name:dtype[shape]' at the example inputs, the form of Site.saved_tensors (fxfuse/audit_profile.py
    parses it)."""
    return f"{n.name}:{str(v.dtype).removeprefix('torch.')}{example_shape(v)}"


def saved_bytes(m: Match) -> tuple[int, list[str]]:
    """Intermediates inside the match that the fused op no longer writes: bytes per call, and which."""
    total, names = 0, []
    for n in sorted(m.region - _escape_cone(m), key=lambda n: n.name):
        v = val(n)
        if n is m.anchor or v is None or n.target is torch.ops.aten.view.default or (
                n.target in CASTS and is_noop_cast(n)):
            continue
        total += bytes_of(v)
        names.append(tensor_desc(n, v))
    for desc, nbytes in m.pattern.hidden_saved(m):
        total += nbytes
        names.append(desc)
    return total, names


def _noop_cast_of(u: fx.Node, n: fx.Node) -> bool:
    """u is a cast of n that changes nothing. n must be the cast's input: ``type_as(y, n)`` takes
    only n's dtype and its value is y's, not n's."""
    return u.target in CASTS and u.args[0] is n and is_noop_cast(u)


def _real_users(n: fx.Node) -> list[fx.Node]:
    """n's users, looking through casts that change nothing (they follow their input anywhere)."""
    out = []
    for u in n.users:
        out += _real_users(u) if _noop_cast_of(u, n) else [u]
    return out


def _escape_cone(m: Match) -> set[fx.Node]:
    """Region nodes that the match's escaping values depend on (they stay computed)."""
    cone, stack = set(), list(m.escapes)
    while stack:
        n = stack.pop()
        if n in m.region and n not in cone:
            cone.add(n)
            stack += n.all_input_nodes
    return cone


def _detach_escapes(m: Match, graph: fx.Graph) -> None:
    """Values of the match used outside it (logits a model returns) stay computed by the same ops,
    now from detached inputs: exact values, no gradient through them, no tangent in backward."""
    cone = _escape_cone(m)
    if not cone:
        return
    order = {n: i for i, n in enumerate(graph.nodes)}
    detached: dict[fx.Node, fx.Node] = {}
    for n in sorted(cone, key=order.__getitem__):
        for a in n.all_input_nodes:
            if a in m.inputs.values() and a not in detached:
                # before its first user in the cone: an input may be computed after the cone starts
                # (Dory's logit scale, computed after the lm_head)
                with graph.inserting_before(n):
                    detached[a] = graph.call_function(torch.ops.aten.detach.default, (a,))
                detached[a].meta["val"] = a.meta.get("val")
        n.args = tuple(detached.get(a, a) if isinstance(a, fx.Node) else a for a in n.args)


def _reads_only(n, roots: set[fx.Node]) -> bool:
    """n is one of roots, or computed from one alone (casts, views, a constant scale; sizes aside),
    and not detached on the way (``return loss, logits.detach()``: eager's needs no guard)."""
    while isinstance(n, fx.Node) and n not in roots:
        inputs = [a for a in n.all_input_nodes if isinstance(val(a), torch.Tensor)]
        if len(inputs) != 1 or n.target is torch.ops.aten.detach.default:
            return False
        n = inputs[0]
    return isinstance(n, fx.Node)


def _skip_escapes(m: Match, graph: fx.Graph) -> list[fx.Node]:
    """Escaping values are not computed: each becomes an empty tensor where it is returned."""
    empties = []
    for e in m.escapes:
        v = val(e)
        with graph.inserting_before(e):
            empty = graph.call_function(torch.ops.aten.empty.memory_format, ([0],),
                                        {"dtype": v.dtype, "device": v.device})
        empty.meta["val"] = v.new_empty(0)
        e.replace_all_uses_with(empty)
        empties.append(empty)
    return empties


def _bypass_noop_casts(n: fx.Node, new: fx.Node) -> None:
    """Users reached through no-op casts of n read new directly (the fused call may sit after the
    casts when it is placed after its last input)."""
    for u in list(n.users):
        if _noop_cast_of(u, n):
            _bypass_noop_casts(u, new)
            u.replace_all_uses_with(new)
            n.graph.erase_node(u)  # dead now, and it may sit before new


def _placed_groups(pattern: Pattern, matches: list[Match], matcher: GraphMatcher
                   ) -> list[tuple[list[Match], fx.Node, list[fx.Node]]]:
    """(group, node to insert its fused call before, views to move after the call). The call goes
    before the group's first anchor if every input exists by then, else right after its last input
    if no anchor is used before that (gpt-fast computes k's input after q's rotation) or used only
    by views that can follow the call (Gemma 4 transposes q before it projects k); a group that fits
    none of these is split."""
    order, segment, written = matcher.order, matcher.segment, matcher.written  # the graph matches were found in
    groups = pattern.group(matches) if pattern.group else [[m] for m in matches]
    # one fused call never spans two activation-checkpointed regions (nor a region and the outside),
    # nor two grad modes
    place = lambda m: (m.anchor.meta.get("ac_graph_id"), segment[m.anchor])  # noqa: E731
    groups = [[m for m in g if place(m) == where] for g in groups for where in dict.fromkeys(map(place, g))]

    def reads_as_eager(g: list[Match], where: fx.Node) -> bool:
        """No in-place write to a member's inputs between where the call reads them and where eager did."""
        for m in g:
            lo = min(order[where], *(order[n] for n in m.region))
            hi = max(order[where], order[m.anchor])
            if any(lo < order[w] < hi for i in m.inputs.values() for w in written.get(i, ())):
                return False
        return True

    def chained(g: list[Match]) -> bool:
        """A member's input computed from another member's output (a rotation of a rotation): one call
        cannot take both. Walks the inputs' ancestors back to the group's first anchor only."""
        anchors = {m.anchor for m in g}
        lo = min(order[a] for a in anchors)
        todo, seen = [i for m in g for i in m.inputs.values() if isinstance(i, fx.Node)], set()
        while todo:
            n = todo.pop()
            if n in anchors:
                return True
            if n not in seen and order[n] > lo:
                seen.add(n)
                todo += n.all_input_nodes
        return False

    out = []
    for g in groups:
        if len(g) > 1 and chained(g):
            out += [([m], m.anchor, []) for m in g]
            continue
        first = min((m.anchor for m in g), key=order.__getitem__)
        last_input = max((i for m in g for i in m.inputs.values()), key=order.__getitem__)
        first_use = min((order[u] for m in g for u in _real_users(m.anchor)), default=len(order))
        if order[last_input] < order[first]:
            placed = (g, first, [])
        elif segment[last_input] != segment[first]:  # after the last input is another grad mode
            placed = None
        elif order[last_input] < first_use:
            placed = (g, last_input.next, [])
        elif (views := _views_before([m.anchor for m in g], order[last_input], order)) is not None:
            placed = (g, last_input.next, views)
        else:
            placed = None
        if placed is not None and (len(g) == 1 or reads_as_eager(g, placed[1])):
            out.append(placed)
        else:
            out += [([m], m.anchor, []) for m in g]
    return out


_VIEWS = {aten.transpose.int, aten.permute.default, aten.view.default, aten.reshape.default,
          aten._unsafe_view.default, aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default, aten.t.default}


def _views_before(anchors: list[fx.Node], limit: int, order: dict) -> list[fx.Node] | None:
    """The nodes that use the anchors (directly or through them) at or before position limit, in
    graph order, when every one is a view or a no-op cast (nothing computed: they can move after the
    fused call); None when anything else reads an anchor by then."""
    seen, stack = set(), [(u, a) for a in anchors for u in a.users]
    while stack:
        u, src = stack.pop()
        if order[u] > limit or u in seen:
            continue
        if not ((u.target in _VIEWS and u.args[0] is src) or _noop_cast_of(u, src)):
            return None
        seen.add(u)
        stack += [(w, u) for w in u.users]
    return sorted(seen, key=order.__getitem__)


def _lower(pattern: Pattern, group: list[Match], graph: fx.Graph, opts: Options) -> list[fx.Node]:
    if pattern.lower_group:
        return pattern.lower_group(group, graph, opts)
    return [pattern.lower(group[0], graph, opts)]


def _tag_checkpointed(nodes, anchor: fx.Node) -> bool:
    """Give every node of a fused site the checkpoint tags of the region it replaces (checkpoint.py):
    the partitioner then recomputes the fused calls with the rest of the region. True if tagged."""
    if "ac_graph_id" not in anchor.meta:
        return False
    for n in nodes:
        n.meta["recompute"] = anchor.meta["recompute"]
        n.meta["ac_graph_id"] = anchor.meta["ac_graph_id"]
    return True


def _tag_recompute(nodes) -> None:
    """Mark fused op calls for recomputation in backward. AOTAutograd copies a node's "recompute"
    meta onto the ATen nodes traced from it (torch.fx.proxy._COPY_META_FIELDS) and the min-cut
    partitioner then recomputes them instead of saving their outputs (as for checkpointed regions).
    Before torch 2.11 they also get the largest region id: torch 2.6's partitioner reads an
    ac_graph_id on every recompute-tagged node next to another (KeyError otherwise; later versions
    skip untagged ones), and the largest id never makes them saved at a region boundary."""
    from torch.utils.checkpoint import CheckpointPolicy

    from .options import tested_torch

    region_id = not tested_torch()
    for n in nodes:
        if n.op == "call_function" and str(n.target).startswith("fxfuse."):
            n.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
            if region_id:
                n.meta.setdefault("ac_graph_id", float("inf"))


def rewrite(gm: fx.GraphModule, patterns: list[Pattern], opts: Options) -> Report:
    """Fuse every accepted match of each pattern in gm (in place); report what happened. Options
    used here: logits="skip": values a match lets escape (returned logits) are not computed: their
    outputs become empty placeholders, listed in report.skipped_outputs (positions in the output
    tuple); recompute: fused calls of patterns with ``recompute=True`` are tagged for recomputation
    in backward (their outputs are not saved); the patterns' lowerings read the rest (loss_head)."""
    skip_escapes, recompute = opts.logits == "skip", opts.recompute
    report = Report(graphs=1)
    skipped: list[fx.Node] = []
    detached: set[fx.Node] = set()  # escaping values now computed from detached inputs
    for pattern in patterns:
        matcher = GraphMatcher(gm.graph)
        matches, misses = matcher.find(pattern)
        for group, where, views in _placed_groups(pattern, matches, matcher):
            first = group[0].anchor
            variant = "+".join(dict.fromkeys(m.variant.name for m in group))
            before = set(gm.graph.nodes)
            try:
                with gm.graph.inserting_before(where):
                    news = _lower(pattern, group, gm.graph, opts)
            except Exception as e:  # fail safe: the site stays unfused, the compile goes on
                for n in reversed(list(gm.graph.nodes)):
                    if n not in before:
                        gm.graph.erase_node(n)
                report.unmatched.append(_site(pattern.name, first, variant,
                                              reason=f"lowering failed: {type(e).__name__}: {e}"))
                continue
            saved = [saved_bytes(m) for m in group]
            nbytes, names = sum(b for b, _ in saved), [t for _, ts in saved for t in ts]
            text, recomputed = f"{len(names)} tensors, {nbytes / 2**10:.1f} KiB/call", []
            if _tag_checkpointed(set(gm.graph.nodes) - before, first):
                text += ", in an activation-checkpointed region (recomputed in backward)"
            elif recompute and pattern.recompute:
                _tag_recompute(set(gm.graph.nodes) - before)
                outs = [(m.anchor, val(m.anchor)) for m in group if val(m.anchor) is not None]
                recomputed = [tensor_desc(n, v) for n, v in outs]
                text += f", output recomputed in backward ({sum(bytes_of(v) for _, v in outs) / 2**10:.1f} KiB)"
            report.matched.append(_site(
                pattern.name, first, variant, saved=text, saved_tensors=names, recomputed=recomputed,
                nodes=sorted(n.name for m in group for n in m.region)))
            for m, new in zip(group, news):
                for k in _CARRIED_META:
                    if k in m.anchor.meta:
                        new.meta[k] = m.anchor.meta[k]
                _bypass_noop_casts(m.anchor, new)
                m.anchor.replace_all_uses_with(new)
                if skip_escapes:
                    skipped += _skip_escapes(m, gm.graph)
                else:
                    _detach_escapes(m, gm.graph)
                    detached |= set(m.escapes)
            for v in views:  # views of an anchor that sat before the call now read its output: follow it
                where.prepend(v)
        for mi in misses:
            report.unmatched.append(_site(pattern.name, mi.anchor, mi.variant, reason=mi.reason,
                                          nodes=[mi.anchor.name]))
        eliminate_dead_code(gm.graph)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    report.skipped_outputs = [i for i, a in enumerate(out.args[0]) if a in skipped]
    report.detached_outputs = [i for i, a in enumerate(out.args[0]) if _reads_only(a, detached)]
    gm.graph.lint()
    gm.recompile()
    return report
