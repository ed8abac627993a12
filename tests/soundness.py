"""Soundness cases: programs that look like a fused op, spelled right or changed in one detail, each
compiled with the fxfuse backend and compared with eager (output and every gradient, fp32).

A matcher that fuses a look-alike whose meaning differs (a sum divided by the wrong count, halves
swapped in a rotation, the classes sliced instead of the rows) gives a wrong result silently; a
parity check on inputs that expose the detail (rows of very different scale, so eps matters) sees it.
Each case also says whether the op must fuse (the spelling means the op), must not (no fused op
computes it), or either (parity is all that matters). tests/test_soundness.py runs every case;
``python tests/soundness.py [OP ...]`` prints each case's verdict, fused or not, with the reason.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable

import torch

PARITY = 1e-5  # fp32 relative error, output and every gradient
# Inductor rounding to bf16 / fp16 wherever eager does (run(precise_casts=True)): emulate_precision_casts,
# and no pattern passes (torch 2.11's joint-graph pass drops an fp32 -> bf16 -> fp32 round trip whatever
# that flag says)
PRECISE_CASTS = {"emulate_precision_casts": True, "pattern_matcher": False}
# cases where Inductor's own numerics may miss eager's value (a bf16 round trip kept in fp32; see
# tests/test_soundness.py's CUDA twin and bench/probe_round_trips.py)
ROUND_TRIPS = ["rope/mixed_dtype_q_fp32_k_bf16", "rms_norm/rounded_to_bf16", "linear_cross_entropy/through_bf16"]


@dataclass(frozen=True)
class Case:
    name: str                      # "<op>/<spelling or change>"
    fn: Callable                   # fn(*inputs) -> tensor or tuple of tensors
    inputs: Callable[[], tuple]    # fresh inputs; every floating tensor becomes a leaf with a gradient
    fuses: bool | None             # True: the op must fuse; False: it must not; None: either

    @property
    def op(self) -> str:
        return self.name.split("/", 1)[0]


@dataclass
class Verdict:
    out_err: float
    grad_err: float
    fused: int                     # matched sites of the case's op
    reasons: list[str]             # the op's unmatched reasons

    def value_problems(self) -> list[str]:
        """The output or a gradient away from eager's."""
        bad = []
        if not self.out_err < PARITY:
            bad.append(f"output {self.out_err:.2e} from eager")
        if not self.grad_err < PARITY:
            bad.append(f"gradient {self.grad_err:.2e} from eager")
        return bad

    def problems(self, case: Case, must_fuse: bool = True) -> list[str]:
        """Value problems, and a fusion the case forbids; with must_fuse, also a fusion it requires
        that did not happen."""
        bad = self.value_problems()
        if must_fuse and case.fuses is True and not self.fused:
            bad.append(f"not fused: {self.reasons or ['no candidate reported']}")
        if case.fuses is False and self.fused:
            bad.append(f"fused {self.fused}x, where no fused op computes it")
        return bad


