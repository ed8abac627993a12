"""Find pattern instances in an ATen graph: networkx subgraph monomorphism, then checks.

For each pattern graph, every user node whose canonical label equals the pattern's anchor label is a
candidate; the monomorphism search runs on the backward cone of that node (as deep as the pattern),
which keeps each search small. A structural match then must pass, in order: captured literals
consistent, no intermediate used outside the match, no overlap with an accepted match, and the
pattern's own check (dtypes, shapes). Failures at a site where no variant was accepted become
unmatched candidates with the reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
from networkx.algorithms.isomorphism import MultiDiGraphMatcher

from .canon import EDGE, VNode, build_view
from .mutation import written_args, written_storages
from .pattern import Free, Pattern, PatternGraph, Variant, is_sentinel, trace_variant


@dataclass
class Match:
    pattern: Pattern
    variant: Variant
    anchor: fx.Node  # FX node whose value the fused op replaces
    inputs: dict[str, fx.Node]  # tensor parameter name -> user node bound to it
    scalars: dict[str, Any]  # captured float parameter name -> literal in the user's graph
    region: set[fx.Node] = field(default_factory=set)  # FX nodes computed inside the match
    escapes: list[fx.Node] = field(default_factory=list)  # region nodes also used outside (may_escape)

    @property
    def consts(self) -> dict:
        return self.variant.consts


@dataclass
class Miss:
    anchor: fx.Node
    variant: str
    reason: str
    size: int  # pattern size, to keep the most specific reason per site
    region: set = field(default_factory=set)  # FX nodes the structural match covered, if any


def _lits_match(p, t) -> bool:
    if isinstance(p, Free):
        return True
    if is_sentinel(p):
        if t is EDGE:  # a value computed in the graph: matched, then refused with a reason (_match_at)
            return True
        if isinstance(p, int):
            return isinstance(t, int) and not isinstance(t, bool)
        return t is None or isinstance(t, (int, float)) and not isinstance(t, bool)
    if isinstance(p, tuple) and isinstance(t, tuple):
        return len(p) == len(t) and all(_lits_match(a, b) for a, b in zip(p, t))
    return type(p) is type(t) and p == t or (
        isinstance(p, (int, float)) and isinstance(t, (int, float))
        and not isinstance(p, bool) and not isinstance(t, bool) and p == t)


def _bind(p, t, out: dict[float, Any]) -> bool:
    """Collect sentinel -> user literal; False if one sentinel meets two different values."""
    if is_sentinel(p):
        if p in out and out[p] != t:
            return False
        out[p] = t
        return True
    if isinstance(p, tuple):
        return all(_bind(a, b, out) for a, b in zip(p, t))
    return True


def _edge_match(ge, pe) -> bool:
    return sorted(d["pos"] for d in ge.values()) == sorted(d["pos"] for d in pe.values())


# the grad-mode switches Dynamo keeps in a graph: torch.no_grad() / enable_grad, inference_mode
GRAD_MODE_SWITCHES = {torch._C._set_grad_enabled, torch.autograd.grad_mode._enter_inference_mode,
                      torch.autograd.grad_mode._exit_inference_mode}


def grad_segments(graph: fx.Graph) -> dict[fx.Node, int]:
    """Each node's grad-mode segment: how many grad-mode switches precede it in graph order. Nodes of
    one segment run in one grad mode; a fused op differentiates all it computes or none of it."""
    seg, out = 0, {}
    for n in graph.nodes:
        seg += n.op == "call_function" and n.target in GRAD_MODE_SWITCHES
        out[n] = seg
    return out


_LAYOUT_DEPTH = 6  # users followed from a non-contiguous site output to an in-place write


class GraphMatcher:
    """Matches patterns against one FX graph; rebuild after each rewrite."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.nodes = {n.name: n for n in graph.nodes}
        # the graph's order, grad-mode segments and in-place writes, also read where the rewrite
        # places the fused calls (before it changes the graph)
        self.order = {n: i for i, n in enumerate(graph.nodes)}
        self.segment = grad_segments(graph)
        self.written = written_storages(graph)
        self.view, self.vnodes, self.alias = build_view(graph, self.written)
        self.rview = self.view.reverse(copy=False)

    def find(self, pattern: Pattern) -> tuple[list[Match], list[Miss]]:
        claimed: set[fx.Node] = set()  # FX nodes inside accepted matches
        pgraphs = [pg for v in pattern.variants for pg in trace_variant(pattern, v)]
        pgraphs.sort(key=lambda pg: -pg.graph.number_of_nodes())  # most specific spelling first
        matches: list[Match] = []
        misses: dict[fx.Node, Miss] = {}
        for pg in pgraphs:
            label = pg.vnodes[pg.anchor]
            for name, vn in self.vnodes.items():
                if vn.label != label.label:
                    continue
                anchor = self.nodes[name]
                if anchor in claimed:
                    continue
                m, reason, region = self._match_at(pattern, pg, name)
                if not region or region & claimed:
                    continue  # no structural match, or inside a larger accepted one
                if m is not None:
                    reason = _checked(pattern, m)
                if reason is None:
                    matches.append(m)
                    claimed |= m.region
                    misses.pop(anchor, None)
                elif anchor not in misses or misses[anchor].size < pg.graph.number_of_nodes():
                    misses[anchor] = Miss(anchor, pg.variant.name, reason, pg.graph.number_of_nodes(), region)
        live = [mi for a, mi in misses.items() if a not in claimed]
        live = [mi for mi in live if not any(mi.anchor in o.region for o in live if o is not mi)]  # one per site
        for mi in live:
            if mi.region & claimed:
                mi.reason += "; a smaller spelling inside it was fused instead"
        covered = set().union(claimed, *(mi.region for mi in live))
        for name in self.vnodes:
            node = self.nodes[name]
            if node not in covered and node.op == "call_function" and pattern.is_candidate(node):
                op = getattr(node.target, "__name__", str(node.target)).split(".")[0]
                reason = pattern.miss_reason(node) or (
                    f"looks like {pattern.name} ({op}) but no variant matched how it is written")
                live.append(Miss(node, "", reason, 0, {node}))
        matches.sort(key=lambda m: self.order[m.anchor])
        return matches, live

    def _with_noop_casts(self, region: set[fx.Node], out: fx.Node) -> set[fx.Node]:
        """Add the elided no-op casts that sit between region nodes (their input is in the region and
        is not the output: a no-op cast of the output stays, reading the fused value)."""
        grown = True
        while grown:
            extra = {c for c, src in self.alias.items() if src in region and src is not out and c not in region}
            region |= extra
            grown = bool(extra)
        return region

    def _written_layout(self, out: fx.Node) -> str | None:
        """Why a site whose output is written in place cannot change that output's layout, else None.
        A view of a written tensor stays a view in the rewritten graph (fxfuse/layout.py), and a view
        valid on eager's non-contiguous output (a norm of x.transpose(1, 2), viewed after transposing
        back) fails on the fused op's contiguous one."""
        v = out.meta.get("val")
        if not self.written or not isinstance(v, torch.Tensor) or v.is_contiguous():
            return None
        # the layout carries on through the ops after it (w * y keeps y's): a few users deep
        seen, todo = {out}, [out]
        for _ in range(_LAYOUT_DEPTH):
            todo = [u for n in todo for u in n.users if u not in seen]
            seen.update(todo)
        # an in-place op writing one of them (not one that only reads it: a KV cache's index_copy_)
        w = next((n for n in seen if any(a in seen for a in written_args(n))), None)
        if w is None:
            return None
        return (f"its output {out.name} keeps its input's strides {tuple(v.stride())} in eager, and a tensor "
                f"after it is written in place ({w.name}: {w.target}): a view written through needs eager's "
                "layout, and the fused op's output is contiguous")

    def _write_inside(self, region: set[fx.Node], inputs: dict, out: fx.Node) -> tuple[fx.Node, fx.Node] | None:
        """(a node the site reads, an in-place write to its storage) where the write comes after the
        site's first read of it and before its output (where the fused call reads it), else None."""
        last = self.order[out]
        for r in (region | set(inputs.values())) & self.written.keys():
            first = min((self.order[u] for u in r.users if u in region), default=last)
            for w in self.written[r]:
                if first < self.order[w] < last:
                    return r, w
        return None

    def _specialize(self, binds: dict, mapping: dict, pvn: dict) -> dict:
        """A captured scalar that is a value in the graph (EDGE) whose traced value is a symbolic
        float or int (HF's eps under dynamic=True: an unspecialised Python float Dynamo made a graph
        input) becomes its value, with a guard: float() on the symbol records it in Dynamo's shape
        environment, so a call with another value recompiles instead of reusing this graph. Values
        with no such hint (data-dependent, tensors) stay EDGE and the match is refused. Returns the
        graph node behind each captured scalar (for the refusal's reason)."""
        sources = {}
        for sentinel in [k for k, v in binds.items() if v is EDGE]:
            for g, p in mapping.items():
                node = self.nodes[g]
                for i, lit in enumerate(pvn[p].lits):
                    if lit != sentinel or i >= len(node.args) or not isinstance(node.args[i], fx.Node):
                        continue
                    sources[sentinel] = node.args[i]
                    value = node.args[i].meta.get("val")
                    try:
                        if isinstance(value, torch.SymFloat):
                            binds[sentinel] = float(value)
                        elif isinstance(value, torch.SymInt):
                            binds[sentinel] = int(value)
                    except Exception:  # noqa: BLE001 - data-dependent: no value to specialise on
                        pass
        return sources

    def _match_at(self, pattern: Pattern, pg: PatternGraph, anchor: str):
        """(Match, None, region) on success; (None, reason, region) for a structural match that fails
        a check; (None, None, set()) when the structure does not match."""
        cone = nx.single_source_shortest_path_length(self.rview, anchor, cutoff=pg.depth)
        sub = self.view.subgraph(cone)
        vn, pvn = self.vnodes, pg.vnodes

        gm = MultiDiGraphMatcher(sub, pg.graph, edge_match=_edge_match)
        base = gm.semantic_feasibility  # edge semantics; node semantics need the anchor, added here
        gm.semantic_feasibility = lambda g, p: _feasible(vn[g], pvn[p], g == anchor, p == pg.anchor) and base(g, p)
        first_reason, first_region = None, set()
        for mapping in gm.subgraph_monomorphisms_iter():
            out = self.nodes[anchor]
            region = self._with_noop_casts(
                {m for g, p in mapping.items() if p not in pg.wildcards for m in vn[g].members}, out)
            first_region = first_region or region
            binds: dict[float, Any] = {}
            if not all(_bind(pvn[p].lits, vn[g].lits, binds) for g, p in mapping.items() if pvn[p].label != "*"):
                first_reason = first_reason or "captured literals differ between uses"
                continue
            inputs = {pg.wildcards[p]: self.nodes[g] for g, p in mapping.items() if p in pg.wildcards}
            outside = [n for n in region if n is not out and any(u not in region for u in n.users)]
            escapes = [n for n in outside if pattern.may_escape(n, [u for u in n.users if u not in region])]
            escaping = [n for n in outside if n not in escapes]
            if escaping:
                first_reason = first_reason or (
                    f"intermediate {escaping[0].name} ({escaping[0].target}) is also used outside the "
                    f"{pattern.name} site by {', '.join(u.name for u in escaping[0].users if u not in region)}; "
                    "fusing would recompute or drop it")
                continue
            if len({n.meta.get("ac_graph_id") for n in region}) > 1:
                first_reason = first_reason or (
                    "spans an activation-checkpoint boundary (part of it is recomputed in backward, part "
                    "is not); fusing would change what is recomputed")
                continue
            if (write := self._write_inside(region, inputs, out)) is not None:
                first_reason = first_reason or (
                    f"{write[0].name} is written in place ({write[1].target}) after the site first reads it and "
                    "before the site's last read: eager reads it on both sides of the write, one fused op once")
                continue
            if (layout := self._written_layout(out)) is not None:
                first_reason = first_reason or layout
                continue
            if len({self.segment[n] for n in region}) > 1:
                first_reason = first_reason or (
                    "spans a grad-mode switch (torch.no_grad(), enable_grad or inference_mode): part of it "
                    "computes no gradient, and one fused op would differentiate all of it")
                continue
            sources = self._specialize(binds, mapping, pvn)
            computed = [(s, sources.get(s)) for s, v in binds.items() if v is EDGE]
            if computed:
                first_reason = first_reason or _computed_reason(*computed[0], pg)
                continue
            scalars = {s.name if isinstance(s, Free) else pg.scalars[s]: v for s, v in binds.items()}
            return Match(pattern, pg.variant, out, inputs, scalars, region, escapes), None, region
        return None, first_reason, first_region


