"""The largest batch (or sequence) that trains: the fit jobs of ``fxfuse audit``'s worker process.

``fit`` answers whether one (batch, seq) trains (two steps; an OOM means no); ``fit_batch`` runs the
whole largest-batch search in one process; ``search_largest`` is the doubling-then-bisection search
both use. They build and step the model through fxfuse/audit_worker.py (its ``_setup`` and
``train_step``), so every mode is set up exactly as in the timed run.
"""
from __future__ import annotations

import gc
import time

import torch

from . import audit_worker as worker
from .audit_data import Batches


def _oom_reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def fit(spec: dict) -> dict:
    """Does (batch, seq) train? Two steps (the first compiles); an OOM means it does not fit."""
    try:
        _, call, opt, data = worker._setup(spec)
        for i in range(2):
            worker.train_step(call, opt, data(i)).item()
            worker._sync(spec["device"])
    except Exception as e:  # noqa: BLE001 - any OOM, however the backend wraps it
        if worker._is_oom(e):
            return {"fits": False, "reason": _oom_reason(e)}
        raise
    out = {"fits": True}
    if spec["device"].startswith("cuda"):
        out["peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def search_largest(fits, cap: int, start: int = 1) -> tuple[int, list[tuple[int, bool]]]:
    """Largest n in [1, cap] with fits(n), assuming fits is monotone (True up to some n, then False).
    Probes ``start`` (clamped to [1, cap]) first: if it fits, doubling until a failure or ``cap``,
    then bisection; if not, bisection below it. Returns (n or 0, trials)."""
    trials = []

    def probe(n: int) -> bool:
        ok = fits(n)
        trials.append((n, ok))
        return ok

    if cap < 1:
        return 0, trials
    start = max(1, min(start, cap))
    good, bad = (start, None) if probe(start) else (0, start)
    while bad is None and good < cap:
        n = min(2 * good, cap)
        if probe(n):
            good = n
        else:
            bad = n
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        if probe(mid):
            good = mid
        else:
            bad = mid
    return good, trials


def fit_batch(spec: dict, progress=None) -> dict:
    """The largest batch at ``seq`` that trains, searched in this one process (``search_largest`` from
    ``batch`` up to ``max_batch_search``): the model, its compiled code and AdamW are built once, and
    each probe runs two training steps at batch n on synthetic tokens (memory does not depend on the
    token values), with the batch dimension of input_ids marked dynamic, so the compiled modes compile
    once (batch 1, if probed, is specialized: one more graph). ``fit_shapes="static"``: no dynamic
    dimension, one compile per probed batch (the run's exact static graphs, at the old cost per probe;
    fxfuse's causal-attention rewrite needs static shapes). An OOM fails the probe; everything the
    failed probe held is then freed (references, gradients, gc, the CUDA cache) before the next; any
    other error ends the search as an error. Per probe: batch, fits, peak allocated MiB (CUDA, peak
    stats reset per probe), seconds, graphs compiled so far. ``progress(partial)`` gets the result so
    far after every probe (the worker writes it to OUT, so a killed search keeps its probes)."""
    import fxfuse
    from torch._dynamo.utils import counters

    device, cuda = spec["device"], spec["device"].startswith("cuda")
    dynamic = spec.get("fit_shapes", "dynamic") == "dynamic"
    n_reports = len(fxfuse.compiled_reports())
    model, call, opt, _ = worker._setup({**spec, "tokens": None})
    vocab, probes = model.config.vocab_size, []
    out = {"mode": spec["mode"], "status": "running", "largest": None, "probes": probes, "dynamic_batch": dynamic}

    def fits(n: int) -> bool:
        data = Batches(vocab, n, spec["seq"], spec["seed"], device, mask=spec.get("attention_mask", "none"))
        reason = None
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        try:
            for i in range(2):
                batch = data(i)
                if dynamic and n > 1:
                    for t in batch.values():
                        torch._dynamo.maybe_mark_dynamic(t, 0)
                worker.train_step(call, opt, batch).item()
            worker._sync(device)
        except Exception as e:  # noqa: BLE001 - any OOM, however the backend wraps it
            if not worker._is_oom(e):
                raise
            reason = _oom_reason(e)
        batch = data = None  # a failed probe's activations and gradients go before the next probe
        probe = {"batch": n, "fits": reason is None, "seconds": time.perf_counter() - t0,
                 "peak_allocated_mib": torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None,
                 "graphs": counters["stats"]["unique_graphs"]}
        if reason:
            probe["reason"] = reason
        opt.zero_grad(set_to_none=True)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        probes.append(probe)
        if progress:
            progress(out)
        return reason is None

    static = {} if dynamic else dict(automatic_dynamic_shapes=False, recompile_limit=64)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, **static):  # never eager silently
        out["largest"], _ = search_largest(fits, spec["max_batch_search"], spec["batch"])
    out["status"] = "ok"
    if spec["mode"] == "fxfuse":  # the dynamic-batch graphs' fusion, to compare with the run's
        report = fxfuse.Report.merge(fxfuse.compiled_reports()[n_reports:])
        out["report"] = {"counts": report.counts(), "graphs": report.graphs,
                         "attention": [{"module": a.module, "reason": a.reason} for a in report.attention]}
    return out
