"""Analyses of ``fxfuse audit``: the share of step time in the target ops, and the tensors fusion removed.

Target-op attribution rule (``category``). An op or kernel name is split into lower-case words at
every non-alphanumeric character ("aten::_log_softmax" -> aten, log, softmax;
"triton_per_fused_add_mean_mul_pow_rsqrt_0" -> ..., mean, mul, pow, rsqrt, 0). It counts for the
first pattern, in this order, whose rule it meets:

  rms_norm              words rsqrt, rmsnorm, pow, mean (and their autograd nodes), or rms + norm
  swiglu                words silu, gelu, sigmoid, swiglu, geglu (and autograd nodes)
  rope                  words rope, rotary, neg, cat (and autograd nodes; HF's rotate_half is neg + cat)
  linear_cross_entropy  words nll, logsumexp, lce, entropy, or log + softmax (and autograd nodes)

This covers the fused ops (fxfuse::rms_norm, fxfuse::rope_bwd, ... and their Triton kernels
_rms_norm_fwd_kernel, _lce_fwd_chunk_kernel, ...), Liger's kernels (_rms_norm_forward_kernel,
liger_cross_entropy_kernel, ...), Inductor's generated kernels (named after the ATen ops they fuse)
and the eager ATen ops of each pattern. Generic ops shared with the rest of the model (mul, add, to,
mm) are not attributed by name, so for eager the share is a lower bound; a fused op's time includes
everything it does (fxfuse::linear_cross_entropy includes the lm_head matmul), so for fxfuse and
Liger the share is an upper bound of the same work. An Inductor kernel fused across patterns counts
for the first one listed. Optimizer ops (AdamW's _foreach_pow, ...) never count. Time inside an op counts for the nearest enclosing op that has a pattern
(the CPU reference of a fused op calls generic ATen ops; they count for the fused op).

Time source: on CUDA, GPU time (every kernel, memcpy and memset; each kernel attributed by its own
name, else by the op that launched it); on CPU, self CPU time of every profiled op. Device time that
two events share counts once, for the one that started first (``exclusive_ms``): a programmatic
dependent launch (fxfuse's RMSNorm dw reduction on sm_90+) starts while its primary kernel runs and
waits for it; counting its whole span had shown fxfuse's RMSNorm backward at twice its time
(bench/RESULTS.md, 2026-12-06, fortieth session).
"""
from __future__ import annotations

import re
from collections import defaultdict

from .report import PATTERN_NAMES

_WORDS = {
    "rms_norm": {"rsqrt", "rmsnorm", "pow", "mean", "powbackward0", "rsqrtbackward0", "meanbackward1",
                 "rmsnormbackward", "fusedrmsnormbackward0"},
    "swiglu": {"silu", "gelu", "sigmoid", "swiglu", "geglu", "silubackward0", "gelubackward0",
               "sigmoidbackward0"},
    "rope": {"rope", "rotary", "neg", "cat", "negbackward0", "catbackward0"},
    "linear_cross_entropy": {"nll", "logsumexp", "lce", "entropy", "nlllossbackward0",
                             "logsoftmaxbackward0"},
}
_PAIRS = {"rms_norm": ("rms", "norm"), "linear_cross_entropy": ("log", "softmax")}


_NOT_MODEL = {"foreach", "adam", "adamw", "optimizer", "zero"}  # optimizer ops (_foreach_pow, ...)


def _words(name: str) -> set[str]:
    return set(re.split(r"[^a-z0-9]+", name.lower()))


def category(name: str) -> str | None:
    """The pattern an op or kernel name belongs to under the rule in the module docstring, else None.
    Optimizer ops (words foreach, adam, optimizer, zero) never count, whatever else they are called."""
    words = _words(name)
    if words & _NOT_MODEL:
        return None
    for pattern in PATTERN_NAMES:
        pair = _PAIRS.get(pattern)
        if words & _WORDS[pattern] or (pair and set(pair) <= words):
            return pattern
    return None


def _own_or_enclosing(evt) -> str | None:
    while evt is not None and not _words(evt.name) & _NOT_MODEL:
        cat = category(evt.name)
        if cat:
            return cat
        evt = evt.cpu_parent
    return None


def exclusive_ms(device_events) -> dict:
    """id(event) -> ms of its span not already covered by an event that started earlier on the same
    device (the union of all spans is the sum of these)."""
    covered, out = {}, {}
    for evt in sorted(device_events, key=lambda e: (e.time_range.start, e.time_range.end)):
        start, end = evt.time_range.start, evt.time_range.end
        until = covered.get(evt.device_index, start)
        out[id(evt)] = max(0.0, end - max(start, until)) / 1e3
        covered[evt.device_index] = max(until, end)
    return out


