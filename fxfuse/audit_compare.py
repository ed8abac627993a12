"""Loss curves of ``fxfuse audit`` compared: against eager, between modes, against eager run again,
and against another run's eager curve (``--reference``, e.g. an fp32 run for a bf16 one).

A bf16 divergence from eager means little alone: rounding differences grow through training, and
eager is not bit-reproducible run to run on CUDA (atomics in backward kernels). Two yardsticks make it
readable: ``eager-rerun`` (eager's own spread, the noise floor of "within X of eager") and a higher
precision reference (how far every mode, eager included, is from the exact math's curve).
"""
from __future__ import annotations

import json

# args that must agree for two runs' loss curves to be comparable step by step (same model, init,
# data order, optimizer); dtype, autocast, compile mode and checkpointing may differ: that is the point
SAME_RUN_KEYS = ("model", "config", "tiny", "batch", "seq", "seed", "lr", "lr_warmup", "synthetic", "tokens")
NOT_COMPARED = ("eager", "eager-rerun")  # pairwise_divergence compares the other modes among themselves


def _worst(curve: list[float], ref: list[float]) -> dict:
    """Largest |curve - ref| over the steps both ran (absolute, relative, step), and at the last step."""
    absd = [abs(a - b) for a, b in zip(curve, ref)]
    i = max(range(len(absd)), key=absd.__getitem__)
    return {"max_abs": absd[i], "max_rel": absd[i] / max(abs(ref[i]), 1e-30), "at_step": i + 1,
            "last_abs": absd[-1], "steps": len(absd)}


def _against(results: dict, ref: list[float]) -> dict:
    """Per mode with a loss curve: its _worst against ref."""
    return {mode: _worst(r["losses"], ref) for mode, r in results.items() if r.get("losses")}


def divergence(results: dict) -> dict:
    """Per mode: the largest |loss - eager loss| over the steps both ran, absolute and relative."""
    ref = (results.get("eager") or {}).get("losses")
    return _against(results, ref) if ref else {}


def pairwise_divergence(results: dict) -> dict:
    """"a vs b" -> the largest |loss difference| between every two non-eager modes: when every mode
    leaves eager's bf16 curve by the same amount, this shows whether they agree with each other."""
    curves = {m: r["losses"] for m, r in results.items() if m not in NOT_COMPARED and r.get("losses")}
    names = list(curves)
    return {f"{a} vs {b}": max(abs(x - y) for x, y in zip(curves[a], curves[b]))
            for i, a in enumerate(names) for b in names[i + 1:]}


def load_reference(path: str, args: dict) -> dict:
    """The eager loss curve of an earlier audit (its audit.json), checked to be the same run as
    ``args`` up to precision: a mismatch (other model, seed, data, lr...) raises SystemExit naming
    the keys, never a silent comparison of unrelated curves."""
    with open(path) as f:
        other = json.load(f)
    theirs = other.get("args") or {}
    bad = [k for k in SAME_RUN_KEYS if theirs.get(k) != args.get(k)]
    if bad:
        raise SystemExit("fxfuse audit: --reference " + path + " is not the same run: "
                         + ", ".join(f"{k}={theirs.get(k)!r} there, {args.get(k)!r} here" for k in bad))
    losses = ((other.get("modes") or {}).get("eager") or {}).get("losses")
    if not losses:
        raise SystemExit(f"fxfuse audit: --reference {path} has no eager loss curve (run it with eager in --compare)")
    return {"path": path, "dtype": theirs.get("dtype"), "autocast": theirs.get("autocast"), "losses": losses}


def reference_divergence(results: dict, reference: dict) -> dict:
    """Per mode (eager included): its largest |loss - reference eager loss|."""
    return _against(results, reference["losses"])


def render_lines(audit: dict) -> list[str]:
    """The comparison lines under the audit table."""
    lines = []
    pairs = audit.get("pairwise") or {}
    if pairs:
        lines.append("max |dloss| between modes: " + ", ".join(f"{k} {v:.2e}" for k, v in pairs.items()))
    spread = audit["divergence"].get("eager-rerun")
    if spread:
        within = [m for m, d in audit["divergence"].items()
                  if m not in NOT_COMPARED and d["max_abs"] <= spread["max_abs"]]
        lines.append(f"eager's own run-to-run spread (eager-rerun vs eager): max |dloss| {spread['max_abs']:.2e} "
                     f"(step {spread['at_step']}); modes within it: {', '.join(within) or 'none'}")
    ref = audit.get("reference")
    if ref:
        prec = ref["dtype"] + (f" + {ref['autocast']} autocast" if ref.get("autocast") else "")
        lines.append(f"vs the reference ({prec} eager, {ref['path']}): "
                     + ", ".join(f"{m} {d['max_abs']:.2e} (step {d['at_step']}, last {d['last_abs']:.1e})"
                                 for m, d in ref["divergence"].items()))
    return lines
