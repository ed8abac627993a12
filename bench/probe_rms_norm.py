"""Kernel-structure probe for RMSNorm at wide rows (4096x8192 bf16): where do the last us go?

    python bench/probe_rms_norm.py                      # 4096x8192, 16384x4096, 2048x16384
    python bench/probe_rms_norm.py --shapes 4096x8192

tune_rms_norm.py sweeps launch parameters of the shipped kernels; this script times kernel
*structures* against them in one process, each under CUDA-graph replay and against the copy
ceiling and a same-size copy:
  fwd  shipped            kernels/rms_norm.py's forward at its chosen launch (kernels/_rms_norm_launch.py)
  fwd  rows warps=..       the persistent row forward at other warps / programs per SM
  fwd  tile               the one-tile-per-program forward (what wide rows ran before the row kernel)
  bwd  shipped            row kernel + dw reduction kernel, as shipped
  bwd  no-reduce          the row kernel alone (what the dw reduction adds to the pair)
  bwd  no-dw              the row kernel with COMPUTE_DW=False (what the dw partial sums cost)
  bwd  no-reduce warps=..  the row kernel at other warps / stages, w held in registers or re-read per row
  bwd  reduce BLOCK_D=..  row kernel + the reduction at other [BLOCK_P, BLOCK_D] tiles and warps
  red  ...                the reduction alone at each tile
The first round (commit fed1cff: 1-D row kernels, dw folded in by fp32 atomics, a PDL-launched
reduction) is in bench/RESULTS.md. Only reports; nothing here is used by fxfuse.
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
from tune_rms_norm import bwd_bytes, fwd_bytes  # noqa: E402


def _time(label, fn, nbytes, rows, kind):
    try:
        ms = bench_ms(graphed(fn))
    except Exception as exc:  # a config that does not compile or capture is reported, never fatal
        print(f"{kind} {label}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
        return
    rows.append((kind, label, ms, nbytes / ms / 1e6))


def probe(m: int, d: int, ceiling: float, args) -> None:
    from fxfuse.kernels import _rms_norm_launch as launch
    from fxfuse.kernels import rms_norm as k
    from fxfuse.kernels._rms_norm_dw import _dw_reduce_kernel

    dt = torch.bfloat16
    x, dy = (torch.randn(m, d, device="cuda", dtype=dt) for _ in range(2))
    w = torch.randn(d, device="cuda", dtype=dt)
    y, dx = torch.empty_like(x), torch.empty_like(x)
    dw = torch.empty(d, device="cuda", dtype=dt)
    fb, bb = fwd_bytes(m, d, 2), bwd_bytes(m, d, 2)
    rows: list = []
    flags = dict(HAS_WEIGHT=True, CAST_BEFORE_WEIGHT=True, RNE_BY_BITS=False)

    persistent, programs, bm, bn, warps, stages = launch.fwd_launch(m, d, 2, x.device)
    if persistent:
        shipped_fwd = lambda: k._rms_norm_fwd_rows_kernel[(programs,)](  # noqa: E731
            x, w, y, m, d, d, 1e-5, 0.0, BLOCK_N=bn, NUM_STAGES=stages, num_warps=warps, **flags)
    else:
        shipped_fwd = lambda: k._rms_norm_fwd_kernel[(programs,)](  # noqa: E731
            x, w, y, m, d, d, 1e-5, 0.0, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, **flags)
    _time(f"shipped warps={warps} stages={stages} grid={programs}", shipped_fwd, fb, rows, "fwd")
    for wp, per in itertools.product(args.warps, (1, 2, 4)):
        g = min(m, launch.num_sms(x.device) * per)
        _time(f"rows warps={wp} stages={stages} per_sm={per}", lambda wp=wp, g=g: k._rms_norm_fwd_rows_kernel[(g,)](
            x, w, y, m, d, d, 1e-5, 0.0, BLOCK_N=bn, NUM_STAGES=stages, num_warps=wp, **flags), fb, rows, "fwd")
    tbm = launch.block_m(bn, m)
    for wp in args.warps:
        _time(f"tile warps={wp}", lambda wp=wp: k._rms_norm_fwd_kernel[(triton.cdiv(m, tbm),)](
            x, w, y, m, d, d, 1e-5, 0.0, BLOCK_M=tbm, BLOCK_N=bn, num_warps=wp, **flags), fb, rows, "fwd")

    grid, bm, bn, bw, bs = launch.bwd_launch(m, d, 2, x.device)
    partial = torch.empty(grid, d, device="cuda", dtype=torch.float32)

    def row_kernel(compute_dw=True, warps=bw, stages=bs):
        k._rms_norm_bwd_kernel[(grid,)](
            dy, x, w, dx, partial, m, d, d, 1e-5, 0.0, HAS_WEIGHT=True, COMPUTE_DW=compute_dw, ROUND=0,
            RNE_BY_BITS=False, INDEPENDENT_SUMS=launch.bwd_independent_sums(bn), BLOCK_M=bm, BLOCK_N=bn,
            NUM_STAGES=stages, num_warps=warps)

    def reduce(red, bp, bd, wp):
        _dw_reduce_kernel[(red,)](partial, dw, grid, d, RNE_BY_BITS=False, BLOCK_P=bp, BLOCK_D=bd, num_warps=wp)

    red, bp, bd = launch.dw_launch(grid, d)
    tag = f"warps={bw} stages={bs} grid={grid}"
    _time(f"shipped {tag} reduce [{bp}, {bd}] x {red}", lambda: (row_kernel(), reduce(red, bp, bd, 4)), bb, rows, "bwd")
    _time(f"no-reduce {tag}", row_kernel, bb, rows, "bwd")
    _time(f"no-dw {tag}", lambda: row_kernel(compute_dw=False), bb, rows, "bwd")
    for wp, st in itertools.product((8, 16, 32), (2, 3)):
        _time(f"no-reduce warps={wp} stages={st}", lambda a=(wp, st): row_kernel(True, *a), bb, rows, "bwd")
    for bd2, cap, wp in itertools.product((16, 32), (8192, 16384), (4,)):
        bp2 = max(1, min(triton.next_power_of_2(grid), cap // bd2))
        red2 = triton.cdiv(d, bd2)
        label = f"[{bp2}, {bd2}] x {red2} warps={wp}"
        _time(f"reduce {label}", lambda a=(red2, bp2, bd2, wp): (row_kernel(), reduce(*a)), bb, rows, "bwd")
        _time(label, lambda a=(red2, bp2, bd2, wp): reduce(*a), grid * d * 4, rows, "red")
    _time(f"old [32, 128] x {triton.cdiv(d, 128)} (before this probe)",
          lambda: reduce(triton.cdiv(d, 128), 32, 128, 4), grid * d * 4, rows, "red")

    same = 2 * x.numel() * 2 / bench_ms(graphed(lambda: y.copy_(x))) / 1e6
    print(f"\n### {m}x{d} bf16, ceiling {ceiling:.0f} GB/s, same-size copy {same:.0f} GB/s "
          f"({100 * same / ceiling:.1f}%)", flush=True)
    for kind in ("fwd", "bwd", "red"):
        for r in sorted((r for r in rows if r[0] == kind), key=lambda r: r[2])[: args.top]:
            print(f"{kind} {r[1]:48s} {r[2] * 1e3:8.1f} us {r[3]:7.0f} GB/s {100 * r[3] / ceiling:5.1f}%")
        for r in (r for r in rows if r[0] == kind and r[1].startswith(("shipped", "no-", "old"))):
            print(f"{kind} [ref] {r[1]:42s} {r[2] * 1e3:8.1f} us {100 * r[3] / ceiling:5.1f}%")
    print(flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["4096x8192", "16384x4096", "2048x16384"])
    p.add_argument("--warps", type=int, nargs="+", default=(4, 8, 16), help="one-tile forward's num_warps")
    p.add_argument("--top", type=int, default=6)
    args = p.parse_args()
    ceiling = copy_ceiling_gbps()
    for shape in args.shapes:
        m, d = (int(s) for s in shape.lower().split("x"))
        probe(m, d, ceiling, args)


if __name__ == "__main__":
    main()
