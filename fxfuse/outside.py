"""What ran outside every compiled graph during one compiled call: Dynamo's graph breaks, and the
module calls that ran eagerly because of them.

The backend only sees the graphs Dynamo hands it. Code Dynamo gave up on (a graph break it could not
resume from, a checkpointed layer whose forward has a side effect, a frame skipped for a break in a
loop) runs eagerly and unfused, and leaves no graph behind: without this census such sites are
simply missing from the report, neither matched nor unmatched.

Each graph's report names the break that ended it (``ending_break``: reason and place).
``Census(model)`` around the compiled call:
  - diffs Dynamo's graph-break counters (``torch._dynamo.utils.counters``: "graph_break" and
    "unimplemented") into one line per distinct reason (headline, Dynamo's debug context, its hint);
  - records, through a Python profile function (``_Profiler``), every submodule whose forward code
    ran in Python: the module forwards that ran eagerly. A forward Dynamo compiled, or traced into a
    caller's graph, is not seen. Module hooks would be simpler, but a hook on a torch.nn module
    makes Dynamo compile that module's forward where it would otherwise run it eagerly (a skipped
    frame's ``nn.RMSNorm``): the census would then report a fusion a plain run does not get.
Recognised site modules (an RMSNorm class, a gated MLP, a rotary model's attention: the harness's
rules) among them become unmatched sites with ``graph = -1``; so does each F.cross_entropy /
F.nll_loss call that ran in Python (the loss of a skipped forward: an unmatched loss head, placed at
the model's line that led to it).

It also counts the runs of every compiled graph with a matched site (the backend wraps those in
``counted``), so ``Report.calls`` holds the fused calls that ran. Sites are counted per compiled
graph; calls are not: where Dynamo skips a model's forward (a graph break in its layer loop) and
compiles a layer's forward as a frame of its own, one graph serves every layer.

Without a census (plain ``torch.compile(backend="fxfuse")``, ``fxfuse.patch``), the backend calls
``warn_eager_frames`` at each compile: a warning per graph break after which Dynamo runs a whole
frame or a checkpointed layer eagerly.
"""
from __future__ import annotations

import inspect
import linecache
import logging
import os
import re
import sys
from collections import Counter

import torch.nn as nn

from .report import PATTERN_NAMES, Report, Site

log = logging.getLogger("fxfuse")
OUTSIDE_REASON = ("ran eagerly, outside every compiled graph (a graph break: see the report's "
                  "graph breaks), so nothing in it is fused")
OUTSIDE_LOSS_REASON = ("this cross-entropy ran eagerly, outside every compiled graph (a graph break: see "
                       "the report's graph breaks), so no loss head fuses here")


_ACTIVE: list[Census] = []  # censuses inside their call: they count graph runs


def counted(compiled, report: Report):
    """compiled(*args), its runs counted by every active census (a list check when none is)."""

    def run(*args):
        for census in _ACTIVE:
            census.ran.setdefault(id(report), [report, 0])[1] += 1
        return compiled(*args)

    return run


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


_AT = "; at "  # between a break's reason and its place (ending_break); the census matches on it


