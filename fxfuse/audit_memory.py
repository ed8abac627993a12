"""What is alive at a training step's memory peak (``fxfuse audit --memory-peak``, CUDA only).

One extra step runs with the CUDA caching allocator's history on
(``torch.cuda.memory._record_memory_history``); its trace of alloc / free events is replayed to find
the moment the allocated total peaks, and the blocks alive then are grouped by the source line that
allocated them (the innermost frame outside torch's own files: a model line, an fxfuse kernel, an
Inductor-generated file). Comparing two modes' tables says which tensors one holds that the other
does not.
"""
from __future__ import annotations

import os
from collections import defaultdict

_TORCH_DIRS = (os.sep + os.path.join("torch", ""), os.sep + os.path.join("triton", ""))


def _where(frames: list[dict]) -> str:
    """The innermost frame that is not torch / triton internals, as 'file.py:line name'."""
    for f in frames:
        name = f.get("filename", "")
        if name.startswith("??") or any(d in name for d in _TORCH_DIRS):
            continue
        return f"{os.path.basename(name)}:{f.get('line', 0)} {f.get('name', '')}"
    return "(no Python frame)"


def peak_blocks(trace: list[dict], top: int = 12) -> dict:
    """From one device's allocator trace: the peak of live allocated bytes and, at that moment, the
    live bytes per allocating source line (largest ``top``)."""
    live: dict[int, dict] = {}
    total = peak = 0
    peak_at = -1
    for i, ev in enumerate(trace):
        action, addr = ev.get("action"), ev.get("addr")
        if action == "alloc":
            live[addr] = ev
            total += ev["size"]
            if total > peak:
                peak, peak_at = total, i
        elif action in ("free_requested", "free_completed") and addr in live:
            total -= live.pop(addr)["size"]
    live.clear()
    for ev in trace[:peak_at + 1]:  # replay to the peak: the blocks alive there
        if ev.get("action") == "alloc":
            live[ev["addr"]] = ev
        elif ev.get("action") in ("free_requested", "free_completed"):
            live.pop(ev.get("addr"), None)
    by_line: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for ev in live.values():
        entry = by_line[_where(ev.get("frames") or [])]
        entry[0] += ev["size"]
        entry[1] += 1
    rows = sorted(by_line.items(), key=lambda kv: -kv[1][0])[:top]
    return {"peak_mib": peak / 2**20, "events": len(trace),
            "lines": [{"where": w, "mib": b / 2**20, "blocks": n} for w, (b, n) in rows]}


def record_peak(step, device: str, top: int = 12) -> dict:
    """Run ``step()`` once with the allocator history on; peak_blocks of its trace."""
    import torch

    torch.cuda.synchronize(device)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize(device)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    index = torch.device(device).index or 0
    traces = snap.get("device_traces") or [[]]
    return peak_blocks(traces[index] if index < len(traces) else [], top)


def render(mode: str, peak: dict) -> list[str]:
    lines = [f"memory at the peak, {mode}: {peak['peak_mib']:.0f} MiB allocated during the step "
             f"(live blocks by allocating line, largest first)"]
    lines += [f"  {r['mib']:9.1f} MiB  {r['blocks']:5d} blocks  {r['where']}" for r in peak["lines"]]
    return lines
