"""What fxfuse did to a graph: matched sites, unmatched candidates and why.

A site is one pattern instance: one RMSNorm call, one attention layer's q+k rotation, one gated-MLP
activation, one lm_head + cross-entropy. ``Report`` gathers the sites of every graph Dynamo handed
the backend for one model (graph breaks give several graphs).
"""
from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import asdict, dataclass, field, replace

import torch.fx as fx

PATTERN_NAMES = ("rms_norm", "rope", "swiglu", "linear_cross_entropy")


@dataclass
class Site:
    pattern: str  # one of PATTERN_NAMES
    module: str  # nn.Module path of the op, e.g. "model.layers.0.mlp"; "" at the top level
    source: str  # "file.py:123" of the user's line that produced the anchor node
    variant: str  # pattern function that matched, e.g. "rmsnorm_llama"; "" when none did
    reason: str = ""  # unmatched only: why the site stayed unfused
    graph: int = 0  # index of the compiled graph (graph breaks give several); -1: ran outside all of them
    nodes: list[str] = field(default_factory=list)  # FX nodes of the site (ATen graph)
    saved: str = ""  # matched only: how much the fusion stops writing per call, e.g. "6 tensors, 7.0 KiB"
    saved_tensors: list[str] = field(default_factory=list)  # matched only: "name:dtype[shape]" of each
    # matched only: "name:dtype[shape]" of fused outputs recomputed in backward instead of kept for it
    # (option recompute; still written once in forward, for the op that reads them)
    recomputed: list[str] = field(default_factory=list)


