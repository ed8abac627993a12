"""RMSNorm on wide rows: the row kernels against the split backward and chunked forward (A/B).

    python bench/probe_rms_wide.py --shapes 2048x16384 1024x32768 --dtypes bf16 fp32 --reps 7
    python bench/probe_rms_wide.py --pass fwd --shapes 2048x18432 4096x8192

The row kernel (kernels/rms_norm.py) holds a whole row of x, dy (and w) plus an fp32 [D] dw
partial per program in registers; the split kernel (kernels/_rms_norm_split.py) gives each of S
programs D / S columns of every row it visits and re-reads the other parts for the row's two sums.
Each candidate is the backward op's launches (row or split kernel, then the dw reduction), timed
as CUDA-graph replays in rounds that alternate between candidates; "shipped" is what
``_rms_norm_backward`` launches today (bwd_split_launch / bwd_launch). "2-pass" candidates take the
row sums from a first kernel (one program per row, column blocks of BLOCK) and read only their own
part. The first session with the split kernel also tried a row kernel whose dw partial lived in
global memory (read-added-written per row, L2-resident): 115 us at 2048x16384 against 82.6 (and a
wrong dw where the loop's pipeliner prefetched the partial ahead of the previous row's store); it
is not kept here.
"""
import argparse
import statistics

import torch
import triton

