"""Benchmark RMSNorm fwd+bwd: eager / inductor / liger / fxfuse, against the copy ceiling.

    python bench/bench_rms_norm.py                       # bf16 16384x4096 and 4096x8192
    python bench/bench_rms_norm.py --shapes 8192x2048 --dtype fp16 --mode gemma
    python bench/bench_rms_norm.py --cuda-graph --providers fxfuse --pdl off   # A/B of the dw kernel's launch
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    PROVIDERS, Row, bench_ms, copy_ceiling_gbps, graphed, have_liger, peak_extra_mib, print_table,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
EPS = 1e-6


def rms_norm_bytes(m: int, d: int, dtype: torch.dtype, w_dtype: torch.dtype | None = None) -> int:
    """Minimum bytes of fwd+bwd: fwd reads x, w, writes y; bwd reads x, w, dy, writes dx, dw."""
    e = torch.empty((), dtype=dtype).element_size()
    ew = torch.empty((), dtype=w_dtype or dtype).element_size()
    fwd = 2 * m * d * e + d * ew
    bwd = 3 * m * d * e + 2 * d * ew
    return fwd + bwd


def eager_rms_norm(x: torch.Tensor, w: torch.Tensor, mode: str) -> torch.Tensor:
    """HF Llama (mode=llama) or Gemma (mode=gemma, weight stored as w with 1 + w applied)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    if mode == "llama":
        return w * y.to(x.dtype)
    return (y * (1.0 + w.float())).type_as(x)


def _fxfuse_fn(mode: str):
    from fxfuse.kernels.rms_norm import rms_norm

    cast_before_weight, offset = (True, 0.0) if mode == "llama" else (False, 1.0)
    return lambda x, w: rms_norm(x, w, EPS, offset, cast_before_weight, x.dtype)


def _liger_fn(mode: str, d: int):
    from liger_kernel.transformers.rms_norm import LigerRMSNorm

    offset = 0.0 if mode == "llama" else 1.0
    mod = LigerRMSNorm(d, eps=EPS, offset=offset, casting_mode=mode, in_place=False)

    def fn(x, w):
        mod.weight = w  # the benchmark's weight Parameter (same dtype/device as x)
        return mod(x)

    return fn


def _provider_fn(provider: str, mode: str, d: int):
    if provider == "eager":
        return lambda x, w: eager_rms_norm(x, w, mode)
    if provider == "inductor":
        return torch.compile(lambda x, w: eager_rms_norm(x, w, mode))
    if provider == "liger":
        return _liger_fn(mode, d)
    return _fxfuse_fn(mode)


def _fwd_bwd(fn, x, w, dy):
    x.grad = None
    w.grad = None
    fn(x, w).backward(dy)


def run(args) -> list[Row]:
    dtype = DTYPES[args.dtype]
    if args.pdl == "off":
        from fxfuse.kernels import _rms_norm_launch as launch

        launch.dw_pdl = lambda device: False  # the dw reduction launched after the backward's memory flush
    ceiling = copy_ceiling_gbps()
    print(f"copy ceiling: {ceiling:.0f} GB/s", flush=True)
    rows: list[Row] = []
    for shape in args.shapes:
        m, d = (int(s) for s in shape.lower().split("x"))
        case = f"rms_norm {args.mode} {args.dtype} {m}x{d}" + (" cg" if args.cuda_graph else "")
        case += " pdl-off" if args.pdl == "off" else ""
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, d, device="cuda", dtype=dtype, generator=gen).requires_grad_()
        w_init = 1.0 if args.mode == "llama" else 0.0
        w = torch.nn.Parameter((w_init + 0.1 * torch.randn(d, device="cuda", generator=gen)).to(dtype))
        dy = torch.randn(m, d, device="cuda", dtype=dtype, generator=gen)

        x64 = x.detach().double().requires_grad_()
        w64 = w.detach().double().requires_grad_()
        ref_y = eager_rms_norm(x64, w64, args.mode)
        ref_y.backward(dy.double())
        refs = (ref_y.detach(), x64.grad, w64.grad)
        nbytes = rms_norm_bytes(m, d, dtype)

        for provider in args.providers:
            if provider == "liger" and not have_liger():
                rows.append(Row(case, provider, None, note="liger_kernel not installed"))
                continue
            try:
                fn = _provider_fn(provider, args.mode, d)
                y = fn(x, w)
                x.grad = w.grad = None
                y.backward(dy)
                err = max(
                    ((a.double() - b).abs().max() / b.abs().max()).item()
                    for a, b in zip((y.detach(), x.grad, w.grad), refs)
                )
                del y  # its autograd graph holds x's AccumulateGrad node, made on the default stream
                # fresh leaves: their AccumulateGrad nodes are made on the capture's warm-up stream
                # (one made on the default stream breaks the capture: cudaErrorStreamCapture)
                xt, wt = x.detach().requires_grad_(), torch.nn.Parameter(w.detach())
                step = lambda: _fwd_bwd(fn, xt, wt, dy)  # noqa: E731
                ms = bench_ms(graphed(step) if args.cuda_graph else step)
                extra = peak_extra_mib(step)
            except Exception as exc:  # a provider failing must not hide the others
                rows.append(Row(case, provider, None, note=f"{type(exc).__name__}: {exc}"[:120]))
                continue
            gbps = nbytes / ms / 1e6
            rows.append(Row(case, provider, ms, gbps, 100 * gbps / ceiling, extra, err, "max rel err y/dx/dw vs fp64"))
    print_table(rows)
    return rows


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", nargs="+", default=["16384x4096", "4096x8192"], help="MxD row shapes")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--mode", choices=["llama", "gemma"], default="llama",
                        help="llama: w * y.to(x.dtype); gemma: (y * (1 + w)).type_as(x)")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="time CUDA-graph replays of fwd+bwd (GPU time only, no CPU dispatch/launch overhead)")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--pdl", choices=["on", "off"], default="on",
                        help="fxfuse's dw reduction is a programmatic dependent launch on sm_90+ (launch.dw_pdl)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
