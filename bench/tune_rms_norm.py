"""Launch-parameter sweep of fxfuse's RMSNorm kernels (GPU time under CUDA-graph replay).

    python bench/tune_rms_norm.py                          # 4096x8192 and 16384x4096, bf16
    python bench/tune_rms_norm.py --shapes 4096x8192 --top 5
    python bench/tune_rms_norm.py --shapes 4096x8192 --bwd-warps 8 16 --bwd-stages 3 4   # a smaller grid

Times the forward kernel (one program per row block, or the persistent row kernel with programs
per SM and num_stages rows in flight) and the backward (row kernel + dw reduction) separately for every
(num_warps[, num_stages, programs per SM]) and (num_warps, num_stages, programs per SM) in the
grids below, and prints each configuration's GB/s against a copy ceiling measured in the same
process, best first. The chosen values go into kernels/rms_norm.py's named tuning functions; this
script only reports.
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

FWD_WARPS = (2, 4, 8, 16)
FWD_STAGES = (2, 3)  # persistent forward: row blocks in flight per program
FWD_PROGRAMS_PER_SM = (0, 2, 4)  # 0: one program per row block (not persistent)
BWD_WARPS = (4, 8, 16, 32)
BWD_STAGES = (2, 3, 4)
BWD_PROGRAMS_PER_SM = (1, 2)
ROWS_PER_TILE = (1, 2, 4)  # BLOCK_M multiples of the default: more bytes in flight per program


def fwd_bytes(m: int, d: int, elem: int) -> int:
    return 2 * m * d * elem  # read x, write y


def bwd_bytes(m: int, d: int, elem: int) -> int:
    return 3 * m * d * elem  # read x and dy, write dx (the [P, D] fp32 partials are ~1% more)


def sweep(m: int, d: int, dtype: torch.dtype, ceiling: float, top: int, grid: argparse.Namespace) -> None:
    from fxfuse.kernels import _rms_norm_launch as launch
    from fxfuse.kernels import rms_norm as k

    x = torch.randn(m, d, device="cuda", dtype=dtype)
    w = torch.randn(d, device="cuda", dtype=dtype)
    dy = torch.randn(m, d, device="cuda", dtype=dtype)
    y, dx = torch.empty_like(x), torch.empty_like(x)
    dw = torch.empty(d, device="cuda", dtype=dtype)
    block_n = launch.block_n(d)
    sms = launch.num_sms(x.device)
    elem = x.element_size()
    base_m = launch.block_m(block_n, m)
    rows = []
    for rows_per_tile in grid.rows_per_tile:
        block_m = base_m * rows_per_tile
        rows += _sweep_tile(k, m, d, x, w, dy, y, dx, dw, block_m, block_n, sms, elem, grid)
    _print(launch, m, d, dtype, ceiling, top, rows, x.device, elem, block_n)


def _sweep_tile(k, m, d, x, w, dy, y, dx, dw, block_m, block_n, sms, elem, grid) -> list:
    from fxfuse.kernels import _rms_norm_launch as launch
    from fxfuse.kernels._rms_norm_dw import _dw_reduce_kernel

    rows = []
    blocks = triton.cdiv(m, block_m)
    # persistent (row kernel) only for one row per tile; per_sm 0: one program per tile
    fwd_grid = [(blocks, 1, 0)] + [(min(m, sms * per_sm), stages, per_sm) for per_sm in grid.fwd_per_sm
                                   if per_sm and block_m == 1 for stages in grid.fwd_stages]
    for warps, (programs, stages, per_sm) in itertools.product(grid.fwd_warps, fwd_grid):
        def fwd(warps=warps, programs=programs, stages=stages, per_sm=per_sm):
            flags = dict(HAS_WEIGHT=True, CAST_BEFORE_WEIGHT=True, RNE_BY_BITS=False, BLOCK_N=block_n,
                         num_warps=warps)
            if per_sm:
                k._rms_norm_fwd_rows_kernel[(programs,)](x, w, y, m, d, x.stride(0), 1e-5, 0.0,
                                                         NUM_STAGES=stages, **flags)
            else:
                k._rms_norm_fwd_kernel[(programs,)](x, w, y, m, d, x.stride(0), 1e-5, 0.0, BLOCK_M=block_m, **flags)
        label = f"BLOCK_M={block_m} warps={warps}" + (f" persistent stages={stages} per_sm={per_sm}" if per_sm else "")
        try:
            ms = bench_ms(graphed(fwd))
        except Exception as exc:  # a config that does not compile (registers, shared memory) is reported
            print(f"fwd {label}: {type(exc).__name__}: {str(exc)[:100]}")
            continue
        rows.append(("fwd", label, ms, fwd_bytes(m, d, elem) / ms / 1e6))
    for warps, stages, per_sm in itertools.product(grid.bwd_warps, grid.bwd_stages, grid.per_sm):
        grid = max(1, min(triton.cdiv(m, block_m), sms * per_sm))
        partial = torch.empty(grid, d, device="cuda", dtype=torch.float32)
        red, block_p, block_d = launch.dw_launch(grid, d)

        def bwd(warps=warps, stages=stages, grid=grid, partial=partial, red=red, block_p=block_p, block_d=block_d):
            k._rms_norm_bwd_kernel[(grid,)](
                dy, x, w, dx, partial, m, d, x.stride(0), 1e-5, 0.0, HAS_WEIGHT=True, COMPUTE_DW=True,
                ROUND=0, RNE_BY_BITS=False, INDEPENDENT_SUMS=launch.bwd_independent_sums(block_n), BLOCK_M=block_m,
                BLOCK_N=block_n, NUM_STAGES=stages, num_warps=warps)
            _dw_reduce_kernel[(red,)](partial, dw, grid, d, RNE_BY_BITS=False, BLOCK_P=block_p, BLOCK_D=block_d)
        try:
            ms = bench_ms(graphed(bwd))
        except Exception as exc:
            print(f"bwd warps={warps} stages={stages} per_sm={per_sm}: {type(exc).__name__}: {str(exc)[:100]}")
            continue
        rows.append(("bwd", f"BLOCK_M={block_m} warps={warps} stages={stages} per_sm={per_sm} grid={grid}", ms,
                     bwd_bytes(m, d, elem) / ms / 1e6))
    return rows


def _print(launch, m, d, dtype, ceiling, top, rows, device, elem, block_n) -> None:
    same = _copy_gbps(fwd_bytes(m, d, elem) // 2)
    print(f"\n### {m}x{d} {dtype}, BLOCK_N={block_n}, ceiling {ceiling:.0f} GB/s "
          f"(a copy of one [{m}, {d}] tensor: {same:.0f} GB/s, {100 * same / ceiling:.1f}%)")
    for kind in ("fwd", "bwd"):
        ranked = sorted((r for r in rows if r[0] == kind), key=lambda r: r[2])
        cur = _current(launch, kind, m, d, elem, device)
        for r in ranked[:top]:
            print(f"{kind} {r[1]:42s} {r[2] * 1e3:8.1f} us {r[3]:7.0f} GB/s {100 * r[3] / ceiling:5.1f}%")
        print(f"{kind} current: {cur}")
    best = {kind: min((r for r in rows if r[0] == kind), key=lambda r: r[2]) for kind in ("fwd", "bwd")}
    total = (fwd_bytes(m, d, elem) + bwd_bytes(m, d, elem)) / (best["fwd"][2] + best["bwd"][2]) / 1e6
    print(f"best fwd+bwd: {best['fwd'][2] * 1e3 + best['bwd'][2] * 1e3:.1f} us, {100 * total / ceiling:.1f}% of ceiling")


def _copy_gbps(nbytes: int) -> float:
    """Copy bandwidth (read + write) at this op's size: how much of the 2 GiB ceiling a transfer this
    small can reach at all (launch and tail effects)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / bench_ms(graphed(lambda: dst.copy_(src))) / 1e6


