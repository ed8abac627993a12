"""Probe: Inkling 2's softcapped SwiGLU kernels on one packed gate_up, over program sizes (max
elements per tensor a program, _gated.launch_config) and the transcendental functions (libdevice's
tanh / expf, or exp-based ones: tl.exp's ex2.approx, the interpreter's formulas), bf16 fwd+bwd.

    python3 bench/probe_softcapped_swiglu.py [--shape 65536x1024] [--tiles 1024 2048 4096 8192]
"""
from __future__ import annotations

import argparse

import torch

from common import bench_ms, copy_ceiling_gbps


def swiglu_bytes(m: int, i: int, element_size: int) -> int:
    """fwd reads gate_up and writes out; bwd reads gate_up and dout and writes d gate_up: 8 [m, i]."""
    return 8 * m * i * element_size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", nargs="+", default=["65536x1024", "16384x4096"], help="MxI (gate_up is [M, 2I])")
    p.add_argument("--tiles", nargs="+", type=int, default=[1024, 2048, 4096, 8192])
    args = p.parse_args()
    import fxfuse.kernels.softcapped_swiglu as sc
    from fxfuse.kernels._gated import launch_backward, launch_forward
    from fxfuse.kernels.swiglu_packed import split_packed

    ceiling = copy_ceiling_gbps()
    print(f"copy ceiling {ceiling:.0f} GB/s; shipped max tile {sc._MAX_TILE}")
    caps = (4.0, 25.0)
    for shape in args.shape:
        m, i = (int(s) for s in shape.split("x"))
        gen = torch.Generator(device="cuda").manual_seed(0)
        gate_up = (torch.randn(m, 2 * i, device="cuda", generator=gen) * 4).bfloat16()
        dout = torch.randn(m, i, device="cuda", generator=gen).bfloat16()
        grad = torch.empty_like(gate_up)
        gate, up = split_packed(gate_up, False, False)
        dgate, dup = split_packed(grad, False, False)
        for libdevice in (True, False):
            for tile in args.tiles:
                def step():
                    launch_forward(sc._softcapped_swiglu_fwd_kernel, gate, up, caps, tile, LIBDEVICE=libdevice)
                    launch_backward(sc._softcapped_swiglu_bwd_kernel, dout, gate, up, dgate, dup, True, True, caps,
                                    tile, LIBDEVICE=libdevice)
                ms = bench_ms(step)
                gbs = swiglu_bytes(m, i, 2) / ms / 1e6
                print(f"{shape} libdevice={libdevice!s:5} tile {tile:5}: {ms:.3f} ms, {gbs:.0f} GB/s, "
                      f"{100 * gbs / ceiling:.1f}% of copy")


if __name__ == "__main__":
    main()
