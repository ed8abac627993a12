"""RMSNorm kernels next to a same-size copy and a same-size 3-tensor op, for Nsight Compute; and the
backward with the residual-gradient add (and dy's sum) outside it against the folded ones
(fxfuse/fold_add.py).

Run under ncu (the hardware counters say where the gap to a copy is: DRAM bytes, DRAM throughput
over the kernel's time, occupancy, warp stalls):
    ncu --clock-control none --profile-from-start off --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        --section WarpStateStats python3 bench/probe_ncu_rms.py --shape 4096x8192
Without ncu it prints CUDA-graph times of the same kernels (bench/common.py's timing).
Each workload runs twice before the profiled region, then once inside it.
"""
import argparse

import torch

from common import bench_ms, graphed


def workloads(m: int, d: int, dtype: torch.dtype) -> dict:
    from fxfuse.kernels import rms_norm as k

    x = torch.randn(m, d, device="cuda", dtype=dtype)
    dy = torch.randn_like(x)
    r = torch.randn_like(x)
    a, b = torch.randn_like(x), torch.randn_like(x)  # dy's other addends: tensors of their own (no cache hits)
    w = torch.randn(d, device="cuda", dtype=dtype)
    y = torch.empty_like(x)
    eps = 1e-6
    return {
        "copy x -> y (2 tensors)": lambda: y.copy_(x),
        "add x + dy -> y (3 tensors)": lambda: torch.add(x, dy, out=y),
        "fxfuse fwd": lambda: k._rms_norm(x, w, eps, 0.0, True, dtype),
        "fxfuse bwd (row kernel + dw reduction)": lambda: k._rms_norm_backward(dy, x, w, eps, 0.0, True),
        "fxfuse bwd, no dw": lambda: k._rms_norm_backward(dy, x, w, eps, 0.0, False),
        "fxfuse bwd, then add dx + r (unfolded)": lambda: k._rms_norm_backward(dy, x, w, eps, 0.0, True)[0] + r,
        "fxfuse bwd_add (fxfuse/fold_add.py)": lambda: k._rms_norm_backward_add(dy, x, w, r, eps, 0.0, True),
        "3-way add (one kernel), then bwd_add (unfolded sum)":
            lambda: k._rms_norm_backward_add(sum3(dy, a, b), x, w, r, eps, 0.0, True),
        "fxfuse bwd_add with dy's 3 addends":
            lambda: k._rms_norm_backward_add(dy, x, w, r, eps, 0.0, True, False, a, b),
        "dy + a, then bwd_add (unfolded sum)": lambda: k._rms_norm_backward_add(dy + a, x, w, r, eps, 0.0, True),
        "fxfuse bwd_add with dy's 2 addends": lambda: k._rms_norm_backward_add(dy, x, w, r, eps, 0.0, True, False, a),
    }


@torch.compile
def sum3(a, b, c):
    """Inductor's one-kernel three-way add, as in the compiled backward before the fold."""
    return a + b + c


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="4096x8192", help="MxD rows x width")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--time", action="store_true", help="CUDA-graph times instead of one profiled launch each")
    args = p.parse_args()
    m, d = (int(v) for v in args.shape.split("x"))
    fns = workloads(m, d, getattr(torch, args.dtype))
    for fn in fns.values():
        fn(), fn()
    torch.cuda.synchronize()
    if args.time:
        for name, fn in fns.items():
            print(f"{args.shape} {name:40} {bench_ms(graphed(fn)) * 1e3:8.1f} us")
        return
    torch.cuda.cudart().cudaProfilerStart()
    for name, fn in fns.items():
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
