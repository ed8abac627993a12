"""Benchmark fxfuse.rope (q and k rotated in one launch), fwd+bwd, against eager / Inductor / Liger.

HF Llama shapes by default: q [B, Hq, T, D], k [B, Hk, T, D], cos/sin [B, 1, T, D] in bf16.
    python bench/bench_rope.py [--batch 4 --heads 32 --kv-heads 8 --seq 4096 --dim 128]
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


def rope_bytes(b: int, hq: int, hk: int, t: int, d: int, cos_batch: int, elem: int, cos_elem: int) -> int:
    """Minimum bytes of fwd+bwd: fwd reads q, k, cos, sin and writes q', k'; bwd reads dq', dk',
    cos, sin and writes dq, dk. So q- and k-sized tensors move 4 times each, cos and sin twice."""
    qk = (hq + hk) * b * t * d * elem
    cos_sin = 2 * cos_batch * t * d * cos_elem
    return 4 * qk + 2 * cos_sin


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hf_rope(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb with cos/sin already [B, 1, T, D]."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _providers(wanted):
    """name -> fn(q, k, cos4, sin4) or a skip note."""
    out = {}
    if "eager" in wanted:
        out["eager"] = hf_rope
    if "inductor" in wanted:
        out["inductor"] = torch.compile(hf_rope)
    if "liger" in wanted:
        if have_liger():
            from liger_kernel.ops.rope import LigerRopeFunction

            # Liger takes cos/sin as [B or 1, T, D] and unsqueezes dim 1 itself.
            out["liger"] = lambda q, k, c, s: LigerRopeFunction.apply(q, k, c.squeeze(1), s.squeeze(1))
        else:
            out["liger"] = "liger_kernel not installed"
    if "fxfuse" in wanted:
        import fxfuse.kernels.rope  # noqa: F401  registers torch.ops.fxfuse.rope

        out["fxfuse"] = lambda q, k, c, s: torch.ops.fxfuse.rope(q, k, c, s, False, c.shape[-1])
    return out


def _inputs(args, dtype):
    b, hq, hk, t, d = args.batch, args.heads, args.kv_heads, args.seq, args.dim
    g = torch.Generator(device="cuda").manual_seed(0)
    if args.transposed:  # HF: q_proj(x).view(B, T, H, D).transpose(1, 2), a non-contiguous view
        q = torch.randn(b, t, hq, d, device="cuda", generator=g).to(dtype).transpose(1, 2)
        k = torch.randn(b, t, hk, d, device="cuda", generator=g).to(dtype).transpose(1, 2)
    else:
        q = torch.randn(b, hq, t, d, device="cuda", generator=g).to(dtype)
        k = torch.randn(b, hk, t, d, device="cuda", generator=g).to(dtype)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2, device="cuda").float() / d)
    pos = torch.arange(t, device="cuda").float()[None].expand(b, t)
    emb = torch.cat([pos[..., None] * inv_freq] * 2, dim=-1)[:, None]  # [B, 1, T, D]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    return q, k, cos, sin, gq, gk


def _fwd_bwd(fn, q, k, cos, sin, gq, gk):
    qo, ko = fn(q, k, cos, sin)
    dq, dk = torch.autograd.grad((qo, ko), (q, k), (gq, gk))
    return qo, ko, dq, dk


def _kernels_only(q, k, cos, sin, gq, gk):
    """fxfuse's two launches (forward, backward) without custom-op dispatch or autograd."""
    from fxfuse.kernels.rope import _launch

    _launch(q.detach(), k.detach(), cos, sin, False, cos.shape[-1], backward=False)
    return _launch(gq, gk, cos, sin, False, cos.shape[-1], backward=True)


def run(args) -> list[Row]:
    dtype = DTYPES[args.dtype]
    q, k, cos, sin, gq, gk = _inputs(args, dtype)
    q.requires_grad_()
    k.requires_grad_()
    ref = _fwd_bwd(hf_rope, *(x.detach().float().requires_grad_(x.requires_grad)
                              for x in (q, k, cos, sin, gq, gk)))
    nbytes = rope_bytes(args.batch, args.heads, args.kv_heads, args.seq, args.dim, cos.shape[0],
                        q.element_size(), cos.element_size())
    ceiling = copy_ceiling_gbps()
    case = (f"rope {args.dtype} q{list(q.shape)} k{args.kv_heads}h"
            f"{' T' if args.transposed else ''}")
    rows = []
    for name, fn in _providers(args.providers).items():
        if isinstance(fn, str):
            rows.append(Row(case, name, None, note=fn))
            continue
        try:
            out = _fwd_bwd(fn, q, k, cos, sin, gq, gk)
            err = max((a.float() - e).abs().max().item() for a, e in zip(out, ref))
            del out  # its autograd graph holds q's and k's AccumulateGrad nodes, made on the default stream
            # fresh leaves: their gradient nodes are made on the capture's warm-up stream (one made on
            # the default stream breaks the capture: cudaErrorStreamCapture, as in bench_rms_norm)
            qt, kt = q.detach().requires_grad_(), k.detach().requires_grad_()
            step = lambda fn=fn: _fwd_bwd(fn, qt, kt, cos, sin, gq, gk)  # noqa: E731
            ms = bench_ms(graphed(step) if args.cuda_graph else step)
        except Exception as exc:  # a provider failing (e.g. a CUDA-graph capture) must not hide the others
            rows.append(Row(case, name, None, note=f"{type(exc).__name__}: {exc}"[:120]))
            continue
        gbps = nbytes / ms / 1e6
        rows.append(Row(case, name, ms, gbps, 100 * gbps / ceiling, peak_extra_mib(step), err))
    if "fxfuse" in args.providers:  # how much of fxfuse's time is host overhead (dispatch, autograd)
        ms = bench_ms(lambda: _kernels_only(q, k, cos, sin, gq, gk))
        gbps = nbytes / ms / 1e6
        rows.append(Row(case, "fxfuse-k", ms, gbps, 100 * gbps / ceiling,
                        note="fxfuse kernels only: no custom-op dispatch, no autograd"))
    rows.append(Row(case, "copy", None, ceiling, 100.0, note=f"ceiling; {nbytes / 1e6:.0f} MB moved"))
    return rows


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--transposed", action="store_true",
                        help="q, k as [B, T, H, D] projections viewed as [B, H, T, D]")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--cuda-graph", action="store_true",
                        help="time CUDA-graph replays of fwd+bwd (GPU time only, no CPU dispatch/launch overhead)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    print_table(run(parser.parse_args()))


if __name__ == "__main__":
    main()
