"""RMSNorm row kernels with fewer block-wide reductions per row (A/B against the shipped kernels).

    python bench/probe_rms_onesum.py --shapes 4096x8192 16384x4096 --reps 9
    python bench/probe_rms_onesum.py --shapes 4096x8192 --sweep     # + warps / stages / 2-row tiles

The row backward (kernels/rms_norm.py) reduced sum(x * x) for rstd, then sum(g * xhat), which needs
rstd: two block-wide reductions in a row, each a shared-memory round trip with barriers, while the
one program per SM (8 warps at 8K-element rows) issues no stores. Since
sum(g * xhat) = rstd * sum(g * xf), both sums can come from the loaded row at once:

    sxx, sgx = sum(xf * xf), sum(g * xf)          (one reduction of a pair, or two independent sums)
    rstd = 1 / sqrt(sxx / D + eps)    c = sgx * rstd / D    dx = rstd * (g - xf * rstd * c)

(the split kernel's formula, kernels/_rms_norm_split.py). Candidates, each the row kernel plus the
shipped dw reduction at the shipped launch, captured in CUDA graphs and timed round robin (every
rep times every candidate once), median over reps:
  dependent     _rms_norm_bwd_kernel with INDEPENDENT_SUMS off (what ran before this probe)
  independent   _rms_norm_bwd_kernel with INDEPENDENT_SUMS on (two tl.sum of independent operands;
                launch.bwd_independent_sums picks it for 8K-lane rows)
  pair          this file's kernel: one tl.reduce over the pair (xf * xf, g * xf)
dx and dw of each candidate are compared with the first's. With --sweep, also:
  independent w=.. s=..         the independent sums at other warps / stages
  fwd shipped                   the shipped forward (kernels/_rms_norm_launch.py fwd_launch)
  fwd tile m=.. w=.. s=.. p=..  a persistent forward over [m, D] tiles of rows: one reduction (and
                                its barriers) per m rows; p programs per SM
Only reports.
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_ms, copy_ceiling_gbps, graphed  # noqa: E402
from tune_rms_norm import bwd_bytes, fwd_bytes  # noqa: E402


@triton.jit
def _add_pair(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _bwd_pair_kernel(
    dy_ptr,  # [M, D] dy.dtype, contiguous
    x_ptr,  # [M, D] x.dtype, contiguous
    w_ptr,  # [D] weight.dtype
    dx_ptr,  # [M, D] x.dtype, contiguous
    dw_partial_ptr,  # [P, D] fp32
    M,
    D,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    # The shipped row kernel's math without offset, rounding options or masks on the weight.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < D
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for row_block in tl.range(pid, tl.cdiv(M, BLOCK_M), tl.num_programs(0), num_stages=NUM_STAGES):
        rows64 = (row_block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (rows64 < M)[:, None] & col_mask[None, :]
        offs = rows64[:, None] * D + cols[None, :]
        xf = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dyf = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = dyf * w
        sxx, sgx = tl.reduce((xf * xf, g * xf), 1, _add_pair)
        rstd = tl.math.rsqrt(sxx / D + eps)
        xhat = xf * rstd[:, None]
        dx = rstd[:, None] * (g - xhat * (sgx * rstd / D)[:, None])
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += dyf * xhat
    tl.store(dw_partial_ptr + pid.to(tl.int64) * D + cols, tl.sum(dw_acc, axis=0), mask=col_mask)


@triton.jit
def _fwd_tiles_kernel(
    x_ptr,  # [M, D] x.dtype, contiguous
    w_ptr,  # [D] weight.dtype
    y_ptr,  # [M, D] x.dtype, contiguous
    M,
    D,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    # Llama's order (cast before weight), no offset: the shipped forward's math on [BLOCK_M, D] tiles.
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < D
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    for tile in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.num_programs(0), num_stages=NUM_STAGES):
        rows64 = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (rows64 < M)[:, None] & col_mask[None, :]
        offs = rows64[:, None] * D + cols[None, :]
        xf = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1, keep_dims=True) / D + eps)
        xhat = (xf * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)
        tl.store(y_ptr + offs, (xhat * w).to(y_ptr.dtype.element_ty), mask=mask)


def fwd_candidates(m, d, x, w):
    """name -> fn() returning y: the shipped forward and persistent [BLOCK_M, D]-tile forwards."""
    from fxfuse.kernels import _rms_norm_launch as launch
    from fxfuse.kernels import rms_norm as k

    bn = launch.block_n(d)
    sms = launch.num_sms(x.device)

    def make(kind, *cfg):
        y = torch.empty_like(x)

        def fn():
            if kind == "shipped":
                return k._rms_norm(x, w, 1e-6, 0.0, True, x.dtype)
            bm, warps, stages, per_sm = cfg
            _fwd_tiles_kernel[(min(triton.cdiv(m, bm), sms * per_sm),)](
                x, w, y, m, d, 1e-6, BLOCK_M=bm, BLOCK_N=bn, NUM_STAGES=stages, num_warps=warps)
            return y
        return fn

    fns = {"fwd shipped": make("shipped")}
    for bm, warps, stages, per_sm in itertools.product((1, 2), (4, 8), (2, 3, 4), (1, 2, 3)):
        if stages * bm * bn * x.element_size() * per_sm <= 224 << 10:  # staged rows fit shared memory
            fns[f"fwd tile m={bm} w={warps} s={stages} p={per_sm}"] = make("tile", bm, warps, stages, per_sm)
    return fns


def candidates(m, d, x, dy, w, sweep=False):
    """name -> fn() returning (dx, dw) in the candidate's own buffers."""
    from fxfuse.kernels import _rms_norm_launch as launch
    from fxfuse.kernels import rms_norm as k
    from fxfuse.kernels._rms_norm_dw import _dw_reduce_kernel

    grid, bm, bn, warps, stages = launch.bwd_launch(m, d, x.element_size(), x.device)
    red, bp, bd = launch.dw_launch(grid, d)

    def make(kind, warps=warps, stages=stages):
        dx, dw = torch.empty_like(x), torch.empty_like(w)
        partial = torch.empty((grid, d), device=x.device, dtype=torch.float32)

        def fn():
            if kind == "pair":
                _bwd_pair_kernel[(grid,)](dy, x, w, dx, partial, m, d, 1e-6, BLOCK_M=bm, BLOCK_N=bn,
                                          NUM_STAGES=stages, num_warps=warps)
            else:
                k._rms_norm_bwd_kernel[(grid,)](
                    dy, x, w, dx, partial, m, d, d, 1e-6, 0.0, HAS_WEIGHT=True, COMPUTE_DW=True, ROUND=0,
                    RNE_BY_BITS=False, INDEPENDENT_SUMS=kind == "independent", BLOCK_M=bm, BLOCK_N=bn,
                    NUM_STAGES=stages, num_warps=warps)
            _dw_reduce_kernel[(red,)](partial, dw, grid, d, RNE_BY_BITS=False, BLOCK_P=bp, BLOCK_D=bd)
            return dx, dw
        return fn

    launch_tag = f"grid {grid}, [{bm}, {bn}], {warps} warps, {stages} stages"
    fns = {name: make(name) for name in ("dependent", "independent", "pair")}
    if sweep:
        for wp, st in itertools.product((8, 16), (2, 3, 4)):
            if (wp, st) != (warps, stages):
                fns[f"independent w={wp} s={st}"] = make("independent", wp, st)
    return fns, launch_tag