def ending_break(gm) -> list[str]:
    """The graph break that ended Dynamo's graph gm (its ``compile_subgraph_reason``) as one line:
    Dynamo's reason (break_line), then ``; at file:line in function `source```. [] where the graph
    ended at a return, or gm did not come from Dynamo. A break Dynamo could not resume from inside a
    called function (transformers' ``loss_function`` property logging a warning) leaves no graph-break
    counter (newer torch) and the reason "step_unsupported"; its place is still known here."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return []
    why = ("Dynamo kept no reason for this break (one inside a function called here; "
           "TORCH_LOGS=graph_breaks prints it)" if reason.reason == "step_unsupported" else break_line(reason.reason))
    stack = getattr(reason, "user_stack", None) or []
    if not stack:
        return [why]
    frame = stack[-1]
    code = linecache.getline(frame.filename, frame.lineno).strip()
    where = f"{os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}"
    return [f"{why}{_AT}{where}" + (f" `{code}`" if code else "")]


def _hf_loss_type_hint(model, line: str) -> str:
    """line, with the fix where it is transformers' ``loss_function`` breaking the graph: it logs a
    warning on every call while ``model.loss_type`` is None (a class named after no known loss, such
    as GPT2LMHeadModel or BertLMHeadModel), and Dynamo cannot trace the logging call."""
    cls_attr = getattr(type(model), "loss_function", None) if model is not None else None
    if not (isinstance(cls_attr, property) and "loss_type" in vars(model) and model.loss_type is None
            and "_loss_function" not in vars(model) and "loss_function" in line):
        return line
    return (line + '; transformers logs a warning there while model.loss_type is None: model.loss_type = '
            '"ForCausalLM" (the loss it falls back to) removes the break')


def _distinct(keys) -> list[str]:
    """break_line of each counter key; a break counted alone and again with the breaks that followed
    it keeps only the longer line."""
    lines = {line for line in map(break_line, keys) if line}
    return sorted(b for b in lines if not any(o != b and o.startswith(b) for o in lines))


_WARNED: set[str] = set()
# breaks after which Dynamo runs a whole frame, or a checkpointed region, in Python
_EAGER_MARKS = ("frame skipped", "Unsafe side effect")


def warn_eager_frames() -> None:
    """Log once per break line each graph break that made Dynamo run a whole frame (or a checkpointed
    layer) eagerly. The backend never sees that code, so its sites stay unfused and are in no report;
    this is the one trace of it outside ``fxfuse.explain`` (called by the backend at every compile)."""
    for line in _distinct(_graph_breaks()):
        if line not in _WARNED and any(mark in line for mark in _EAGER_MARKS):
            _WARNED.add(line)
            log.warning("fxfuse: Dynamo runs code outside every compiled graph, unfused: %s. "
                        "fxfuse.explain(model, *inputs) lists the sites that ran eagerly.", line)


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
    from .sites import is_attention, is_gated_mlp, is_rms_norm

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
        self.eager: list[tuple[str, nn.Module]] = []  # module forwards whose own code ran in Python
        self.ran: dict[int, list] = {}  # id(graph report) -> [report, runs]
        self._names: dict[int, str] = {}
        self._codes: set[int] = set()  # id() of the forward code objects: a code object holding a dict
        # constant (a Dynamo resume function's, say) cannot be hashed; the classes keep these alive
        self.losses: dict[tuple[str, str], None] = {}  # (module, source) of each eager cross-entropy call

    def __enter__(self) -> Census:
        self._before = _graph_breaks()
        if self.model is not None:
            for name, mod in self.model.named_modules():
                self._names[id(mod)] = name
                self._codes.add(id(_forward_code(mod)))
        _ACTIVE.append(self)
        if len(_ACTIVE) == 1:
            _Profiler.start()
        return self

    def _saw(self, code, self_arg) -> None:
        if id(code) in self._codes and id(self_arg) in self._names:
            self.eager.append((self._names[id(self_arg)], self_arg))

    def _saw_loss(self, caller) -> None:
        """F.cross_entropy / F.nll_loss ran in Python, called from frame caller: a compiled graph runs
        ATen ops, never these functions, so it ran outside every graph. Placed at the innermost model
        module whose forward led to it (the line there), else at the caller. Not a model's loss: a call
        from a GraphModule's own code (an unfused graph run as written), or from fxfuse's (the fast
        loss head reduces its rows with F.nll_loss inside its op, during a compiled graph's run)."""
        if caller is None or caller.f_code.co_filename.startswith("<"):
            return
        if os.path.dirname(caller.f_code.co_filename) in _Profiler.own_dirs:
            return
        place, module, frame = caller, "", caller
        for _ in range(16):
            if frame is None:
                break
            owner = frame.f_locals.get("self") if frame.f_code.co_name == "forward" else None
            if owner is not None and id(owner) in self._names:
                place, module = frame, self._names[id(owner)]
                break
            frame = frame.f_back
        self.losses.setdefault((module, f"{os.path.basename(place.f_code.co_filename)}:{place.f_lineno}"), None)

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)
        if not _ACTIVE:
            _Profiler.stop()
        self._after = _graph_breaks()

    def around(self, call):
        """call wrapped so that only its own run is counted (not a backward's checkpoint recompute,
        which calls the eagerly run modules again)."""

        def counted(*args, **kwargs):
            with self:
                return call(*args, **kwargs)

        return counted

    def apply(self, report: Report) -> Report:
        from .sites import uses_rope

        report.calls = {p: 0 for p in PATTERN_NAMES}
        for graph, runs in self.ran.values():
            for p, n in graph.counts().items():
                report.calls[p] += n * runs
        # the graphs' own breaks (ending_break) carry the place; a counter of the same reason adds nothing
        report.graph_breaks += [b for b in _distinct(self._after - self._before)
                                if not any(o.startswith(b + _AT) for o in report.graph_breaks)]
        report.graph_breaks = [_hf_loss_type_hint(self.model, b) for b in report.graph_breaks]
        # an eager module's eager submodules fold into it, but not into the root: a skipped top-level
        # forward (a graph break in its layer loop) runs its layers as compiled frames of their own
        names = {n for n, _ in self.eager} - {""}
        outer = [(n, m) for n, m in self.eager if not any(p in names for p in _ancestors(n))]
        report.outside += _grouped(outer)
        rope = self.model is not None and uses_rope(self.model)
        for name, mod in self.eager:
            for pattern in site_patterns(mod, rope):
                report.unmatched.append(Site(pattern, name, _source(mod), "", OUTSIDE_REASON, graph=-1))
        for module, source in self.losses:
            report.unmatched.append(Site("linear_cross_entropy", module, source, "", OUTSIDE_LOSS_REASON, graph=-1))
        return report


