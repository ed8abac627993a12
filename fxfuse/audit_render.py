"""The audit's text: the console table (``render``, also audit.txt) and the header pieces bench/e2e.py
reuses for its markdown (sequence lengths, input options, graphs compiled, fxfuse options)."""
from __future__ import annotations

from .audit_compare import render_lines
from .audit_memory import render as render_peak
from .audit_worker import fxfuse_options

MIB = 2**20


def seq_text(a: dict) -> str:
    """--seq, or the lengths the steps cycle through (--seq-lengths)."""
    return "/".join(map(str, a["seq_lengths"])) + " by step" if a.get("seq_lengths") else str(a["seq"])


def inputs_text(a: dict) -> str:
    """The run's non-default inputs for table headers: attention mask, dynamic shapes."""
    parts = [f"attention_mask {a['attention_mask']}" if a.get("attention_mask", "none") != "none" else "",
             "dynamic=True" if a.get("dynamic") else ""]
    return "".join(f", {p}" for p in parts if p)


def graphs_text(results: dict) -> str:
    """Dynamo graphs each compiled mode built over its steps (recompiles show up here), and which
    variant fxfuse's graphs with a run-time checked causal mask ran (fxfuse/attention_tags.py)."""
    seen = {m: r["graphs_compiled"] for m, r in results.items() if r.get("graphs_compiled")}
    text = "graphs compiled: " + ", ".join(f"{m} {n}" for m, n in seen.items()) if seen else ""
    checks = (results.get("fxfuse") or {}).get("mask_checks")
    if checks:
        text += (f"; fxfuse's mask-checked graph calls: {checks.get('causal', 0)} ran is_causal, "
                 f"{checks.get('traced', 0)} ran with the mask")
    return text


def options_text(a: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in fxfuse_options(a).items())


def _short(name: str, width: int = 60) -> str:
    """A kernel name cut to width characters (ATen's templated kernel names run to hundreds)."""
    return name if len(name) <= width else name[:width - 3] + "..."


def _f(v, fmt: str) -> str:
    """format(v, fmt), or "-" padded to the same width when v is missing."""
    width = int("".join(c for c in fmt.split(".")[0] if c.isdigit()) or 0)
    return "-".rjust(width) if v is None else format(v, fmt)