def _current(launch, kind: str, m: int, d: int, elem: int, device) -> str:
    if kind == "fwd":
        persistent, programs, _, _, warps, stages = launch.fwd_launch(m, d, elem, device)
        return f"warps={warps} stages={stages} grid={programs}" + (" persistent" if persistent else "")
    grid, _, _, warps, stages = launch.bwd_launch(m, d, elem, device)
    return f"warps={warps} stages={stages} grid={grid}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["4096x8192", "16384x4096"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--top", type=int, default=6)
    p.add_argument("--fwd-warps", type=int, nargs="+", default=FWD_WARPS)
    p.add_argument("--fwd-stages", type=int, nargs="+", default=FWD_STAGES)
    p.add_argument("--fwd-per-sm", type=int, nargs="+", default=FWD_PROGRAMS_PER_SM,
                   help="forward programs per SM (0: one per row block)")
    p.add_argument("--bwd-warps", type=int, nargs="+", default=BWD_WARPS)
    p.add_argument("--bwd-stages", type=int, nargs="+", default=BWD_STAGES)
    p.add_argument("--per-sm", type=int, nargs="+", default=BWD_PROGRAMS_PER_SM, help="backward programs per SM")
    p.add_argument("--rows-per-tile", type=int, nargs="+", default=ROWS_PER_TILE)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    ceiling = copy_ceiling_gbps()
    for shape in args.shapes:
        m, d = (int(s) for s in shape.lower().split("x"))
        sweep(m, d, dtype, ceiling, args.top, args)


if __name__ == "__main__":
    main()
