"""Probe: where Inkling 2's softcapped SwiGLU (one packed gate_up, bf16) loses to Inductor: the
shipped kernels against twins of them with cheaper math, forward and backward timed apart and
together, CUDA-graph replays round robin, and Inductor's fwd+bwd of the eager module.

    python3 bench/probe_softcapped_swiglu.py [--shapes 65536x1024 16384x4096] [--tiles 1024 2048] [--reps 5]

Math variants of the twins (MATH constexpr):
    0  the 34th session's kernels: x / cap, tanh's divide by `/`, the sigmoid's by tl.math.div_rn
    1  the shipped kernels (35th session): the caps' reciprocals multiplied, tl.fdiv (approximate)
       inside tanh and sigmoid; the twin's outputs are checked bit-equal to the shipped ones
    2  the same loads and stores with trivial math (out = g * u): the layout's own ceiling
    3  as 1, but one approximate reciprocal for both tanh (2 / (d1 d2), times d2 or d1; each tanh's
       argument clamped to +-15, where tanh rounds to +-1 in fp32): five special-function ops an
       element instead of six
"""
from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl

from common import bench_ms, copy_ceiling_gbps, graphed
from fxfuse.kernels._gated import load_pair, load_tile, store_out, store_pair


@triton.jit
def _div(a, b, MATH: tl.constexpr):
    if MATH == 1:
        return tl.fdiv(a, b)
    return a / b


@triton.jit
def _tanh(u, MATH: tl.constexpr):
    u2 = u * u
    series = u * (1.0 + u2 * (-1.0 / 3 + u2 * (2.0 / 15 + u2 * (-17.0 / 315 + u2 * (62.0 / 2835)))))
    return tl.where(tl.abs(u) < 0.25, series, 1.0 - _div(2.0, tl.exp(2.0 * u) + 1.0, MATH))


@triton.jit
def _tanh_pair(x, y):
    # (tanh x, tanh y) from one reciprocal: 1 - 2 / d = 1 - (2 / (d1 d2)) * (the other d)
    d1 = tl.exp(2.0 * tl.minimum(tl.maximum(x, -15.0), 15.0)) + 1.0
    d2 = tl.exp(2.0 * tl.minimum(tl.maximum(y, -15.0), 15.0)) + 1.0
    q = tl.fdiv(2.0, d1 * d2)
    x2, y2 = x * x, y * y
    sx = x * (1.0 + x2 * (-1.0 / 3 + x2 * (2.0 / 15 + x2 * (-17.0 / 315 + x2 * (62.0 / 2835)))))
    sy = y * (1.0 + y2 * (-1.0 / 3 + y2 * (2.0 / 15 + y2 * (-17.0 / 315 + y2 * (62.0 / 2835)))))
    return tl.where(tl.abs(x) < 0.25, sx, 1.0 - q * d2), tl.where(tl.abs(y) < 0.25, sy, 1.0 - q * d1)


@triton.jit
def _terms(g, u, gate_cap, up_cap, MATH: tl.constexpr):
    if MATH == 3:
        t, r = _tanh_pair(g * (1.0 / gate_cap), u * (1.0 / up_cap))
    elif MATH == 1:
        t = _tanh(g * (1.0 / gate_cap), MATH)
        r = _tanh(u * (1.0 / up_cap), MATH)
    else:
        t = _tanh(g / gate_cap, MATH)
        r = _tanh(u / up_cap, MATH)
    a = t * gate_cap
    if MATH == 1 or MATH == 3:
        s = tl.fdiv(1.0, 1.0 + tl.exp(-g))
    else:
        s = tl.math.div_rn(tl.full(g.shape, 1.0, tl.float32), 1.0 + tl.exp(-g))
    return t, a, s, a * s, r, r * up_cap


