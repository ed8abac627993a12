"""Probe: RMSNorm's TMA row forward (kernels/_rms_norm_rows.py) at its launch choices and around them.

    python bench/probe_rms_tma.py                        # 4096x8192, 2048x16384, 16384x4096
    python bench/probe_rms_tma.py --shapes 4096x8192
    python bench/probe_rms_tma.py --ab 9 --shapes 4096x8192 2048x16384   # TMA on/off, alternating

Times, under CUDA-graph replay against the copy ceiling, in one process: the shipped forward, the
TMA row forward at stages x programs per SM x warps (with its shared memory per program; 16384x4096
rows normally run the one-tile forward), a same-size copy, and the shipped backward row kernel at
2-5 stages. The first round (TMA forward vs per-thread copies, a TMA backward, cache-eviction
hints: tenth session) is in bench/RESULTS.md. Only reports; nothing here is used by fxfuse.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_ms, copy_ceiling_gbps, graphed  # noqa: E402


def probe(m: int, d: int, ceiling: float) -> None:
    from fxfuse.kernels import _rms_norm_launch as launch
    from fxfuse.kernels import rms_norm as k

    dt = torch.bfloat16
    x, dy = (torch.randn(m, d, device="cuda", dtype=dt) for _ in range(2))
    w = torch.randn(d, device="cuda", dtype=dt)
    y, dx = torch.empty_like(x), torch.empty_like(x)
    fb, bb = 2 * m * d * 2, 3 * m * d * 2
    res = []

    def t(kind, label, fn, nbytes):
        try:
            ms = bench_ms(graphed(fn))
        except Exception as exc:  # a config that does not compile or capture is reported, never fatal
            print(f"{kind} {label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            return
        res.append((kind, label, ms, 100 * nbytes / ms / 1e6 / ceiling))

    ref = k._rms_norm(x, w, 1e-6, 0.0, True, dt)
    t("fwd", "shipped", lambda: k._rms_norm(x, w, 1e-6, 0.0, True, dt), fb)
    t("copy", "same-size", lambda: y.copy_(x), fb)
    chunk = launch.TMA_CHUNK
    nb = triton.next_power_of_2(d // chunk)
    desc = launch.TensorDescriptor(x, [m, d // chunk, chunk], [d, chunk, 1], [1, nb, chunk])
    flags = dict(HAS_WEIGHT=True, CAST_BEFORE_WEIGHT=True, RNE_BY_BITS=False, NB=nb, CHUNK=chunk)
    sms = launch.num_sms(x.device)
    for st, per, wp in itertools.product((3, 4, 5), (2, 3, 4, 6), (4, 8)):
        g = min(m, sms * per)
        fn = lambda a=(st, g, wp): k._rms_norm_fwd_tma_kernel[(a[1],)](  # noqa: E731
            desc, w, y, m, d, 1e-6, 0.0, NUM_STAGES=a[0], num_warps=a[2], **flags)
        try:
            y.zero_()
            compiled = fn()
            torch.cuda.synchronize()
            bad = (y.float() - ref.float()).abs().max().item()
        except Exception as exc:
            print(f"fwd tma stages={st} per_sm={per} warps={wp}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        smem = getattr(compiled.metadata, "shared", -1) >> 10
        t("fwd", f"tma stages={st} per_sm={per} warps={wp} smem={smem}K err={bad:.0e}", fn, fb)

    grid, bm, bn, bw, bs, rw = launch.bwd_launch(m, d, 2, x.device)
    partial = torch.empty(grid, d, device="cuda", dtype=torch.float32)
    t("bwd", "shipped", lambda: k._rms_norm_backward(dy, x, w, 1e-6, 0.0, True), bb)
    for st in (2, 3, 4, 5):
        t("bwd", f"row kernel stages={st}{' (shipped)' if st == bs else ''}", lambda st=st: k._rms_norm_bwd_kernel[(grid,)](
            dy, x, w, dx, partial, m, d, d, 1e-6, 0.0, HAS_WEIGHT=True, COMPUTE_DW=True, ROUND=0, RNE_BY_BITS=False,
            RELOAD_W=rw, BLOCK_M=bm, BLOCK_N=bn, NUM_STAGES=st, num_warps=bw), bb)
    print(f"\n### {m}x{d} bf16, ceiling {ceiling:.0f} GB/s", flush=True)
    for r in sorted(res, key=lambda r: (r[0], r[2])):
        print(f"{r[0]} {r[1]:58s} {r[2] * 1e3:7.1f} us {r[3]:5.1f}%", flush=True)


def ab(m: int, d: int, ceiling: float, reps: int) -> None:
    """fwd and fwd+bwd (autograd, as bench_rms_norm.py times it) with the TMA row forward on and off,
    each captured once and replayed in alternation, so drift between calls hits both alike."""
    from fxfuse.kernels import _rms_norm_launch as launch
    from fxfuse.kernels.rms_norm import rms_norm

    x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = torch.nn.Parameter(torch.randn(d, device="cuda", dtype=torch.bfloat16))
    dy = torch.randn_like(x)
    on = launch.fwd_tma
    graphs = {}
    for name, choice in (("tma", on), ("copies", lambda d, elem, device: False)):
        launch.fwd_tma = choice
        launch.fwd_launch.cache_clear()
        launch.fwd_tma_launch.cache_clear()

        def step():
            x.grad = w.grad = None
            rms_norm(x, w, 1e-6, 0.0, True, x.dtype).backward(dy)

        graphs[name, "fwd"] = graphed(lambda: rms_norm(x.detach(), w.detach(), 1e-6, 0.0, True, x.dtype))
        graphs[name, "fwd+bwd"] = graphed(step)
    launch.fwd_tma = on
    times = {key: [] for key in graphs}
    for _ in range(reps):
        for key, replay in graphs.items():
            times[key].append(bench_ms(replay, warmup_ms=25, rep_ms=100))
    nbytes = {"fwd": 2 * m * d * 2, "fwd+bwd": 5 * m * d * 2}
    print(f"\n### A/B {m}x{d} bf16, {reps} alternating reps, ceiling {ceiling:.0f} GB/s", flush=True)
    for (name, kind), ts in times.items():
        med = sorted(ts)[len(ts) // 2]
        print(f"{kind:8s} {name:7s} median {med * 1e3:6.1f} us ({100 * nbytes[kind] / med / 1e6 / ceiling:4.1f}%)"
              f"  min {min(ts) * 1e3:6.1f}  max {max(ts) * 1e3:6.1f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["4096x8192", "2048x16384", "16384x4096"])
    p.add_argument("--ab", type=int, default=0, metavar="REPS",
                   help="only the A/B of the TMA forward on/off, REPS alternating reps per shape")
    args = p.parse_args()
    ceiling = copy_ceiling_gbps()
    for shape in args.shapes:
        m, d = (int(s) for s in shape.lower().split("x"))
        ab(m, d, ceiling, args.ab) if args.ab else probe(m, d, ceiling)


if __name__ == "__main__":
    main()