def awkward(*shape, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """randn with each row (last dim) scaled by 10 ** u, u uniform in [-3, 1]: rows whose mean square
    is near a norm's eps, so an eps in the wrong place, or a wrong one, shows in fp32."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    scale = 10.0 ** (torch.rand(*shape[:-1], 1, generator=g, dtype=torch.float64) * 4 - 3)
    return (x * scale).to(dtype)


def randn(*shape, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _leaves(inputs: tuple) -> tuple:
    return tuple(t.detach().clone().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t
                 for t in inputs)


def _outputs(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [o for item in out for o in _outputs(item)] if isinstance(out, (tuple, list)) else []


def _fwd_bwd(fn, inputs: tuple) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Outputs, and the gradients of a random projection of them (not a plain sum: its uniform
    output gradient would hide a swap of two output elements). A case makes its own tensors (a ramp,
    a table) on its inputs' device (a torch.device context does not reach into Dynamo's trace on
    torch 2.11)."""
    leaves = _leaves(inputs)
    outs = _outputs(fn(*leaves))
    g = torch.Generator().manual_seed(7)
    loss = sum((o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device)).sum()
               for o in outs if o.is_floating_point() and o.requires_grad)
    if isinstance(loss, torch.Tensor):
        loss.backward()
    grads = [t.grad for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return [o.detach() for o in outs], grads


def _err(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    if a.shape != b.shape or a.dtype != b.dtype:
        return float("inf")
    a, b = a.double(), b.double()
    if not torch.equal(a.isnan(), b.isnan()):
        return float("inf")
    a, b = a.nan_to_num(0.0), b.nan_to_num(0.0)
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def run(case: Case, inner: str = "aot_eager", dynamic: bool | None = False, device: str = "cpu",
        backend: str = "fxfuse", precise_casts: bool = False) -> Verdict:
    """The case compiled with the fxfuse backend (one graph: fullgraph=True) against eager, on device;
    backend="inductor": plain Inductor instead (its own numerics, nothing fused). precise_casts: Inductor
    with PRECISE_CASTS (by default it may keep a bf16 round trip in fp32)."""
    import fxfuse

    inputs = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in case.inputs())
    ref_outs, ref_grads = _fwd_bwd(case.fn, inputs)
    torch._dynamo.reset()
    n0 = len(fxfuse.compiled_reports())
    casts = PRECISE_CASTS if precise_casts else {}
    options = {"inner": inner, "inductor_config": casts} if backend == "fxfuse" else casts or None
    compiled = torch.compile(case.fn, backend=backend, options=options, dynamic=dynamic, fullgraph=True)
    outs, grads = _fwd_bwd(compiled, inputs)
    report = fxfuse.Report.merge(fxfuse.compiled_reports()[n0:])
    out_err = max([_err(o, r) for o, r in zip(outs, ref_outs)] + [0.0 if len(outs) == len(ref_outs) else float("inf")])
    grad_err = max([_err(g, r) for g, r in zip(grads, ref_grads)], default=0.0)
    return Verdict(out_err, grad_err, report.counts()[case.op],
                   [s.reason for s in report.unmatched if s.pattern == case.op])


def all_cases() -> list[Case]:
    import soundness_layouts_linear_cross_entropy
    import soundness_layouts_rms_norm
    import soundness_layouts_rope
    import soundness_layouts_swiglu
    import soundness_linear_cross_entropy
    import soundness_rms_norm
    import soundness_rope
    import soundness_row_loops
    import soundness_swiglu

    return [c for mod in (soundness_rms_norm, soundness_rope, soundness_swiglu, soundness_linear_cross_entropy,
                          soundness_row_loops, soundness_layouts_rms_norm, soundness_layouts_rope,
                          soundness_layouts_swiglu, soundness_layouts_linear_cross_entropy) for c in mod.CASES]


def postgrad_cases() -> list[Case]:
    """The cases of fxfuse's Inductor-only backward rewrites (tests/soundness_postgrad_*.py): run them
    with inner="inductor"."""
    import soundness_postgrad_linear_cross_entropy
    import soundness_postgrad_rms_norm
    import soundness_postgrad_swiglu

    return [c for mod in (soundness_postgrad_rms_norm, soundness_postgrad_swiglu,
                          soundness_postgrad_linear_cross_entropy) for c in mod.CASES]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ops", nargs="*", help="rms_norm, rope, swiglu, linear_cross_entropy (default: all)")
    p.add_argument("--inner", default="aot_eager", choices=("aot_eager", "inductor", "eager"))
    p.add_argument("--dynamic", action="store_true", help="compile with dynamic=True")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    bad = 0
    for case in all_cases():
        if args.ops and case.op not in args.ops:
            continue
        v = run(case, args.inner, args.dynamic, args.device)
        problems = v.problems(case)
        bad += bool(problems)
        why = f" ({v.reasons[0]})" if v.reasons and not v.fused else ""
        print(f"{'FAIL' if problems else 'ok  '} {case.name}: fused {v.fused}, out {v.out_err:.1e}, "
              f"grad {v.grad_err:.1e}{why}{'  <- ' + '; '.join(problems) if problems else ''}", flush=True)
    print(f"{bad} failing", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