from common import bench_ms, copy_ceiling_gbps, graphed

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def candidates(m, d, x, dy, w, sms):
    """name -> fn() returning (dx, dw), each with its own output buffers."""
    from fxfuse.kernels import _rms_norm_launch as launch
    from fxfuse.kernels import rms_norm as k
    from fxfuse.kernels._rms_norm_dw import _dw_reduce_kernel
    from fxfuse.kernels._rms_norm_split import split_backward

    elem = x.element_size()

    def reduce(partial, p, dw):
        programs, block_p, block_d = launch.dw_launch(p, d)
        _dw_reduce_kernel[(programs,)](partial, dw, p, d, RNE_BY_BITS=False, BLOCK_P=block_p, BLOCK_D=block_d)

    def row_kernel():
        grid, bm, bn, warps, stages = launch.bwd_launch(m, d, elem, x.device)
        dx, dw = torch.empty_like(x), torch.empty_like(w)
        partial = torch.empty((grid, d), device="cuda", dtype=torch.float32)

        def fn():
            k._rms_norm_bwd_kernel[(grid,)](
                dy, x, w, dx, partial, m, d, d, 1e-6, 0.0, HAS_WEIGHT=True, COMPUTE_DW=True, ROUND=0,
                RNE_BY_BITS=False, INDEPENDENT_SUMS=launch.bwd_independent_sums(bn), BLOCK_M=bm, BLOCK_N=bn,
                NUM_STAGES=stages, num_warps=warps)
            reduce(partial, grid, dw)
            return dx, dw
        return fn

    def split(cfg):
        dx, dw = torch.empty_like(x), torch.empty_like(w)
        partial = torch.empty((cfg[0], d), device="cuda", dtype=torch.float32)

        def fn():
            split_backward(dy, x, w, dx, partial, 1e-6, 0.0, True, True, 0, False, cfg)
            reduce(partial, cfg[0], dw)
            return dx, dw
        return fn

    out = {"shipped": lambda: k._rms_norm_backward(dy, x, w, 1e-6, 0.0, True), "row kernel": row_kernel()}
    for s in (2, 3, 4, 8):  # one pass: each program re-reads the other parts for the row sums
        part = launch.block_n(triton.cdiv(d, s))
        if part < 2048 or (s * part > launch.block_n(d) and s * part != d):
            continue
        groups = max(1, min(m, sms // s))  # one program per SM (two per SM lost everywhere in the first probe)
        for warps in (8, 16) if part >= 8192 else (4, 8):
            # stages of x and dy for all S parts in shared memory; one stage does not pipeline
            for stages in [st for st in (2, 3) if 2 * s * part * elem * st <= 224 << 10] or [1]:
                out[f"split S={s} w={warps} st={stages}"] = split((groups, s, part, warps, stages, None))
    for part in (4096, 8192):  # two passes: row sums first, then each program reads its own part only
        s = triton.cdiv(d, part)
        if s < 2:
            continue
        groups = max(1, min(m, sms // s))
        for row_sums in ((2048, 4, 3), (4096, 8, 2), (1024, 4, 4)):
            out[f"2-pass S={s} w=8 st=3 sums={row_sums}"] = split((groups, s, part, 8, 3, row_sums))
    return out


def fwd_candidates(m, d, x, w, sms):
    """name -> fn() returning (y,): the forward's row kernel (tile or persistent, as fwd_launch picks)
    and the chunked forward (kernels/_rms_norm_chunked.py) per (BLOCK, num_warps, num_stages)."""
    from fxfuse.kernels import _rms_norm_launch as launch
    from fxfuse.kernels import rms_norm as k
    from fxfuse.kernels._rms_norm_chunked import chunked_forward

    flags = dict(HAS_WEIGHT=True, CAST_BEFORE_WEIGHT=True, RNE_BY_BITS=False)

    def row_kernel():
        persistent, grid, bm, bn, warps, stages = launch.fwd_launch(m, d, x.element_size(), x.device)
        y = torch.empty_like(x)

        def fn():
            if persistent:
                k._rms_norm_fwd_rows_kernel[(grid,)](x, w, y, m, d, d, 1e-6, 0.0, BLOCK_N=bn, NUM_STAGES=stages,
                                                     num_warps=warps, **flags)
            else:
                k._rms_norm_fwd_kernel[(grid,)](x, w, y, m, d, d, 1e-6, 0.0, BLOCK_M=bm, BLOCK_N=bn,
                                                num_warps=warps, **flags)
            return (y,)
        return fn

    def chunked(cfg):
        y = torch.empty_like(x)

        def fn():
            chunked_forward(x, w, y, 1e-6, 0.0, True, True, False, cfg)
            return (y,)
        return fn

    out = {"shipped": lambda: (k._rms_norm(x, w, 1e-6, 0.0, True, x.dtype),), "row kernel": row_kernel()}
    for block in (1024, 2048, 4096, 8192):
        for warps in (4, 8, 16):
            if block // (32 * warps) < 4:  # under 4 elements per thread: narrower than a 16-byte bf16 vector
                continue
            for stages in (2, 3, 4):
                out[f"chunked B={block} w={warps} st={stages}"] = chunked((block, warps, stages))
    return out


def main():
    from fxfuse.kernels import rms_norm as k

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["2048x16384", "1024x32768", "2048x12288"])
    p.add_argument("--dtypes", nargs="+", default=["bf16"], choices=sorted(DTYPES))
    p.add_argument("--pass", dest="which", choices=("fwd", "bwd"), default="bwd")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--top", type=int, default=8, help="rows printed per shape, fastest first")
    args = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ceiling = copy_ceiling_gbps()
    print(f"copy ceiling {ceiling:.0f} GB/s, {sms} SMs", flush=True)
    for dtype_name in args.dtypes:
        for shape in args.shapes:
            m, d = (int(v) for v in shape.split("x"))
            torch.manual_seed(0)
            x = torch.randn(m, d, device="cuda", dtype=DTYPES[dtype_name])
            dy = torch.randn_like(x)
            w = torch.randn(d, device="cuda", dtype=x.dtype)
            if args.which == "fwd":
                refs = (k.rms_norm_reference(x, w, 1e-6, 0.0, True, torch.float32),)
                cands, names, nbytes = fwd_candidates(m, d, x, w, sms), ("y",), 2 * m * d * x.element_size()
            else:
                refs = k._rms_norm_backward_reference(dy, x, w, 1e-6, 0.0, True)
                cands, names, nbytes = candidates(m, d, x, dy, w, sms), ("dx", "dw"), 3 * m * d * x.element_size()
            graphs, worst = {}, [0.0] * len(refs)
            for name, fn in cands.items():
                try:
                    outs = fn()
                    torch.cuda.synchronize()
                except Exception as exc:  # a config that does not compile (shared memory, registers)
                    print(f"{dtype_name} {shape} {name:36} failed: {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                for i, (got, ref) in enumerate(zip(outs, refs)):
                    ref = ref.float()
                    worst[i] = max(worst[i], (got.float() - ref).abs().max().item() / ref.abs().max().item())
                graphs[name] = graphed(fn)
            errs = ", ".join(f"{n} {e:.2e}" for n, e in zip(names, worst))
            print(f"{dtype_name} {shape} {args.which}: {len(graphs)} candidates, worst max|err| / max|ref| "
                  f"against the fp32 reference: {errs}", flush=True)
            times = {name: [] for name in graphs}
            for _ in range(args.reps):
                for name, g in graphs.items():
                    times[name].append(bench_ms(g, warmup_ms=10, rep_ms=50) * 1e3)
            ranked = sorted(times.items(), key=lambda kv: statistics.median(kv[1]))
            for rank, (name, t) in enumerate(ranked):
                if rank < args.top or name in ("shipped", "row kernel"):
                    med = statistics.median(t)
                    print(f"{dtype_name} {shape} {name:36} {med:7.1f} us (min {min(t):.1f}, max {max(t):.1f})  "
                          f"{100 * nbytes / med / 1e3 / ceiling:5.1f}% of ceiling", flush=True)


if __name__ == "__main__":
    main()
