"""The architecture harness: how many sites a model has (from its own module calls), whether fxfuse
fused every one and nothing else, and whether training through the fused model matches eager.

``check(build, inputs)``:
  - expected sites per pattern, counted from module calls in one eager forward (``fxfuse.sites``),
    against the fused calls that ran in one compiled forward (``Report.calls``: a graph Dynamo reuses
    for every layer counts once per run);
  - fp32 parity: loss and every gradient of the fxfuse-compiled model against eager (rel err < 1e-5).
    Where a tensor misses that, an fp64 eager run decides whether the fp32 comparison is only at
    rounding's noise floor: the tensor still passes if fxfuse is as accurate as eager fp32 against
    fp64 (``as_accurate_as_eager``), else parity fails;
  - no false match: no pattern matched more sites than the model has;
  - 20 AdamW steps under bf16 autocast on a fixed batch: the loss tracks eager's within 1e-2 relative.
A site that stays unfused is a *gap* (with the report's reason), never a pass. Dropout is set to 0
(its random masks differ between runs: nn.Dropout modules here, config probabilities in
zoo.check_hf); models are otherwise as built, in train mode.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from .outside import Census
from .report import PATTERN_NAMES, Report
from .sites import expected_sites

FP32_TOL = 1e-5
ZERO_REL = 1e-6  # a gradient this small against all gradients' norm is rounding noise around 0
BF16_STEPS, BF16_TOL = 20, 1e-2
# torch._dynamo.utils.same's fp64 rule: the compiled result's error against fp64 may be at most
# FP64_MULTIPLIER x eager fp32's own error against fp64, plus FP32_TOL / 10
FP64_MULTIPLIER = 2.0
# where the bf16 curves part by BF16_TOL or more: fxfuse's bf16 curve may be at most BF16_MULTIPLIER x
# as far from an fp32 run's curve (no autocast) as eager's bf16 curve is (the kernels' bf16 rule)
BF16_MULTIPLIER = 2.0


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def grad_errors(grads: dict, ref: dict) -> dict[str, float]:
    """Relative error per gradient. A reference gradient that is numerically zero (norm below
    ZERO_REL of all gradients' norm: a key bias, whose true gradient is 0 since softmax ignores a
    constant shift) has no meaningful relative error: it must just be numerically zero too (0, else inf)."""
    total = torch.cat([g.detach().double().flatten() for g in ref.values()]).norm().item()
    errs = {}
    for k, r in ref.items():
        if r.double().norm().item() < ZERO_REL * total:
            errs[k] = 0.0 if grads[k].double().norm().item() < ZERO_REL * total else float("inf")
        else:
            errs[k] = rel_err(grads[k], r)
    return errs


def grad_error(grads: dict, ref: dict) -> float:
    """Worst per-tensor relative error (grad_errors); inf where the parameter sets differ. A parameter
    with no gradient in eager may have an all-zero one in the compiled run: torch.compile itself, under
    any backend, gives zeros to parameters that enter its graph without reaching the loss (a VLM vision
    tower's unused pooling head)."""
    grads = {k: g for k, g in grads.items() if k in ref or bool(g.any())}
    if grads.keys() != ref.keys():
        return float("inf")
    return max(grad_errors(grads, ref).values(), default=0.0)


def as_accurate_as_eager(got: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor) -> bool:
    """got (fxfuse, fp32) is as accurate as eager fp32, both measured against exact (an fp64 run).
    For a tensor whose fp32 rounding error alone is near FP32_TOL (ill-conditioned: a small
    gradient that sums cancelling terms), got vs eager can miss FP32_TOL though neither is wrong."""
    return rel_err(got, exact) <= FP64_MULTIPLIER * rel_err(eager, exact) + FP32_TOL / 10


def _copy(model: nn.Module, build: Callable[[], nn.Module] | None = None) -> nn.Module:
    """A deep copy of model; where torch refuses one (weight_norm's non-leaf weights: RecurrentGemma),
    a fresh build() with model's state loaded."""
    try:
        return copy.deepcopy(model)
    except RuntimeError:
        if build is None:
            raise
    device = next(model.parameters()).device
    fresh = build().to(device)
    fresh.load_state_dict(model.state_dict())
    for a, b in zip(model.modules(), fresh.modules()):
        b.train(a.training)
        if isinstance(a, nn.Dropout):
            b.p = a.p
    return fresh


def fp64_run(model: nn.Module, call_inputs: dict, loss_of, build=None) -> tuple[torch.Tensor, dict] | None:
    """Eager loss and gradients of an fp64 copy of model; None where the model cannot run in fp64
    (one that casts to float32 on its own). MoE experts run their per-expert loop there: grouped_mm,
    transformers' default on some MoE models, has no fp64 kernel."""
    m64 = _copy(model, build).double()
    if getattr(getattr(m64, "config", None), "_experts_implementation", None) not in (None, "eager"):
        m64.set_experts_implementation("eager")
    inputs = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in call_inputs.items()}
    try:
        return step(m64, m64, inputs, loss_of)
    except (RuntimeError, TypeError):
        return None


