"""RMSNorm persistent kernels: grid size (programs per SM) x warps x stages, interleaved A/B.

    python bench/probe_rms_grid.py --shape 4096x8192 --reps 7              # the 8K+-row forward
    python bench/probe_rms_grid.py --kernel bwd --shape 4096x8192          # backward row kernel + dw

Nsight Compute showed the shipped 4096x8192 forward (528 programs = 4 per SM, 8 warps, 80
registers per thread) fitting only 3 programs per SM: a persistent grid with a partial second
wave. Each configuration is captured in a CUDA graph; replays are timed round-robin (every rep
times every config once, so drift between reps hits all alike), median over reps. Prints the
compiled kernel's registers and shared memory and the programs per SM that fit by registers.
The backward's time includes the dw reduction over the grid's [P, D] partials (P = programs). (Its
RELOAD_W axis, w re-read per row, went with that option: bench/probe_rms_wide.py's split kernel
took over the 16K+-element rows where re-reading had won.)
"""
import argparse
import itertools
import statistics

import torch
import triton

from common import bench_ms, copy_ceiling_gbps, graphed


def resident_by_regs(n_regs: int, num_warps: int) -> int:
    """Programs per SM that fit the 64K-register file (registers allocated per warp in 256s)."""
    per_warp = triton.cdiv(n_regs * 32, 256) * 256
    return 65536 // (per_warp * num_warps)


def main() -> None:
    from fxfuse.kernels import rms_norm as k
    from fxfuse.kernels._rms_norm_dw import _dw_reduce_kernel
    from fxfuse.kernels import _rms_norm_launch as launch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernel", default="fwd", choices=["fwd", "bwd"])
    p.add_argument("--shape", default="4096x8192")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--per-sm", type=int, nargs="+", default=[1, 2, 3, 4, 6])
    args = p.parse_args()
    m, d = (int(v) for v in args.shape.split("x"))
    x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    w = torch.randn(d, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    dw = torch.empty_like(w)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ceiling = copy_ceiling_gbps()
    bn = triton.next_power_of_2(d)
    fwd = args.kernel == "fwd"
    nbytes = (2 if fwd else 3) * m * d * x.element_size()

    def fwd_fn(grid, warps, stages):
        return lambda: k._rms_norm_fwd_rows_kernel[(grid,)](
            x, w, y, m, d, x.stride(0), 1e-6, 0.0, HAS_WEIGHT=True, CAST_BEFORE_WEIGHT=True,
            RNE_BY_BITS=False, BLOCK_N=bn, NUM_STAGES=stages, num_warps=warps)

    def bwd_fn(grid, warps, stages):
        partial = torch.empty((grid, d), device="cuda", dtype=torch.float32)
        programs, block_p, block_d = launch.dw_launch(grid, d)

        def run():
            compiled = k._rms_norm_bwd_kernel[(grid,)](
                dy, x, w, y, partial, m, d, x.stride(0), 1e-6, 0.0, HAS_WEIGHT=True, COMPUTE_DW=True,
                ROUND=0, RNE_BY_BITS=False, INDEPENDENT_SUMS=launch.bwd_independent_sums(bn), BLOCK_M=1, BLOCK_N=bn,
                NUM_STAGES=stages, num_warps=warps)
            _dw_reduce_kernel[(programs,)](partial, dw, grid, d, RNE_BY_BITS=False, BLOCK_P=block_p,
                                             BLOCK_D=block_d)
            return compiled
        return run

    shipped = launch.fwd_launch(m, d, 2, x.device) if fwd else launch.bwd_launch(m, d, 2, x.device)
    print(f"{args.kernel} {args.shape} shipped: {shipped}  ceiling {ceiling:.0f} GB/s", flush=True)
    configs, graphs = [], []
    for warps, stages, per_sm in itertools.product(args.warps, args.stages, args.per_sm):
        fn = (fwd_fn if fwd else bwd_fn)(min(m, sms * per_sm), warps, stages)
        try:
            compiled = fn()
            torch.cuda.synchronize()
        except Exception as exc:  # a config that does not fit shared memory
            print(f"skip warps {warps} stages {stages}: {type(exc).__name__}", flush=True)
            continue
        fit = resident_by_regs(compiled.n_regs, warps)
        configs.append((warps, stages, per_sm, compiled.n_regs, compiled.metadata.shared, fit))
        graphs.append(graphed(fn))
    times = [[] for _ in configs]
    for _ in range(args.reps):
        for i, g in enumerate(graphs):
            times[i].append(bench_ms(g, warmup_ms=10, rep_ms=60) * 1e3)
    rows = sorted(zip(configs, times), key=lambda r: statistics.median(r[1]))
    print("warps stages per_sm regs smem_KiB fit_by_regs   us(median) min  max   GB/s  %ceil")
    for (warps, stages, per_sm, regs, smem, fit), t in rows:
        med = statistics.median(t)
        print(f"{warps:5} {stages:6} {per_sm:6} {regs:4} {smem / 1024:8.1f} {fit:11}   {med:9.1f} "
              f"{min(t):5.1f} {max(t):5.1f} {nbytes / med / 1e3:6.0f} {100 * nbytes / med / 1e3 / ceiling:6.1f}")


if __name__ == "__main__":
    main()
