"""Kernel-structure probe for RMSNorm at wide rows (4096x8192 bf16): where do the last us go?

    python bench/probe_rms_norm.py                      # 4096x8192 and 16384x4096
    python bench/probe_rms_norm.py --shapes 4096x8192

tune_rms_norm.py sweeps launch parameters of the shipped kernels; this script times candidate
kernel *structures* against them in one process, each under CUDA-graph replay and against the copy
ceiling and a same-size copy:
  fwd  shipped            kernels/rms_norm.py's forward at its chosen launch
  fwd  row1d              persistent, one 1-D row per step (no row mask, scalar row offset)
  bwd  shipped            row kernel + dw reduction kernel, as shipped
  bwd  shipped-no-reduce  the row kernel alone (what the dw reduction launch costs)
  bwd  no-dw              the row kernel with COMPUTE_DW=False (what the dw partial sums cost)
  bwd  pdl                shipped, the reduction launched as a programmatic dependent (Hopper PDL)
  bwd  row1d              persistent 1-D row backward + the shipped reduction
  bwd  atomic             1-D row backward folding dw in: fp32 atomics into a zeroed [D] buffer,
                          the last program (atomic ticket) rounds to weight.dtype (non-deterministic
                          sum order: measured to price the reduction launch, not a shipping candidate)
Only reports; nothing here is used by fxfuse.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_ms, copy_ceiling_gbps, graphed  # noqa: E402
from tune_rms_norm import bwd_bytes, fwd_bytes  # noqa: E402


@triton.jit
def _fwd_row1d(
    x_ptr,  # [M, D] bf16, contiguous
    w_ptr,  # [D] bf16
    y_ptr,  # [M, D] bf16, contiguous
    M, D, eps,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_N)
    mask = cols < D
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    for row in tl.range(tl.program_id(0), M, tl.num_programs(0), num_stages=NUM_STAGES):
        off = row * D  # int32: the probed shapes stay below 2**31 elements
        xf = tl.load(x_ptr + off + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
        y = (xf * rstd).to(y_ptr.dtype.element_ty).to(tl.float32) * w
        tl.store(y_ptr + off + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_row1d(
    dy_ptr,  # [M, D] bf16, contiguous
    x_ptr,  # [M, D] bf16, contiguous
    w_ptr,  # [D] bf16
    dx_ptr,  # [M, D] bf16, contiguous
    partial_ptr,  # [P, D] fp32 (ATOMIC False) or [D] fp32 zeroed accumulator (ATOMIC True)
    counter_ptr,  # [1] int32 zeroed (ATOMIC True only)
    dw_ptr,  # [D] bf16 (ATOMIC True only)
    M, D, eps,
    ATOMIC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < D
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for row in tl.range(pid, M, tl.num_programs(0), num_stages=NUM_STAGES):
        off = row * D  # int32: the probed shapes stay below 2**31 elements
        xf = tl.load(x_ptr + off + cols, mask=mask, other=0.0).to(tl.float32)
        dyf = tl.load(dy_ptr + off + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
        xhat = xf * rstd
        g = dyf * w
        c = tl.sum(g * xhat, axis=0) / D
        tl.store(dx_ptr + off + cols, (rstd * (g - xhat * c)).to(dx_ptr.dtype.element_ty), mask=mask)
        acc += dyf * xhat
    if ATOMIC:
        tl.atomic_add(partial_ptr + cols, acc, mask=mask)
        tl.debug_barrier()
        ticket = tl.atomic_add(counter_ptr, 1)
        if ticket == tl.num_programs(0) - 1:
            total = tl.load(partial_ptr + cols, mask=mask, cache_modifier=".cg")
            tl.store(dw_ptr + cols, total.to(dw_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(partial_ptr + pid.to(tl.int64) * D + cols, acc, mask=mask)


@triton.jit
def _dw_reduce_pdl(
    partial_ptr,  # [P, D] fp32
    dw_ptr,  # [D] bf16
    P, D,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tl.extra.cuda.gdc_wait()  # the primary (row kernel) grid has finished and flushed its partials
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        ps = p0 + tl.arange(0, BLOCK_P)
        m = (ps < P)[:, None] & col_mask[None, :]
        acc += tl.sum(tl.load(partial_ptr + ps[:, None] * D + cols[None, :], mask=m, other=0.0), axis=0)
    tl.store(dw_ptr + cols, acc.to(dw_ptr.dtype.element_ty), mask=col_mask)


def _time(label, fn, nbytes, rows, kind):
    try:
        ms = bench_ms(graphed(fn))
    except Exception as exc:  # a config that does not compile or capture is reported, never fatal
        print(f"{kind} {label}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
        return
    rows.append((kind, label, ms, nbytes / ms / 1e6))


def probe(m: int, d: int, ceiling: float, args) -> None:
    from fxfuse.kernels import rms_norm as k

    dt = torch.bfloat16
    x, dy = (torch.randn(m, d, device="cuda", dtype=dt) for _ in range(2))
    w = torch.randn(d, device="cuda", dtype=dt)
    y, dx = torch.empty_like(x), torch.empty_like(x)
    dw = torch.empty(d, device="cuda", dtype=dt)
    sms = k._num_sms(x.device)
    fb, bb = fwd_bytes(m, d, 2), bwd_bytes(m, d, 2)
    rows: list = []

    programs, bm, bn, warps, stages = k._fwd_launch(m, d, x.device)
    def fwd_shipped():
        k._rms_norm_fwd_kernel[(programs,)](
            x, w, y, m, d, d, 1e-5, 0.0, HAS_WEIGHT=True, CAST_BEFORE_WEIGHT=True,
            BLOCK_M=bm, BLOCK_N=bn, NUM_STAGES=stages, num_warps=warps)

    _time(f"shipped warps={warps} stages={stages} grid={programs}", fwd_shipped, fb, rows, "fwd")
    for wp, st, per in itertools.product(args.warps, args.stages, args.per_sm):
        g = min(m, sms * per)
        _time(f"row1d warps={wp} stages={st} per_sm={per}", lambda wp=wp, st=st, g=g: _fwd_row1d[(g,)](
            x, w, y, m, d, 1e-5, BLOCK_N=bn, NUM_STAGES=st, num_warps=wp), fb, rows, "fwd")

    grid, bm, bn, bw = k._bwd_launch(m, d, x.device)
    bs = k._bwd_num_stages()
    partial = torch.empty(grid, d, device="cuda", dtype=torch.float32)
    red = triton.cdiv(d, k._DW_BLOCK_D)

    def row_kernel(compute_dw=True, pdl=False):
        k._rms_norm_bwd_kernel[(grid,)](
            dy, x, w, dx, partial, m, d, d, 1e-5, 0.0, HAS_WEIGHT=True, COMPUTE_DW=compute_dw,
            ROUND=0, RNE_BY_BITS=False, BLOCK_M=bm, BLOCK_N=bn, NUM_STAGES=bs, num_warps=bw)

    def shipped():
        row_kernel()
        k._dw_reduce_kernel[(red,)](partial, dw, grid, d, BLOCK_P=k._DW_BLOCK_P, BLOCK_D=k._DW_BLOCK_D)

    def pdl():
        row_kernel()
        _dw_reduce_pdl[(red,)](partial, dw, grid, d, BLOCK_P=k._DW_BLOCK_P, BLOCK_D=k._DW_BLOCK_D, launch_pdl=True)

    tag = f"warps={bw} stages={bs} grid={grid}"
    _time(f"shipped {tag}", shipped, bb, rows, "bwd")
    _time(f"shipped-no-reduce {tag}", row_kernel, bb, rows, "bwd")
    _time(f"no-dw {tag}", lambda: row_kernel(compute_dw=False), bb, rows, "bwd")
    _time(f"pdl {tag}", pdl, bb, rows, "bwd")
    _time("dw-reduce alone", lambda: k._dw_reduce_kernel[(red,)](
        partial, dw, grid, d, BLOCK_P=k._DW_BLOCK_P, BLOCK_D=k._DW_BLOCK_D), grid * d * 4, rows, "red")
    acc = torch.zeros(d + 1, device="cuda", dtype=torch.float32)
    counter = torch.zeros(1, device="cuda", dtype=torch.int32)
    for wp, st, per in itertools.product(args.bwd_warps, args.stages, (1, 2)):
        g = min(m, sms * per)
        part = torch.empty(g, d, device="cuda", dtype=torch.float32)

        def row1d(wp=wp, st=st, g=g, part=part):
            _bwd_row1d[(g,)](dy, x, w, dx, part, counter, dw, m, d, 1e-5, ATOMIC=False,
                             BLOCK_N=bn, NUM_STAGES=st, num_warps=wp)
            k._dw_reduce_kernel[(red,)](part, dw, g, d, BLOCK_P=k._DW_BLOCK_P, BLOCK_D=k._DW_BLOCK_D)

        def atomic(wp=wp, st=st, g=g):
            acc.zero_()
            counter.zero_()
            _bwd_row1d[(g,)](dy, x, w, dx, acc, counter, dw, m, d, 1e-5, ATOMIC=True,
                             BLOCK_N=bn, NUM_STAGES=st, num_warps=wp)

        _time(f"row1d warps={wp} stages={st} per_sm={per}", row1d, bb, rows, "bwd")
        _time(f"atomic warps={wp} stages={st} per_sm={per}", atomic, bb, rows, "bwd")

    # the candidates compute what the shipped kernels do (bf16 outputs: within an ulp or two)
    shipped()
    torch.cuda.synchronize()
    ref_dx, ref_dw = dx.clone(), dw.clone()
    _bwd_row1d[(sms,)](dy, x, w, dx, acc.zero_(), counter.zero_(), dw, m, d, 1e-5, ATOMIC=True,
                       BLOCK_N=bn, NUM_STAGES=3, num_warps=16)
    fwd_shipped()
    ref_y = y.clone()
    _fwd_row1d[(sms,)](x, w, y, m, d, 1e-5, BLOCK_N=bn, NUM_STAGES=3, num_warps=8)
    print(f"check: row1d y {(y.float() - ref_y.float()).abs().max().item():.3g}, atomic dx "
          f"{(dx.float() - ref_dx.float()).abs().max().item():.3g}, dw {(dw.float() - ref_dw.float()).abs().max().item():.3g}"
          f" (|dw| max {ref_dw.abs().max().item():.3g})")
    same = 2 * x.numel() * 2 / bench_ms(graphed(lambda: y.copy_(x))) / 1e6
    print(f"\n### {m}x{d} bf16, ceiling {ceiling:.0f} GB/s, same-size copy {same:.0f} GB/s "
          f"({100 * same / ceiling:.1f}%)", flush=True)
    for kind in ("fwd", "bwd", "red"):
        for r in sorted((r for r in rows if r[0] == kind), key=lambda r: r[2])[: args.top]:
            print(f"{kind} {r[1]:44s} {r[2] * 1e3:8.1f} us {r[3]:7.0f} GB/s {100 * r[3] / ceiling:5.1f}%")
        shipped_rows = [r for r in rows if r[0] == kind and r[1].startswith(("shipped ", "dw-", "no-dw", "pdl"))]
        for r in shipped_rows:
            print(f"{kind} [ref] {r[1]:38s} {r[2] * 1e3:8.1f} us {100 * r[3] / ceiling:5.1f}%")
    print(flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["4096x8192", "16384x4096"])
    p.add_argument("--warps", type=int, nargs="+", default=(4, 8, 16), help="forward candidates' num_warps")
    p.add_argument("--bwd-warps", type=int, nargs="+", default=(8, 16))
    p.add_argument("--stages", type=int, nargs="+", default=(2, 3, 4))
    p.add_argument("--per-sm", type=int, nargs="+", default=(1, 2, 4), help="forward candidates' programs per SM")
    p.add_argument("--top", type=int, default=8)
    args = p.parse_args()
    ceiling = copy_ceiling_gbps()
    for shape in args.shapes:
        m, d = (int(s) for s in shape.lower().split("x"))
        probe(m, d, ceiling, args)


if __name__ == "__main__":
    main()
