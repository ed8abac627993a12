"""Pattern definitions: plain eager functions traced once into canonical view graphs.

A ``Pattern`` is one fused op (``rms_norm``, ...) with several ``Variant``s, each a plain eager
function copied from how real models write the op. Tensor parameters of a variant are wildcards
(any node may bind); float parameters are captured literals: they are traced with a sentinel value
that matches any number in the user's graph and is handed to ``lower`` under the parameter's name.
``check`` returns None to accept a match or the reason the site stays unfused; ``lower`` emits the
fused call. Adding a spelling means adding a function; the engine does not change.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import networkx as nx
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from .canon import VNode, build_view
from .normalize import canonical_ops

# Captured scalar parameters are traced with these values (ints for parameters whose default is an
# int, else floats); a view literal equal to one is a wildcard.
SENTINELS = (1.2345e-3, 2.3456e-3, 3.4567e-3, 4.5678e-3)
INT_SENTINELS = (-918273, -918274, -918275, -918276)


@dataclass(frozen=True)
class Free:
    """A literal position of an op that matches any value and is captured under name (for literals a
    pattern function cannot take as a parameter: aten's reduction enum, say)."""

    name: str


def is_sentinel(v) -> bool:
    if isinstance(v, Free):
        return True
    if isinstance(v, bool):
        return False
    return (isinstance(v, float) and v in SENTINELS) or (isinstance(v, int) and v in INT_SENTINELS)


@dataclass(frozen=True)
class Variant:
    fn: Callable  # the eager reference: how some model writes the op
    consts: dict = field(default_factory=dict)  # fixed lowering arguments of this spelling
    # dtype sets / example shapes to trace with, overriding the pattern's (e.g. complex freqs_cis)
    dtypes: tuple | None = None
    shapes: dict | None = None

    @property
    def name(self) -> str:
        return self.fn.__name__

    def __hash__(self):
        return hash(self.fn)


@dataclass(frozen=True)
class Pattern:
    name: str  # public pattern name (Report.counts keys)
    variants: tuple[Variant, ...]
    shapes: dict[str, tuple[int, ...]]  # example shape of each tensor parameter, for tracing
    dtypes: tuple[dict[str, torch.dtype], ...]  # dtype sets to trace each variant with
    check: Callable[[Any], str | None]  # Match -> None (accept) or the reason it is not fused
    # (Match, graph, Options) -> the fused call, emitted at the graph's insertion point (the backend's
    # options choose how a site is lowered: the loss head's algorithm, say)
    lower: Callable[[Any, fx.Graph, Any], fx.Node] | None = None
    # patterns whose fused call serves several matches (RoPE: q and k): group the accepted matches
    # (each group is one site), and lower a group to one node per match, in the group's order
    group: Callable[[list], list[list]] | None = None
    lower_group: Callable[[list, fx.Graph, Any], list[fx.Node]] | None = None
    # (interior FX node, its users outside the match) -> True if it may be used there (a loss head's
    # logits, which models return): it stays computed, from detached inputs, so no gradient or
    # backward tangent flows to it
    may_escape: Callable[[fx.Node, list], bool] = lambda n, users: False
    # Match -> [(description, bytes)] of tensors written inside single ATen ops of the match that
    # the fused op does not write either (cross_entropy's log-softmax, say): added to the report
    hidden_saved: Callable[[Any], list] = lambda m: []
    # op -> {literal position: capture name}: literals that match any value (see Free)
    free_literals: dict = field(default_factory=dict)
    # candidate FX node -> a specific reason it matched no spelling, or None for the generic one
    miss_reason: Callable[[fx.Node], str | None] = lambda n: None
    # FX node -> True if it marks a candidate site (reported as unmatched when no match covers it)
    is_candidate: Callable[[fx.Node], bool] = lambda n: False
    saved: Callable[[Any], str] = lambda m: ""  # what the fusion stops writing, for the report
    # the fused op's output is cheap to recompute from inputs its backward keeps anyway (RMSNorm: x;
    # SwiGLU: gate, up): tagged for recomputation, the output is not saved for the matmul after it
    recompute: bool = False

    def __hash__(self):
        return hash(self.name)


@dataclass
class PatternGraph:
    variant: Variant
    graph: nx.MultiDiGraph
    vnodes: dict[str, VNode]
    anchor: str  # view node of the returned value
    wildcards: dict[str, str]  # view node -> tensor parameter name
    depth: int  # longest path in the graph: how far back from the anchor to look
    scalars: dict  # sentinel value -> captured parameter name


@functools.cache
def trace_variant(pattern: Pattern, variant: Variant) -> tuple[PatternGraph, ...]:
    """Pattern graphs of one variant, one per distinct dtype set (identical traces deduplicated)."""
    params = inspect.signature(variant.fn).parameters
    shapes = pattern.shapes | (variant.shapes or {})
    tensors = [p for p in params if p in shapes]
    scalars = [p for p in params if p not in shapes]
    if len(scalars) > len(SENTINELS):
        raise ValueError(f"{variant.name}: at most {len(SENTINELS)} captured scalars")
    sentinel = {p: (INT_SENTINELS if type(params[p].default) is int else SENTINELS)[i] for i, p in enumerate(scalars)}
    out, seen = [], set()
    for dts in variant.dtypes or pattern.dtypes:
        args = [_example(shapes[p], dts[p]) for p in tensors]

        def fn(*ts):
            return variant.fn(**dict(zip(tensors, ts)), **sentinel)

        with warnings.catch_warnings(), _without_autocast():  # mixed-dtype example inputs warn in some fast paths
            warnings.simplefilter("ignore")
            gm = make_fx(fn, pre_dispatch=True)(*args)
        canonical_ops(gm.graph)
        g, vnodes, _ = build_view(gm.graph)
        sig = _signature(g, vnodes)
        if sig in seen:
            continue
        seen.add(sig)
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for ph in phs:
            if ph.name in g and g.out_degree(ph.name) == 0:  # parameter unused by this spelling
                g.remove_node(ph.name)
                del vnodes[ph.name]
        wildcards = {ph.name: tensors[i] for i, ph in enumerate(phs) if ph.name in vnodes}
        for name in wildcards:
            vnodes[name] = VNode("*", (), ())
        for name, vn in vnodes.items():
            for op, positions in pattern.free_literals.items():
                if vn.label == str(op):
                    lits = list(vn.lits)
                    for pos, capture in positions.items():
                        lits[pos] = Free(capture)
                    vnodes[name] = VNode(vn.label, tuple(lits), vn.members)
        ret = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        ret = ret[0] if isinstance(ret, (tuple, list)) else ret
        anchor = _resolve_alias(ret, vnodes)
        out.append(PatternGraph(variant, g, vnodes, anchor, wildcards, nx.dag_longest_path_length(g),
                                {v: k for k, v in sentinel.items()}))
    return tuple(out)


@contextlib.contextmanager
def _without_autocast():
    """Autocast off while a pattern is traced: the traces are cached for the process, and the first
    compile may run under the user's autocast (fp16 autocast made the RoPE spellings' traces raise, and
    the whole graph compiled unfused; bf16 autocast changed two loss-head spellings' graphs)."""
    with contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def _example(shape, dtype) -> torch.Tensor:
    """Example input for tracing a pattern; a private generator keeps the user's RNG stream intact
    (compiling must not change what dropout or data shuffling draw next)."""
    g = torch.Generator().manual_seed(0)
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype, device="cpu")
    return torch.randint(0, 5, shape, generator=g, dtype=dtype, device="cpu")


def _resolve_alias(n: fx.Node, vnodes) -> str:
    while n.name not in vnodes:  # a returned no-op cast stands for its input
        n = n.args[0]
    return n.name


def _signature(g: nx.MultiDiGraph, vnodes) -> str:
    order = {n: i for i, n in enumerate(g.nodes)}
    rows = []
    for n in g.nodes:
        ins = sorted((d["pos"], order[s]) for s, _, d in g.in_edges(n, data=True))
        rows.append(f"{vnodes[n].label}{vnodes[n].lits}{ins}")
    return ";".join(rows)
