"""Spelling coverage probe: every combination of how hand-written code writes each fused op, run
through ``fxfuse.explain`` on CPU; prints the combinations that do not fuse and a count.

    python tests/probe_spellings.py                      # all four ops (~20 min on a busy 2-core machine)
    python tests/probe_spellings.py swiglu linear_cross_entropy

Not a test (pytest does not collect it): the product is too large for CI. The tests keep a
representative slice of each axis (tests/test_rms_norm_graph.py SPELLINGS, the rotate_half halves
in tests/test_rope_graph.py, tests/test_linear_cross_entropy_graph.py's 96 head combinations). Exit status 1 if any
combination misses, so a matcher change can be checked against the whole product.
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch
import torch.nn.functional as F

D = 32


def rms_norm_cases():
    """(name, fn(x, w), inputs): upcast, square, mean, inverse root, operand order, eps side, cast
    point, weight, Gemma's (1 + w); fp32 models without the (no-op) upcast axis."""
    def make(upcast, sq, red, inv, order, eps_first, cast, weight, gemma):
        def fn(x, w):
            h = x.float() if upcast else x
            s = {"mul": h * h, "pow": h.pow(2), "square": torch.square(h), "pow_op": h ** 2}[sq]
            v = s.mean(-1, keepdim=True) if red == "mean" else s.sum(-1, keepdim=True) / D
            v = (1e-6 + v) if eps_first else (v + 1e-6)
            y = {"rsqrt": lambda: h * torch.rsqrt(v), "div_sqrt": lambda: h / torch.sqrt(v),
                 "one_over_sqrt": lambda: h * (1.0 / torch.sqrt(v)), "method": lambda: h * v.rsqrt(),
                 "div_pow_half": lambda: h / v ** 0.5}[inv]()
            ww = (1 + w.float()) if gemma else w
            if not weight:
                return y.type_as(x) if cast == "type_as" else y.to(x.dtype)
            if cast == "before":  # Llama: w * y.to(dtype)
                return ww * y.to(x.dtype) if order == "wx" else y.to(x.dtype) * ww
            out = y * ww if order == "xw" else ww * y  # fp32 multiply, then the cast (Gemma)
            return out.type_as(x) if cast == "type_as" else out.to(x.dtype)
        return fn

    axes = (("mul", "pow", "square", "pow_op"), ("mean", "sum"),
            ("rsqrt", "div_sqrt", "one_over_sqrt", "method", "div_pow_half"),
            ("wx", "xw"), (False, True), ("before", "after", "type_as"), (True, False), (False, True))
    for dt in (torch.float32, torch.bfloat16):
        for upcast in ((True,) if dt == torch.float32 else (True, False)):
            for combo in itertools.product(*axes):
                if combo[-1] and not combo[-2]:  # Gemma's offset needs a weight
                    continue
                x = torch.randn(2, 5, D, dtype=dt, requires_grad=True)
                w = torch.randn(D, dtype=dt, requires_grad=True)
                yield f"{str(dt)[6:]} upcast={upcast} " + " ".join(map(str, combo)), make(upcast, *combo), (x, w)


def halves(x, how):
    """x's two halves along the last dim, taken the way ``how`` names (also tests/test_rope_graph.py)."""
    d = x.shape[-1] // 2
    return {"slice": lambda: (x[..., :d], x[..., d:]), "chunk": lambda: x.chunk(2, dim=-1),
            "split": lambda: x.split(d, dim=-1), "split_sizes": lambda: torch.split(x, [d, d], dim=-1),
            "narrow": lambda: (x.narrow(-1, 0, d), x.narrow(-1, d, d))}[how]()


def head_fn(layout, transform, bias, cast, loss="cross_entropy"):
    """F.linear -> transform -> layout -> cross_entropy (or nll_loss of log_softmax), as hand-written
    code spells it, with the .float() before the transform, after it, or none (also
    tests/test_linear_cross_entropy_graph.py)."""
    def fn(x, w, b, t):
        z = F.linear(x, w, b if bias else None)
        z = z.float() if cast == "before" else z
        z = {"none": z, "scale": z * 0.5, "divide": z / 2.0, "softcap": torch.tanh(z / 30.0) * 30.0}[transform]
        z = z.float() if cast == "after" else z
        z = z.view(-1, z.shape[-1]) if layout == "view" else z.flatten(0, 1) if layout == "flatten" else z
        if loss == "nll":
            return F.nll_loss(F.log_softmax(z, -1), t.view(-1))
        return F.cross_entropy(z, t.view(-1))
    return fn