def attribute(events, cuda: bool) -> tuple[dict, dict, float, dict]:
    """(ms per pattern, ms per op or kernel name, total ms, what each pattern's ms is made of) over
    profiler FunctionEvents. The last maps pattern -> {kernel or op name: [ms, calls]}; a kernel
    counted for its launching op's pattern is named "kernel (in op)".

    CUDA: the total is the device time of every device event (kernels, memcpy, memset; overlaps once:
    exclusive_ms); a kernel counts for its own name's pattern, else for the pattern of the op that
    launched it (or an op enclosing that one).
    CPU: self CPU time of every op, counted for its own or its nearest enclosing op's pattern."""
    from torch.autograd import DeviceType

    per_pattern, per_name, total = defaultdict(float), defaultdict(float), 0.0
    parts = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))

    def count(cat, name, ms):
        per_pattern[cat] += ms
        parts[cat][name][0] += ms
        parts[cat][name][1] += 1

    # GPU-side spans of record_function ranges (Optimizer.step#AdamW.step: ~20 ms a step on Llama-1B)
    # are no device work: counted, they would take the time of the kernels they cover
    events = [e for e in events if not (getattr(e, "is_user_annotation", False) and e.device_type != DeviceType.CPU)]
    device = [e for e in events if cuda and not e.is_async and e.device_type != DeviceType.CPU]
    exclusive = exclusive_ms(device)
    # An op's kernels are copies (name, duration) of device events: find each one's exclusive ms.
    launched = defaultdict(list)
    for e in device:
        launched[e.name, e.time_range.end - e.time_range.start].append(exclusive[id(e)])
    for evt in events:
        if evt.is_async:
            continue
        if cuda and evt.device_type != DeviceType.CPU:
            ms = exclusive[id(evt)]
            total += ms
            per_name[evt.name] += ms
            cat = category(evt.name)
            if cat:
                count(cat, evt.name, ms)
        elif cuda:
            unnamed = [k for k in evt.kernels if category(k.name) is None]
            cat = _own_or_enclosing(evt) if unnamed and not evt.is_legacy else None
            for k in unnamed if cat else ():
                same = launched.get((k.name, k.duration))
                count(cat, f"{k.name} (in {evt.name})", same.pop(0) if same else k.duration / 1e3)
        else:
            ms = evt.self_cpu_time_total / 1e3
            total += ms
            per_name[evt.name] += ms
            cat = _own_or_enclosing(evt)
            if cat:
                count(cat, evt.name, ms)
    return dict(per_pattern), dict(per_name), total, {c: dict(v) for c, v in parts.items()}


def profile_shares(call, opt, data, first_batch: int, steps: int, cuda: bool, step_fn) -> dict:
    """Profile ``steps`` more training steps (batches first_batch...) and attribute their time."""
    from torch.profiler import ProfilerActivity, profile

    if steps <= 0:
        return {}
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for i in range(steps):
            step_fn(call, opt, data(first_batch + i)).item()
    per_pattern, per_name, total, parts = attribute(prof.events(), cuda)
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:12]
    return {
        "time_source": "GPU kernel time" if cuda else "self CPU time",
        "steps": steps,
        "total_ms": total,
        "ms": {p: per_pattern.get(p, 0.0) for p in PATTERN_NAMES},
        "share": {p: per_pattern.get(p, 0.0) / total if total else 0.0 for p in PATTERN_NAMES},
        "target_share": sum(per_pattern.values()) / total if total else 0.0,
        "top_ops": [{"name": n, "ms": ms, "pattern": category(n)} for n, ms in top],
        "pattern_parts": {p: [{"name": n, "ms": ms, "calls": calls}
                              for n, (ms, calls) in sorted(v.items(), key=lambda kv: -kv[1][0])[:8]]
                          for p, v in parts.items()},
    }


_TENSOR = re.compile(r"^(?P<name>.*):(?P<dtype>\w+)\[(?P<shape>[^\]]*)\]$")


def tensor_bytes(desc: str) -> tuple[str, str, list, int | None]:
    """'mul_3:float32[2, 9, 32]' -> ('mul_3', 'float32', [2, 9, 32], 2304); bytes None if symbolic."""
    import torch

    m = _TENSOR.match(desc)
    if not m:
        return desc, "", [], None
    dims = [d.strip() for d in m["shape"].split(",") if d.strip()]
    shape = [int(d) if d.lstrip("-").isdigit() else d for d in dims]
    dt = getattr(torch, m["dtype"], None)
    if dt is None or not all(isinstance(d, int) for d in shape):
        return m["name"], m["dtype"], shape, None
    n = 1
    for d in shape:
        n *= d
    return m["name"], m["dtype"], shape, n * dt.itemsize


def removed_tensors(report, top: int = 8) -> dict:
    """Per pattern (largest first): sites, bytes no longer written per step at the traced shapes, and
    the ``top`` largest such tensors with the module they belonged to (from ``Site.saved_tensors``);
    ``recomputed_bytes_per_step``: fused outputs no longer kept for backward (``Site.recomputed``)."""
    out = {}
    causal = [s for s in report.attention if s.saved_tensors]  # repeat_kv copies no longer written
    for site in report.matched + causal:
        agg = out.setdefault(site.pattern, {"sites": 0, "bytes_per_step": 0, "unknown_size": 0, "tensors": [],
                                            "recomputed_bytes_per_step": 0})
        agg["sites"] += 1
        agg["recomputed_bytes_per_step"] += sum(tensor_bytes(d)[3] or 0 for d in site.recomputed)
        for desc in site.saved_tensors:
            name, dtype, shape, nbytes = tensor_bytes(desc)
            agg["tensors"].append({"tensor": name, "dtype": dtype, "shape": shape, "bytes": nbytes,
                                   "module": site.module})
            if nbytes is None:
                agg["unknown_size"] += 1
            else:
                agg["bytes_per_step"] += nbytes
    for agg in out.values():
        agg["tensors"] = sorted(agg["tensors"], key=lambda t: -(t["bytes"] or 0))[:top]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["bytes_per_step"]))
