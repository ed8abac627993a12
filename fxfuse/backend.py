"""The ``fxfuse`` torch.compile backend: normalise, match, rewrite, report, hand to the inner compiler.

Registered through the ``torch_dynamo_backends`` entry point (pyproject.toml), so
``torch.compile(model, backend="fxfuse")`` works after ``pip install`` without ``import fxfuse``.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import logging
from pathlib import Path

import torch
import torch.fx as fx

from .attention import causal_attention, causal_outputs
from .attention_tags import causal_variant, dispatch, tag_outputs
from .dump import dump_report
from .layout import relax_views
from .normalize import to_aten
from .options import Options
from .outside import counted, ending_break, warn_eager_frames
from .report import Report
from .rewrite import rewrite
from .skipped import wrap_outputs

log = logging.getLogger("fxfuse")
_REPORTS: list[tuple[str, Report]] = []  # (Dynamo compile id, report) of every graph compiled
_graph_ids = itertools.count()


def _dynamo_control_flow(e: Exception) -> bool:
    """Exceptions Dynamo raises on purpose to restart or skip (e.g. TensorifyScalarRestartAnalysis
    under dynamic shapes): they must reach Dynamo, not the fail-safe."""
    from torch._dynamo import exc

    kinds = tuple(k for k in (getattr(exc, "RestartAnalysis", None), getattr(exc, "SkipFrame", None)) if k)
    return isinstance(e, kinds)


def selected_patterns(names):
    from fxfuse.patterns import all_patterns

    return [p for p in all_patterns() if p.name in names]


def transform(gm: fx.GraphModule, example_inputs, opts: Options) -> tuple[fx.GraphModule, Report]:
    """Dynamo graph -> rewritten ATen graph and its report (no inner compile). Fail safe: if the
    re-trace or the rewrite raises, Dynamo's graph is returned unchanged and the report says why."""
    breaks = ending_break(gm)  # the graph break that ended Dynamo's graph, reported either way
    try:
        aten_gm = to_aten(gm, example_inputs)
        before = aten_gm.code if opts.debug_dir else ""
        report = rewrite(aten_gm, selected_patterns(opts.patterns), opts)
        report.opaque = aten_gm.meta.pop("fxfuse_opaque", [])
        if opts.causal_attention:
            done, left = causal_attention(aten_gm)
            variant = causal_variant(aten_gm)
            if variant is not None:  # calls on a mask input: causal when the input is a tagged mask
                tagged = {s.nodes[-1] for s in variant[2]}  # the SDPA calls as named in aten_gm
                left = [s for s in left if s.nodes[0] not in tagged] + variant[2]
            report.attention = done + left
            if variant is not None:
                relax_views(variant[0])
            # popped by fxfuse_backend before the inner compile (a GraphModule's __dict__ is pickled
            # into compile-cache keys)
            aten_gm._fxfuse_causal = (variant, causal_outputs(aten_gm))
        if report.matched or any(not s.reason for s in report.attention):  # a layout may have changed
            relax_views(aten_gm)
    except Exception as e:
        if _dynamo_control_flow(e):
            raise
        log.warning("fxfuse: graph left unfused: %s: %s", type(e).__name__, e)
        report = Report(graphs=1, errors=[f"graph left unfused: {type(e).__name__}: {e}"], graph_breaks=breaks)
        return gm, report
    report.graph_breaks = breaks
    if opts.debug_dir:
        dump_report(opts.debug_dir, f"graph{next(_graph_ids)}", report, before, aten_gm)
    return aten_gm, report


def fxfuse_backend(gm: fx.GraphModule, example_inputs, options: dict | None = None, mode: str | None = None):
    opts = Options.parse(options)
    warn_eager_frames()
    aten_gm, report = transform(gm, example_inputs, opts)
    entry = (str(gm.meta.get("dynamo_compile_id", "")), report)
    _REPORTS.append(entry)
    log.info("%s", report)
    if aten_gm is gm:  # transform left the graph unfused
        return _compile_unfused(gm, example_inputs, opts, mode, entry)
    variant, causal_outs = aten_gm.__dict__.pop("_fxfuse_causal", (None, []))
    try:
        compiled = inner_compile(aten_gm, example_inputs, opts, mode)
        if variant is not None:
            compiled = _with_causal_variant(compiled, variant, example_inputs, opts, mode, report)
        compiled = tag_outputs(compiled, causal_outs)
    except Exception as e:  # fail safe: never fail the user's compile because of the rewrite
        if _dynamo_control_flow(e):
            _REPORTS.remove(entry)
            log.info("fxfuse: Dynamo restarts this graph's compile (%s); its report is dropped", type(e).__name__)
            raise
        log.warning("fxfuse: the rewritten graph failed to compile (%s: %s); compiling it unfused", type(e).__name__, e)
        report.matched, report.skipped_outputs, report.detached_outputs = [], [], []
        failed = f"{type(e).__name__}: {e}"
        compiled = _compile_unfused(gm, example_inputs, opts, mode, entry,
                                    f"rewritten graph failed in the inner compiler: {failed}; ")
        report.errors.append(f"rewritten graph failed in the inner compiler, compiled unfused: {failed}")
        return compiled
    compiled = wrap_outputs(compiled, report.skipped_outputs, report.detached_outputs)
    return counted(compiled, report) if report.matched else compiled