def fp64_verdict(loss, grads, ref_loss, ref_grads, exact) -> tuple[bool, list[str]]:
    """Whether every tensor that missed FP32_TOL against eager is as accurate as eager against the
    fp64 run exact = (loss, grads), and one line per such tensor for the summary. A gradient
    grad_errors scores inf (nonzero where eager's is numerically zero) is never rescued."""
    errs = {"loss": rel_err(loss, ref_loss)} | grad_errors(grads, ref_grads)
    missed = {k: e for k, e in errs.items() if not e < FP32_TOL}
    ok, lines = exact is not None and all(e != float("inf") for e in missed.values()), []
    for k, e in missed.items():
        got, ref = (loss, ref_loss) if k == "loss" else (grads[k], ref_grads[k])
        if exact is None or e == float("inf"):
            lines.append(f"{k}: rel err {e:.2e} vs eager" + (", no fp64 run" if exact is None else ""))
            continue
        want = exact[0] if k == "loss" else exact[1][k]
        good = as_accurate_as_eager(got, ref, want)
        ok &= good
        lines.append(f"{k}: rel err vs eager {e:.2e}; vs fp64: fxfuse {rel_err(got, want):.2e}, "
                     f"eager {rel_err(ref, want):.2e} -> {'as accurate as eager' if good else 'LESS ACCURATE'}")
    return ok, lines


def step(model, call, inputs, loss_of=lambda out: out.loss):
    """Loss of call(**inputs) and the gradients of model's parameters after backward."""
    model.zero_grad(set_to_none=True)
    loss = loss_of(call(**inputs))
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def curve_gap(got: list[float], ref: list[float]) -> float:
    """Largest relative difference between two loss curves, step by step."""
    return max(abs(g - r) / max(abs(r), 1e-12) for g, r in zip(got, ref))


def fp32_curve_verdict(got: list[float], ref: list[float], exact: list[float]) -> tuple[bool, str]:
    """Whether fxfuse's bf16 curve got is as close to the fp32 run's curve exact as eager's bf16 curve
    ref is (within BF16_MULTIPLIER x), and the line that says so. Twenty bf16 steps of a tiny model
    can part by more than BF16_TOL where neither run is wrong: each rounding moves the next step."""
    mine, eager = curve_gap(got, exact), curve_gap(ref, exact)
    ok = mine <= BF16_MULTIPLIER * eager
    return ok, (f"against an fp32 run's curve: fxfuse bf16 {mine:.2e}, eager bf16 {eager:.2e} -> "
                f"{'as close as eager' if ok else 'FURTHER THAN EAGER'}")