def _computed_reason(sentinel, node: fx.Node | None, pg: PatternGraph) -> str:
    """Why a captured scalar bound to a value of the graph cannot be passed to the fused op."""
    name = sentinel.name if isinstance(sentinel, Free) else pg.scalars[sentinel]
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    if isinstance(v, torch.Tensor):
        return (f"{name} is a tensor of shape {tuple(v.shape)} computed in the graph ({node.name}: a learned "
                "or per-element scale, say), not a constant; the fused op takes a number known at compile time")
    return (f"{name} is a value computed in the graph, not a constant (a Python float that "
            "dynamic=True turned into a graph input, say); the fused op needs it at compile time")


def _feasible(g: VNode, p: VNode, g_is_anchor: bool, p_is_anchor: bool) -> bool:
    if p_is_anchor != g_is_anchor:
        return False
    if p.label == "*":
        return True
    return g.label == p.label and _lits_match(p.lits, g.lits)


def _checked(pattern: Pattern, m: Match) -> str | None:
    """pattern.check(m); a check that raises keeps this site unfused, with the error as its reason,
    instead of leaving the whole graph unfused."""
    try:
        return pattern.check(m)
    except Exception as e:  # noqa: BLE001  any failure of a check refuses its match only
        return (f"{pattern.name}'s check failed ({type(e).__name__}: {e}): kept as written (an fxfuse bug: "
                "please report it)")
