"""Probe: the vocabulary-scaled loss head's extra work on the GPU, per pass / per chunk.

fast: one pass's [R, V] logits block through the row kernel's two sweeps (no scale) against the row
kernel's sweep 1 plus the column kernel (scale; dzr in place and the scale's grad in G row-group
partials, summed), over column kernel tiles BLOCK_R x BLOCK_V x warps x G (G 0: the shipped choice);
then both kernels on sub-blocks of S rows at a time (--sub-rows), so that the column kernel reads a
block the row kernel has just read, from L2, if S x V fits there (the shipped pass reads it from
DRAM twice: 1.56x an unscaled pass on an H100, thirty-fourth session). Its dzr and scale grad are
checked against the whole pass's first (--check alone does only that, on CPU under the interpreter too).
lean: the column sum of one [R, C] fp32 chunk of scale-grad terms, torch.sum(0) against a cuBLAS
matrix-vector product.

    python3 bench/probe_lce_vscale.py [--rows 1024] [--vocab 128256] [--tiles 16x256x8x0 32x512x8x1 ...]
        [--sub-rows 64 128 256] [--check --device cpu]
"""
from __future__ import annotations

import argparse

import torch
import triton

from common import bench_ms


def pass_bytes(rows: int, vocab: int, element_size: int) -> int:
    """Sweep 2's traffic, the floor of both variants: the block read twice (sweeps) and written once."""
    return 3 * rows * vocab * element_size


def _scaled_pass(lcef, z, t, loss, w, vs, lse, ds, n0, block_r, block_v, warps, groups):
    """Rows n0 .. n0 + R of the pass (z: their [R, V] view): the row kernel's sweep 1 (SUM_DS), then the
    column kernel over the same rows; ds += their scale grad."""
    from fxfuse.kernels._lce_chunks import _num_warps

    r, v = z.shape
    block = lcef._fast_tile(v)
    per_group = (lcef._cols_rows_per_group(r, block_r, triton.cdiv(v, block_v), z.device) if groups == 0
                 else triton.cdiv(triton.cdiv(r, groups), block_r) * block_r)
    part = torch.empty(triton.cdiv(r, per_group), v, device=z.device)
    block_n = lcef._rows_per_program(r, block, z.device)
    lcef._lce_fast_rows_kernel[(triton.cdiv(r, block_n),)](
        z, t, loss, w, vs, lse, n0, r, v, z.stride(0), -100, 1.0, 0.0, 1.0, 0.0, 0.0,
        HAS_VSCALE=True, SUM_DS=True, SOFTCAP=False, SMOOTHING=False, ROUND=0, ROUND_OPS=0, ROUND_OUT=1,
        RNE_BY_BITS=False, BLOCK_N=block_n, BLOCK=block, num_warps=_num_warps(block))
    lcef._lce_fast_cols_kernel[(triton.cdiv(v, block_v), part.shape[0])](
        z, t, lse, w, vs, part, n0, r, v, per_group, z.stride(0), -100, 1.0, 0.0, 1.0, 0.0,
        SOFTCAP=False, ROUND_OUT=1, RNE_BY_BITS=False, BLOCK_R=block_r, BLOCK_V=block_v, num_warps=warps)
    ds.add_(part.sum(0))