def _train(model, call, inputs, loss_of, steps: int, autocast: bool = True) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(next(model.parameters()).device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = loss_of(call(**inputs))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@dataclass
class Result:
    name: str
    expected: dict[str, int]
    matched: dict[str, int]
    loss_err: float
    grad_err: float
    bf16_max_rel: float | None
    reasons: dict[str, list[str]] = field(default_factory=dict)  # unmatched reasons per pattern; "graph", "graph_breaks"
    fp64: list[str] = field(default_factory=list)  # tensors judged against an fp64 run (fp64_verdict)
    fp64_ok: bool = False
    # sites fused per pattern in the fp32 compile and in the bf16 autocast one (static counts, None without
    # the bf16 run), and why the autocast compile left sites unfused
    fp32_fused: dict[str, int] | None = None
    bf16_fused: dict[str, int] | None = None
    bf16_reasons: dict[str, list[str]] = field(default_factory=dict)
    # where bf16_max_rel >= BF16_TOL: both bf16 curves judged against an fp32 run (fp32_curve_verdict)
    bf16_fp32: str = ""
    bf16_fp32_ok: bool = False

    @property
    def autocast_gaps(self) -> list[str]:
        """Patterns with fewer sites fused under bf16 autocast than in fp32 (informational: the bf16
        check compares loss curves, which an unfused site does not move)."""
        if self.fp32_fused is None or self.bf16_fused is None:
            return []
        return [p for p in PATTERN_NAMES if self.bf16_fused[p] < self.fp32_fused[p]]

    @property
    def false_matches(self) -> list[str]:
        return [p for p in PATTERN_NAMES if self.matched[p] > self.expected[p]]

    @property
    def gaps(self) -> list[str]:
        return [p for p in PATTERN_NAMES if self.matched[p] < self.expected[p]]

    @property
    def parity_ok(self) -> bool:
        return (self.loss_err < FP32_TOL and self.grad_err < FP32_TOL) or self.fp64_ok

    @property
    def bf16_ok(self) -> bool:
        return self.bf16_max_rel is not None and (self.bf16_max_rel < BF16_TOL or self.bf16_fp32_ok)

    @property
    def passed(self) -> bool:
        return not self.gaps and not self.false_matches and self.parity_ok and self.bf16_ok

    def to_dict(self) -> dict:
        return asdict(self) | {"gaps": self.gaps, "false_matches": self.false_matches, "parity_ok": self.parity_ok,
                               "passed": self.passed}


@contextlib.contextmanager
def exact_fp32():
    """fp32 matmuls and convolutions in full fp32 on CUDA. cuDNN's default is TF32
    (``torch.backends.cudnn.allow_tf32``): its 10-bit mantissa turns fp32 rounding differences in a
    conv's inputs into ~1e-5 differences in its weight gradient (seen in Qwen3-VL-MoE's and
    GLM-4V-MoE's patch embeddings), so parity would measure TF32's rounding, not fxfuse."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def check(name: str, build: Callable[[], nn.Module], inputs: dict, loss_of=lambda out: out.loss,
          has_loss_head: bool = True, inner: str = "aot_eager", bf16_steps: int = BF16_STEPS,
          device: str = "cpu") -> Result:
    """Run the harness on the model build() returns (random weights, fp32, train mode), moved with
    inputs to device: on "cuda" the fused ops run their Triton kernels, on "cpu" their CPU path."""
    import fxfuse

    model = build().to(device)
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}
    for m in model.modules():  # random dropout masks would differ between eager and compiled runs
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    expected = expected_sites(model, inputs, has_loss_head)
    with exact_fp32():
        ref_loss, ref_grads = step(model, model, inputs, loss_of)
        mine = _copy(model, build)
        n0 = len(fxfuse.compiled_reports())
        compiled = torch.compile(mine, backend="fxfuse", options={"inner": inner})
        census = Census(mine)
        loss, grads = step(mine, census.around(compiled), inputs, loss_of)
        fp32_report = Report.merge(fxfuse.compiled_reports()[n0:])
        report = census.apply(fp32_report)
        loss_err, grad_err = rel_err(loss, ref_loss), grad_error(grads, ref_grads)
        fp64_ok, fp64 = False, []
        if not (loss_err < FP32_TOL and grad_err < FP32_TOL) and grads.keys() == ref_grads.keys():
            fp64_ok, fp64 = fp64_verdict(loss, grads, ref_loss, ref_grads, fp64_run(model, inputs, loss_of, build))
    bf16, bf16_report = None, None
    if bf16_steps:
        torch._dynamo.reset()
        eager_model, fx_model = _copy(model, build), _copy(model, build)
        ref = _train(eager_model, eager_model, inputs, loss_of, bf16_steps)
        n1 = len(fxfuse.compiled_reports())
        got = _train(fx_model, torch.compile(fx_model, backend="fxfuse", options={"inner": inner}),
                     inputs, loss_of, bf16_steps)
        bf16 = curve_gap(got, ref)
        bf16_report = Report.merge(fxfuse.compiled_reports()[n1:])
        bf16_fp32_ok, bf16_fp32 = False, ""
        if not bf16 < BF16_TOL:
            with exact_fp32():
                fp32_model = _copy(model, build)
                exact = _train(fp32_model, fp32_model, inputs, loss_of, bf16_steps, autocast=False)
            bf16_fp32_ok, bf16_fp32 = fp32_curve_verdict(got, ref, exact)
    reasons: dict[str, list[str]] = {}
    for s in report.unmatched:
        reasons.setdefault(s.pattern, []).append(s.reason)
    reasons.update({"graph": report.errors} if report.errors else {})
    reasons.update({"graph_breaks": report.graph_breaks} if report.graph_breaks else {})
    result = Result(name, expected, report.calls, loss_err, grad_err, bf16, reasons, fp64, fp64_ok)
    if bf16_report is not None:
        result.fp32_fused, result.bf16_fused = fp32_report.counts(), bf16_report.counts()
        result.bf16_fp32, result.bf16_fp32_ok = bf16_fp32, bf16_fp32_ok
        for s in bf16_report.unmatched:
            result.bf16_reasons.setdefault(s.pattern, []).append(s.reason)
    return result
