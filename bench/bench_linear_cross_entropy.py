"""Benchmark of fxfuse.linear_cross_entropy (lm_head + cross-entropy), fwd+bwd, against eager,
Inductor and Liger; fxfuse's two algorithms side by side ("fxfuse": the default 4-matmul "lean"
one; "fxfuse-fast": the 3-matmul "fast" one, option loss_head="fast"), and the time floor of any
implementation: "matmuls", the three cuBLAS matmuls alone at full size, and "matmuls-passes", the same
split into the fast algorithm's passes of R rows (no loss, no softmax: the time that is not matmul
is the difference to these rows).

    python bench/bench_linear_cross_entropy.py [--shapes 8192x4096x128256] [--dtype bfloat16]
        [--label-smoothing 0.1] [--softcap 30] [--bias] [--frozen-weight] [--fast-rows 512 2048]
        [--vocab-scale [--frozen-scale]] [--log-probs]

--vocab-scale times Dory's head instead, ``cross_entropy(linear(x, W, b).float() * s, t)`` with a
learned [V] scale s (its gradient included; --frozen-scale: not, as under LoRA): fxfuse fuses it through
the backend, s the op's fp32 vocab_scale (providers eager, inductor, fxfuse-compiled[-lean], and the
bare op as fxfuse / fxfuse-fast; Liger has no such scale).

--log-probs times an RL policy loss on per-token log-probs instead (GRPO's ``-(exp(lp - lp.detach()) *
adv).mean()``, lp spelled as verl writes it, ``log_softmax(linear(x, W, b).float(), -1).gather(-1, t[:, None])``,
no target ignored): fxfuse-compiled fuses it through the backend's respelling to minus the per-token
cross-entropy; fxfuse / fxfuse-fast / liger are their ops with reduction "none".

Each case (NxHxV) times ``loss = f(x, W, b, target)`` and ``torch.autograd.grad`` of x, W (and b),
and reports ms, TFLOP/s from ``lce_flops`` (the three matmuls any implementation needs;
fxfuse (lean) runs a fourth, the logits recompute), GB/s from ``lce_bytes`` against the copy
ceiling, the peak memory above the inputs (the floor is dW + dx, printed per case; fxfuse-fast
adds its [R, V] logits block, fxfuse (lean) ~104 MiB) and the max relative error of loss
and grads against an fp32 eager reference on the same inputs.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import NamedTuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import PROVIDERS, Row, bench_ms, copy_ceiling_gbps, have_liger, peak_extra_mib, print_table  # noqa: E402

DEFAULT_SHAPES = ("8192x4096x128256", "16384x2048x32000")
# "fxfuse" = the op with algorithm "lean"; "fxfuse-compiled[-lean]": the unfused definition under
# torch.compile(backend="fxfuse") (inner Inductor; loss_head "auto" = fast, or "lean"): the user's path
LCE_PROVIDERS = (*PROVIDERS, "fxfuse-fast", "fxfuse-compiled", "fxfuse-compiled-lean", "matmuls", "matmuls-passes")
IGNORE_INDEX = -100


def lce_bytes(n: int, h: int, v: int, element_size: int, bias: bool = False, frozen_weight: bool = False) -> int:
    """Minimum bytes of fwd+bwd: read x, W, (b) and the int64 target once; write dx, (dW), (db) once."""
    reads = (n * h + v * h + (v if bias else 0)) * element_size + 8 * n
    writes = (n * h + (0 if frozen_weight else v * h) + (v if bias else 0)) * element_size
    return reads + writes


def lce_flops(n: int, h: int, v: int, frozen_weight: bool = False) -> int:
    """FLOPs of the matmuls any implementation needs: logits x @ W.T, dx = dz @ W, dW = dz.T @ x."""
    return 2 * n * h * v * (2 if frozen_weight else 3)


def floor_mib(n: int, h: int, v: int, element_size: int, frozen_weight: bool = False) -> float:
    """The unavoidable extra memory of fwd+bwd: the gradients dx and dW themselves."""
    return (n * h + (0 if frozen_weight else v * h)) * element_size / 2**20


def _fast_rows(n: int, v: int, element_size: int) -> int:
    """Rows per pass of the fast algorithm at this shape (its own rule, or the --fast-rows value that
    _provider_row sets as the kernel module's override)."""
    from fxfuse.kernels.linear_cross_entropy_fast import _fast_rows_per_pass

    return _fast_rows_per_pass(n, v, element_size)


def _matmul_step(x, w, rows: int):
    """The three matmuls of fwd+bwd alone, over passes of `rows` rows: z = x @ W.T, dx = z @ W,
    dW (+)= z.T @ x (z stands in for the logits' gradient): the floor of any implementation."""
    n = x.shape[0]
    z = torch.empty(min(rows, n), w.shape[0], device=x.device, dtype=x.dtype)
    dx, dw = torch.empty_like(x), torch.empty_like(w)

    def step():
        for n0 in range(0, n, rows):
            xs = x[n0:n0 + rows]
            zs = z[:xs.shape[0]]
            torch.mm(xs, w.T, out=zs)
            torch.mm(zs, w, out=dx[n0:n0 + rows])
            if n0 == 0:
                torch.mm(zs.T, xs, out=dw)
            else:
                dw.addmm_(zs.T, xs)
    return step


def lce_vocab_scaled(x, w, b, t, s, ignore_index: int, label_smoothing: float):
    """Dory's loss head: logits.float() times a learned per-vocabulary scale s [V], then cross-entropy."""
    logits = torch.nn.functional.linear(x, w, b).float() * s.float()
    return torch.nn.functional.cross_entropy(logits, t, ignore_index=ignore_index, label_smoothing=label_smoothing)


def _policy_loss(lp, t):
    """GRPO's token loss on log-probs lp [N]: -(exp(lp - lp.detach()) * adv).mean(), adv a fixed stand-in
    advantage per token."""
    return -(torch.exp(lp - lp.detach()) * torch.cos(t.float())).mean()


def lce_log_probs(x, w, b, t, s):
    """An RL policy loss on per-token log-probs, spelled as verl's logprobs_from_logits_naive."""
    z = torch.nn.functional.linear(x, w, b).float()
    return _policy_loss(torch.log_softmax(z, -1).gather(-1, t[:, None]).squeeze(-1), t)


def _liger_fn(args):
    """(fn(x, w, b, t, s) -> loss, note); fn is None when Liger cannot run this case."""
    if not have_liger():
        return None, "liger_kernel not installed"
    if args.logit_scale != 1.0 or args.vocab_scale:
        return None, "liger has no logit scale"
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    kw = dict(ignore_index=IGNORE_INDEX, label_smoothing=args.label_smoothing,
              reduction="none" if args.log_probs else "mean")
    if args.softcap > 0:
        kw["softcap"] = args.softcap
    loss = LigerFusedLinearCrossEntropyLoss(**kw)
    if args.log_probs:
        return (lambda x, w, b, t, s: _policy_loss(-loss(w, x, t, b), t)), ""
    return (lambda x, w, b, t, s: loss(w, x, t, b)), ""


def _definition(args):
    """(eager definition, its trailing arguments): fn(x, w, b, t, s) = definition(x, w, b, t, [s,] *extra)."""
    from fxfuse.kernels.linear_cross_entropy import linear_cross_entropy_eager

    if args.vocab_scale:
        return lce_vocab_scaled, (IGNORE_INDEX, args.label_smoothing)
    if args.log_probs:
        return lce_log_probs, ()
    return ((lambda x, w, b, t, s, *e: linear_cross_entropy_eager(x, w, b, t, *e)),
            (IGNORE_INDEX, "mean", args.label_smoothing, args.softcap, args.logit_scale))


def _provider_fn(provider: str, args):
    """(fn(x, w, b, t, s) -> 0-dim loss, note); fn is None when the provider cannot run."""
    definition, extra = _definition(args)
    if provider == "eager":
        return (lambda x, w, b, t, s: definition(x, w, b, t, s, *extra)), ""
    if provider == "inductor":
        compiled = torch.compile(definition)
        return (lambda x, w, b, t, s: compiled(x, w, b, t, s, *extra)), ""
    if provider == "liger":
        return _liger_fn(args)
    if provider.startswith("fxfuse-compiled"):
        options = {"loss_head": "lean"} if provider.endswith("-lean") else {}
        compiled = torch.compile(definition, backend="fxfuse", options=options)
        note = _fused_note(definition, options, extra, args)
        return (lambda x, w, b, t, s: compiled(x, w, b, t, s, *extra)), note
    if provider in ("fxfuse", "fxfuse-fast"):
        algorithm = "fast" if provider == "fxfuse-fast" else "lean"
        if args.vocab_scale:  # the op's vocab_scale: fp32 [V]
            return (lambda x, w, b, t, s: torch.ops.fxfuse.linear_cross_entropy(
                x, w, b, t, IGNORE_INDEX, "mean", args.label_smoothing, 0.0, 1.0, algorithm, False, False,
                s.float())), ""
        if args.log_probs:  # no index ignored, as the backend's respelling passes it
            from fxfuse.respell import NO_CLASS

            return (lambda x, w, b, t, s: _policy_loss(-torch.ops.fxfuse.linear_cross_entropy(
                x, w, b, t, NO_CLASS, "none", 0.0, 0.0, 1.0, algorithm), t)), ""
        return (lambda x, w, b, t, s: torch.ops.fxfuse.linear_cross_entropy(x, w, b, t, *extra, algorithm)), ""
    raise ValueError(provider)


def _fused_note(fn, options: dict, extra: tuple, args) -> str:
    """What fxfuse.explain reports for fn compiled with these options, on a small case."""
    import fxfuse

    x, w, b, t, s = _inputs(64, 32, 128, torch.float32, args, device="cuda" if torch.cuda.is_available() else "cpu")
    report = fxfuse.explain(fn, x, w, b, t, s, *extra, fxfuse_options=options)
    fused = report.counts().get("linear_cross_entropy", 0)
    return f"loss head fused {fused}x, {len(report.unmatched)} unmatched"


def _inputs(n: int, h: int, v: int, dtype: torch.dtype, args, seed: int = 0, device: str = "cuda"):
    """x [n, h], W [v, h] (std 1/sqrt(h): logits ~ N(0, 1)), b [v] or None, target [n] with ~5% ignored,
    s [v] in [0.5, 1.5) (--vocab-scale) or None."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, h, device=device, dtype=dtype, generator=gen).requires_grad_()
    w = (torch.randn(v, h, device=device, dtype=dtype, generator=gen) * h**-0.5).requires_grad_(not args.frozen_weight)
    b = torch.randn(v, device=device, dtype=dtype, generator=gen).requires_grad_() if args.bias else None
    t = torch.randint(0, v, (n,), device=device, generator=gen)
    if not args.log_probs:  # a gathered log-prob has no ignored index
        t[torch.rand(n, device=device, generator=gen) < 0.05] = IGNORE_INDEX
    s = torch.rand(v, device=device, dtype=dtype, generator=gen) + 0.5 if args.vocab_scale else None
    s = s.requires_grad_(not args.frozen_scale) if s is not None else None
    return x, w, b, t, s


def _fwd_bwd(fn, x, w, b, t, s):
    """[loss, dx, (dW), (db), (ds)] of one fwd+bwd, without accumulating into .grad."""
    wrt = [p for p in (x, w, b, s) if p is not None and p.requires_grad]
    loss = fn(x, w, b, t, s)
    return [loss, *torch.autograd.grad(loss, wrt)]


def _max_rel_err(fn, n: int, h: int, v: int, dtype: torch.dtype, args) -> float:
    """Max over loss and grads of max|got - ref| / max|ref|, ref = fp32 eager on the same inputs."""
    x, w, b, t, s = _inputs(n, h, v, dtype, args, seed=1)
    up = lambda p: p.detach().float().requires_grad_(p.requires_grad) if p is not None else None  # noqa: E731
    eager, _ = _provider_fn("eager", args)
    ref = _fwd_bwd(eager, up(x), up(w), up(b), t, up(s))
    got = _fwd_bwd(fn, x, w, b, t, s)
    return max(((g.float() - r).abs().max() / r.abs().max()).item() for g, r in zip(got, ref))


def run(args) -> list[Row]:
    dtype = getattr(torch, args.dtype)
    ceiling = copy_ceiling_gbps()
    print(f"copy ceiling: {ceiling:.0f} GB/s", flush=True)
    rows = []
    for shape in args.shapes:
        n, h, v = (int(s) for s in shape.lower().split("x"))
        es = torch.empty((), dtype=dtype).element_size()
        case = Case(f"lce {n}x{h}x{v} {args.dtype}", n, h, v, dtype, ceiling)
        print(f"{case.name}: floor (dW + dx) {floor_mib(n, h, v, es, args.frozen_weight):.0f} MiB", flush=True)
        for provider in args.providers:
            rows.append(_provider_row(case, provider, args))
        for fast_rows in args.fast_rows or ():  # the fast algorithm's pass size swept (memory vs time)
            rows.append(_provider_row(case, "matmuls-passes", args, fast_rows))
            rows.append(_provider_row(case, "fxfuse-fast", args, fast_rows))
    print_table(rows)
    return rows


class Case(NamedTuple):
    name: str
    n: int
    h: int
    v: int
    dtype: torch.dtype
    ceiling: float


def _provider_row(case: Case, provider: str, args, fast_rows: int | None = None) -> Row:
    """One provider timed on one case; fast_rows forces the fast algorithm's rows per pass."""
    from fxfuse.kernels import _lce_chunks as chunks

    n, h, v = case.n, case.h, case.v
    nbytes = lce_bytes(n, h, v, torch.empty((), dtype=case.dtype).element_size(), args.bias, args.frozen_weight)
    flops = lce_flops(n, h, v, args.frozen_weight)
    label = provider if fast_rows is None else f"{provider} R={fast_rows}"
    chunks._CHUNK_OVERRIDE = None if fast_rows is None else (fast_rows, 4096, 4096)
    try:
        x, w, b, t, s = _inputs(n, h, v, case.dtype, args)
        if provider.startswith("matmuls"):
            passes = n if provider == "matmuls" else _fast_rows(n, v, x.element_size())  # honours fast_rows
            step, err = _matmul_step(x.detach(), w.detach(), passes), None
            note = f"floor: cuBLAS matmuls only, {-(-n // passes)} pass(es) of {passes} rows"
        else:
            fn, note = _provider_fn(provider, args)
            if fn is None:
                return Row(case.name, label, None, note=note)
            err = _max_rel_err(fn, n, h, v, case.dtype, args)
            step = lambda: _fwd_bwd(fn, x, w, b, t, s)  # noqa: E731
        ms = bench_ms(step)
        gbps = nbytes / ms / 1e6
        note = f"{flops / ms / 1e9:.0f} TFLOP/s" + (f", {note}" if note else "")
        return Row(case.name, label, ms, gbps, 100 * gbps / case.ceiling, peak_extra_mib(step), err, note)
    finally:
        chunks._CHUNK_OVERRIDE = None
        torch.cuda.empty_cache()


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="NxHxV per case")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--label-smoothing", type=float, default=0.0)
    parser.add_argument("--softcap", type=float, default=0.0)
    parser.add_argument("--logit-scale", type=float, default=1.0)
    parser.add_argument("--bias", action="store_true", help="lm_head with a bias [V]")
    parser.add_argument("--frozen-weight", action="store_true", help="W.requires_grad = False (no dW)")
    parser.add_argument("--vocab-scale", action="store_true",
                        help="Dory's head: logits.float() * a learned [V] scale (see the module doc)")
    parser.add_argument("--frozen-scale", action="store_true", help="with --vocab-scale: s.requires_grad = False")
    parser.add_argument("--log-probs", action="store_true",
                        help="an RL policy loss on per-token log-probs (log_softmax + gather) instead")
    parser.add_argument("--providers", nargs="+", default=list(LCE_PROVIDERS), choices=LCE_PROVIDERS)
    parser.add_argument("--fast-rows", type=int, nargs="+", default=None,
                        help="also time fxfuse-fast (and matmuls-passes) at these rows per pass")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(parser)
    args = parser.parse_args()
    if args.log_probs and (args.vocab_scale or args.softcap or args.logit_scale != 1.0 or args.label_smoothing):
        parser.error("--log-probs times the plain head: "
                     "no --vocab-scale, --softcap, --logit-scale or --label-smoothing")
    run(args)


if __name__ == "__main__":
    main()