def report(title, fns, nbytes, ceiling, reps):
    """Compare every candidate's outputs with the first's, then time them round robin."""
    names = list(fns)
    ref = [t.float() for t in _as_tuple(fns[names[0]]())]
    for name in names[1:]:
        errs = [(o.float() - r).abs().max().item() / max(r.abs().max().item(), 1e-30)
                for o, r in zip(_as_tuple(fns[name]()), ref)]
        print(f"{title} {name}: max relative difference to {names[0]} " + ", ".join(f"{e:.2e}" for e in errs))
    graphs = {name: graphed(fn) for name, fn in fns.items()}
    times = {name: [] for name in graphs}
    for _ in range(reps):
        for name, g in graphs.items():
            times[name].append(bench_ms(g, warmup_ms=10, rep_ms=80) * 1e3)
    print(f"### {title}")
    for name, t in sorted(times.items(), key=lambda kv: statistics.median(kv[1])):
        med = statistics.median(t)
        print(f"{name:34s} {med:7.1f} us (min {min(t):.1f} max {max(t):.1f})  "
              f"{nbytes / med / 1e3:6.0f} GB/s {100 * nbytes / med / 1e3 / ceiling:5.1f}%", flush=True)


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["4096x8192", "16384x4096"])
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--sweep", action="store_true", help="also warps / stages and the tiled forward")
    args = p.parse_args()
    ceiling = copy_ceiling_gbps()
    print(f"ceiling {ceiling:.0f} GB/s", flush=True)
    for shape in args.shapes:
        m, d = (int(v) for v in shape.split("x"))
        x, dy = (torch.randn(m, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        w = torch.randn(d, device="cuda", dtype=torch.bfloat16)
        fns, tag = candidates(m, d, x, dy, w, args.sweep)
        report(f"{shape} bf16 backward (row kernel + dw reduction), shipped launch {tag}", fns,
               bwd_bytes(m, d, 2), ceiling, args.reps)
        if args.sweep:
            y = torch.empty_like(x)
            same = 2 * x.numel() * 2 / bench_ms(graphed(lambda: y.copy_(x))) / 1e6
            report(f"{shape} bf16 forward (same-size copy {same:.0f} GB/s, {100 * same / ceiling:.1f}%)",
                   fwd_candidates(m, d, x, w), fwd_bytes(m, d, 2), ceiling, args.reps)


if __name__ == "__main__":
    main()