def fast_pass(args) -> None:
    import fxfuse.kernels.linear_cross_entropy_fast as lcef
    from fxfuse.kernels._lce_chunks import _num_warps

    r, v, dev = args.rows, args.vocab, args.device
    gen = torch.Generator(device=dev).manual_seed(0)
    z0 = torch.randn(r, v, device=dev, generator=gen).bfloat16()
    t = torch.randint(0, v, (r,), device=dev, generator=gen)
    w = torch.full((1,), 1.0 / r, device=dev)
    vs = torch.rand(v, device=dev, generator=gen) + 0.5
    loss, ds, lse = torch.empty(r, device=dev), torch.zeros(v, device=dev), torch.empty(r, device=dev)
    z = z0.clone()
    gbs = lambda ms: pass_bytes(r, v, 2) / ms / 1e6  # noqa: E731
    shipped = lcef._cols_tiles(r, v)
    tiles = (*shipped, _num_warps(shipped[0] * shipped[1]), 0)

    def whole():
        _scaled_pass(lcef, z, t, loss, w, vs, lse, ds, 0, *tiles)

    def sub_blocks(sub):
        for r0 in range(0, r, sub):
            _scaled_pass(lcef, z[r0:r0 + sub], t, loss, w, vs, lse[r0:r0 + sub], ds, r0, *tiles)

    for sub in args.sub_rows:  # same dzr (bits) and scale grad (fp32 sums in another grouping) as the whole pass
        z.copy_(z0), ds.zero_()
        whole()
        want_z, want_ds = z.clone(), ds.clone()
        z.copy_(z0), ds.zero_()
        sub_blocks(sub)
        ds_err = ((ds - want_ds).abs().max() / want_ds.abs().max()).item()
        print(f"check, sub-blocks of {sub} rows: dzr bit-equal {torch.equal(z, want_z)}, scale grad rel err {ds_err:.1e}")
        assert torch.equal(z, want_z) and ds_err < 1e-5
    if args.check:
        return

    def rows_only():
        lcef._fast_rows(z, t, loss, w, None, None, 0, -100, 0.0, 0.0, 1.0, False, False, True)

    ms = bench_ms(rows_only)
    print(f"fast pass [{r}, {v}] bf16, no scale (row kernel, two sweeps): {ms * 1e3:.1f} us, {gbs(ms):.0f} GB/s")
    for spec in [f"{'x'.join(map(str, tiles))} (shipped)", *args.tiles]:
        block_r, block_v, warps, groups = (int(p) for p in spec.split()[0].split("x"))
        ms = bench_ms(lambda: _scaled_pass(lcef, z, t, loss, w, vs, lse, ds, 0, block_r, block_v, warps, groups))
        print(f"  scale: row sweep 1 + column kernel {spec}: {ms * 1e3:.1f} us, {gbs(ms):.0f} GB/s")
    for sub in args.sub_rows:
        ms = bench_ms(lambda: sub_blocks(sub))
        print(f"  scale, shipped tiles, sub-blocks of {sub} rows ({sub * v * 2 / 2**20:.0f} MiB): {ms * 1e3:.1f} us, "
              f"{gbs(ms):.0f} GB/s")


def lean_chunk(args) -> None:
    r, c, n_chunks = args.lean_rows, args.lean_cols, args.lean_chunks
    z = torch.randn(r, c, device="cuda")
    ds = torch.zeros(c, device="cuda")
    ones = torch.ones(r, device="cuda")
    gbs = lambda ms: r * c * 4 / ms / 1e6  # noqa: E731
    for name, fn in [("z.sum(0)", lambda: ds.add_(z.sum(0))), ("addmv(z.T, ones)", lambda: ds.addmv_(z.T, ones))]:
        ms = bench_ms(fn)
        print(f"lean chunk [{r}, {c}] fp32 column sum, {name}: {ms * 1e3:.1f} us, {gbs(ms):.0f} GB/s "
              f"(x{n_chunks} chunks: {ms * n_chunks:.2f} ms)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1024, help="fast: rows per pass (8192 tokens / 8)")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--tiles", nargs="*", default=[
        "32x512x8x1", "32x512x8x2", "32x512x8x8", "16x256x8x0", "16x256x4x0", "32x256x8x0", "16x512x8x0",
        "64x512x8x0", "32x1024x8x0", "32x512x16x0", "8x1024x8x0"], help="BLOCK_RxBLOCK_VxwarpsxG of the column kernel")
    p.add_argument("--sub-rows", type=int, nargs="*", default=[64, 128, 256],
                   help="rows per sub-block of the scaled pass (row kernel then column kernel on each)")
    p.add_argument("--check", action="store_true", help="only check the sub-blocks against the whole pass")
    p.add_argument("--device", default="cuda", help="cpu (with TRITON_INTERPRET=1) for --check")
    p.add_argument("--lean-rows", type=int, default=4096)
    p.add_argument("--lean-cols", type=int, default=1024)
    p.add_argument("--lean-chunks", type=int, default=252, help="chunks per fwd+bwd (8192 x 128256: 2 x 126)")
    args = p.parse_args()
    fast_pass(args)
    if not args.check:
        lean_chunk(args)


if __name__ == "__main__":
    main()