def _compile_unfused(gm: fx.GraphModule, example_inputs, opts: Options, mode, entry, prefix: str = ""):
    """Dynamo's graph gm through the inner compiler as it is. If that fails too (plain
    backend=opts.inner would fail the same way), Dynamo breaks the graph there and runs that code
    eagerly: the report (entry's) says so after prefix, or, when Dynamo restarts the compile, is dropped
    (its graph is compiled again and reported then)."""
    try:
        return inner_compile(gm, example_inputs, opts, mode)
    except Exception as e:
        if _dynamo_control_flow(e):
            _REPORTS.remove(entry)
        else:
            entry[1].errors.append(
                f"{prefix}the unfused graph fails in the inner compiler ({opts.inner}) too: {type(e).__name__}: "
                f'{e}; Dynamo runs this code eagerly (a graph break), unfused; plain backend="{opts.inner}" fails '
                "the same way")
        raise


def _with_causal_variant(compiled, variant, example_inputs, opts: Options, mode, report: Report):
    """compiled, dispatching to the graph's is_causal variant when its mask inputs are causal; if
    the variant fails to compile, compiled alone (the report says why)."""
    try:
        causal = inner_compile(variant[0], example_inputs, opts, mode)
    except Exception as e:
        if _dynamo_control_flow(e):
            raise
        log.warning("fxfuse: the is_causal variant failed to compile (%s: %s); masks kept", type(e).__name__, e)
        for s in variant[2]:
            s.reason = f"is_causal variant failed to compile: {type(e).__name__}: {e}"
        return compiled
    return dispatch(causal, compiled, variant[1], f"graph {len(_REPORTS) - 1}")


def inner_compile(gm: fx.GraphModule, example_inputs, opts: Options, mode: str | None):
    if opts.inner == "eager":
        return gm
    if opts.inner == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)
    from torch._functorch import config as functorch_config
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    mode_opts = list_mode_options(mode) if mode not in (None, "default") else {}
    # AOTAutograd's cache keys a graph by its code, not by node meta: a graph whose fused calls are
    # tagged for recomputation would share an entry with the same graph untagged (and get the wrong
    # saved set). Tagged graphs skip that cache; Inductor's own cache of the partitioned graphs stays.
    tagged = any("recompute" in n.meta for n in gm.graph.nodes)
    # config_patches, not a config.patch around the call: compile_fx also applies them to the
    # backward graph's compile, which AOTAutograd may run later (at the first backward)
    with functorch_config.patch(enable_autograd_cache=functorch_config.enable_autograd_cache and not tagged), \
            _cache_salt():
        return compile_fx(gm, example_inputs, config_patches={**mode_opts, **opts.inductor_patches()})


def hashed_files() -> list[Path]:
    """The sources of the fused ops: fxfuse.kernels and fxfuse.patterns, found through their package
    paths (an editable install maps them to the checkout's kernels/ and patterns/, not fxfuse/'s
    subfolders: a hash of those found no file and never changed)."""
    import fxfuse.kernels
    import fxfuse.patterns

    return [f for pkg in (fxfuse.kernels, fxfuse.patterns) for d in pkg.__path__ for f in sorted(Path(d).glob("*.py"))]


@functools.cache
def source_hash() -> str:
    """Hash of fxfuse's kernels and patterns: the fused ops' schemas, autograd and how they decompose."""
    h = hashlib.sha256()
    for f in hashed_files():
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


def _cache_salt():
    """AOTAutograd's cache keys a graph by its code, where a fused call reads the same across fxfuse
    versions; its cached compiled code also holds the calls the op decomposed into, so after an
    upgrade that changes an op's schema a stale entry would call it with the old arguments. The
    kernels' hash joins the cache key tag for the compile (where torch has the tag)."""
    config = getattr(torch.compiler, "config", None)
    if config is None or not hasattr(config, "cache_key_tag"):
        return contextlib.nullcontext()
    return config.patch(cache_key_tag=f"{config.cache_key_tag}fxfuse:{source_hash()}")


def compiled_reports() -> list[Report]:
    """Reports of every graph the backend compiled in this process, oldest first."""
    return [r for _, r in _REPORTS]


def running_reports(since: int = 0) -> list[Report]:
    """Of the reports compiled_reports()[since:], the latest per Dynamo frame: a recompile of a frame
    (another shape, automatic dynamic shapes) replaces its earlier graph for the steps that follow,
    so per-step sums (sites, bytes no longer written) count each frame once."""
    latest: dict[str, Report] = {}
    for cid, r in _REPORTS[since:]:
        frame = cid.strip("[]").rsplit("/", 1)[0] if "/" in cid else f"#{id(r)}"
        latest.pop(frame, None)  # re-insert: keep the order of the latest compiles
        latest[frame] = r
    return list(latest.values())


def last_report() -> Report:
    """Report of the most recently compiled graph (empty if none)."""
    return _REPORTS[-1][1] if _REPORTS else Report()