def rope_cases():
    """rotate_half's halves (slice, chunk, split, narrow) x negation spelling x sum order x product
    order x [B, H, T, D] / [B, T, H, D] x upcast; q and k rotated by the same tables (one site)."""
    def make(split, neg, add_order, mul_order, layout, upcast):
        def rot(x):
            a, b = halves(x, split)
            nb = {"minus": lambda: -b, "neg": lambda: b.neg(), "times_minus1": lambda: b * -1,
                  "torch_neg": lambda: torch.neg(b)}[neg]()
            return torch.cat((nb, a), dim=-1)

        def apply(x, cos, sin):
            h = x.float() if upcast else x
            p1, p2 = (h * cos, rot(h) * sin) if mul_order == "x*c" else (cos * h, sin * rot(h))
            out = p1 + p2 if add_order == "cos_first" else p2 + p1
            return out.type_as(x) if upcast else out

        def fn(q, k, cos, sin):
            d = 1 if layout == "bhtd" else 2
            c, s = cos.unsqueeze(d), sin.unsqueeze(d)
            return (apply(q, c, s) * 2).sum() + (apply(k, c, s) * 3).sum()
        return fn

    axes = (("slice", "chunk", "split", "narrow"), ("minus", "neg", "times_minus1", "torch_neg"),
            ("cos_first", "sin_first"), ("x*c", "c*x"), ("bhtd", "bthd"), (False, True))
    for combo in itertools.product(*axes):
        shape = (2, 4, 6, 16) if combo[4] == "bhtd" else (2, 6, 4, 16)
        ang = torch.randn(2, 6, 8)
        cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)
        q, k = (torch.randn(*shape, requires_grad=True) for _ in range(2))
        yield " ".join(map(str, combo)), make(*combo), (q, k, cos, sin)


def swiglu_cases():
    """Activation spelling x operand order x gate/up layout (separate, chunk, split, interleaved)."""
    acts = {"F.silu": F.silu, "nn.SiLU": lambda g: torch.nn.SiLU()(g), "x*sigmoid": lambda g: g * torch.sigmoid(g),
            "sigmoid*x": lambda g: torch.sigmoid(g) * g, "x/(1+exp(-x))": lambda g: g / (1 + torch.exp(-g)),
            "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"), "gelu": F.gelu}

    def make(act, order, layout):
        def fn(x, wg, wu, wgu):
            if layout == "separate":
                g, u = F.linear(x, wg), F.linear(x, wu)
            elif layout == "interleaved":
                gu = F.linear(x, wgu)
                g, u = gu[..., ::2], gu[..., 1::2]
            else:
                gu = F.linear(x, wgu)
                g, u = gu.chunk(2, dim=-1) if layout == "chunk" else gu.split(48, dim=-1)
            a = acts[act](g)
            return (a * u if order == "a*u" else u * a).sum()
        return fn

    for dt in (torch.float32, torch.bfloat16):
        for combo in itertools.product(acts, ("a*u", "u*a"), ("separate", "chunk", "split", "interleaved")):
            args = (torch.randn(2, 5, D, dtype=dt), *(torch.randn(n, D, dtype=dt) for n in (48, 48, 96)))
            yield f"{str(dt)[6:]} " + " ".join(combo), make(*combo), tuple(a.requires_grad_() for a in args)


def linear_cross_entropy_cases():
    """Hidden-state layout x logit transform x bias x .float() after / before the transform, or none
    (fp32: a no-op, so one case) x cross_entropy / nll_loss of log_softmax."""
    for dt, cast in ((torch.float32, "after"), (torch.bfloat16, "after"), (torch.bfloat16, "before"),
                     (torch.bfloat16, "none")):
        for combo in itertools.product(("2d", "view", "flatten"), ("none", "scale", "divide", "softcap"), (False, True)):
            for loss in ("cross_entropy", "nll"):
                x = torch.randn(*((16,) if combo[0] == "2d" else (2, 8)), 16, dtype=dt, requires_grad=True)
                w, b = torch.randn(40, 16, dtype=dt, requires_grad=True), torch.randn(40, dtype=dt, requires_grad=True)
                yield (f"{str(dt)[6:]} cast={cast} {loss} " + " ".join(map(str, combo)), head_fn(*combo, cast, loss),
                       (x, w, b, torch.randint(0, 40, (16,))))


CASES = {"rms_norm": rms_norm_cases, "rope": rope_cases, "swiglu": swiglu_cases,
         "linear_cross_entropy": linear_cross_entropy_cases}


def main() -> int:
    import fxfuse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # choices checked here: argparse (3.11) checks an empty nargs="*" list against them as one value
    p.add_argument("ops", nargs="*", help=f"of {', '.join(CASES)} (default: all)")
    args = p.parse_args()
    if set(args.ops) - set(CASES):
        p.error(f"unknown ops {sorted(set(args.ops) - set(CASES))}; choose from {list(CASES)}")
    args.ops = args.ops or list(CASES)
    missed = 0
    for op in args.ops:
        total = misses = 0
        for name, fn, inputs in CASES[op]():
            torch._dynamo.reset()
            report = fxfuse.explain(fn, *inputs)
            total += 1
            if report.counts()[op] != 1:
                misses += 1
                reasons = [s.reason for s in report.unmatched if s.pattern == op] or ["not a candidate: no report"]
                print(f"MISS {op}: {name} | {reasons[0]}", flush=True)
        print(f"{op}: {total - misses} of {total} spellings fused", flush=True)
        missed += misses
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
