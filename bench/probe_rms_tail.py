"""What the persistent RMSNorm grids' last partial wave of rows costs, and a split of that wave.

    python bench/probe_rms_tail.py                       # 8192-wide rows around M = 4096 on this GPU
    python bench/probe_rms_tail.py --d 4096 --at 16384
    python bench/probe_rms_tail.py --split               # + the split kernels at M = --at (A/B, checked)
    TRITON_INTERPRET=1 python bench/probe_rms_tail.py --check --device cpu   # the split kernels' check

The persistent kernels (kernels/_rms_norm_launch.py) give program p rows p, p + P, ... With S SMs,
M = k * S rows put k rows on every SM; M = 4096 on a 132-SM H200 is 31 * 132 + 4, so 4 SMs take
a 32nd row while the other 128 idle. This times the shipped forward, the row backward (no dw, so
the dw reduction's own cost stays out) and a same-size copy at M and at the whole multiples of S
around it, every candidate once per rep, round robin, median over reps. The tail's cost is M's
time above the straight line through the multiples (linear in rows: the copy's line is the check).

--split: the shipped kernels against copies of them whose loop stops at M_MAIN = M - M % S and whose
last T = M % S rows are shared: TAIL_K programs per tail row each read the whole row (for its sums;
after the first reader, L2 hits) and store only their 1 / TAIL_K of its columns (the backward adds
only those columns to its dw partial). The tail step runs before the loop (POS 0), after it
(POS 1), or as the loop's last step (POS 2), whose loads the pipeliner issues during the last rows. Outputs are checked against the shipped kernels (y, dx bit-equal; dw to fp32 summation order).
Only reports.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl

from common import bench_ms, graphed
from fxfuse.kernels import _rms_norm_launch as launch
from fxfuse.kernels import rms_norm as k
from fxfuse.kernels._rms_norm_dw import _dw_reduce_kernel
from fxfuse.kernels._dispatch import num_sms
from fxfuse.kernels._rms_norm_split import grad_out
from fxfuse.kernels._round import rne_by_bits, round_code, round_dtype, round_to

EPS = 1e-6


@triton.jit
def _tail_share(pid, M, M_MAIN, TAIL_PID0, cols, col_mask, BLOCK_N: tl.constexpr, TAIL_K: tl.constexpr):
    """(has a share, its row, its columns' mask, their first column): programs TAIL_PID0 + j take row
    M_MAIN + j // TAIL_K, column block j % TAIL_K of BLOCK_N / TAIL_K."""
    t = pid - TAIL_PID0
    lo = (t % TAIL_K) * (BLOCK_N // TAIL_K)
    return ((t >= 0) & (t < (M - M_MAIN) * TAIL_K), (M_MAIN + t // TAIL_K).to(tl.int64),
            col_mask & (cols >= lo) & (cols < lo + BLOCK_N // TAIL_K), lo)


@triton.jit
def _step_mask(whole, lo, cols, col_mask, BLOCK_N: tl.constexpr, TAIL_K: tl.constexpr):
    """Store mask of a POS 2 loop step: the whole row, or the tail share's columns. Bounds selected, not
    masks: a select between two masks hides the 16-byte runs and the stores go 2 bytes at a time."""
    lo = tl.where(whole, 0, lo)
    return col_mask & (cols >= lo) & (cols < tl.where(whole, BLOCK_N, lo + BLOCK_N // TAIL_K))


@triton.jit
def _rows_of(pid, M_MAIN):
    """Loop rows of program pid: pid, pid + P, ... below M_MAIN."""
    return tl.maximum(tl.cdiv(M_MAIN - pid, tl.num_programs(0)), 0)


@triton.jit
def _fwd_row_step(x_ptr, y_ptr, w, row64, cols, col_mask, store_mask, D, stride_x, eps,
                  CAST_BEFORE_WEIGHT: tl.constexpr, RNE_BY_BITS: tl.constexpr):
    """y of one row, stored where store_mask (the shipped row forward's step)."""
    x = tl.load(x_ptr + row64 * stride_x + cols, mask=col_mask, other=0.0)
    y = k._fwd_row_math(x, w, eps, D, x_ptr.dtype.element_ty, y_ptr.dtype.element_ty, True,
                        CAST_BEFORE_WEIGHT, 0, RNE_BY_BITS)
    tl.store(y_ptr + row64 * D + cols, y, mask=store_mask)


@triton.jit
def _fwd_rows_tail_kernel(
    x_ptr,  # [M, D] x.dtype, row stride stride_x, col stride 1
    w_ptr,  # [D] weight.dtype
    y_ptr,  # [M, D] out_dtype, contiguous
    M,
    M_MAIN,  # rows [0, M_MAIN) in the loop; [M_MAIN, M) shared by TAIL_K programs each
    TAIL_PID0,  # first program with a tail share
    D,
    stride_x,
    eps,
    offset,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    RNE_BY_BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    TAIL_K: tl.constexpr,
    POS: tl.constexpr,  # 0: tail share before the loop, 1: after, 2: as the loop's last step (pipelined)
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < D
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    has_tail, tail_row, tail_mask, tail_lo = _tail_share(pid, M, M_MAIN, TAIL_PID0, cols, col_mask, BLOCK_N, TAIL_K)
    if POS == 0:
        if has_tail:
            _fwd_row_step(x_ptr, y_ptr, w, tail_row, cols, col_mask, tail_mask, D, stride_x, eps,
                          CAST_BEFORE_WEIGHT, RNE_BY_BITS)
    if POS < 2:
        for row in tl.range(pid, M_MAIN, tl.num_programs(0), num_stages=NUM_STAGES):
            _fwd_row_step(x_ptr, y_ptr, w, tl.cast(row, tl.int64), cols, col_mask, col_mask, D, stride_x, eps,
                          CAST_BEFORE_WEIGHT, RNE_BY_BITS)
    else:
        n_main = _rows_of(pid, M_MAIN)
        for i in tl.range(0, n_main + has_tail.to(tl.int32), num_stages=NUM_STAGES):
            row64 = tl.where(i < n_main, (pid + i * tl.num_programs(0)).to(tl.int64), tail_row)
            _fwd_row_step(x_ptr, y_ptr, w, row64, cols, col_mask,
                          _step_mask(i < n_main, tail_lo, cols, col_mask, BLOCK_N, TAIL_K), D, stride_x, eps,
                          CAST_BEFORE_WEIGHT, RNE_BY_BITS)
    if POS == 1:
        if has_tail:
            _fwd_row_step(x_ptr, y_ptr, w, tail_row, cols, col_mask, tail_mask, D, stride_x, eps,
                          CAST_BEFORE_WEIGHT, RNE_BY_BITS)


@triton.jit
def _bwd_row_step(dy_ptr, x_ptr, dx_ptr, w, row64, cols, col_mask, store_mask, D, stride_x, eps,
                  ROUND: tl.constexpr, RNE_BY_BITS: tl.constexpr):
    """dx of one row (stored where store_mask) and its dw term [BLOCK_N] (0 outside store_mask);
    the shipped row kernel's math with INDEPENDENT_SUMS, BLOCK_M = 1."""
    x = tl.load(x_ptr + row64 * stride_x + cols, mask=col_mask, other=0.0)
    dy = tl.load(dy_ptr + row64 * D + cols, mask=col_mask, other=0.0)
    xf = x.to(tl.float32)
    dyf = dy.to(tl.float32)
    g = grad_out(dyf, w, True, ROUND, RNE_BY_BITS)
    sxx = tl.sum(xf * xf, axis=0)
    sgx = tl.sum(g * xf, axis=0)
    rstd = tl.math.rsqrt(sxx / D + eps)
    xhat = xf * rstd
    dx = rstd * (g - xhat * (sgx * rstd / D))
    dx = round_dtype(dx, dx_ptr.dtype.element_ty, RNE_BY_BITS).to(dx_ptr.dtype.element_ty)
    tl.store(dx_ptr + row64 * D + cols, dx, mask=store_mask)
    return tl.where(store_mask, round_to(dyf * round_to(xhat, ROUND, RNE_BY_BITS), ROUND, RNE_BY_BITS), 0.0)


@triton.jit
def _bwd_rows_tail_kernel(
    dy_ptr,  # [M, D] out_dtype, contiguous
    x_ptr,  # [M, D] x.dtype, row stride stride_x, col stride 1
    w_ptr,  # [D] weight.dtype
    dx_ptr,  # [M, D] x.dtype, contiguous
    dw_partial_ptr,  # [P, D] fp32
    M,
    M_MAIN,
    TAIL_PID0,
    D,
    stride_x,
    eps,
    offset,
    ROUND: tl.constexpr,
    RNE_BY_BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    TAIL_K: tl.constexpr,
    POS: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < D
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    has_tail, tail_row, tail_mask, tail_lo = _tail_share(pid, M, M_MAIN, TAIL_PID0, cols, col_mask, BLOCK_N, TAIL_K)
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if POS == 0:
        if has_tail:
            dw_acc += _bwd_row_step(dy_ptr, x_ptr, dx_ptr, w, tail_row, cols, col_mask, tail_mask, D, stride_x,
                                    eps, ROUND, RNE_BY_BITS)
    if POS < 2:
        for row in tl.range(pid, M_MAIN, tl.num_programs(0), num_stages=NUM_STAGES):
            dw_acc += _bwd_row_step(dy_ptr, x_ptr, dx_ptr, w, tl.cast(row, tl.int64), cols, col_mask, col_mask, D,
                                    stride_x, eps, ROUND, RNE_BY_BITS)
    else:
        n_main = _rows_of(pid, M_MAIN)
        for i in tl.range(0, n_main + has_tail.to(tl.int32), num_stages=NUM_STAGES):
            row64 = tl.where(i < n_main, (pid + i * tl.num_programs(0)).to(tl.int64), tail_row)
            dw_acc += _bwd_row_step(dy_ptr, x_ptr, dx_ptr, w, row64, cols, col_mask,
                                    _step_mask(i < n_main, tail_lo, cols, col_mask, BLOCK_N, TAIL_K), D, stride_x,
                                    eps, ROUND, RNE_BY_BITS)
    if POS == 1:
        if has_tail:
            dw_acc += _bwd_row_step(dy_ptr, x_ptr, dx_ptr, w, tail_row, cols, col_mask, tail_mask, D, stride_x,
                                    eps, ROUND, RNE_BY_BITS)
    tl.store(dw_partial_ptr + pid.to(tl.int64) * D + cols, dw_acc, mask=col_mask)


def tail_plan(m: int, sms: int, programs: int, bn: int, tail_k: int) -> tuple[int, int, int]:
    """(M_MAIN, TAIL_K, TAIL_PID0): the loop's rows, programs per tail row (at most tail_k, a power of
    two, each owning >= 16 columns), the first program with a tail share (the last T * TAIL_K)."""
    t = m % sms
    m_main = m - t
    kk = tail_k
    while kk > 1 and (t * kk > programs or bn // kk < 16):
        kk //= 2
    return m_main, kk, programs - t * kk


def split_forward(x, w, tail_k: int, pos: int) -> torch.Tensor:
    m, d = x.shape
    persistent, programs, _, bn, warps, stages = launch.fwd_launch(m, d, x.element_size(), x.device)
    assert persistent, "the split forward copies the persistent row forward (rows of 8K+ elements)"
    m_main, kk, pid0 = tail_plan(m, num_sms(x.device), programs, bn, tail_k)
    y = torch.empty_like(x)
    _fwd_rows_tail_kernel[(programs,)](x, w, y, m, m_main, pid0, d, x.stride(0), EPS, 0.0, CAST_BEFORE_WEIGHT=True,
                                       RNE_BY_BITS=rne_by_bits(x.device), BLOCK_N=bn, NUM_STAGES=stages,
                                       TAIL_K=kk, POS=pos, num_warps=warps)
    return y


def split_backward(dy, x, w, tail_k: int, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    m, d = x.shape
    programs, _, bn, warps, stages = launch.bwd_launch(m, d, x.element_size(), x.device)
    m_main, kk, pid0 = tail_plan(m, num_sms(x.device), programs, bn, tail_k)
    dx = torch.empty_like(x)
    partial = torch.empty((programs, d), dtype=torch.float32, device=x.device)
    _bwd_rows_tail_kernel[(programs,)](dy, x, w, dx, partial, m, m_main, pid0, d, x.stride(0), EPS, 0.0,
                                       ROUND=round_code(dy.dtype, False), RNE_BY_BITS=rne_by_bits(x.device),
                                       BLOCK_N=bn, NUM_STAGES=stages, TAIL_K=kk, POS=pos, num_warps=warps)
    dw = torch.empty((d,), dtype=w.dtype, device=x.device)
    grid, block_p, block_d = launch.dw_launch(programs, d)
    _dw_reduce_kernel[(grid,)](partial, dw, programs, d, RNE_BY_BITS=rne_by_bits(x.device), BLOCK_P=block_p,
                                 BLOCK_D=block_d)
    return dx, dw


def split_cases(m: int, d: int, dtype: torch.dtype, device: str, tail_ks: list[int]) -> tuple[dict, list[str]]:
    """(name -> step, mismatches): shipped forward / backward (with dw) and the split copies, whose
    outputs are checked against the shipped kernels'."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, d, device=device, dtype=dtype, generator=gen)
    dy = torch.randn(m, d, device=device, dtype=dtype, generator=gen)
    w = torch.randn(d, device=device, dtype=dtype, generator=gen)
    y_ref = k._rms_norm(x, w, EPS, 0.0, True, dtype)
    dx_ref, dw_ref = k._rms_norm_backward(dy, x, w, EPS, 0.0, True)
    bad = []
    steps = {"fwd shipped": lambda: k._rms_norm(x, w, EPS, 0.0, True, dtype),
             "bwd shipped": lambda: k._rms_norm_backward(dy, x, w, EPS, 0.0, True)}
    for kk in tail_ks:
        for pos in (0, 1, 2):
            y = split_forward(x, w, kk, pos)
            dx, dw = split_backward(dy, x, w, kk, pos)
            dw_err = ((dw.float() - dw_ref.float()).abs().max() / dw_ref.float().abs().max()).item()
            print(f"{m}x{d} split K<={kk} pos {pos}: y equal {torch.equal(y, y_ref)}, dx equal "
                  f"{torch.equal(dx, dx_ref)}, dw max rel diff {dw_err:.2e}")
            if not (torch.equal(y, y_ref) and torch.equal(dx, dx_ref) and dw_err < 2e-2):
                bad.append(f"split K<={kk} pos {pos}")
            steps[f"fwd split K<={kk} pos {pos}"] = lambda kk=kk, pos=pos: split_forward(x, w, kk, pos)
            steps[f"bwd split K<={kk} pos {pos}"] = lambda kk=kk, pos=pos: split_backward(dy, x, w, kk, pos)
    return steps, bad


def cases(m: int, d: int, dtype: torch.dtype) -> dict:
    x = torch.randn(m, d, device="cuda", dtype=dtype)
    dy = torch.randn_like(x)
    w = torch.randn(d, device="cuda", dtype=dtype)
    y = torch.empty_like(x)
    return {
        "copy": graphed(lambda: y.copy_(x)),
        "fwd": graphed(lambda: k._rms_norm(x, w, EPS, 0.0, True, dtype)),
        "bwd no dw": graphed(lambda: k._rms_norm_backward(dy, x, w, EPS, 0.0, False)),
    }


def line_excess(ms: list[int], us: list[float], m: int) -> float:
    """us at m above the least-squares line through the other (whole-wave) points."""
    pts = [(a, b) for a, b in zip(ms, us) if a != m]
    n = len(pts)
    mx = sum(a for a, _ in pts) / n
    my = sum(b for _, b in pts) / n
    slope = sum((a - mx) * (b - my) for a, b in pts) / sum((a - mx) ** 2 for a, _ in pts)
    return us[ms.index(m)] - (my + slope * (m - mx))


def tail_table(args, dtype: torch.dtype) -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    waves = args.at // sms
    ms = sorted(set(args.m or [(waves - 1) * sms, waves * sms, args.at, (waves + 1) * sms]))
    fns = {m: cases(m, args.d, dtype) for m in ms}
    times = {(m, name): [] for m in ms for name in fns[m]}
    for _ in range(args.reps):
        for m in ms:
            for name, fn in fns[m].items():
                times[m, name].append(bench_ms(fn) * 1e3)
    print(f"{torch.cuda.get_device_name()} ({sms} SMs), D={args.d} {args.dtype}, median of {args.reps} reps, us")
    names = list(fns[ms[0]])
    print(f"{'M':>7} " + " ".join(f"{n:>10}" for n in names))
    med = {key: statistics.median(v) for key, v in times.items()}
    for m in ms:
        print(f"{m:7d} " + " ".join(f"{med[m, n]:10.1f}" for n in names))
    if args.at in ms and len(ms) >= 3:
        excess = [line_excess(ms, [med[m, n] for m in ms], args.at) for n in names]
        print(f"{'tail':>7} " + " ".join(f"{e:+10.1f}" for e in excess) + f"   (M={args.at} above the line)")


def split_table(args, dtype: torch.dtype) -> None:
    steps, bad = split_cases(args.at, args.d, dtype, "cuda", args.tail_k)
    if bad:
        print("differ from the shipped kernels (timed anyway):", ", ".join(bad))
    graphs = {name: graphed(fn) for name, fn in steps.items()}
    times = {name: [] for name in graphs}
    for _ in range(args.reps):
        for name, g in graphs.items():
            times[name].append(bench_ms(g) * 1e3)
    for name, v in times.items():
        print(f"{args.at}x{args.d} {name:28} {statistics.median(v):8.1f} us  (min {min(v):.1f}, max {max(v):.1f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d", type=int, default=8192)
    p.add_argument("--m", type=int, nargs="*", help="rows (default: --at and the multiples of the SM count around it)")
    p.add_argument("--at", type=int, default=4096, help="the M whose tail is priced")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--split", action="store_true", help="also time the split kernels at --at")
    p.add_argument("--tail-k", type=int, nargs="+", default=[8, 32], help="most programs per tail row")
    p.add_argument("--check", action="store_true", help="only check the split kernels against the shipped ones")
    p.add_argument("--device", default="cuda", help="cpu (with TRITON_INTERPRET=1) for --check")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.check:
        _, bad = split_cases(args.at, args.d, dtype, args.device, args.tail_k)
        if bad:
            raise SystemExit("differ from the shipped kernels: " + ", ".join(bad))
        return
    tail_table(args, dtype)
    if args.split:
        split_table(args, dtype)


if __name__ == "__main__":
    main()
