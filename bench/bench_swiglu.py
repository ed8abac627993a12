"""Benchmark of fxfuse.swiglu (gated-MLP activation), bf16 fwd+bwd, against eager, Inductor and Liger.

    python bench/bench_swiglu.py [--shapes 16384x14336 8192x8192] [--act silu] [--chunked]
    python bench/bench_swiglu.py --act clamped_swiglu --shapes 65536x2880   # gpt-oss experts
    python bench/bench_swiglu.py --interleaved --round-act --shapes 65536x2880 --cuda-graph
    python bench/bench_swiglu.py --act softcapped_swiglu --chunked --shapes 65536x1024   # Inkling 2 experts
    python bench/bench_swiglu.py --up-dtype float32 --shapes 16384x8192   # Mamba's mixer under bf16 autocast
    python bench/bench_swiglu.py --act gelu_tanh --fp32-act --shapes 16384x8192   # T5's gelu_new, CUDA autocast

--act clamped_swiglu is gpt-oss's activation (alpha 1.702, limit 7) on its layout, gate and up
interleaved in one [M, 2I] tensor (gate_up[..., ::2], gate_up[..., 1::2]); --chunked takes gate and
up as the halves of one [M, 2I] tensor (Phi-3), --interleaved as gpt-oss's columns. In the packed
layouts the gradient is that of the [M, 2I] tensor, and fxfuse runs the op its backend emits there
(fxfuse::swiglu_packed / clamped_swiglu_packed: d gate_up written by the kernel, no scatter of dg
and du into it). --round-act: fxfuse rounds as under the backend's default numerics="eager".
--up-dtype: up in another dtype than gate (bf16 gate, fp32 up under bf16 autocast: Mamba's scan output
times act(gate), Gemma 3n's per-layer gate); out and dout in the promoted dtype, as eager's product.
--fp32-act: act(gate) in fp32 from a bf16 gate, so out = act(g) * u and dout are fp32 (T5's gelu_new
under CUDA autocast, which runs its pow in fp32); fxfuse runs fxfuse::swiglu with out_dtype=float32.
--act softcapped_swiglu is Inkling 2's (gate cap 4, up cap 25, fp32 math as its ``.float()``); on a
packed layout fxfuse runs fxfuse::softcapped_swiglu_packed, as the backend emits it since the
thirty-fourth session (before: the unpacked op on the halves, dgate and dup concatenated).

Each case times ``out = act(g) * u`` and its backward (``torch.autograd.grad``, so no gradient
accumulation traffic) and reports GB/s from ``swiglu_bytes`` against the measured copy ceiling.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    PROVIDERS, Row, bench_ms, copy_ceiling_gbps, graphed, have_liger, peak_extra_mib, print_table,
)

DEFAULT_SHAPES = ("16384x14336", "8192x8192")


def swiglu_bytes(m: int, i: int, element_size: int, up_size: int | None = None, out_size: int | None = None) -> int:
    """Minimum bytes of fwd+bwd: fwd reads g, u and writes out; bwd reads g, u, dout and writes dg, du.
    Sizes per element: g's (element_size), u's and out's (default: g's)."""
    up_size, out_size = up_size or element_size, out_size or element_size
    return 3 * m * i * element_size + 3 * m * i * up_size + 2 * m * i * out_size


GPT_OSS_ALPHA, GPT_OSS_LIMIT = 1.702, 7.0
INKLING_GATE_CAP, INKLING_UP_CAP = 4.0, 25.0  # Inkling2Config's mlp_gate_softcap, mlp_up_softcap defaults


def eager_swiglu(g: torch.Tensor, u: torch.Tensor, act: str, fp32_act: bool = False) -> torch.Tensor:
    if act == "clamped_swiglu":  # HF GptOssExperts._apply_gate after its split
        g = g.clamp(min=None, max=GPT_OSS_LIMIT)
        u = u.clamp(min=-GPT_OSS_LIMIT, max=GPT_OSS_LIMIT)
        return (u + 1) * (g * torch.sigmoid(g * GPT_OSS_ALPHA))
    if act == "softcapped_swiglu":  # HF Inkling2SoftcappedSwiGLU on its fp32 upcast
        gf, uf = g.float(), u.float()
        capped = torch.tanh(gf / INKLING_GATE_CAP) * INKLING_GATE_CAP * torch.sigmoid(gf)
        return (capped * (torch.tanh(uf / INKLING_UP_CAP) * INKLING_UP_CAP)).to(g.dtype)
    if fp32_act:  # CUDA autocast's fp32 pow / exp inside the activation: act(g) and the product are fp32
        g = g.float()
    if act == "silu":
        return F.silu(g) * u
    return F.gelu(g, approximate="tanh" if act == "gelu_tanh" else "none") * u


def _liger_fn(act: str, mixed: bool = False):
    """Liger's fused op for act, or (None, reason)."""
    if not have_liger():
        return None, "liger_kernel not installed"
    if mixed:
        return None, "liger's gated ops take one dtype (in, out)"
    if act == "silu":
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        return LigerSiLUMulFunction.apply, ""
    if act == "gelu_tanh":
        from liger_kernel.ops.geglu import LigerGELUMulFunction

        return LigerGELUMulFunction.apply, ""
    return None, f"liger has no {act} gated op"


