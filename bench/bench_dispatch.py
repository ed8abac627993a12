"""Host-side (CPU) cost of one call of each fused op: dispatch, autograd and host-wrapper work.

    python bench/bench_dispatch.py                  # PyTorch reference path (TRITON_INTERPRET unset)
    python bench/bench_dispatch.py --stub-kernels   # the Triton host wrappers, kernels replaced by no-ops
    python bench/bench_dispatch.py --ops rope,swiglu -n 5000

Tensors are tiny CPU tensors, so the time per call is what a GPU host pays before and around the
kernels. Default mode: TRITON_INTERPRET unset, so each op runs its PyTorch reference and the time
is dispatch + autograd + wrapper + a few tiny aten ops; "eager" is the equivalent unfused PyTorch
expression (the floor an op cannot beat on this path). --stub-kernels takes the Triton branch of
every host wrapper on CPU with every @triton.jit kernel replaced by a launcher that does nothing
(outputs are uninitialised): it times the wrapper's own Python (block sizing, views, allocations)
without Triton's launch cost. Prints microseconds per call (min over --repeats runs of -n calls).
"""
from __future__ import annotations

import argparse
import importlib
import os
import time

if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)  # before torch/triton are imported

import torch
import torch.nn.functional as F

OPS = ("rms_norm", "rope", "swiglu", "linear_cross_entropy")
EPS = 1e-6


class _NoLaunch:
    """Stands in for a @triton.jit kernel: kernel[grid](*args, **meta) does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def stub_kernels() -> None:
    """Every kernel module takes its Triton branch on CPU, and launches nothing (the op modules'
    kernels and those of the helper modules they launch from, such as _rms_norm_dw)."""
    import sys

    import triton

    for name in OPS:
        importlib.import_module(f"fxfuse.kernels.{name}").use_triton = lambda t: True
    for mod in [m for n, m in sys.modules.items() if n.startswith("fxfuse.kernels.")]:
        for name, obj in list(vars(mod).items()):
            if isinstance(obj, triton.runtime.JITFunction) and name.endswith("_kernel"):
                setattr(mod, name, _NoLaunch())


def _rms_eager(x, w):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope_eager(q, k, cos, sin):
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def cases():
    """name -> (inputs factory, fused call, eager call); inputs tiny and fp32, the first two of them
    differentiable in the fwd+bwd timing (cos/sin and targets are not)."""
    def rms_inputs():
        return torch.randn(4, 64), torch.randn(64)

    def rope_inputs():
        return torch.randn(1, 2, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)

    def swiglu_inputs():
        return torch.randn(4, 64), torch.randn(4, 64)

    def lce_inputs():
        return torch.randn(4, 16), torch.randn(32, 16), torch.randint(0, 32, (4,))

    ops = torch.ops.fxfuse
    return {
        "rms_norm": (rms_inputs,
                     lambda x, w: ops.rms_norm.default(x, w, EPS, 0.0, True, torch.float32),
                     _rms_eager),
        "rope": (rope_inputs,
                 lambda q, k, c, s: ops.rope.default(q, k, c, s, False, 8),
                 _rope_eager),
        "swiglu": (swiglu_inputs,
                   lambda g, u: ops.swiglu.default(g, u, "silu"),
                   lambda g, u: F.silu(g) * u),
        "linear_cross_entropy": (lce_inputs,
                                 lambda x, w, t: ops.linear_cross_entropy(x, w, None, t),
                                 lambda x, w, t: F.cross_entropy(F.linear(x, w).float(), t)),
    }


def _outputs(out):
    return out if isinstance(out, (tuple, list)) else (out,)


def time_us(step, n: int, repeats: int) -> float:
    """Minimum over repeats of the mean time of n calls of step(), in microseconds."""
    for _ in range(min(n, 200)):
        step()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def run(args) -> list[tuple[str, str, float, float]]:
    """(op, provider, fwd us, fwd+bwd us) per op and provider."""
    for name in OPS:
        importlib.import_module(f"fxfuse.kernels.{name}")  # registers torch.ops.fxfuse.*
    if args.stub_kernels:
        stub_kernels()
    torch.manual_seed(0)
    rows = []
    for name, (make, fused, eager) in cases().items():
        if name not in args.ops:
            continue
        inputs = make()
        grad_inputs = [t.clone().requires_grad_() if i < 2 else t for i, t in enumerate(inputs)]
        leaves = grad_inputs[:2]
        for provider, fn in (("fxfuse", fused), ("eager", eager)):
            if provider == "eager" and args.stub_kernels:
                continue

            def fwd(fn=fn):
                with torch.no_grad():
                    return fn(*inputs)

            def fwd_bwd(fn=fn):
                outs = _outputs(fn(*grad_inputs))
                loss = sum(o.sum() for o in outs)
                return torch.autograd.grad(loss, leaves)

            rows.append((name, provider, time_us(fwd, args.n, args.repeats),
                         time_us(fwd_bwd, args.n, args.repeats)))
    return rows


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", type=int, default=2000, help="calls per timed run")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs; the minimum is reported")
    parser.add_argument("--ops", type=lambda s: s.split(","), default=list(OPS),
                        help="comma-separated subset of " + ",".join(OPS))
    parser.add_argument("--stub-kernels", action="store_true",
                        help="time the Triton host wrappers with no-op kernels instead of the reference path")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1: less noise)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    mode = "stubbed Triton wrappers" if args.stub_kernels else "PyTorch reference path"
    print(f"torch {torch.__version__}, {mode}, us per call (min of {args.repeats} x {args.n} calls)")
    print(f"{'op':22} {'provider':9} {'fwd us':>9} {'fwd+bwd us':>11}")
    for name, provider, f, fb in run(args):
        print(f"{name:22} {provider:9} {f:9.1f} {fb:11.1f}")


if __name__ == "__main__":
    main()
