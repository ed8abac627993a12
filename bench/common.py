"""Shared pieces of the kernel benchmarks: timing, the copy ceiling, providers, the result table.

Every benchmark times fwd+bwd with ``triton.testing.do_bench`` (median, CUDA events) and reports
GB/s from a byte count written as a function next to each benchmark, against a copy ceiling
measured in the same process.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

PROVIDERS = ("eager", "inductor", "liger", "fxfuse")


def have_liger() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def bench_ms(fn, warmup_ms: int = 50, rep_ms: int = 300) -> float:
    """Median time of fn() in ms over CUDA events."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


_primed = False


def _prime_graph_capture() -> None:
    """The first CUDA-graph capture of a process failed on the H200 (cudaErrorStreamCapture) and
    poisoned the case being captured; one throwaway capture per process keeps that out of results."""
    global _primed
    if _primed:
        return
    _primed = True
    t = torch.zeros(1, device="cuda")
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            t.add_(1)
        graph.replay()
    except Exception as exc:  # reported, never fatal: the real captures follow
        print(f"priming capture failed: {type(exc).__name__}: {exc}"[:200], flush=True)
    torch.cuda.synchronize()


def graphed(step):
    """step captured in a CUDA graph: replay times the GPU work alone, without Python/launch overhead
    (what a model run under CUDA graphs, or one that keeps the GPU busy, pays)."""
    _prime_graph_capture()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # thread_local: autograd's backward runs on its own device thread during the capture.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        step()

    def replay():
        graph.replay()

    # The graph reads and writes the tensors step closes over: they must live as long as the replay
    # (a later capture's empty_cache would otherwise free their memory under the graph).
    replay.step = step
    return replay


def copy_ceiling_gbps(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth counting bytes read plus bytes written (the ceiling)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e6


def peak_extra_mib(fn) -> float:
    """Peak memory allocated by fn() above what was allocated before it, in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


@dataclass
class Row:
    case: str
    provider: str
    ms: float | None
    gbps: float | None = None
    ceiling_pct: float | None = None
    extra_mib: float | None = None
    max_err: float | None = None
    note: str = ""


def print_table(rows: list[Row]) -> str:
    head = f"{'case':34} {'provider':9} {'ms':>9} {'GB/s':>8} {'%ceil':>6} {'MiB+':>8} {'err':>9}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        f = lambda v, fmt: format(v, fmt) if v is not None else "-"  # noqa: E731
        lines.append(
            f"{r.case:34} {r.provider:9} {f(r.ms, '9.3f')} {f(r.gbps, '8.0f')} {f(r.ceiling_pct, '6.1f')} "
            f"{f(r.extra_mib, '8.0f')} {f(r.max_err, '9.2e')}  {r.note}"
        )
    text = "\n".join(lines)
    print(text, flush=True)
    return text