def _halves(gate_up: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    if layout == "interleaved":  # gpt-oss: gate_up[..., ::2], gate_up[..., 1::2]
        return gate_up[..., ::2], gate_up[..., 1::2]
    return gate_up.chunk(2, dim=-1)  # Phi-3's gate_up_proj


def _fxfuse_fn(act: str, layout: str, round_act: bool, fp32_act: bool = False):
    """What the fxfuse backend emits: the packed op when gate and up are halves of one tensor.
    round_act: numerics="eager" (the backend's default; fp32 math between eager's roundings).
    fp32_act: out in fp32 (out_dtype), as the backend lowers an fp32 act(gate) of a low-precision gate."""
    import fxfuse.kernels.swiglu_packed  # noqa: F401  (registers the fxfuse swiglu ops)

    ops = torch.ops.fxfuse
    if act == "softcapped_swiglu":
        caps = INKLING_GATE_CAP, INKLING_UP_CAP
        if layout == "separate":
            return lambda g, u: ops.softcapped_swiglu(g, u, *caps)
        return lambda gu: ops.softcapped_swiglu_packed(gu, *caps, layout == "interleaved", False)
    if layout == "separate":
        out_dtype = torch.float32 if fp32_act else None
        return lambda g, u: ops.swiglu(g, u, act, round_act, out_dtype=out_dtype)
    interleaved = layout == "interleaved"
    if act == "clamped_swiglu":
        return lambda gu: ops.clamped_swiglu_packed(gu, GPT_OSS_ALPHA, GPT_OSS_LIMIT, interleaved, False, round_act)
    return lambda gu: ops.swiglu_packed(gu, act, interleaved, False, round_act)


def _provider_fn(provider: str, act: str, layout: str, round_act: bool = False, mixed: bool = False,
                 fp32_act: bool = False):
    """(fn(*leaves) -> out, note); fn is None when the provider cannot run. leaves: (g, u), or
    (gate_up,) for a packed layout."""
    if provider == "fxfuse":
        return _fxfuse_fn(act, layout, round_act, fp32_act), ""
    if provider == "liger":
        fn, note = _liger_fn(act, mixed or fp32_act)
    elif provider == "inductor":
        fn, note = torch.compile(lambda g, u: eager_swiglu(g, u, act, fp32_act)), ""
    elif provider == "eager":
        fn, note = (lambda g, u: eager_swiglu(g, u, act, fp32_act)), ""
    else:
        raise ValueError(provider)
    if fn is None or layout == "separate":
        return fn, note
    if provider == "inductor":  # the split inside the compiled function, as in a compiled model
        return torch.compile(lambda gu: eager_swiglu(*_halves(gu, layout), act)), note
    return (lambda gu: fn(*_halves(gu, layout))), note


def _inputs(m: int, i: int, dtype: torch.dtype, layout: str, seed: int = 0, up_dtype: torch.dtype | None = None,
            out_dtype: torch.dtype | None = None):
    """(leaves, dout): leaves are gate, up [m, i] (up in up_dtype, default dtype), or one gate_up
    [m, 2i] for a packed layout ("chunked": gate and up its halves; "interleaved": its even and odd
    columns); dout: [m, i] in the output's dtype (out_dtype, default gate's and up's promoted)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    scale = 4 if layout == "interleaved" else 1  # x4: some values past gpt-oss's clamp at 7
    up_dtype = up_dtype or dtype
    if layout == "separate":
        leaves = tuple(torch.randn(m, i, device="cuda", dtype=d, generator=gen).requires_grad_()
                       for d in (dtype, up_dtype))
    else:
        leaves = ((torch.randn(m, 2 * i, device="cuda", generator=gen) * scale).to(dtype).requires_grad_(),)
    out_dtype = out_dtype or torch.promote_types(dtype, up_dtype)
    dout = torch.randn(m, i, device="cuda", dtype=out_dtype, generator=gen)
    return leaves, dout


def _fwd_bwd(fn, leaves, dout):
    """(out, *grads of the leaves) of one fwd+bwd."""
    out = fn(*leaves)
    return (out, *torch.autograd.grad(out, leaves, dout))


def _max_err(fn, m: int, i: int, dtype: torch.dtype, act: str, layout: str, up_dtype=None, out_dtype=None) -> float:
    """Max abs error of out and the gradients vs an fp32 reference on the same inputs (fresh copies:
    Liger's backward overwrites its saved inputs in place)."""
    leaves, dout = _inputs(m, i, dtype, layout, seed=1, up_dtype=up_dtype, out_dtype=out_dtype)
    wide = tuple(t.detach().float().requires_grad_() for t in leaves)
    ref_fn = (lambda g, u: eager_swiglu(g, u, act)) if layout == "separate" else (
        lambda gu: eager_swiglu(*_halves(gu, layout), act))
    ref = _fwd_bwd(ref_fn, wide, dout.float())
    got = _fwd_bwd(fn, leaves, dout)
    return max((x.float() - r).abs().max().item() for x, r in zip(got, ref))


def run(args) -> list[Row]:
    dtype = getattr(torch, args.dtype)
    up_dtype = getattr(torch, args.up_dtype or args.dtype)
    mixed = up_dtype != dtype
    out_dtype = torch.float32 if args.fp32_act else torch.promote_types(dtype, up_dtype)
    ceiling = copy_ceiling_gbps()
    print(f"copy ceiling: {ceiling:.0f} GB/s", flush=True)
    rows = []
    for shape in args.shapes:
        m, i = (int(v) for v in shape.lower().split("x"))
        layout = ("interleaved" if args.act == "clamped_swiglu" or args.interleaved
                  else "chunked" if args.chunked else "separate")
        if mixed and layout != "separate":
            raise SystemExit("--up-dtype needs gate and up as separate tensors (not --chunked / --interleaved)")
        if args.fp32_act and (layout != "separate" or args.act not in ("silu", "gelu", "gelu_tanh")):
            raise SystemExit("--fp32-act takes --act silu / gelu / gelu_tanh on separate gate and up")
        dtypes = f"{args.dtype}" + (f" gate, {args.up_dtype} up" if mixed else "")
        dtypes += " fp32 act" if args.fp32_act else ""
        case = f"swiglu-{args.act} {m}x{i} {dtypes}{'' if layout == 'separate' else ' ' + layout}"
        size = lambda d: torch.empty((), dtype=d).element_size()  # noqa: E731
        nbytes = swiglu_bytes(m, i, size(dtype), size(up_dtype), size(out_dtype))
        for provider in args.providers:
            fn, note = _provider_fn(provider, args.act, layout, args.round_act, mixed, args.fp32_act)
            if fn is None:
                rows.append(Row(case, provider, None, note=note))
                continue
            leaves, dout = _inputs(m, i, dtype, layout, up_dtype=up_dtype, out_dtype=out_dtype)
            step = lambda: _fwd_bwd(fn, leaves, dout)  # noqa: E731
            err = _max_err(fn, m, i, dtype, args.act, layout, up_dtype, out_dtype)
            ms = bench_ms(graphed(step) if args.cuda_graph else step)
            gbps = nbytes / ms / 1e6
            rows.append(Row(case, provider, ms, gbps, 100 * gbps / ceiling, peak_extra_mib(step), err, note))
            del leaves, dout
            torch.cuda.empty_cache()
    print_table(rows)
    return rows


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="MxI per case (gate and up each MxI)")
    parser.add_argument("--act", default="silu", choices=("silu", "gelu", "gelu_tanh", "clamped_swiglu", "softcapped_swiglu"))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--up-dtype", default=None, choices=("bfloat16", "float16", "float32"),
                        help="up in this dtype (default --dtype): a mixed pair as under autocast, out promoted")
    parser.add_argument("--fp32-act", action="store_true",
                        help="act(gate) in fp32, so out is fp32 (T5's gelu_new, CUDA autocast): fxfuse's out_dtype")
    parser.add_argument("--chunked", action="store_true", help="gate, up = gate_up.chunk(2, -1) of one [M, 2I] tensor")
    parser.add_argument("--interleaved", action="store_true",
                        help="gate, up = gate_up[..., ::2], gate_up[..., 1::2] (clamped_swiglu's layout, always)")
    parser.add_argument("--round-act", action="store_true",
                        help="fxfuse rounds where eager's ops do (numerics='eager', the backend's default)")
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    parser.add_argument("--cuda-graph", action="store_true",
                        help="time CUDA-graph replays of fwd+bwd (GPU time only, no CPU dispatch/launch overhead)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(parser)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