def _forward_code(mod: nn.Module):
    """The code object of mod's forward body (under decorators such as transformers' own)."""
    fn = inspect.unwrap(getattr(type(mod).forward, "__func__", type(mod).forward))
    return getattr(fn, "__code__", None)


class _Profiler:
    """A Python profile function (``sys.setprofile``) that reports to the active censuses every
    frame that starts running a module's forward code in Python, and every call of F.cross_entropy /
    F.nll_loss (a loss computed eagerly: the loss head a sweep would otherwise show as a silent gap).
    A forward Dynamo compiled runs its transformed code object instead, and one traced into a
    caller's graph runs no Python at all, so only eager runs are seen; unlike module hooks (with
    which Dynamo compiles a torch.nn module's forward it would otherwise run eagerly), a profile
    function changes nothing Dynamo decides. It pauses while Dynamo compiles (its compile
    callbacks): tracing runs no model code, and profiling Dynamo itself would cost seconds. A Python
    profiler already set (cProfile) is off for the call and restored after it."""

    previous = None
    losses: set[int] = set()  # id() of F.cross_entropy's and F.nll_loss's code objects
    own_dirs: set[str] = set()  # fxfuse's and its kernels' folders: their loss calls are no model's

    @staticmethod
    def hook(frame, event, _arg) -> None:
        if event != "call":
            return
        if frame.f_code.co_name == "forward":
            self_arg = frame.f_locals.get("self")
            for census in _ACTIVE:
                census._saw(frame.f_code, self_arg)
        elif id(frame.f_code) in _Profiler.losses:
            for census in _ACTIVE:
                census._saw_loss(frame.f_back)

    @classmethod
    def start(cls) -> None:
        import torch.nn.functional as F

        from . import kernels

        cls.losses = {id(F.cross_entropy.__code__), id(F.nll_loss.__code__)}
        cls.own_dirs = {os.path.dirname(os.path.abspath(m.__file__)) for m in (kernels, sys.modules[__package__])}
        cls.previous = sys.getprofile()
        handler = _callbacks()
        if handler is not None:
            handler.register_start_callback(cls._pause)
            handler.register_end_callback(cls._resume)
        sys.setprofile(cls.hook)

    @classmethod
    def stop(cls) -> None:
        sys.setprofile(cls.previous)
        handler = _callbacks()
        if handler is not None:
            handler.remove_start_callback(cls._pause)
            handler.remove_end_callback(cls._resume)

    # Dynamo passes the callbacks one argument from torch 2.7 on, none before
    @classmethod
    def _pause(cls, *_args) -> None:
        sys.setprofile(cls.previous)

    @classmethod
    def _resume(cls, *_args) -> None:
        sys.setprofile(cls.hook)


def _callbacks():
    """Dynamo's compile start / end callbacks (torch >= 2.5); without them the profiler runs through
    compiles too (slower, same result)."""
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:
        return None
    return callback_handler


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [""] + [".".join(parts[:i]) for i in range(1, len(parts))] if name else []


def _grouped(calls: list[tuple[str, nn.Module]]) -> list[str]:
    """'model.layers.*.mlp (LlamaMLP) x2' per module path with its indices starred, in call order."""
    groups: Counter = Counter()
    for name, mod in calls:
        groups[(re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name) or "(root)", type(mod).__name__)] += 1
    return [f"{path} ({cls}) x{n}" for (path, cls), n in groups.items()]