@dataclass
class Report:
    matched: list[Site] = field(default_factory=list)
    unmatched: list[Site] = field(default_factory=list)
    graphs: int = 0
    errors: list[str] = field(default_factory=list)  # graphs left whole unfused, and why
    skipped_outputs: list[int] = field(default_factory=list)  # single graph: outputs not computed
    # single graph: outputs computed from detached inputs (logits returned beside a fused loss head)
    detached_outputs: list[int] = field(default_factory=list)
    # SDPA calls with a mask (fxfuse/attention.py): reason "" = mask proven causal, now is_causal=True
    attention: list[Site] = field(default_factory=list)
    # higher-order op calls kept as written through the re-trace (fxfuse/opaque.py), and where
    opaque: list[str] = field(default_factory=list)
    # Dynamo's graph breaks, one line per reason: each graph's report the break that ended it (reason,
    # file:line); fxfuse.explain (fxfuse/outside.py) adds the others seen during the call, and the
    # outermost module calls that ran eagerly, outside every compiled graph
    graph_breaks: list[str] = field(default_factory=list)
    outside: list[str] = field(default_factory=list)
    # fxfuse.explain / the harness only: fused calls per pattern that ran during the call, each
    # compiled graph's matched sites times its runs (a frame's graph reused for every layer of a
    # model whose forward Dynamo skipped runs once per layer); None where runs were not counted
    calls: dict[str, int] | None = None

    def counts(self) -> dict[str, int]:
        """Matched sites per pattern; every pattern name is present."""
        c = Counter(s.pattern for s in self.matched)
        return {p: c.get(p, 0) for p in PATTERN_NAMES}

    def extend(self, other: Report) -> None:
        """Append other's sites (copies, graph indices shifted after this report's graphs)."""
        shift = lambda s: replace(s, graph=s.graph + self.graphs if s.graph >= 0 else s.graph)  # noqa: E731
        self.matched += map(shift, other.matched)
        self.unmatched += map(shift, other.unmatched)
        self.attention += map(shift, other.attention)
        self.errors += other.errors
        self.opaque += other.opaque
        self.graph_breaks += [b for b in other.graph_breaks if b not in self.graph_breaks]
        self.outside += other.outside
        if other.calls is not None:
            self.calls = {p: (self.calls or {}).get(p, 0) + other.calls[p] for p in PATTERN_NAMES}
        self.graphs += other.graphs

    @classmethod
    def merge(cls, reports) -> Report:
        out = cls()
        for r in reports:
            out.extend(r)
        return out

    def to_json(self) -> str:
        return json.dumps(
            {
                "counts": self.counts(),
                "graphs": self.graphs,
                "matched": [asdict(s) for s in self.matched],
                "unmatched": [asdict(s) for s in self.unmatched],
                "errors": self.errors,
                "attention": [asdict(s) for s in self.attention],
                "opaque": self.opaque,
                "graph_breaks": self.graph_breaks,
                "outside": self.outside,
                "calls": self.calls,
            },
            indent=2,
        )

    def __str__(self) -> str:
        counts = ", ".join(f"{k} {v}" for k, v in self.counts().items())
        lines = [f"fxfuse report: {len(self.matched)} matched, {len(self.unmatched)} unmatched "
                 f"in {self.graphs} graph(s) [{counts}]"]
        if self.matched:
            lines.append(_table("matched", self.matched, ("pattern", "variant", "module", "source", "saved")))
        if self.unmatched:
            lines.append(_table("unmatched", self.unmatched, ("pattern", "module", "source", "reason")))
        causal = [s for s in self.attention if not s.reason and not s.variant.endswith("_checked")]
        if causal:
            gqa = sum(s.variant == "sdpa_causal_gqa" for s in causal)
            lines.append(f"attention: {len(causal)} SDPA call(s) given is_causal=True instead of a "
                         f"constant causal mask ({gqa} without repeat_kv, enable_gqa=True)")
        checked = [s for s in self.attention if not s.reason and s.variant.endswith("_checked")]
        if checked:
            lines.append(f"attention: {len(checked)} SDPA call(s) on a mask input: is_causal=True when the "
                         "mask is causal at run time (compared once per mask tensor), else run with the mask")
        left = [s for s in self.attention if s.reason]
        if left:
            lines.append(_table("attention masks kept", left, ("module", "source", "reason")))
        lines += [f"opaque: {o}" for o in self.opaque]
        if self.calls is not None and self.calls != self.counts():
            lines.append("fused calls at run time (a compiled graph ran more than once, or not at all): "
                         + ", ".join(f"{k} {v}" for k, v in self.calls.items()))
        if self.outside:
            lines.append("ran eagerly, outside every compiled graph (module forwards; "
                         "modules they call may still compile): " + ", ".join(self.outside))
        lines += [f"graph break: {b}" for b in self.graph_breaks]
        lines += [f"error: {e}" for e in self.errors]
        return "\n".join(lines)


def _table(title: str, sites: list[Site], cols: tuple[str, ...]) -> str:
    rows = [[str(getattr(s, c)) or ("(root)" if c == "module" else "") for c in cols] for s in sites]
    widths = [min(60, max(len(c), *(len(r[i]) for r in rows))) for i, c in enumerate(cols)]
    fmt = lambda r: "  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([f"{title}:", fmt(cols), *map(fmt, rows)])


_ROOT = re.compile(r"^L\['[^']*'\](\[\d+\])?\.?")


def module_path(node: fx.Node) -> str:
    """nn.Module path of the innermost module that produced node ("model.layers.0.mlp")."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    paths = [v[0] for v in stack.values()]
    # a module reached through a global (transformers >= 5.25 wraps apply_rotary_pos_emb in one,
    # "G['__import_transformers_dot_...']") names no place in the model: the innermost local one does
    local = [p for p in paths if not p.startswith("G[")]
    path = (local or paths)[-1]
    path = _ROOT.sub("", path)
    return re.sub(r"\[(\d+)\]", r".\1", path).replace("._modules['", ".").replace("']", "")


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def source_line(node: fx.Node) -> str:
    """file:line of the user's code that produced node, from Dynamo's stack trace."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return ""
    path, line = frames[-1]
    return f"{os.path.basename(path)}:{line}"