@triton.jit
def _fwd(gate_ptr, up_ptr, out_ptr, M, I, stride_gm, stride_gn, stride_um, stride_un, gate_cap, up_cap,
         PAIR: tl.constexpr, RNE_BY_BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
         MATH: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pid_n = tl.program_id(1)
    g, u = load_pair(gate_ptr, up_ptr, rows, pid_n, M, I, stride_gm, stride_gn, stride_um, stride_un,
                     PAIR, True, BLOCK_M, BLOCK_N)
    if MATH == 2:
        y = g * u
    else:
        _, _, _, p, _, b = _terms(g, u, gate_cap, up_cap, MATH)
        y = p * b
    store_out(out_ptr, y, rows, pid_n, M, I, RNE_BY_BITS, BLOCK_N)


@triton.jit
def _bwd(dout_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, M, I, stride_dm, stride_dn, stride_gm, stride_gn,
         stride_um, stride_un, stride_om, stride_on, gate_cap, up_cap,
         PAIR: tl.constexpr, OUT_PAIR: tl.constexpr, READ_BEFORE_WRITE: tl.constexpr, NEED_DGATE: tl.constexpr,
         NEED_DUP: tl.constexpr, RNE_BY_BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
         MATH: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pid_n = tl.program_id(1)
    dout = load_tile(dout_ptr, rows, pid_n, M, I, stride_dm, stride_dn, BLOCK_N)
    g, u = load_pair(gate_ptr, up_ptr, rows, pid_n, M, I, stride_gm, stride_gn, stride_um, stride_un,
                     PAIR, True, BLOCK_M, BLOCK_N)
    if MATH == 2:
        dg = dout * u
        du = dout * g
    else:
        t, a, s, p, r, b = _terms(g, u, gate_cap, up_cap, MATH)
        dp = dout * b
        if MATH == 1 or MATH == 3:
            du = ((dout * p) * up_cap) * (1.0 - r * r) * (1.0 / up_cap)
            dg = ((dp * s) * gate_cap) * (1.0 - t * t) * (1.0 / gate_cap) + ((dp * a) * s) * (1.0 - s)
        else:
            du = ((dout * p) * up_cap) * (1.0 - r * r) / up_cap
            dg = ((dp * s) * gate_cap) * (1.0 - t * t) / gate_cap + ((dp * a) * s) * (1.0 - s)
    store_pair(dgate_ptr, dup_ptr, dg, du, rows, pid_n, M, I, stride_om, stride_on, OUT_PAIR, True, True,
               RNE_BY_BITS, BLOCK_M, BLOCK_N)


def swiglu_bytes(m: int, i: int, element_size: int, part: str) -> int:
    """fwd reads gate_up [m, 2i] and writes out; bwd reads gate_up and dout and writes d gate_up."""
    return {"fwd": 3, "bwd": 5, "both": 8}[part] * m * i * element_size


def eager_softcapped(gate_up: torch.Tensor, gate_cap: float, up_cap: float) -> torch.Tensor:
    gate, up = gate_up.chunk(2, -1)
    g, u = gate.float(), up.float()
    return (torch.tanh(g / gate_cap) * gate_cap * torch.sigmoid(g) * (torch.tanh(u / up_cap) * up_cap)).to(gate.dtype)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["65536x1024", "16384x4096"], help="MxI (gate_up is [M, 2I])")
    p.add_argument("--tiles", nargs="+", type=int, default=[1024, 2048])
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    import fxfuse.kernels.softcapped_swiglu as sc
    from fxfuse.kernels._gated import launch_backward, launch_forward
    from fxfuse.kernels.swiglu_packed import split_packed

    ceiling = copy_ceiling_gbps()
    print(f"copy ceiling {ceiling:.0f} GB/s; shipped max tile {sc._MAX_TILE}")
    caps = (4.0, 25.0)
    for shape in args.shapes:
        m, i = (int(s) for s in shape.split("x"))
        gen = torch.Generator(device="cuda").manual_seed(0)
        gate_up = (torch.randn(m, 2 * i, device="cuda", generator=gen) * 4).bfloat16()
        dout = torch.randn(m, i, device="cuda", generator=gen).bfloat16()
        grad = torch.empty_like(gate_up)
        gate, up = split_packed(gate_up, False, False)
        dgate, dup = split_packed(grad, False, False)
        out_ref = launch_forward(sc._softcapped_swiglu_fwd_kernel, gate, up, caps, sc._MAX_TILE)
        launch_backward(sc._softcapped_swiglu_bwd_kernel, dout, gate, up, dgate, dup, True, True, caps, sc._MAX_TILE)
        grad_ref = grad.clone()
        steps = {}
        for tile in args.tiles:
            steps[f"shipped tile {tile}"] = {
                "fwd": lambda t=tile: launch_forward(sc._softcapped_swiglu_fwd_kernel, gate, up, caps, t),
                "bwd": lambda t=tile: launch_backward(sc._softcapped_swiglu_bwd_kernel, dout, gate, up, dgate, dup,
                                                      True, True, caps, t)}
            for math in (0, 1, 2, 3):
                steps[f"twin MATH={math} tile {tile}"] = {
                    "fwd": lambda t=tile, k=math: launch_forward(_fwd, gate, up, caps, t, MATH=k),
                    "bwd": lambda t=tile, k=math: launch_backward(_bwd, dout, gate, up, dgate, dup, True, True, caps,
                                                                  t, MATH=k)}
        compiled = torch.compile(eager_softcapped)
        leaf = gate_up.clone().requires_grad_()
        steps["inductor"] = {"both": lambda: torch.autograd.grad(compiled(leaf, *caps), leaf, dout)}
        for name, fns in steps.items():  # outputs against the shipped kernels (twin 1 bit-equal expected)
            if "fwd" in fns:
                out = fns["fwd"]()
                fns["bwd"]()
                diff = max((out.float() - out_ref.float()).abs().max().item(), (grad - grad_ref).abs().max().item())
                print(f"{shape} {name}: max |diff| vs shipped {diff:.3g}")
                fns["both"] = lambda f=fns["fwd"], b=fns["bwd"]: (f(), b())
        graphs = {(name, part): graphed(fn) for name, fns in steps.items() for part, fn in fns.items()}
        times = {key: [] for key in graphs}
        for _ in range(args.reps):
            for key, g in graphs.items():
                times[key].append(bench_ms(g))
        for (name, part), ts in times.items():
            ms = statistics.median(ts)
            gbs = swiglu_bytes(m, i, 2, part) / ms / 1e6
            print(f"{shape} {name:22} {part:4}: {ms * 1e3:7.1f} us, {gbs:5.0f} GB/s, {100 * gbs / ceiling:5.1f}% of copy")


if __name__ == "__main__":
    main()
