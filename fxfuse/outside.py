"""What ran outside every compiled graph during one compiled call: Dynamo's graph breaks, and the
module calls that ran eagerly because of them.

The backend only sees the graphs Dynamo hands it. Code Dynamo gave up on (a graph break it could not
resume from, a checkpointed layer whose forward has a side effect, a frame skipped for a break in a
loop) runs eagerly and unfused, and leaves no graph behind: without this census such sites are
simply missing from the report, neither matched nor unmatched.

``Census(model)`` around the compiled call:
  - diffs Dynamo's graph-break counters (``torch._dynamo.utils.counters``: "graph_break" and
    "unimplemented") into one line per distinct reason (headline, Dynamo's debug context, its hint);
  - hooks every submodule with a forward pre-hook that records the call only when it runs in Python
    (``torch.compiler.is_compiling()`` is False). Under tracing the hook does nothing, so the traced
    graphs are unchanged and no side effect is replayed; a module call inside a compiled graph
    never reaches the hook at run time. What it records are exactly the eager module calls.
Recognised site modules (an RMSNorm class, a gated MLP, a rotary model's attention: the harness's
rules) among them become unmatched sites with ``graph = -1``.
"""
from __future__ import annotations

import inspect
import os
import re
from collections import Counter

import torch
import torch.nn as nn

from .report import Report, Site

OUTSIDE_REASON = ("ran eagerly, outside every compiled graph (a graph break: see the report's "
                  "graph breaks), so nothing in it is fused")


def _graph_breaks() -> Counter:
    """Dynamo's graph breaks, and what made it skip or fall back on a whole frame ("unimplemented":
    a side effect inside a checkpoint call lands there only)."""
    from torch._dynamo.utils import counters

    return Counter(counters["graph_break"]) + Counter(counters["unimplemented"])


def break_line(key: str) -> str:
    """One readable line of a graph-break counter key: per break (Dynamo chains the ones that
    followed while handling the first, such as a frame skipped for a break in a loop) its headline,
    Dynamo's debug context and hint, without the explanation or the docs link."""
    return "; then: ".join(filter(None, map(_one_break, key.split("*** While handling this graph break"))))


def _one_break(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if lines and lines[0].startswith(", another graph break occurred"):
        lines = lines[1:]
    if not lines:
        return ""
    out = lines[0]
    for tag in ("Developer debug context:", "Hint:"):
        found = [ln[len(tag):].strip() for ln in lines[1:] if ln.startswith(tag)]
        if found and found[0] and not found[0].startswith("This graph break may have been caused by an earlier"):
            out += f" [{tag.rstrip(':').lower()}: {found[0]}]"
    return out


def site_patterns(mod: nn.Module, rope: bool) -> list[str]:
    """The patterns a module's call is one site of, by the harness's rules (a block holding both
    its attention and MLP projections is both a rope and a swiglu site)."""
    from .harness import is_attention, is_gated_mlp, is_rms_norm

    tests = (("rms_norm", is_rms_norm), ("rope", lambda m: rope and is_attention(m)), ("swiglu", is_gated_mlp))
    return [p for p, test in tests if test(mod)]


def _source(mod: nn.Module) -> str:
    try:
        fn = inspect.unwrap(type(mod).forward)
        return f"{os.path.basename(inspect.getsourcefile(fn) or '')}:{inspect.getsourcelines(fn)[1]}"
    except (OSError, TypeError):
        return ""


class Census:
    """Context manager around one compiled call; ``apply(report)`` adds what ran outside."""

    def __init__(self, model_or_fn):
        self.model = model_or_fn if isinstance(model_or_fn, nn.Module) else None
        self.eager: list[tuple[str, nn.Module]] = []
        self._hooks = []

    def __enter__(self) -> Census:
        self._before = _graph_breaks()
        if self.model is not None:
            for name, mod in self.model.named_modules():
                self._hooks.append(mod.register_forward_pre_hook(self._hook(name, mod)))
        return self

    def _hook(self, name: str, mod: nn.Module):
        eager = self.eager

        def fxfuse_census(_mod, _args):
            if not torch.compiler.is_compiling():
                eager.append((name, mod))

        return fxfuse_census

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._after = _graph_breaks()

    def around(self, call):
        """call wrapped so that only its own run is counted (not a backward's checkpoint recompute,
        which calls the eagerly run modules again)."""

        def counted(*args, **kwargs):
            with self:
                return call(*args, **kwargs)

        return counted

    def apply(self, report: Report) -> Report:
        from .harness import uses_rope

        new = self._after - self._before
        lines = {line for line in map(break_line, new) if line}
        # a break counted alone and again with the breaks that followed it: keep the longer line
        report.graph_breaks += sorted(b for b in lines if not any(o != b and o.startswith(b) for o in lines))
        names = {n for n, _ in self.eager}
        outer = [(n, m) for n, m in self.eager if not any(p in names for p in _ancestors(n))]
        report.outside += _grouped(outer)
        rope = self.model is not None and uses_rope(self.model)
        for name, mod in self.eager:
            for pattern in site_patterns(mod, rope):
                report.unmatched.append(Site(pattern, name, _source(mod), "", OUTSIDE_REASON, graph=-1))
        return report


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [""] + [".".join(parts[:i]) for i in range(1, len(parts))] if name else []


def _grouped(calls: list[tuple[str, nn.Module]]) -> list[str]:
    """'model.layers.*.mlp (LlamaMLP) x2' per module path with its indices starred, in call order."""
    groups: Counter = Counter()
    for name, mod in calls:
        groups[(re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name) or "(root)", type(mod).__name__)] += 1
    return [f"{path} ({cls}) x{n}" for (path, cls), n in groups.items()]
