"""Where a compiled training step leaves the GPU idle: one mode, a few profiled steps, a chrome trace.

    python bench/probe_step_trace.py --mode fxfuse --model llama-1b --out /tmp/trace
    python bench/probe_step_trace.py --mode inductor --model llama-1b --out /tmp/trace

Builds the model as ``fxfuse audit`` does (fxfuse/audit_worker.py: same presets, data, AdamW), runs
--warmup steps, then profiles --steps steps (CPU + CUDA) and prints, per step: host wall time, GPU
busy time (union of kernel, memcpy and memset spans), GPU idle time, and the idle time before each
kernel grouped by the phase and op that launched that kernel (forward, backward, optimizer; an
fxfuse op, an aten op, or Inductor's Python launcher). Host time spent inside fxfuse ops is printed
too. The chrome trace (gzip) goes to --out for a closer look.
"""
from __future__ import annotations

import argparse
import gzip
import os
import shutil
import time
from collections import defaultdict

import torch

from fxfuse.audit_worker import _setup, train_step

PHASES = (("backward", ("backward",)), ("optimizer", ("optimizer", "adam")), ("forward", ("compiled", "forward")))


def _phase(names: list[str]) -> str:
    """Phase of a launch from the names of its enclosing CPU ops (innermost first)."""
    joined = " ".join(names).lower()
    for phase, words in PHASES:
        if any(w in joined for w in words):
            return phase
    return "other"


def _op(names: list[str]) -> str:
    """The op a launch counts for: the innermost fxfuse op enclosing it, else the outermost aten op,
    else the innermost named event (Inductor's Python launcher has none: "(python launcher)")."""
    fx = [n for n in names if n.startswith("fxfuse::")]
    aten = [n for n in names if n.startswith("aten::")]
    return fx[0] if fx else aten[-1] if aten else names[0] if names else "(python launcher)"


def _enclosing(evt) -> list[str]:
    names = []
    evt = evt.cpu_parent if evt is not None else None
    while evt is not None:
        names.append(evt.name)
        evt = evt.cpu_parent
    return names


def idle_table(events, steps: int, top: int) -> list[str]:
    """GPU busy / idle per step and the idle time before each device event, counted for the phase
    and op of the CPU call that launched it (runtime launch and device event share a correlation id)."""
    from torch.autograd import DeviceType

    from fxfuse.audit_profile import exclusive_ms

    cpu = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
    launches = {e.id: e for e in cpu if e.name.startswith(("cuda", "cu")) and "Launch" in e.name
                or e.name.startswith(("cudaMemsetAsync", "cudaMemcpyAsync"))}
    # not the GPU-side spans of record_function ranges (Optimizer.step: they would hide its gaps)
    device = sorted((e for e in events if e.device_type != DeviceType.CPU and not e.is_async
                     and not getattr(e, "is_user_annotation", False)), key=lambda e: e.time_range.start)
    busy = sum(exclusive_ms(device).values())  # the union of the device spans (fxfuse/audit_profile.py)
    until = device[0].time_range.start if device else 0.0
    by_phase, by_op, gaps = defaultdict(float), defaultdict(lambda: [0.0, 0]), []
    for e in device:
        if e.time_range.start > until:
            gap = (e.time_range.start - until) / 1e3
            names = _enclosing(launches.get(e.id))
            phase, op = _phase(names), _op(names)
            by_phase[phase] += gap
            by_op[phase, op][0] += gap
            by_op[phase, op][1] += 1
            gaps.append((gap, phase, op, e.name))
        until = max(until, e.time_range.end)
    idle = sum(g[0] for g in gaps)
    host_fx = defaultdict(lambda: [0.0, 0])
    for e in cpu:
        if e.name.startswith("fxfuse::") and not (e.cpu_parent and e.cpu_parent.name == e.name):
            host_fx[e.name][0] += e.cpu_time_total / 1e3
            host_fx[e.name][1] += 1
    per = lambda ms: ms / steps  # noqa: E731
    lines = [f"GPU busy {per(busy):.2f} ms / step, idle between first and last kernel {per(idle):.2f} ms / step",
             "idle before kernels, by phase (ms / step): "
             + ", ".join(f"{k} {per(v):.2f}" for k, v in sorted(by_phase.items(), key=lambda kv: -kv[1]))]
    lines.append(f"idle by launching op (top {top}): phase | op | ms / step | gaps / step")
    for (phase, op), (ms, n) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {phase} | {op} | {per(ms):.3f} | {n / steps:.0f}")
    lines.append(f"largest gaps (top {top}): ms | phase | op | kernel after the gap")
    for gap, phase, op, name in sorted(gaps, reverse=True)[:top]:
        lines.append(f"  {gap:.3f} | {phase} | {op} | {name[:90]}")
    lines.append("host time inside fxfuse ops (CPU total incl. children): op | ms / step | calls / step | us / call")
    for name, (ms, n) in sorted(host_fx.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"  {name} | {per(ms):.3f} | {n / steps:.0f} | {ms * 1e3 / n:.1f}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="fxfuse", choices=["eager", "inductor", "liger", "fxfuse"])
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=2, help="profiled steps")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--fxfuse-option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--device", default="cuda", help="cpu with --tiny: a smoke run of this script")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default="step_trace")
    a = p.parse_args()
    options = dict(kv.split("=", 1) for kv in a.fxfuse_option)
    for k, v in options.items():
        options[k] = {"True": True, "False": False}.get(v, v)
    cuda = a.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    spec = dict(device=a.device, dtype="bfloat16" if cuda else "float32", mode=a.mode, model=a.model, config={},
                tiny=a.tiny, seed=0, lr=3e-4, batch=a.batch, seq=a.seq, tokens=None, fxfuse_options=options)
    model, call, opt, data = _setup(spec)
    times = []
    for i in range(a.warmup):
        sync()
        t0 = time.perf_counter()
        train_step(call, opt, data(i)).item()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    where = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{a.mode} {a.model} {a.batch}x{a.seq} on {where}: unprofiled steps "
          + " ".join(f"{t:.1f}" for t in times[-3:]) + " ms")
    from torch.profiler import ProfilerActivity, profile

    sync()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        for i in range(a.steps):
            train_step(call, opt, data(a.warmup + i)).item()
        sync()
    print(f"profiled steps: {(time.perf_counter() - t0) * 1e3 / a.steps:.1f} ms / step (profiler on)")
    print("\n".join(idle_table(prof.events(), a.steps, a.top)))
    os.makedirs(a.out, exist_ok=True)
    raw = os.path.join(a.out, f"trace_{a.mode}.json")
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as f, gzip.open(raw + ".gz", "wb") as g:
        shutil.copyfileobj(f, g)
    os.remove(raw)


if __name__ == "__main__":
    main()
