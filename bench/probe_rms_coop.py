"""RMSNorm backward with the dw reduction folded in after a grid barrier, against the shipped pair.

    python bench/probe_rms_coop.py --shape 4096x8192 --reps 9

The shipped backward is two kernels: the persistent row kernel writes a [P, D] fp32 partial dw
per program, then _dw_reduce_kernel sums them (3.5 us of 61 at 4096x8192 on the H200). Here the
row kernel's programs (all resident: one wave, launched cooperatively) meet at a grid barrier
and then each reduces a block of columns itself: one launch fewer. The barrier resets itself
(count back to 0 by the last arrival, which flips a sense flag), so no memset per call and CUDA
graphs replay it. GPU only: the interpreter runs programs one after another, so a spin barrier
would never release there. Prints both times (interleaved A/B) and the dx / dw differences.
"""
import argparse
import statistics

import torch
import triton
import triton.language as tl

from common import bench_ms, copy_ceiling_gbps, graphed


@triton.jit
def _grid_barrier(count_ptr, sense_ptr, P):
    # count_ptr, sense_ptr: int32 [1] each, zero at allocation; all P programs must be resident.
    tl.debug_barrier()  # this program's stores are done before it arrives
    sense = tl.atomic_add(sense_ptr, 0, sem="acquire")
    arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel")
    if arrived == P - 1:
        tl.atomic_xchg(count_ptr, 0, sem="relaxed")
        tl.atomic_xchg(sense_ptr, 1 - sense, sem="release")
    else:
        now = tl.atomic_add(sense_ptr, 0, sem="acquire")
        while now == sense:
            now = tl.atomic_add(sense_ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _bwd_coop_kernel(
    dy_ptr,  # [M, D] bf16, contiguous
    x_ptr,  # [M, D] bf16, contiguous
    w_ptr,  # [D] bf16
    dx_ptr,  # [M, D] bf16 out
    partial_ptr,  # [P, D] fp32 scratch: one dw partial per program
    dw_ptr,  # [D] bf16 out
    count_ptr, sense_ptr,  # int32 [1] each: the grid barrier's state
    M, D, eps,
    BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < D
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for row in tl.range(pid, M, P, num_stages=NUM_STAGES):
        off = tl.cast(row, tl.int64) * D + cols
        xf = tl.load(x_ptr + off, mask=col_mask, other=0.0).to(tl.float32)
        dyf = tl.load(dy_ptr + off, mask=col_mask, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
        xhat = xf * rstd
        g = dyf * w
        c = tl.sum(g * xhat, axis=0) / D
        tl.store(dx_ptr + off, (rstd * (g - xhat * c)).to(dx_ptr.dtype.element_ty), mask=col_mask)
        dw_acc += dyf * xhat
    tl.store(partial_ptr + pid.to(tl.int64) * D + cols, dw_acc, mask=col_mask)
    _grid_barrier(count_ptr, sense_ptr, P)
    ps = tl.arange(0, BLOCK_P)
    for cb in range(pid, tl.cdiv(D, BLOCK_D), P):
        dcols = cb * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = (ps < P)[:, None] & (dcols < D)[None, :]
        part = tl.load(partial_ptr + ps.to(tl.int64)[:, None] * D + dcols[None, :], mask=mask, other=0.0,
                       cache_modifier=".cg")  # L2: other SMs wrote these
        tl.store(dw_ptr + dcols, tl.sum(part, axis=0).to(dw_ptr.dtype.element_ty), mask=dcols < D)


def main() -> None:
    from fxfuse.kernels import rms_norm as k

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="4096x8192")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--warps", type=int, default=8)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--block-d", type=int, default=0, help="columns per reduction step (0: D / programs)")
    args = p.parse_args()
    m, d = (int(v) for v in args.shape.split("x"))
    x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    w = torch.randn(d, device="cuda", dtype=torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = min(m, sms)  # one program per SM: the shipped backward's grid at 8K rows
    dx = torch.empty_like(x)
    dw = torch.empty_like(w)
    partial = torch.empty((grid, d), device="cuda", dtype=torch.float32)
    barrier = torch.zeros(2, device="cuda", dtype=torch.int32)
    block_d = args.block_d or max(16, triton.next_power_of_2(triton.cdiv(d, grid)))

    def coop():
        k_ = _bwd_coop_kernel[(grid,)](
            dy, x, w, dx, partial, dw, barrier[0:], barrier[1:], m, d, 1e-6,
            BLOCK_N=triton.next_power_of_2(d), BLOCK_P=triton.next_power_of_2(grid), BLOCK_D=block_d,
            NUM_STAGES=args.stages, num_warps=args.warps, launch_cooperative_grid=True)
        return k_

    def shipped():
        return k._rms_norm_backward(dy, x, w, 1e-6, 0.0, True)

    compiled = coop()
    torch.cuda.synchronize()
    ref_dx, ref_dw = shipped()
    print(f"coop: regs {compiled.n_regs}, smem {compiled.metadata.shared / 1024:.1f} KiB, grid {grid}, "
          f"BLOCK_D {block_d}; max |dx - shipped| {(dx.float() - ref_dx.float()).abs().max().item():.3e}, "
          f"max |dw - shipped| / max |dw| {(dw.float() - ref_dw.float()).abs().max().item() / ref_dw.float().abs().max().item():.3e}",
          flush=True)
    for _ in range(20):  # the barrier must come back to its initial state call after call
        coop()
    torch.cuda.synchronize()
    print(f"barrier state after 21 calls: {barrier.tolist()} (count must be 0)", flush=True)
    ceiling = copy_ceiling_gbps()
    nbytes = 3 * m * d * x.element_size()
    graphs = {"shipped (row kernel + dw kernel)": graphed(shipped), "coop (one kernel)": graphed(coop)}
    times = {name: [] for name in graphs}
    for _ in range(args.reps):
        for name, g in graphs.items():
            times[name].append(bench_ms(g, warmup_ms=10, rep_ms=100) * 1e3)
    for name, t in times.items():
        med = statistics.median(t)
        print(f"{args.shape} {name:34} {med:7.1f} us (min {min(t):.1f}, max {max(t):.1f})  "
              f"{100 * nbytes / med / 1e3 / ceiling:5.1f}% of {ceiling:.0f} GB/s")


if __name__ == "__main__":
    main()