def render(audit: dict) -> str:
    """The console table (also audit.txt)."""
    a, results, div, fit = audit["args"], audit["modes"], audit["divergence"], audit["fit"]
    cuda = a["device"].startswith("cuda")
    mem = "peak alloc / reserved MiB (CUDA allocator)" if cuda else "peak RSS MiB (process, CPU)"
    amp = f" weights, {a['autocast']} autocast" if a.get("autocast") else ""
    ckpt = ", activation checkpointing" if a.get("checkpointing") else ""
    warm = f" (linear warm-up over {a['lr_warmup']} steps)" if a.get("lr_warmup") else ""
    data = "tokens " + a["tokens"] if a["tokens"] else f"synthetic tokens ({a.get('synthetic', 'uniform')})"
    lines = [f"fxfuse audit: {a['model']}{' (tiny)' if a['tiny'] else ''}, batch {a['batch']} x seq {seq_text(a)}, "
             f"{a['steps']} steps (median after {a['warmup']} warm-up), {a['dtype']}{amp}{ckpt}{inputs_text(a)} "
             f"on {audit['env']['device']}, "
             f"AdamW lr {a['lr']}{warm}, seed {a['seed']}, {data}, "
             f"fxfuse options: {options_text(a)}",
             f"memory: {mem}; target-op share: fraction of profiled step time in rms_norm/rope/swiglu/"
             f"linear_cross_entropy ops (rule: fxfuse/audit_profile.py); 1st step: the first training step, "
             f"compile included ({'empty compile caches per mode' if a.get('cold_compile') else 'caches as found'})"]
    head = (f"{'mode':11} {'1st step s':>10} {'step ms':>9} {'tokens/s':>10} {'peak alloc':>11} {'reserved':>9} "
            f"{'max batch':>9} {'max seq':>8} {'target %':>8} {'max|dloss|':>10} {'final loss':>10}  status")
    lines += [head, "-" * len(head)]
    for mode, r in results.items():
        fr = fit.get(mode, {})
        prof = r.get("profile") or {}
        lines.append(
            f"{mode:11} {_f(r['step_times_s'][0] if r.get('step_times_s') else None, '10.1f')} "
            f"{_f(r.get('step_time_ms'), '9.2f')} {_f(r.get('tokens_per_s'), '10.0f')} "
            f"{_f(r.get('peak_allocated_mib'), '11.1f')} {_f(r.get('peak_reserved_mib'), '9.1f')} "
            f"{_f(fr.get('batch', {}).get('largest'), '9d')} {_f(fr.get('seq', {}).get('largest'), '8d')} "
            f"{_f(prof['target_share'] * 100 if 'target_share' in prof else None, '8.1f')} "
            f"{_f(div.get(mode, {}).get('max_abs'), '10.2e')} "
            f"{_f(r['losses'][-1] if r.get('losses') else None, '10.4f')}  {r.get('status', '')}")
    for mode, fr in fit.items():
        b = fr.get("batch") or {}
        probes = b.get("probes") or []
        if probes or b.get("status", "ok") != "ok":
            mib = lambda p: f" {p['peak_allocated_mib']:.0f} MiB" if p.get("peak_allocated_mib") else ""  # noqa: E731
            lines.append(f"largest batch, {mode} (one process, {a.get('fit_shapes', 'dynamic')} batch): "
                         + ", ".join(f"{p['batch']} {'fits' if p['fits'] else 'OOM'}{mib(p)}" for p in probes)
                         + (f"; graphs compiled after the first probe: {probes[-1]['graphs'] - probes[0]['graphs']}"
                            if probes else "")
                         + ("" if b.get("status", "ok") == "ok" else f"; {b['status']}"))
        rep = b.get("report")
        if rep:  # fusion of the dynamic-batch graphs: can differ from the static run's (e.g. attention)
            att = rep["attention"]
            why = sorted({x["reason"] for x in att if x["reason"]})
            lines.append(f"  its fxfuse graphs: fused {rep['counts']}" + (
                f", causal attention at {sum(not x['reason'] for x in att)}/{len(att)} SDPA calls"
                + (f" ({'; '.join(why)})" if why else "") if att else ""))
    lines += [t for t in [graphs_text(results)] if t]
    lines += render_lines(audit)
    n = a["show_losses"]
    lines.append(f"\nloss curve, first {n} steps:")
    for mode, r in results.items():
        if r.get("losses"):
            lines.append(f"  {mode:11} " + " ".join(f"{v:.4f}" for v in r["losses"][:n]))
    for mode, r in results.items():
        prof = r.get("profile") or {}
        if prof:
            parts = ", ".join(f"{p} {prof['ms'][p]:.1f} ms ({prof['share'][p] * 100:.1f}%)" for p in prof["ms"])
            lines.append(f"target ops, {mode} ({prof['time_source']}, {prof['steps']} steps, "
                         f"{prof['total_ms']:.1f} ms): {parts}")
            for pattern, items in prof.get("pattern_parts", {}).items():
                lines.append(f"    {pattern}: " + ", ".join(
                    f"{_short(i['name'])} {i['ms']:.1f} ms / {i['calls']}" for i in items))
    for mode, r in results.items():
        if r.get("memory_peak"):
            lines += ["", *render_peak(mode, r["memory_peak"])]
    for mode, r in results.items():
        if r.get("removed") is None:
            continue
        counts = r["report"]["counts"]
        lines.append(f"\n{mode}: {sum(counts.values())} sites fused {counts}, "
                     f"{len(r['report']['unmatched'])} unmatched; tensors no longer written, per pattern:")
        for pattern, agg in r["removed"].items():
            lines.append(f"  {pattern:21} {agg['sites']:3d} sites  {agg['bytes_per_step'] / MIB:10.2f} MiB/step")
            if agg.get("recomputed_bytes_per_step"):
                lines.append(f"      + fused outputs recomputed in backward, not kept: "
                             f"{agg['recomputed_bytes_per_step'] / MIB:.2f} MiB/step")
            for t in agg["tensors"][:3]:
                size = "?" if t["bytes"] is None else f"{t['bytes'] / MIB:.2f} MiB"
                lines.append(f"      {t['tensor']}:{t['dtype']}{t['shape']}  {size}  ({t['module'] or 'top level'})")
        for s in r["report"]["unmatched"][:5]:
            lines.append(f"  unmatched {s['pattern']} at {s['module'] or 'top level'}: {s['reason']}")
        if r.get("post_grad"):
            lines.append("  " + post_grad_text(r["post_grad"]))
    return "\n".join(lines)


def post_grad_text(counts: dict) -> str:
    """One line on what fxfuse's post-grad passes did in the backward graphs compiled during a run (a
    graph compiled twice, as the is_causal variant of a masked graph, counts twice)."""
    c = counts
    if c["cache_hits"] and not any(v for k, v in c.items() if k != "cache_hits"):
        return (f"post-grad (Inductor backward): not run in this process ({c['cache_hits']} compile cache "
                "hits reused code compiled earlier, with whatever the passes did then)")
    folds = c["residual_adds_folded"] + c["gradient_sums_folded"]
    size = (f"{c['fold_bytes_unwritten'] / MIB:.2f} MiB no longer written, summed over the backward graphs "
            "compiled in the run: a step's when one runs per step"
            if c["fold_bytes_unwritten"] or not folds else "bytes not counted: symbolic sizes")
    return (f"post-grad (Inductor backward): {c['residual_adds_folded']} residual-gradient adds and "
            f"{c['gradient_sums_folded']} gradient sums folded into the RMSNorm backward ({size}), "
            f"{c['gradients_in_place']} gated-MLP gradients written in place"
            + (f"; {c['cache_hits']} compile cache hits (graphs reused as compiled earlier, not counted)"
               if c["cache_hits"] else ""))
